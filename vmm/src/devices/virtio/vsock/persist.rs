//! Serialisable virtio-vsock state and its [`Persist`] impl. Host connections are not part of
//! it: the restored device starts with none, listens on the new run's socket and tells the guest
//! with a TRANSPORT_RESET event, so guest sockets see their connections reset (as Firecracker
//! does).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use vm_memory::GuestMemoryMmap;

use super::device::{Active, Vsock, QUEUE_SIZES};
use crate::devices::virtio::persist::{
    restore_active_queues, CommonRestore, QueueState, VirtioCommonState, VirtioPersistError,
};
use crate::devices::virtio::{DeviceState, IrqTrigger, VirtioDevice};
use crate::persist::Persist;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VsockState {
    pub guest_cid: u64,
    pub uds_path: String,
    pub acked_features: u64,
    /// rx, tx, event; empty while inactive.
    pub queues: Vec<QueueState>,
    pub broken: bool,
}

impl VsockState {
    pub fn common(&self) -> VirtioCommonState<'_> {
        VirtioCommonState { acked_features: self.acked_features, queues: &self.queues, broken: self.broken }
    }
}

/// What a restored vsock device needs from the new process.
pub struct VsockConstructorArgs {
    /// The run's host socket (hybrid vsock listens here).
    pub uds_path: PathBuf,
    pub mem: GuestMemoryMmap,
    /// The interrupt of the device's transport slot.
    pub irq: IrqTrigger,
}

impl Persist for Vsock {
    type State = VsockState;
    type ConstructorArgs = VsockConstructorArgs;
    type Error = VirtioPersistError;

    fn save(&self) -> VsockState {
        VsockState {
            guest_cid: self.guest_cid,
            uds_path: self.uds_path.clone(),
            acked_features: self.acked_features,
            queues: match &self.state {
                DeviceState::Active(a) => a.queues.iter().map(QueueState::from).collect(),
                _ => vec![],
            },
            broken: self.state.is_broken(),
        }
    }

    fn restore(args: VsockConstructorArgs, s: &VsockState) -> Result<Self, VirtioPersistError> {
        if s.guest_cid < 3 || s.guest_cid >= u64::from(u32::MAX) {
            return Err(VirtioPersistError::Invalid(format!("guest CID {} is not a guest CID", s.guest_cid)));
        }
        let mut dev = Vsock::new(s.guest_cid, &args.uds_path)
            .map_err(|e| VirtioPersistError::Backend(format!("vsock {}: {e}", args.uds_path.display())))?;
        // The event queue may be unused (not ready); rx and tx must be live.
        let restored = s.common().restore(dev.avail_features(), &QUEUE_SIZES, &args.mem).or_else(|e| match e {
            VirtioPersistError::Queue { index: 2, .. } => {
                restore_unused_event_queue(&s.queues, &args.mem).map(CommonRestore::Active)
            }
            e => Err(e),
        })?;
        dev.acked_features = s.acked_features;
        match restored {
            CommonRestore::Broken(e) => dev.state = DeviceState::Broken(e),
            CommonRestore::Inactive => {}
            CommonRestore::Active(queues) => {
                dev.state =
                    DeviceState::Active(Active { mem: args.mem, queues, irq: args.irq, reset_event_pending: true });
                // Every connection the guest had is gone: tell it now, or once it posts an event buffer.
                dev.process_events();
            }
        }
        Ok(dev)
    }
}

/// rx and tx checked as live queues, the event queue taken as saved when the driver left it unset.
fn restore_unused_event_queue(
    saved: &[QueueState],
    mem: &GuestMemoryMmap,
) -> Result<Vec<virtio_queue::Queue>, VirtioPersistError> {
    let mut queues = restore_active_queues(&saved[..2], &QUEUE_SIZES[..2], mem)?;
    let ev = saved[2];
    if ev.ready || ev.max_size != QUEUE_SIZES[2] {
        return Err(VirtioPersistError::Queue { index: 2, reason: "ready but outside guest memory".into() });
    }
    let q =
        virtio_queue::Queue::try_from(ev).map_err(|e| VirtioPersistError::Queue { index: 2, reason: e.to_string() })?;
    queues.push(q);
    Ok(queues)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::chain::test_utils::{mem, TestQueue, F_WRITE};
    use crate::devices::virtio::vsock::device::{EVQ, VIRTIO_VSOCK_EVENT_TRANSPORT_RESET};
    use std::io::Write;
    use std::os::unix::net::UnixStream;
    use virtio_queue::QueueT;
    use vm_memory::{Bytes, GuestAddress};
    use vmm_sys_util::eventfd::EventFd;

    fn irq() -> IrqTrigger {
        IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap())
    }

    struct Rig {
        dev: Vsock,
        mem: GuestMemoryMmap,
        ev: TestQueue,
        dir: tempfile::TempDir,
    }

    /// An active device whose event queue has `event_buffers` buffers posted.
    fn rig(event_buffers: u16) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let mut dev = Vsock::new(3, &dir.path().join("a.sock")).unwrap();
        let m = mem();
        let (rx, tx) = (TestQueue::new(0x1000, 8), TestQueue::new(0x2000, 8));
        let mut ev = TestQueue::new(0x3000, 8);
        for i in 0..event_buffers {
            ev.set_desc(&m, i, 0x6000 + u64::from(i) * 0x100, 8, F_WRITE, 0);
            ev.publish(&m, i);
        }
        m.write_obj(0xffff_ffffu32, GuestAddress(0x6000)).unwrap();
        dev.set_acked_features(crate::devices::virtio::VIRTIO_F_VERSION_1);
        dev.activate(m.clone(), vec![rx.device_queue(256), tx.device_queue(256), ev.device_queue(256)], irq()).unwrap();
        Rig { dev, mem: m, ev, dir }
    }

    fn restore(r: &Rig, saved: &VsockState, name: &str) -> Result<(Vsock, IrqTrigger), VirtioPersistError> {
        let irq = irq();
        let args = VsockConstructorArgs { uds_path: r.dir.path().join(name), mem: r.mem.clone(), irq: irq.clone() };
        Vsock::restore(args, saved).map(|d| (d, irq))
    }

    #[test]
    fn restored_device_tells_the_guest_its_transport_was_reset() {
        let r = rig(2);
        let saved = r.dev.save();
        assert_eq!(saved.queues.len(), 3);
        let back: VsockState = postcard::from_bytes(&postcard::to_stdvec(&saved).unwrap()).unwrap();
        let (dev, irq) = restore(&r, &back, "b.sock").unwrap();
        assert_eq!(r.ev.used_idx(&r.mem), 1, "one event delivered");
        assert_eq!(r.ev.used_elem(&r.mem, 0), (0, 4));
        assert_eq!(r.mem.read_obj::<u32>(GuestAddress(0x6000)).unwrap(), VIRTIO_VSOCK_EVENT_TRANSPORT_RESET);
        assert_ne!(irq.status(), 0, "the guest is interrupted");
        assert_eq!(irq.eventfd().read().unwrap(), 1);
        let after = dev.save();
        assert_eq!(after.queues[EVQ].next_used, 1);
        assert_eq!((after.guest_cid, after.acked_features), (saved.guest_cid, saved.acked_features));
        // The new run's socket listens; the old one is the old process's business.
        let mut host = UnixStream::connect(r.dir.path().join("b.sock")).unwrap();
        host.write_all(b"CONNECT 1024\n").unwrap();
    }

    #[test]
    fn reset_event_waits_for_an_event_buffer() {
        let mut r = rig(0);
        let saved = r.dev.save();
        let (mut dev, irq) = restore(&r, &saved, "b.sock").unwrap();
        assert_eq!(r.ev.used_idx(&r.mem), 0);
        assert_eq!(irq.status(), 0);
        r.ev.set_desc(&r.mem, 0, 0x6000, 8, F_WRITE, 0);
        r.ev.publish(&r.mem, 0);
        dev.process_events(); // what the EVQ notify does
        assert_eq!(r.ev.used_idx(&r.mem), 1);
        assert_eq!(r.mem.read_obj::<u32>(GuestAddress(0x6000)).unwrap(), VIRTIO_VSOCK_EVENT_TRANSPORT_RESET);
        dev.process_events();
        assert_eq!(r.ev.used_idx(&r.mem), 1, "one event only");
    }

    #[test]
    fn hostile_event_buffer_breaks_only_the_device() {
        let mut r = rig(0);
        let saved = r.dev.save();
        r.ev.set_desc(&r.mem, 0, 0x6000, 2, F_WRITE, 0); // too short for an event
        r.ev.publish(&r.mem, 0);
        let (dev, _) = restore(&r, &saved, "b.sock").unwrap();
        assert!(dev.is_broken());
    }

    #[test]
    fn inactive_device_and_unused_event_queue_restore() {
        let dir = tempfile::tempdir().unwrap();
        let idle = Vsock::new(7, &dir.path().join("a.sock")).unwrap().save();
        let r = rig(0);
        let (dev, _) = restore(&r, &idle, "c.sock").unwrap();
        let uds_path = r.dir.path().join("c.sock").display().to_string();
        assert_eq!(dev.save(), VsockState { uds_path, ..idle });

        // A driver that never set up the event queue.
        let mut saved = r.dev.save();
        saved.queues[EVQ] = QueueState { max_size: 256, size: 256, ..Default::default() };
        let (dev, _) = restore(&r, &saved, "d.sock").unwrap();
        assert!(!dev.is_broken());
        assert!(!virtio_queue::Queue::try_from(dev.save().queues[EVQ]).unwrap().ready());
    }

    #[test]
    fn bogus_state_is_refused() {
        let r = rig(0);
        let good = r.dev.save();
        let mut cases = vec![
            (VsockState { guest_cid: 2, ..good.clone() }, "CID"),
            (VsockState { acked_features: 1 << 50, ..good.clone() }, "acked features"),
            (VsockState { queues: good.queues[..1].to_vec(), ..good.clone() }, "queues saved"),
        ];
        let mut far = good.clone();
        far.queues[0].desc_table = 1 << 45;
        cases.push((far, "queue 0"));
        for (i, (s, needle)) in cases.into_iter().enumerate() {
            let e = restore(&r, &s, &format!("x{i}.sock")).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(needle), "{needle}: {e}");
        }
    }
}
