//! The host side of a pod's network, in the pod's network namespace (made by containerd, wired
//! by CNI). All of it runs over rtnetlink (and /dev/net/tun for taps) on a thread that joined
//! that namespace ([`netns`]); nothing here shells out.
//!
//! - **vm backend** ([`attach_vm`]): for each CNI interface (an up Ethernet link with an
//!   address) a persistent tap `bhtap<i>` owned by the jailed VMM's uid/gid, and tc redirects
//!   both ways between the two (a clsact qdisc on each, u32 match-all + mirred egress redirect:
//!   Kata's "tcfilter" mode). The guest NIC takes the CNI interface's MAC, so the CNI network
//!   sees the same station. Unless allowed, a metadata drop filter sits on the tap's ingress
//!   ahead of the redirect: the guest's frames never meet the namespace's routing table, and the
//!   guest kernel is hostile, so the drop must be on the host side of the tap.
//! - **namespace backend** ([`block_metadata`]): the workloads share the namespace, so the drop
//!   sits on the egress hook of every sending link. Undoing it takes CAP_NET_ADMIN in the pod's
//!   namespace, which CRI's default capability set does not grant (a container given NET_ADMIN
//!   can remove it, and an AF_PACKET socket with PACKET_QDISC_BYPASS, which needs CAP_NET_RAW,
//!   skips the egress hook: the namespace backend isolates nothing from the kernel anyway).
//! - **both**: the cloud metadata addresses are 169.254.169.254 and fd00:ec2::254, any
//!   protocol. Everything added is first written to a record in the pod's state dir;
//!   [`teardown`] removes exactly that, is idempotent, and works from the record alone (so from
//!   `delete` after a shim crash). A namespace that is gone (CNI DEL, netns removed) took
//!   everything with it.
//! - [`dns`]: the pod's resolv.conf, read for the agent's SetupSandbox.
//!
//! Host-network pods (no netns in the sandbox spec) get none of this: their network is the
//! node's, which the shim must not filter; the vm backend cannot attach one.
//!
//! # How the vm backend calls it
//!
//! Start, with `req.netns = Some(netns)`, after the pod's state dir exists and before the VMM
//! is spawned (the VMM attaches to the taps by name, inside the same netns):
//!
//! ```ignore
//! let net = crate::network::attach_vm(&crate::network::VmAttach {
//!     netns: &netns,                                   // SandboxRequest.netns
//!     record: &paths.network_record(),                 // <state_dir>/<pod>/network.json
//!     tap_uid: jail_id,                                // the pod's jailed VMM's ids
//!     tap_gid: jail_id,
//!     metadata: MetadataAccess::from_config(&config.network),
//! })
//! .await?;                                             // SandboxError::Network on failure
//! // VmConfig.net, one entry per NIC, in this order (the guest names them eth0, eth1, ...):
//! //   NetConfig { tap: nic.tap.clone(), mac: nic.mac.clone(), mtu: Some(nic.mtu), .. }
//! // SetupSandboxRequest: interfaces: net.interfaces(), routes: net.routes.clone()
//! ```
//!
//! On failure `attach_vm` has already removed what it added. Stop (after the VMM is gone) and
//! crash cleanup (`delete`) are the same call, before the pod's state dir is removed:
//! `crate::network::teardown(&paths.network_record()).await` (no record: nothing to do).

mod discover;
pub mod dns;
mod error;
mod netns;
pub mod placeholder;
mod record;
mod tap;
mod tc;

use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use bulkhead_protocol::agent as pb;
use futures::TryStreamExt;
use rtnetlink::{Handle, LinkUnspec};
use tracing::{info, warn};

use crate::config::NetworkConfig;
use discover::PodNic;
pub use error::NetworkError;
use netns::Netns;
use record::{NetRecord, RecordedLink};
use tc::Hook;

/// Bound on one setup or teardown in the pod's namespace (a handful of netlink round trips).
const LIMIT: Duration = Duration::from_secs(10);

/// Whether the pod may reach the cloud metadata endpoint (`[network] allow_metadata`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetadataAccess {
    Blocked,
    Allowed,
}

impl MetadataAccess {
    pub fn from_config(config: &NetworkConfig) -> Self {
        if config.allow_metadata {
            Self::Allowed
        } else {
            Self::Blocked
        }
    }
}

/// What [`attach_vm`] needs.
#[derive(Debug, Clone)]
pub struct VmAttach<'a> {
    /// The pod's network namespace (`SandboxRequest.netns`).
    pub netns: &'a Path,
    /// Where the record of what was added goes (`PodPaths::network_record`).
    pub record: &'a Path,
    /// Owner of the taps: the uid/gid the jailed VMM runs as.
    pub tap_uid: u32,
    pub tap_gid: u32,
    pub metadata: MetadataAccess,
}

/// The guest's network, as the VMM and the agent need it.
#[derive(Debug, Clone, PartialEq)]
pub struct VmNetwork {
    /// One per virtio-net device, in `VmConfig.net` order.
    pub nics: Vec<VmNic>,
    /// For SetupSandbox: the pod's routes, on the guest's device names.
    pub routes: Vec<pb::Route>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct VmNic {
    /// `NetConfig.tap`: the tap in the pod's netns.
    pub tap: String,
    /// `NetConfig.mac`: the CNI interface's MAC, `aa:bb:cc:dd:ee:ff`.
    pub mac: String,
    /// `NetConfig.mtu`: the CNI interface's MTU.
    pub mtu: u16,
    /// The CNI interface this NIC stands in for (for logs).
    pub pod_interface: String,
    /// For SetupSandbox: the guest device (`eth<i>`) with the MAC, MTU and addresses.
    pub guest: pb::Interface,
}

impl VmNetwork {
    fn new(nics: &[PodNic], taps: Vec<String>, routes: Vec<pb::Route>) -> Self {
        let nics = nics
            .iter()
            .zip(taps)
            .enumerate()
            .map(|(i, (nic, tap))| {
                let mac = discover::format_mac(&nic.mac);
                VmNic {
                    guest: pb::Interface {
                        name: discover::guest_name(i),
                        mac: mac.clone(),
                        mtu: u32::from(nic.mtu),
                        addresses: nic.addresses.iter().map(|(a, p)| cidr(a, *p)).collect(),
                        ..Default::default()
                    },
                    tap,
                    mac,
                    mtu: nic.mtu,
                    pod_interface: nic.name.clone(),
                }
            })
            .collect();
        Self { nics, routes }
    }

    /// SetupSandbox's `interfaces`.
    pub fn interfaces(&self) -> Vec<pb::Interface> {
        self.nics.iter().map(|n| n.guest.clone()).collect()
    }
}

fn cidr(addr: &IpAddr, prefix: u8) -> String {
    format!("{addr}/{prefix}")
}

/// The MTUs of the NICs [`attach_vm`] would give the VM, in order, without changing anything:
/// what a template for the pod must have been booted with.
pub async fn vm_nic_mtus(netns: &Path) -> Result<Vec<u16>, NetworkError> {
    Netns::open(netns)?
        .run("list the pod's interfaces", LIMIT, |h| async move {
            let links = discover::links(&h).await?;
            let nics = discover::vm_nics(&links, &discover::addresses(&h).await?)?;
            Ok(nics.iter().map(|n| n.mtu).collect())
        })
        .await
}

/// Gives the VM the pod's network: taps, redirects and (unless allowed) the metadata drop.
/// On failure nothing of it is left.
pub async fn attach_vm(req: &VmAttach<'_>) -> Result<VmNetwork, NetworkError> {
    let netns = Netns::open(req.netns)?;
    let (netns_path, netns_id, record_path) = (netns.path().to_path_buf(), netns.id, req.record.to_path_buf());
    let (uid, gid, metadata) = (req.tap_uid, req.tap_gid, req.metadata);
    let network = netns
        .run("attach the pod network to the VM", LIMIT, move |mut h| async move {
            let links = discover::links(&h).await?;
            let nics = discover::vm_nics(&links, &discover::addresses(&h).await?)?;
            if nics.is_empty() {
                return Err(NetworkError::Unsupported(format!(
                    "no CNI interface (an up Ethernet link with an address) in {}",
                    netns_path.display()
                )));
            }
            let routes = discover::guest_routes(&discover::routes(&h).await?, &nics);
            let taps: Vec<String> = (0..nics.len()).map(tap::name).collect();
            if let Some(taken) = taps.iter().find(|t| links.iter().any(|l| &l.name == *t)) {
                return Err(NetworkError::Unsupported(format!("a link named {taken} already exists")));
            }
            for nic in &nics {
                ensure_ingress_free(&h, nic.index, &nic.name).await?;
            }
            let record = NetRecord {
                netns: netns_path,
                netns_id,
                clsact: nics.iter().map(|n| RecordedLink { index: n.index, name: n.name.clone() }).collect(),
                taps: taps.clone(),
            };
            record.write(&record_path)?;
            match plumb(&mut h, &nics, &taps, (uid, gid), metadata).await {
                Ok(()) => Ok(VmNetwork::new(&nics, taps, routes)),
                Err(e) => {
                    undo_logged(&mut h, &record).await;
                    let _ = NetRecord::remove(&record_path);
                    Err(e)
                }
            }
        })
        .await?;
    for nic in &network.nics {
        info!(
            netns = %req.netns.display(), tap = %nic.tap, interface = %nic.pod_interface, mac = %nic.mac,
            mtu = nic.mtu, metadata = ?req.metadata, "pod interface redirected to the VM's tap"
        );
    }
    Ok(network)
}

/// The tap and both redirects for each NIC; on the tap, the drop goes in before the redirect,
/// so no guest frame is ever forwarded unchecked.
async fn plumb(
    h: &mut Handle,
    nics: &[PodNic],
    taps: &[String],
    (uid, gid): (u32, u32),
    metadata: MetadataAccess,
) -> Result<(), NetworkError> {
    for (nic, tap_name) in nics.iter().zip(taps) {
        tap::create_persistent(tap_name, uid, gid)?;
        tap::disable_ipv6(tap_name);
        let tap = link_index(h, tap_name).await?;
        h.link()
            .set(LinkUnspec::new_with_index(tap).mtu(u32::from(nic.mtu)).up().build())
            .execute()
            .await
            .map_err(|e| NetworkError::netlink(format!("set {tap_name} up"), e))?;
        tc::add_clsact(h, tap).await?;
        if metadata == MetadataAccess::Blocked {
            tc::add_metadata_drop(h, tap, Hook::Ingress, tc::PRIO_METADATA_DROP).await?;
        }
        tc::add_redirect(h, tap, Hook::Ingress, nic.index, tc::PRIO_REDIRECT).await?;
        tc::add_clsact(h, nic.index).await?;
        tc::add_redirect(h, nic.index, Hook::Ingress, tap, tc::PRIO_REDIRECT).await?;
    }
    Ok(())
}

/// Namespace backend: drops traffic to the metadata addresses on the egress of every sending
/// link of the pod's namespace. Call before the agent starts, unless metadata is allowed.
pub async fn block_metadata(netns: &Path, record: &Path) -> Result<(), NetworkError> {
    let ns = Netns::open(netns)?;
    let (netns_path, netns_id, record_path) = (ns.path().to_path_buf(), ns.id, record.to_path_buf());
    let blocked = ns
        .run("block the metadata endpoint", LIMIT, move |mut h| async move {
            let links = discover::links(&h).await?;
            let targets: Vec<RecordedLink> = discover::egress_links(&links)
                .into_iter()
                .map(|l| RecordedLink { index: l.index, name: l.name.clone() })
                .collect();
            for t in &targets {
                ensure_ingress_free(&h, t.index, &t.name).await?;
            }
            if targets.is_empty() {
                return Ok(targets);
            }
            let record = NetRecord { netns: netns_path, netns_id, clsact: targets.clone(), taps: vec![] };
            record.write(&record_path)?;
            for t in &targets {
                let added = async {
                    tc::add_clsact(&mut h, t.index).await?;
                    tc::add_metadata_drop(&mut h, t.index, Hook::Egress, tc::PRIO_METADATA_DROP).await
                };
                if let Err(e) = added.await {
                    undo_logged(&mut h, &record).await;
                    let _ = NetRecord::remove(&record_path);
                    return Err(e);
                }
            }
            Ok(targets)
        })
        .await?;
    let names: Vec<&str> = blocked.iter().map(|l| l.name.as_str()).collect();
    info!(netns = %netns.display(), links = ?names, "metadata endpoint blocked on the pod's egress");
    Ok(())
}

/// Removes everything the record at `record` lists, then the record. Idempotent; without a
/// record there is nothing to do. A namespace that is gone, or is another one now, took ours
/// with it.
pub async fn teardown(record: &Path) -> Result<(), NetworkError> {
    let Some(rec) = NetRecord::read(record)? else {
        return Ok(());
    };
    let ns = match Netns::open(&rec.netns) {
        Ok(ns) if ns.id == rec.netns_id => ns,
        Ok(_) => {
            info!(netns = %rec.netns.display(), "pod network namespace was replaced; nothing of ours is left in it");
            return NetRecord::remove(record);
        }
        Err(NetworkError::Netns { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            return NetRecord::remove(record);
        }
        Err(e) => return Err(e),
    };
    let netns_path = rec.netns.clone();
    ns.run("tear down the pod network", LIMIT, move |mut h| async move { undo(&mut h, &rec).await }).await?;
    info!(netns = %netns_path.display(), "pod network torn down");
    NetRecord::remove(record)
}

/// Removes what `record` lists that is still there: the clsact qdiscs of links that still have
/// their recorded index and name, and taps by name (only tun devices). Tries everything; returns
/// the first failure.
async fn undo(h: &mut Handle, record: &NetRecord) -> Result<(), NetworkError> {
    let links = discover::links(h).await?;
    let mut first_err = None;
    for l in &record.clsact {
        if links.iter().any(|x| x.index == l.index && x.name == l.name) {
            if let Err(e) = tc::del_clsact(h, l.index).await {
                first_err.get_or_insert(e);
            }
        }
    }
    for name in &record.taps {
        if let Some(tap) = links.iter().find(|x| &x.name == name && x.tun) {
            match h.link().del(tap.index).execute().await {
                Ok(()) => {}
                Err(rtnetlink::Error::NetlinkError(m)) if -m.raw_code() == libc::ENODEV => {}
                Err(e) => {
                    first_err.get_or_insert(NetworkError::netlink(format!("delete tap {name}"), e));
                }
            }
        }
    }
    first_err.map_or(Ok(()), Err)
}

async fn undo_logged(h: &mut Handle, record: &NetRecord) {
    if let Err(e) = undo(h, record).await {
        warn!(netns = %record.netns.display(), "undoing a failed pod network setup: {e}");
    }
}

/// Refuses an interface whose ingress slot is taken: its qdisc is not ours to replace or remove.
async fn ensure_ingress_free(h: &Handle, index: u32, name: &str) -> Result<(), NetworkError> {
    match tc::ingress_qdisc(h, index).await? {
        None => Ok(()),
        Some(kind) => Err(NetworkError::Unsupported(format!(
            "interface {name} already has an {kind} qdisc; bulkhead needs that slot for its filters"
        ))),
    }
}

async fn link_index(h: &Handle, name: &str) -> Result<u32, NetworkError> {
    let mut found = h.link().get().match_name(name.to_string()).execute();
    match found.try_next().await {
        Ok(Some(link)) => Ok(link.header.index),
        Ok(None) => Err(NetworkError::Unsupported(format!("link {name} vanished"))),
        Err(e) => Err(NetworkError::netlink(format!("find link {name}"), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_network_maps_nics_in_order() {
        let nics = vec![
            PodNic {
                index: 3,
                name: "eth0".into(),
                mac: [2, 0x42, 10, 88, 0, 7],
                mtu: 1450,
                addresses: vec![("10.88.0.7".parse().unwrap(), 16), ("fd00::7".parse().unwrap(), 64)],
            },
            PodNic { index: 5, name: "net1".into(), mac: [2, 0, 0, 0, 0, 9], mtu: 9000, addresses: vec![] },
        ];
        let net = VmNetwork::new(&nics, vec!["bhtap0".into(), "bhtap1".into()], vec![]);
        assert_eq!(net.nics[0].tap, "bhtap0");
        assert_eq!(net.nics[0].mac, "02:42:0a:58:00:07");
        assert_eq!(net.nics[1].mtu, 9000);
        let ifs = net.interfaces();
        assert_eq!(ifs[0].name, "eth0");
        assert_eq!(ifs[1].name, "eth1");
        assert_eq!(ifs[0].addresses, vec!["10.88.0.7/16".to_string(), "fd00::7/64".to_string()]);
        assert_eq!((ifs[0].mac.as_str(), ifs[0].mtu), ("02:42:0a:58:00:07", 1450));
    }

    #[test]
    fn metadata_is_blocked_unless_allowed() {
        assert_eq!(MetadataAccess::from_config(&NetworkConfig::default()), MetadataAccess::Blocked);
        assert_eq!(MetadataAccess::from_config(&NetworkConfig { allow_metadata: true }), MetadataAccess::Allowed);
    }
}
