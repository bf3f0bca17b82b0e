//! What CNI left in the pod's network namespace: links, addresses and routes, read over
//! rtnetlink into plain structs, and the pure choices made from them (which links the guest
//! gets, which addresses and routes it is given, where the metadata drop goes).

use std::collections::HashMap;
use std::net::IpAddr;

use bulkhead_protocol::agent as pb;
use futures::TryStreamExt;
use rtnetlink::packet_route::address::AddressAttribute;
use rtnetlink::packet_route::link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo, LinkLayerType};
use rtnetlink::packet_route::route::{RouteAddress, RouteAttribute, RouteHeader, RouteProtocol, RouteType};
use rtnetlink::{Handle, RouteMessageBuilder};

use super::error::NetworkError;

/// A link of the namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    pub ethernet: bool,
    pub loopback: bool,
    pub up: bool,
    pub tun: bool,
    pub mac: Option<[u8; 6]>,
    pub mtu: u32,
}

/// An address on a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Address {
    pub index: u32,
    pub addr: IpAddr,
    pub prefix: u8,
}

/// A unicast route of the main table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// `None`: a default route.
    pub destination: Option<(IpAddr, u8)>,
    pub gateway: Option<IpAddr>,
    pub oif: u32,
    /// Added by the kernel for an address's prefix (the guest's kernel adds its own).
    pub kernel: bool,
}

/// A pod interface the guest gets a NIC for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodNic {
    pub index: u32,
    pub name: String,
    pub mac: [u8; 6],
    pub mtu: u16,
    pub addresses: Vec<(IpAddr, u8)>,
}

fn netlink(what: &'static str) -> impl FnOnce(rtnetlink::Error) -> NetworkError {
    move |e| NetworkError::netlink(what.to_string(), e)
}

pub async fn links(h: &Handle) -> Result<Vec<Link>, NetworkError> {
    let mut dump = h.link().get().execute();
    let mut out = Vec::new();
    while let Some(msg) = dump.try_next().await.map_err(netlink("list links"))? {
        let mut link = Link {
            index: msg.header.index,
            name: String::new(),
            ethernet: msg.header.link_layer_type == LinkLayerType::Ether,
            loopback: msg.header.flags.contains(LinkFlags::Loopback),
            up: msg.header.flags.contains(LinkFlags::Up),
            tun: false,
            mac: None,
            mtu: 0,
        };
        for attr in &msg.attributes {
            match attr {
                LinkAttribute::IfName(n) => link.name = n.clone(),
                LinkAttribute::Address(a) => link.mac = <[u8; 6]>::try_from(a.as_slice()).ok(),
                LinkAttribute::Mtu(m) => link.mtu = *m,
                LinkAttribute::LinkInfo(infos) => {
                    link.tun = infos.iter().any(|i| matches!(i, LinkInfo::Kind(InfoKind::Tun)));
                }
                _ => {}
            }
        }
        out.push(link);
    }
    Ok(out)
}

pub async fn addresses(h: &Handle) -> Result<Vec<Address>, NetworkError> {
    let mut dump = h.address().get().execute();
    let mut out = Vec::new();
    while let Some(msg) = dump.try_next().await.map_err(netlink("list addresses"))? {
        // IFA_LOCAL is the interface's own address (IFA_ADDRESS is the peer on point-to-point links).
        let local = msg.attributes.iter().find_map(|a| match a {
            AddressAttribute::Local(ip) => Some(*ip),
            _ => None,
        });
        let address = msg.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        });
        if let Some(addr) = local.or(address) {
            out.push(Address { index: msg.header.index, addr, prefix: msg.header.prefix_len });
        }
    }
    Ok(out)
}

pub async fn routes(h: &Handle) -> Result<Vec<Route>, NetworkError> {
    let mut out = Vec::new();
    for query in [
        RouteMessageBuilder::<std::net::Ipv4Addr>::new().build(),
        RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
    ] {
        let mut dump = h.route().get(query).execute();
        while let Some(msg) = dump.try_next().await.map_err(netlink("list routes"))? {
            let table = msg.attributes.iter().find_map(|a| match a {
                RouteAttribute::Table(t) => Some(*t),
                _ => None,
            });
            let main = table.unwrap_or(u32::from(msg.header.table)) == u32::from(RouteHeader::RT_TABLE_MAIN);
            if !main || msg.header.kind != RouteType::Unicast {
                continue;
            }
            let ip = |a: &RouteAddress| match a {
                RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
                RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
                _ => None,
            };
            let mut destination = None;
            let mut gateway = None;
            let mut oif = None;
            for attr in &msg.attributes {
                match attr {
                    RouteAttribute::Destination(a) => destination = ip(a),
                    RouteAttribute::Gateway(a) => gateway = ip(a),
                    RouteAttribute::Oif(i) => oif = Some(*i),
                    _ => {}
                }
            }
            // Multipath and blackhole routes have no single output interface: not ours to copy.
            let Some(oif) = oif else { continue };
            let len = msg.header.destination_prefix_length;
            out.push(Route {
                destination: destination.filter(|_| len > 0).map(|d| (d, len)),
                gateway,
                oif,
                kernel: msg.header.protocol == RouteProtocol::Kernel,
            });
        }
    }
    Ok(out)
}

fn is_v6_link_local(ip: &IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80)
}

fn is_v6_multicast(ip: &IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if v6.is_multicast())
}

/// The interfaces the guest gets a NIC for: Ethernet links CNI configured (up, with a MAC and
/// an address the guest can use). Never a tap of our own.
pub fn vm_nics(links: &[Link], addresses: &[Address]) -> Result<Vec<PodNic>, NetworkError> {
    let mut nics = Vec::new();
    for l in links.iter().filter(|l| l.ethernet && l.up && !l.loopback && !l.tun) {
        let Some(mac) = l.mac else { continue };
        let addrs: Vec<(IpAddr, u8)> = addresses
            .iter()
            .filter(|a| a.index == l.index && !is_v6_link_local(&a.addr))
            .map(|a| (a.addr, a.prefix))
            .collect();
        if addrs.is_empty() {
            continue;
        }
        let mtu = u16::try_from(l.mtu).ok().filter(|m| *m >= 68).ok_or_else(|| {
            NetworkError::Unsupported(format!("interface {} has MTU {}, the guest NIC takes 68..=65535", l.name, l.mtu))
        })?;
        nics.push(PodNic { index: l.index, name: l.name.clone(), mac, mtu, addresses: addrs });
    }
    Ok(nics)
}

/// The links the namespace backend's metadata drop goes on: every link that can send (up, not
/// loopback).
pub fn egress_links(links: &[Link]) -> Vec<&Link> {
    links.iter().filter(|l| l.up && !l.loopback).collect()
}

/// The guest's name for the NIC at position `i`: the guest kernel names virtio-net devices
/// eth0, eth1, ... in the order of `VmConfig.net`.
pub fn guest_name(i: usize) -> String {
    format!("eth{i}")
}

/// The routes the guest is given: the main table's unicast routes out of a NIC, without the
/// kernel's own prefix routes (the guest's kernel makes those from the addresses) and IPv6
/// link-local and multicast ones. Routes without a gateway come first, so the gateway of a later
/// route is reachable when it is added.
pub fn guest_routes(routes: &[Route], nics: &[PodNic]) -> Vec<pb::Route> {
    let names: HashMap<u32, String> = nics.iter().enumerate().map(|(i, n)| (n.index, guest_name(i))).collect();
    let mut out: Vec<(bool, pb::Route)> = routes
        .iter()
        .filter(|r| !r.kernel)
        .filter(|r| r.destination.is_none_or(|(d, _)| !is_v6_link_local(&d) && !is_v6_multicast(&d)))
        .filter_map(|r| {
            let device = names.get(&r.oif)?.clone();
            let destination = match r.destination {
                None => "default".to_string(),
                Some((d, len)) => format!("{d}/{len}"),
            };
            let gateway = r.gateway.map(|g| g.to_string()).unwrap_or_default();
            Some((r.gateway.is_some(), pb::Route { destination, gateway, device, ..Default::default() }))
        })
        .collect();
    out.sort_by_key(|(has_gateway, _)| *has_gateway);
    out.into_iter().map(|(_, r)| r).collect()
}

/// `aa:bb:cc:dd:ee:ff`.
pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(index: u32, name: &str) -> Link {
        Link {
            index,
            name: name.into(),
            ethernet: true,
            loopback: false,
            up: true,
            tun: false,
            mac: Some([2, 0, 0, 0, 0, index as u8]),
            mtu: 1450,
        }
    }

    fn addr(index: u32, s: &str) -> Address {
        let (a, p) = s.split_once('/').unwrap();
        Address { index, addr: a.parse().unwrap(), prefix: p.parse().unwrap() }
    }

    #[test]
    fn nics_are_the_configured_ethernet_links() {
        let lo = Link { loopback: true, ethernet: false, mac: None, ..link(1, "lo") };
        let tunl = Link { ethernet: false, up: false, ..link(2, "tunl0") };
        let eth0 = link(3, "eth0");
        let unaddressed = link(4, "eth1");
        let tap = Link { tun: true, ..link(5, "bhtap0") };
        let addrs = [
            addr(1, "127.0.0.1/8"),
            addr(3, "10.88.0.5/16"),
            addr(3, "fe80::1/64"),
            addr(3, "fd00::5/64"),
            addr(4, "fe80::2/64"),
            addr(5, "10.1.0.1/24"),
        ];
        let nics = vm_nics(&[lo, tunl, eth0, unaddressed, tap], &addrs).unwrap();
        assert_eq!(nics.len(), 1);
        assert_eq!(nics[0].name, "eth0");
        assert_eq!(nics[0].mtu, 1450);
        assert_eq!(nics[0].addresses, vec![("10.88.0.5".parse().unwrap(), 16), ("fd00::5".parse().unwrap(), 64)]);
    }

    #[test]
    fn an_mtu_the_guest_cannot_take_is_an_error() {
        let big = Link { mtu: 70_000, ..link(3, "eth0") };
        let err = vm_nics(&[big], &[addr(3, "10.0.0.2/24")]).unwrap_err();
        assert!(err.to_string().contains("MTU 70000"), "{err}");
    }

    #[test]
    fn guest_routes_skip_kernel_and_link_local_and_order_gatewayless_first() {
        let nics = vec![PodNic { index: 3, name: "cni0".into(), mac: [2; 6], mtu: 1500, addresses: vec![] }];
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let routes = [
            Route { destination: None, gateway: Some(ip("169.254.1.1")), oif: 3, kernel: false },
            Route { destination: Some((ip("169.254.1.1"), 32)), gateway: None, oif: 3, kernel: false },
            Route { destination: Some((ip("10.88.0.0"), 16)), gateway: None, oif: 3, kernel: true },
            Route { destination: Some((ip("fe80::"), 64)), gateway: None, oif: 3, kernel: false },
            Route { destination: Some((ip("ff00::"), 8)), gateway: None, oif: 3, kernel: false },
            Route { destination: None, gateway: Some(ip("fd00::1")), oif: 3, kernel: false },
            Route { destination: Some((ip("192.168.0.0"), 16)), gateway: None, oif: 9, kernel: false },
        ];
        let got: Vec<(String, String, String)> =
            guest_routes(&routes, &nics).into_iter().map(|r| (r.destination, r.gateway, r.device)).collect();
        assert_eq!(
            got,
            vec![
                ("169.254.1.1/32".into(), "".into(), "eth0".into()),
                ("default".into(), "169.254.1.1".into(), "eth0".into()),
                ("default".into(), "fd00::1".into(), "eth0".into()),
            ]
        );
    }

    #[test]
    fn egress_links_are_every_sending_link() {
        let lo = Link { loopback: true, ..link(1, "lo") };
        let down = Link { up: false, ..link(2, "tunl0") };
        let links = [lo, down, link(3, "eth0"), Link { ethernet: false, ..link(4, "wg0") }];
        let names: Vec<&str> = egress_links(&links).iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["eth0", "wg0"]);
    }

    #[test]
    fn macs_are_formatted_for_the_guest() {
        assert_eq!(format_mac(&[0x02, 0x42, 0x0a, 0x58, 0, 7]), "02:42:0a:58:00:07");
    }
}
