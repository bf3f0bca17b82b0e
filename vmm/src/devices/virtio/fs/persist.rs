//! Serialisable virtio-fs state and its restore. It is the frontend's view only: the backend's
//! FUSE session (open files, inode numbers) lives in virtiofsd and is not part of it. A restored
//! device gets a fresh backend (the run's socket), so a snapshot is only taken before the guest
//! has sent a request (`Fs::snapshot_blocker`): the product snapshots templates whose guest
//! probed the device but has not mounted the tag.
//!
//! Restoring does not talk to the backend: a device that was active posts a start to its backend
//! thread, as DRIVER_OK does, which connects to the new backend and starts fresh shadow vrings
//! (the backend never sees guest memory, so a restored VM's memory may stay a private map of
//! the snapshot). The driver's queues go on where the saved ones stood. A backend that fails
//! breaks the device, as after DRIVER_OK.

use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;

use super::device::Fs;
use super::worker::BackendThreads;
use super::AVAIL_FEATURES;
use super::NUM_QUEUES;
use crate::config::FsConfig;
use crate::devices::virtio::persist::{CommonRestore, QueueState, VirtioCommonState, VirtioPersistError};
use crate::devices::virtio::{DeviceState, IrqTrigger, VirtioDevice};
use crate::persist::Persist;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FsState {
    pub tag: String,
    /// The backend's socket at save time (a restore is given another).
    pub socket: String,
    pub queue_size: u16,
    pub acked_features: u64,
    /// hiprio, then the request queue: addresses, size, and the used index published to the
    /// driver (the restored relay restarts there). Empty while inactive.
    pub vrings: Vec<QueueState>,
    pub broken: bool,
}

impl FsState {
    pub fn common(&self) -> VirtioCommonState<'_> {
        VirtioCommonState { acked_features: self.acked_features, queues: &self.vrings, broken: self.broken }
    }
}

/// What a restore needs besides the snapshot.
pub struct FsConstructorArgs {
    /// The run's device: the snapshot's tag and queue size, the run's backend socket.
    pub cfg: FsConfig,
    pub index: usize,
    pub threads: BackendThreads,
    pub mem: GuestMemoryMmap,
    pub irq: IrqTrigger,
}

impl Persist for Fs {
    type State = FsState;
    type ConstructorArgs = FsConstructorArgs;
    type Error = VirtioPersistError;

    /// Each of the driver's queues is saved at the used index published to the driver, so
    /// requests taken but not answered are taken again after a restore. Open files live in the
    /// backend and are not part of this state.
    fn save(&self) -> FsState {
        FsState {
            tag: self.tag.clone(),
            socket: self.socket.display().to_string(),
            queue_size: self.queue_sizes[0],
            acked_features: self.acked_features,
            vrings: match &self.state {
                DeviceState::Active(a) => a.queues.iter().map(|q| published_position(&a.mem, q)).collect(),
                _ => vec![],
            },
            broken: self.state.is_broken(),
        }
    }

    /// The snapshot is untrusted: tag and queue size must be the run's, acked features ones the
    /// device offers, live vrings valid in the new guest memory.
    fn restore(args: FsConstructorArgs, state: &FsState) -> Result<Self, VirtioPersistError> {
        if state.tag != args.cfg.tag || state.queue_size != args.cfg.queue_size {
            return Err(VirtioPersistError::Mismatch(format!(
                "tag {:?} with queue size {} in the snapshot, {:?} with {} in the run",
                state.tag, state.queue_size, args.cfg.tag, args.cfg.queue_size
            )));
        }
        // Checked before the backend's threads start (the queue sizes are the config's, checked above).
        let max_sizes = [state.queue_size; NUM_QUEUES];
        let restored = state.common().restore(AVAIL_FEATURES, &max_sizes, &args.mem)?;
        let mut fs = Fs::new(&args.cfg, args.index, args.threads)
            .map_err(|e| VirtioPersistError::Backend(format!("backend threads: {e}")))?;
        fs.set_acked_features(state.acked_features);
        match restored {
            CommonRestore::Broken(_) => fs.mark_broken(),
            CommonRestore::Inactive => {}
            CommonRestore::Active(queues) => {
                fs.activate(args.mem, queues, args.irq).map_err(VirtioPersistError::Activate)?
            }
        }
        Ok(fs)
    }
}

/// A queue as a restored relay must pick it up: both indices at the used index published to
/// the driver (or as the transport left them, if guest memory cannot be read).
fn published_position(mem: &GuestMemoryMmap, q: &Queue) -> QueueState {
    let mut s = QueueState::from(q);
    if let Ok(used) = q.used_idx(mem, Ordering::Acquire) {
        s.next_avail = used.0;
        s.next_used = used.0;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::fs::test_utils::{FakeBackend, Script};
    use crate::devices::virtio::VIRTIO_F_VERSION_1;
    use crate::memory::create_guest_memory;
    use std::path::Path;
    use std::time::{Duration, Instant};
    use vmm_sys_util::eventfd::EventFd;

    fn args(socket: &Path, mem: GuestMemoryMmap) -> FsConstructorArgs {
        FsConstructorArgs {
            cfg: FsConfig { tag: "rootfs".into(), socket: socket.to_owned(), queue_size: 256 },
            index: 0,
            threads: BackendThreads::unconfined(),
            mem,
            irq: IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()),
        }
    }

    fn vring(at: u64) -> QueueState {
        QueueState {
            max_size: 256,
            size: 8,
            ready: true,
            desc_table: at,
            avail_ring: at + 0x1000,
            used_ring: at + 0x2000,
            ..Default::default()
        }
    }

    fn saved(vrings: Vec<QueueState>) -> FsState {
        FsState {
            tag: "rootfs".into(),
            socket: "/old/fs.sock".into(),
            queue_size: 256,
            acked_features: VIRTIO_F_VERSION_1,
            vrings,
            broken: false,
        }
    }

    #[test]
    fn an_active_device_starts_its_vrings_on_the_runs_backend() {
        let backend = FakeBackend::start(Script::virtiofsd_like());
        let mem = create_guest_memory(16 << 20).unwrap();
        let state = saved(vec![vring(0x10_0000), vring(0x20_0000)]);
        let fs = Fs::restore(args(&backend.path, mem), &state).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !backend.requests().contains(&super::super::test_utils::SET_VRING_ENABLE) {
            assert!(Instant::now() < deadline, "the backend was never started: {:?}", backend.requests());
            std::thread::sleep(Duration::from_millis(5));
        }
        let back = fs.save();
        let json = serde_json::to_string(&back).unwrap();
        assert_eq!(serde_json::from_str::<FsState>(&json).unwrap(), back);
        assert_eq!((back.tag, back.vrings.len(), back.acked_features), ("rootfs".into(), 2, VIRTIO_F_VERSION_1));
        assert_eq!(back.socket, backend.path.display().to_string(), "the run's socket");
    }

    #[test]
    fn an_inactive_or_broken_device_waits_for_the_driver() {
        let mem = create_guest_memory(16 << 20).unwrap();
        let absent = Path::new("/nonexistent/fs.sock");
        let fs = Fs::restore(args(absent, mem.clone()), &saved(vec![])).unwrap();
        assert!(!fs.is_broken());
        assert_eq!(fs.save().vrings.len(), 0);
        let broken = FsState { broken: true, ..saved(vec![vring(0x10_0000), vring(0x20_0000)]) };
        assert!(Fs::restore(args(absent, mem), &broken).unwrap().is_broken());
    }

    #[test]
    fn untrusted_snapshots_are_refused() {
        let mem = create_guest_memory(16 << 20).unwrap();
        let absent = Path::new("/nonexistent/fs.sock");
        let good = saved(vec![vring(0x10_0000), vring(0x20_0000)]);
        let cases = [
            (FsState { tag: "other".into(), ..good.clone() }, "tag"),
            (FsState { queue_size: 128, ..good.clone() }, "queue size"),
            (FsState { acked_features: 1, ..good.clone() }, "does not offer"),
            (FsState { vrings: vec![vring(0x10_0000)], ..good.clone() }, "queues saved"),
            (
                FsState { vrings: vec![vring(0x10_0000), vring((16 << 20) - 0x1000)], ..good.clone() },
                "outside guest memory",
            ),
        ];
        for (state, needle) in cases {
            let err = Fs::restore(args(absent, mem.clone()), &state).err().expect(needle).to_string();
            assert!(err.contains(needle), "{needle}: {err}");
        }
    }
}
