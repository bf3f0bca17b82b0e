//! Serialisable virtio-balloon state and its [`Persist`] impl: the configured features, what the
//! driver acked and wrote (`actual`), the virtqueues and the running counters. Nothing of the
//! host is in it: the device's host end is guest memory itself, which the new process maps (a
//! restore maps the memory file private, so reported pages are then dropped with
//! `MADV_DONTNEED` rather than punched out of a memfd: `discard.rs` picks by mapping).

use serde::{Deserialize, Serialize};
use vm_memory::GuestMemoryMmap;

use super::device::{Active, Balloon, QUEUE_SIZES, VIRTIO_BALLOON_F_REPORTING};
use super::metrics::BalloonCounters;
use crate::config::BalloonConfig;
use crate::devices::virtio::persist::{CommonRestore, QueueState, VirtioCommonState, VirtioPersistError};
use crate::devices::virtio::{DeviceState, IrqTrigger, VirtioDevice};
use crate::persist::Persist;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BalloonState {
    pub free_page_reporting: bool,
    pub acked_features: u64,
    /// The host's `num_pages` (the API's balloon target).
    #[serde(default)]
    pub num_pages: u32,
    /// The driver's `actual` config field.
    pub actual: u32,
    /// inflate, deflate (and reporting when negotiated); empty while inactive.
    pub queues: Vec<QueueState>,
    pub broken: bool,
    pub counters: BalloonCounters,
}

impl BalloonState {
    pub fn common(&self) -> VirtioCommonState<'_> {
        VirtioCommonState { acked_features: self.acked_features, queues: &self.queues, broken: self.broken }
    }
}

/// What a restored balloon needs from the new process.
pub struct BalloonConstructorArgs {
    /// The run's balloon config (a restore keeps the snapshot's).
    pub cfg: BalloonConfig,
    pub mem: GuestMemoryMmap,
    /// The interrupt of the device's transport slot.
    pub irq: IrqTrigger,
}

impl Persist for Balloon {
    type State = BalloonState;
    type ConstructorArgs = BalloonConstructorArgs;
    type Error = VirtioPersistError;

    fn save(&self) -> BalloonState {
        BalloonState {
            free_page_reporting: self.free_page_reporting,
            acked_features: self.acked_features,
            num_pages: self.num_pages,
            actual: self.actual,
            queues: match &self.state {
                DeviceState::Active(a) => a.queues.iter().map(QueueState::from).collect(),
                _ => vec![],
            },
            broken: self.state.is_broken(),
            counters: self.counters,
        }
    }

    fn restore(args: BalloonConstructorArgs, s: &BalloonState) -> Result<Self, VirtioPersistError> {
        if args.cfg.free_page_reporting != s.free_page_reporting {
            return Err(VirtioPersistError::Mismatch(format!(
                "balloon free_page_reporting={} but the snapshot's device had {}",
                args.cfg.free_page_reporting, s.free_page_reporting
            )));
        }
        let mut dev = Balloon::new(&args.cfg).map_err(|e| VirtioPersistError::Backend(e.to_string()))?;
        // A live device has exactly the queues its negotiated features call for.
        let live = if s.acked_features & VIRTIO_BALLOON_F_REPORTING != 0 { 3 } else { 2 };
        dev.state = match s.common().restore(dev.avail_features(), &QUEUE_SIZES[..live], &args.mem)? {
            CommonRestore::Broken(e) => DeviceState::Broken(e),
            CommonRestore::Inactive => DeviceState::Inactive,
            CommonRestore::Active(queues) => DeviceState::Active(Active { mem: args.mem, queues, irq: args.irq }),
        };
        dev.acked_features = s.acked_features;
        dev.num_pages = s.num_pages;
        dev.actual = s.actual;
        dev.counters = s.counters;
        Ok(dev)
    }
}

#[cfg(test)]
mod tests {
    use super::super::device::tests::{report, rig};
    use super::super::device::{REPORTQ, VIRTIO_BALLOON_F_REPORTING};
    use super::*;
    use crate::devices::virtio::chain::test_utils::F_WRITE;
    use crate::devices::virtio::VIRTIO_F_VERSION_1;
    use vm_memory::{Bytes, GuestAddress};
    use vmm_sys_util::eventfd::EventFd;

    fn irq() -> IrqTrigger {
        IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap())
    }

    fn args(mem: &GuestMemoryMmap, reporting: bool) -> BalloonConstructorArgs {
        BalloonConstructorArgs { cfg: BalloonConfig { free_page_reporting: reporting }, mem: mem.clone(), irq: irq() }
    }

    #[test]
    fn a_live_device_roundtrips_with_its_queues_and_counters_and_keeps_serving() {
        let mut r = rig(true);
        r.dev.write_config(4, &3u32.to_le_bytes());
        report(&mut r, &[(1 << 20, 0x1000, F_WRITE), (1 << 40, 0x1000, F_WRITE)]);
        let saved = r.dev.save();
        assert_eq!(saved.queues.len(), 3);
        assert_eq!((saved.queues[REPORTQ].next_avail, saved.queues[REPORTQ].next_used), (1, 1));
        assert_eq!((saved.counters.reports, saved.counters.rejected_ranges), (1, 1));
        let back: BalloonState = postcard::from_bytes(&postcard::to_stdvec(&saved).unwrap()).unwrap();
        assert_eq!(back, saved);

        let mut restored = Balloon::restore(args(&r.mem, true), &back).unwrap();
        assert_eq!(restored.save(), saved);
        let mut actual = [0u8; 4];
        restored.read_config(4, &mut actual);
        assert_eq!(u32::from_le_bytes(actual), 3);
        // The guest's next report lands in the restored queue where the saved one stopped.
        r.mem.write_slice(&[0x77; 0x1000], GuestAddress(2 << 20)).unwrap();
        r.report.set_desc(&r.mem, 1, 2 << 20, 0x1000, F_WRITE, 0);
        r.report.publish(&r.mem, 1);
        restored.process_queue(REPORTQ);
        assert_eq!(r.report.used_idx(&r.mem), 2);
        assert_eq!(r.mem.read_obj::<u8>(GuestAddress(2 << 20)).unwrap(), 0);
        assert_eq!(restored.counters().reports, 2);
    }

    #[test]
    fn inactive_broken_and_reporting_less_devices_roundtrip() {
        let m = crate::devices::virtio::chain::test_utils::mem();
        let fresh = Balloon::new(&BalloonConfig { free_page_reporting: true }).unwrap().save();
        assert!(fresh.queues.is_empty());
        assert_eq!(Balloon::restore(args(&m, true), &fresh).unwrap().save(), fresh);
        let broken = BalloonState { broken: true, ..fresh.clone() };
        assert!(Balloon::restore(args(&m, true), &broken).unwrap().is_broken());
        let r = rig(false);
        let two = r.dev.save();
        assert_eq!(two.queues.len(), 2, "REPORTING declined: two live queues");
        assert_eq!(Balloon::restore(args(&r.mem, true), &two).unwrap().save(), two);
    }

    #[test]
    fn bogus_state_is_refused() {
        let r = rig(true);
        let good = r.dev.save();
        let err = |s: &BalloonState, reporting: bool| {
            Balloon::restore(args(&r.mem, reporting), s).err().map(|e| e.to_string()).unwrap_or_default()
        };
        assert!(err(&good, false).contains("free_page_reporting"), "{}", err(&good, false));
        let not_offered = BalloonState { free_page_reporting: false, ..good.clone() };
        assert!(err(&not_offered, false).contains("acked features"), "{}", err(&not_offered, false));
        let (q, rq) = (good.queues[0], good.queues[REPORTQ]);
        let cases = [
            (BalloonState { queues: vec![q, q], ..good.clone() }, "2 queues"),
            (BalloonState { acked_features: VIRTIO_F_VERSION_1, ..good.clone() }, "3 queues saved, the device has 2"),
            (BalloonState { queues: vec![q, q, q], ..good.clone() }, "queue 2: max size 64"),
            (BalloonState { queues: vec![q, q, QueueState { size: 3, ..rq }], ..good.clone() }, "queue 2"),
            (
                BalloonState { queues: vec![q, q, QueueState { used_ring: 1 << 40, ..rq }], ..good.clone() },
                "guest memory",
            ),
            (BalloonState { acked_features: 1 << 40 | VIRTIO_BALLOON_F_REPORTING, ..good.clone() }, "acked features"),
        ];
        for (s, needle) in cases {
            assert!(err(&s, true).contains(needle), "{needle}: {}", err(&s, true));
        }
    }
}
