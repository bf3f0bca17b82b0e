//! SetupSandbox's network part: configure existing devices (MAC, MTU, addresses, up) and
//! routes over rtnetlink, in the agent's network namespace, then wait until each device has a
//! carrier, so the pod's first packets are not dropped. Parsing and validation are pure
//! functions, tested here; the netlink calls are exercised by the e2e test.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use rtnetlink::packet_route::link::LinkFlags;
use rtnetlink::{packet_route::route::RouteScope, Handle, LinkUnspec, RouteMessageBuilder};

use crate::error::{AgentError, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterfaceConfig {
    pub name: String,
    pub mac: Option<[u8; 6]>,
    pub mtu: Option<u32>,
    pub addresses: Vec<Cidr>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteConfig {
    /// None: the default route.
    pub destination: Option<Cidr>,
    pub gateway: Option<IpAddr>,
    pub device: String,
}

const MAX_ITEMS: usize = 64;
/// How long a configured device may take to report a carrier. A booted VM's NIC has one before
/// the agent listens; a restored VM's gets it when the guest handles the link-up config
/// interrupt the VMM raised at the restore: milliseconds. Below the shim's SetupSandbox timeout.
const CARRIER_TIMEOUT: Duration = Duration::from_secs(5);
const CARRIER_POLL: Duration = Duration::from_millis(2);

fn invalid(what: &str, v: &str) -> AgentError {
    AgentError::InvalidArgument(format!("{what} {v:?}"))
}

pub fn parse_mac(s: &str) -> Result<[u8; 6]> {
    let parts: Vec<&str> = s.split(':').collect();
    if parts.len() != 6 {
        return Err(invalid("MAC address", s));
    }
    let mut mac = [0u8; 6];
    for (i, p) in parts.iter().enumerate() {
        if p.len() != 2 {
            return Err(invalid("MAC address", s));
        }
        mac[i] = u8::from_str_radix(p, 16).map_err(|_| invalid("MAC address", s))?;
    }
    Ok(mac)
}

pub fn parse_cidr(s: &str) -> Result<Cidr> {
    let (a, p) = s.split_once('/').ok_or_else(|| invalid("CIDR", s))?;
    let addr: IpAddr = a.parse().map_err(|_| invalid("CIDR", s))?;
    let prefix: u8 = p.parse().map_err(|_| invalid("CIDR", s))?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    if prefix > max {
        return Err(invalid("CIDR", s));
    }
    Ok(Cidr { addr, prefix })
}

fn check_ifname(name: &str) -> Result<()> {
    // IFNAMSIZ is 16 including the NUL.
    if name.is_empty() || name.len() > 15 || name.contains('/') || name.contains(char::is_whitespace) {
        return Err(invalid("interface name", name));
    }
    Ok(())
}

pub fn parse_interfaces(items: &[(String, String, u32, Vec<String>)]) -> Result<Vec<InterfaceConfig>> {
    if items.len() > MAX_ITEMS {
        return Err(AgentError::InvalidArgument(format!("more than {MAX_ITEMS} interfaces")));
    }
    items
        .iter()
        .map(|(name, mac, mtu, addrs)| {
            check_ifname(name)?;
            if addrs.len() > MAX_ITEMS {
                return Err(AgentError::InvalidArgument(format!("more than {MAX_ITEMS} addresses on {name}")));
            }
            Ok(InterfaceConfig {
                name: name.clone(),
                mac: (!mac.is_empty()).then(|| parse_mac(mac)).transpose()?,
                mtu: (*mtu != 0).then_some(*mtu),
                addresses: addrs.iter().map(|a| parse_cidr(a)).collect::<Result<_>>()?,
            })
        })
        .collect()
}

pub fn parse_routes(items: &[(String, String, String)]) -> Result<Vec<RouteConfig>> {
    if items.len() > MAX_ITEMS {
        return Err(AgentError::InvalidArgument(format!("more than {MAX_ITEMS} routes")));
    }
    items
        .iter()
        .map(|(dest, gw, dev)| {
            check_ifname(dev)?;
            let destination = match dest.as_str() {
                "" | "default" => None,
                d => Some(parse_cidr(d)?),
            };
            let gateway = match gw.as_str() {
                "" => None,
                g => Some(g.parse::<IpAddr>().map_err(|_| invalid("gateway", g))?),
            };
            if destination.is_none() && gateway.is_none() {
                return Err(AgentError::InvalidArgument(format!("default route on {dev} needs a gateway")));
            }
            if let (Some(d), Some(g)) = (&destination, &gateway) {
                if d.addr.is_ipv4() != g.is_ipv4() {
                    return Err(AgentError::InvalidArgument(format!("route {dest} via {gw}: mixed families")));
                }
            }
            Ok(RouteConfig { destination, gateway, device: dev.clone() })
        })
        .collect()
}

fn nl(what: &str, e: impl std::fmt::Display) -> AgentError {
    AgentError::FailedPrecondition(format!("netlink {what}: {e}"))
}

async fn link_index(h: &Handle, name: &str) -> Result<u32> {
    let mut links = h.link().get().match_name(name.to_owned()).execute();
    match links.try_next().await {
        Ok(Some(l)) => Ok(l.header.index),
        Ok(None) => Err(AgentError::NotFound(format!("network interface {name}"))),
        Err(rtnetlink::Error::NetlinkError(m)) if m.raw_code() == -libc::ENODEV => {
            Err(AgentError::NotFound(format!("network interface {name}")))
        }
        Err(e) => Err(nl(&format!("find {name}"), e)),
    }
}

/// Until the device `idx` (`name`) has a carrier, or an error after [`CARRIER_TIMEOUT`].
async fn await_carrier(h: &Handle, name: &str, idx: u32) -> Result<()> {
    let deadline = Instant::now() + CARRIER_TIMEOUT;
    loop {
        let mut links = h.link().get().match_index(idx).execute();
        let flags = match links.try_next().await {
            Ok(Some(l)) => l.header.flags,
            Ok(None) => return Err(AgentError::NotFound(format!("network interface {name}"))),
            Err(e) => return Err(nl(&format!("read {name}"), e)),
        };
        if flags.contains(LinkFlags::LowerUp) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(AgentError::FailedPrecondition(format!(
                "network interface {name} has no carrier {CARRIER_TIMEOUT:?} after it was set up: its device \
                 reports the link down (on a restored VM, the VMM raises it at the restore)"
            )));
        }
        tokio::time::sleep(CARRIER_POLL).await;
    }
}

/// Brings `lo` up, configures the interfaces, adds the routes (replacing equal ones), then
/// waits for each interface's carrier.
pub async fn apply(interfaces: &[InterfaceConfig], routes: &[RouteConfig]) -> Result<()> {
    let (conn, h, _) = rtnetlink::new_connection().map_err(|e| nl("socket", e))?;
    let conn = tokio::spawn(conn);
    let result = async {
        let lo = link_index(&h, "lo").await?;
        h.link().set(LinkUnspec::new_with_index(lo).up().build()).execute().await.map_err(|e| nl("lo up", e))?;
        let mut configured = Vec::with_capacity(interfaces.len());
        for i in interfaces {
            let idx = link_index(&h, &i.name).await?;
            configured.push((i.name.as_str(), idx));
            let mut b = LinkUnspec::new_with_index(idx);
            if let Some(mac) = i.mac {
                b = b.address(mac.to_vec());
            }
            if let Some(mtu) = i.mtu {
                b = b.mtu(mtu);
            }
            h.link().set(b.up().build()).execute().await.map_err(|e| nl(&format!("set {}", i.name), e))?;
            for a in &i.addresses {
                h.address()
                    .add(idx, a.addr, a.prefix)
                    .replace()
                    .execute()
                    .await
                    .map_err(|e| nl(&format!("address {}/{} on {}", a.addr, a.prefix, i.name), e))?;
            }
        }
        for r in routes {
            let idx = link_index(&h, &r.device).await?;
            let mut b = RouteMessageBuilder::<IpAddr>::new();
            let (dest, len) = match (&r.destination, r.gateway) {
                (Some(d), _) => (d.addr, d.prefix),
                (None, Some(IpAddr::V4(_))) => (IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 0),
                (None, _) => (IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), 0),
            };
            b = b.destination_prefix(dest, len).map_err(|e| nl("route", e))?;
            match r.gateway {
                Some(g) => b = b.gateway(g).map_err(|e| nl("route gateway", e))?,
                // On-link (as `ip route add <dst> dev <dev>` makes it): a later route may use a
                // gateway reachable only through it (CNIs such as Calico do).
                None if dest.is_ipv4() => b = b.scope(RouteScope::Link),
                None => {}
            }
            let msg = b.output_interface(idx).build();
            h.route()
                .add(msg)
                .replace()
                .execute()
                .await
                .map_err(|e| nl(&format!("route {:?} via {:?} dev {}", r.destination, r.gateway, r.device), e))?;
        }
        for (name, idx) in configured {
            await_carrier(&h, name, idx).await?;
        }
        Ok(())
    }
    .await;
    conn.abort();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_macs_and_cidrs() {
        assert_eq!(parse_mac("02:42:ac:11:00:02").unwrap(), [2, 0x42, 0xac, 0x11, 0, 2]);
        for bad in ["", "02:42:ac:11:00", "02:42:ac:11:00:zz", "002:42:ac:11:00:02", "02-42-ac-11-00-02"] {
            assert!(parse_mac(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_cidr("10.88.0.5/16").unwrap(), Cidr { addr: "10.88.0.5".parse().unwrap(), prefix: 16 });
        assert_eq!(parse_cidr("fd00::5/64").unwrap().prefix, 64);
        for bad in ["10.88.0.5", "10.88.0.5/33", "fd00::/129", "x/8", "10.0.0.1/-1"] {
            assert!(parse_cidr(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn validates_interfaces_and_routes() {
        let ifs = parse_interfaces(&[("eth0".into(), "".into(), 0, vec!["10.0.0.2/24".into()])]).unwrap();
        assert_eq!((ifs[0].mac, ifs[0].mtu), (None, None));
        assert!(parse_interfaces(&[("a-very-long-ifname0".into(), "".into(), 0, vec![])]).is_err());
        assert!(parse_interfaces(&[("../x".into(), "".into(), 0, vec![])]).is_err());
        let r = parse_routes(&[("default".into(), "10.0.0.1".into(), "eth0".into())]).unwrap();
        assert_eq!(r[0].destination, None);
        assert!(parse_routes(&[("".into(), "".into(), "eth0".into())]).is_err());
        assert!(parse_routes(&[("10.1.0.0/16".into(), "fd00::1".into(), "eth0".into())]).is_err());
        assert!(parse_routes(&[("10.1.0.0/16".into(), "".into(), "eth0".into())]).is_ok());
    }
}
