//! Serialisable virtio-net state: MAC, MTU, link, acked features and the virtqueues. The tap, a
//! frame waiting for a guest buffer and the rate limiters' buckets are not part of it: after a
//! restore the device starts with full buckets on a tap the new process attached, and a frame
//! in flight is lost, as on a real wire. The link is the run's: a template's link that was down
//! comes up, and the guest is told.

use serde::{Deserialize, Serialize};
use vm_memory::GuestMemoryMmap;

use super::device::{format_mac, Net};
use super::tap::FrameIo;
use crate::config::{LinkState, NetConfig, NetRateLimiterConfig};
use crate::devices::virtio::persist::{CommonRestore, QueueState, VirtioCommonState, VirtioPersistError};
use crate::devices::virtio::{DeviceState, IrqTrigger, VirtioDevice};
use crate::persist::Persist;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NetState {
    pub tap: String,
    pub mac: [u8; 6],
    pub mtu: Option<u16>,
    /// The link the driver last saw.
    pub link: LinkState,
    pub acked_features: u64,
    /// rx, tx; empty while inactive.
    pub queues: Vec<QueueState>,
    pub broken: bool,
}

impl NetState {
    pub fn common(&self) -> VirtioCommonState<'_> {
        VirtioCommonState { acked_features: self.acked_features, queues: &self.queues, broken: self.broken }
    }
}

/// What a restore needs besides the snapshot.
pub struct NetConstructorArgs {
    pub index: usize,
    /// The run's tap name (for logs; the snapshot's may be another pod's).
    pub tap: String,
    /// The tap (or another host end), attached by the restoring process.
    pub backend: Box<dyn FrameIo>,
    pub rate_limiter: Option<NetRateLimiterConfig>,
    /// The run's link (up: the run's tap is the pod's network).
    pub link: LinkState,
    pub mem: GuestMemoryMmap,
    pub irq: IrqTrigger,
}

impl Persist for Net {
    type State = NetState;
    type ConstructorArgs = NetConstructorArgs;
    type Error = VirtioPersistError;

    fn save(&self) -> NetState {
        NetState {
            tap: self.tap_name.clone(),
            mac: self.mac,
            mtu: self.mtu,
            link: self.link,
            acked_features: self.acked_features,
            queues: match &self.state {
                DeviceState::Active(a) => vec![QueueState::from(&a.rx), QueueState::from(&a.tx)],
                _ => vec![],
            },
            broken: self.state.is_broken(),
        }
    }

    /// Rebuilds the device on a new host end. The snapshot is untrusted: its MAC must be unicast,
    /// its MTU one a config may name, its acked features ones this host end offers, and live
    /// queues (rx and tx) must be the device's size at most, ready and inside the new guest memory
    /// (the check every device's restore shares).
    fn restore(args: NetConstructorArgs, state: &NetState) -> Result<Self, VirtioPersistError> {
        if state.mac[0] & 1 != 0 {
            return Err(VirtioPersistError::Invalid(format!("mac {} is not unicast", format_mac(&state.mac))));
        }
        if state.mtu.is_some_and(|m| m < 68) {
            return Err(VirtioPersistError::Invalid(format!("mtu {:?} is below 68", state.mtu)));
        }
        let cfg = NetConfig {
            tap: args.tap.clone(),
            mac: format_mac(&state.mac),
            mtu: state.mtu,
            rate_limiter: args.rate_limiter,
            link: args.link,
        };
        let mut net = Net::with_backend(&cfg, args.index, args.backend)
            .map_err(|e| VirtioPersistError::Backend(format!("tap {}: {e}", args.tap)))?;
        let restored = state.common().restore(net.avail_features(), net.queue_max_sizes(), &args.mem)?;
        net.set_acked_features(state.acked_features);
        match restored {
            CommonRestore::Broken(_) => net.mark_broken(),
            CommonRestore::Inactive => {}
            CommonRestore::Active(queues) => {
                net.activate(args.mem, queues, args.irq).map_err(VirtioPersistError::Activate)?
            }
        }
        net.restored_link(state.link);
        Ok(net)
    }
}

#[cfg(test)]
mod tests {
    use super::super::device::test_utils::{device, net_config, rig, rig_with, SocketEnd};
    use super::*;
    use crate::devices::virtio::VIRTIO_F_VERSION_1;
    use std::os::unix::net::UnixDatagram;
    use vmm_sys_util::eventfd::EventFd;

    fn args(mem: GuestMemoryMmap, offloads: u32) -> NetConstructorArgs {
        let (sock, _) = UnixDatagram::pair().unwrap();
        NetConstructorArgs {
            index: 0,
            tap: "tap-test".into(),
            backend: Box::new(SocketEnd { sock, offloads, set: Default::default() }),
            rate_limiter: None,
            link: LinkState::Up,
            mem,
            irq: IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()),
        }
    }

    #[test]
    fn live_device_roundtrips_through_json() {
        let r = rig();
        let snap = r.dev.save();
        assert_eq!(snap.mac, [2, 0, 0, 0, 0, 2]);
        assert_eq!(snap.queues.len(), 2);
        let json = serde_json::to_string(&snap).unwrap();
        let back: NetState = serde_json::from_str(&json).unwrap();
        let restored = Net::restore(args(r.mem.clone(), 0), &back).unwrap();
        assert_eq!(restored.save(), snap);
        let mut mac = [0u8; 6];
        restored.read_config(0, &mut mac);
        assert_eq!(mac, snap.mac);
    }

    #[test]
    fn a_templates_link_comes_up_on_restore_and_the_driver_is_told_once() {
        use crate::devices::virtio::VIRTIO_MMIO_INT_CONFIG;
        use virtio_bindings::virtio_net::{VIRTIO_NET_F_MAC, VIRTIO_NET_F_STATUS};
        let down = NetConfig { link: LinkState::Down, ..net_config() };
        let with_status = VIRTIO_F_VERSION_1 | 1 << VIRTIO_NET_F_MAC | 1 << VIRTIO_NET_F_STATUS;
        let template = rig_with(&down, 0, with_status);
        let snap = template.dev.save();
        assert_eq!(snap.link, LinkState::Down);

        let run = args(template.mem.clone(), 0);
        let irq = run.irq.clone();
        let mut restored = Net::restore(run, &snap).unwrap();
        let mut status = [0xffu8; 2];
        restored.read_config(6, &mut status);
        assert_eq!(status, [1, 0], "the run's link is up");
        assert_eq!(irq.status(), 0, "not told before the irqchip is back");
        restored.tell_link_change();
        assert_eq!(irq.status(), VIRTIO_MMIO_INT_CONFIG, "the driver is told of the change");
        irq.ack(VIRTIO_MMIO_INT_CONFIG);
        restored.tell_link_change();
        assert_eq!(irq.status(), 0, "once");
        assert_eq!(restored.save().link, LinkState::Up);

        // Nobody to tell: a driver that did not negotiate link status, a device never set up, or
        // a link that did not change.
        let no_status = rig_with(&down, 0, VIRTIO_F_VERSION_1).dev.save();
        let inactive = NetState { queues: vec![], ..snap.clone() };
        let up = NetState { link: LinkState::Up, ..snap };
        for state in [no_status, inactive, up] {
            let run = args(template.mem.clone(), 0);
            let irq = run.irq.clone();
            let mut restored = Net::restore(run, &state).unwrap();
            restored.tell_link_change();
            assert_eq!(irq.status(), 0, "{state:?}");
        }
    }

    #[test]
    fn untrusted_snapshots_are_refused() {
        let r = rig();
        let good = r.dev.save();
        let tso_tap = libc::TUN_F_CSUM | libc::TUN_F_TSO4;
        let (mut offloading, _h, _) = device(&net_config(), tso_tap);
        offloading.set_acked_features(u64::MAX);
        let needs_offloads = NetState { acked_features: offloading.save().acked_features, ..good.clone() };
        let cases = [
            (needs_offloads, "the device does not offer"),
            (NetState { queues: vec![good.queues[0]], ..good.clone() }, "1 queues saved, the device has 2"),
            (NetState { mac: [1, 0, 0, 0, 0, 1], ..good.clone() }, "mac 01:00:00:00:00:01 is not unicast"),
            (NetState { mtu: Some(10), ..good.clone() }, "mtu"),
            (NetState { queues: vec![QueueState { size: 3, ..good.queues[0] }; 2], ..good.clone() }, "queue"),
            // Queues larger than the device's: as a maximum, or as a size past it.
            (
                NetState {
                    queues: vec![QueueState { max_size: 1024, size: 1024, ..good.queues[0] }; 2],
                    ..good.clone()
                },
                "queue 0: max size 1024 differs from the device's 256",
            ),
            (
                NetState { queues: vec![good.queues[0], QueueState { size: 512, ..good.queues[1] }], ..good.clone() },
                "queue 1",
            ),
            // A ring past the end of guest memory.
            (
                NetState {
                    queues: vec![good.queues[0], QueueState { used_ring: 1 << 40, ..good.queues[1] }],
                    ..good.clone()
                },
                "queue 1: not ready or outside guest memory",
            ),
        ];
        for (snap, needle) in cases {
            let err = Net::restore(args(r.mem.clone(), 0), &snap).err().expect(needle).to_string();
            assert!(err.contains(needle), "{needle}: {err}");
        }
        let inactive = NetState { queues: vec![], acked_features: VIRTIO_F_VERSION_1, broken: true, ..good };
        let net = Net::restore(args(r.mem.clone(), 0), &inactive).unwrap();
        assert!(net.is_broken());
    }
}
