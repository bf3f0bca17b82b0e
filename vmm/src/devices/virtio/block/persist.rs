//! Serialisable virtio-blk state and its [`Persist`] impl. The backing file comes from the new
//! run (a pod may get its own copy of the template's disk); it must look like the saved one,
//! because the guest already read its capacity and negotiated read-only.

use std::fs::OpenOptions;

use serde::{Deserialize, Serialize};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::device::{Active, Block, QUEUE_SIZES};
use super::packet::SECTOR_SIZE;
use crate::config::BlockConfig;
use crate::devices::virtio::persist::{CommonRestore, QueueState, VirtioCommonState, VirtioPersistError};
use crate::devices::virtio::{DeviceState, IrqTrigger, VirtioDevice};
use crate::persist::Persist;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BlockState {
    pub path: String,
    pub read_only: bool,
    pub capacity_sectors: u64,
    pub acked_features: u64,
    /// Empty while the device is inactive.
    pub queues: Vec<QueueState>,
    pub broken: bool,
}

impl BlockState {
    pub fn common(&self) -> VirtioCommonState<'_> {
        VirtioCommonState { acked_features: self.acked_features, queues: &self.queues, broken: self.broken }
    }
}

/// What a restored block device needs from the new process.
pub struct BlockConstructorArgs {
    /// The run's backing file for this slot.
    pub cfg: BlockConfig,
    pub index: usize,
    pub mem: GuestMemoryMmap,
    /// The interrupt of the device's transport slot.
    pub irq: IrqTrigger,
}

impl Persist for Block {
    type State = BlockState;
    type ConstructorArgs = BlockConstructorArgs;
    type Error = VirtioPersistError;

    fn save(&self) -> BlockState {
        BlockState {
            path: self.path.clone(),
            read_only: self.read_only,
            capacity_sectors: self.capacity_sectors,
            acked_features: self.acked_features,
            queues: match &self.state {
                DeviceState::Active(a) => vec![QueueState::from(&a.queue)],
                _ => vec![],
            },
            broken: self.state.is_broken(),
        }
    }

    fn restore(args: BlockConstructorArgs, s: &BlockState) -> Result<Self, VirtioPersistError> {
        let path = args.cfg.path.display().to_string();
        if args.cfg.read_only != s.read_only {
            return Err(VirtioPersistError::Mismatch(format!(
                "block {path} read_only={} but the snapshot's device was read_only={}",
                args.cfg.read_only, s.read_only
            )));
        }
        let backend = |e: std::io::Error| VirtioPersistError::Backend(format!("block {path}: {e}"));
        let file = OpenOptions::new().read(true).write(!s.read_only).open(&args.cfg.path).map_err(backend)?;
        let capacity_sectors = file.metadata().map_err(backend)?.len() / SECTOR_SIZE;
        if capacity_sectors != s.capacity_sectors {
            return Err(VirtioPersistError::Mismatch(format!(
                "block {path} holds {capacity_sectors} sectors, the snapshot's disk held {}",
                s.capacity_sectors
            )));
        }
        let mut dev = Block {
            name: format!("blk{}", args.index),
            file,
            path,
            read_only: s.read_only,
            capacity_sectors,
            acked_features: 0,
            queue_evts: [EventFd::new(libc::EFD_NONBLOCK).map_err(|e| VirtioPersistError::Backend(e.to_string()))?],
            state: DeviceState::Inactive,
            logs: Default::default(),
        };
        dev.state = match s.common().restore(dev.avail_features(), &QUEUE_SIZES, &args.mem)? {
            CommonRestore::Broken(e) => DeviceState::Broken(e),
            CommonRestore::Inactive => DeviceState::Inactive,
            CommonRestore::Active(mut queues) => {
                let queue = queues.pop().ok_or(VirtioPersistError::QueueCount { expected: 1, got: 0 })?;
                DeviceState::Active(Active { mem: args.mem, queue, irq: args.irq })
            }
        };
        dev.acked_features = s.acked_features;
        Ok(dev)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::chain::test_utils::{mem, TestQueue, F_NEXT, F_WRITE};
    use std::io::Write;
    use vm_memory::{Bytes, GuestAddress};

    fn disk(len: usize) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let mut data = vec![0u8; len];
        data[512..517].copy_from_slice(b"hello");
        f.write_all(&data).unwrap();
        f
    }

    fn irq() -> IrqTrigger {
        IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap())
    }

    fn args(f: &tempfile::NamedTempFile, read_only: bool, m: &GuestMemoryMmap) -> BlockConstructorArgs {
        BlockConstructorArgs {
            cfg: BlockConfig { path: f.path().to_owned(), read_only },
            index: 0,
            mem: m.clone(),
            irq: irq(),
        }
    }

    /// Reads sector `sector` into 0x9000 through chain head 0; returns the status byte.
    fn read_sector(blk: &mut Block, m: &GuestMemoryMmap, tq: &mut TestQueue, sector: u64) -> u8 {
        m.write_obj(0u32, GuestAddress(0x8000)).unwrap();
        m.write_obj(sector, GuestAddress(0x8008)).unwrap();
        tq.set_desc(m, 0, 0x8000, 16, F_NEXT, 1);
        tq.set_desc(m, 1, 0x9000, 512, F_WRITE | F_NEXT, 2);
        tq.set_desc(m, 2, 0xa000, 1, F_WRITE, 0);
        tq.publish(m, 0);
        blk.process_queue();
        m.read_obj(GuestAddress(0xa000)).unwrap()
    }

    #[test]
    fn active_device_roundtrips_with_its_queue_indices_and_keeps_serving() {
        let f = disk(4096);
        let m = mem();
        let mut blk = Block::new(&BlockConfig { path: f.path().to_owned(), read_only: false }, 0).unwrap();
        let mut tq = TestQueue::new(0x1000, 8);
        blk.set_acked_features(crate::devices::virtio::VIRTIO_F_VERSION_1);
        blk.activate(m.clone(), vec![tq.device_queue(256)], irq()).unwrap();
        assert_eq!(read_sector(&mut blk, &m, &mut tq, 0), 0);
        let saved = blk.save();
        assert_eq!((saved.queues.len(), saved.queues[0].next_avail, saved.queues[0].next_used), (1, 1, 1));
        let back: BlockState = postcard::from_bytes(&postcard::to_stdvec(&saved).unwrap()).unwrap();

        let mut restored = Block::restore(args(&f, false, &m), &back).unwrap();
        assert_eq!(restored.save(), saved);
        assert_eq!(read_sector(&mut restored, &m, &mut tq, 1), 0, "the restored queue continues");
        assert_eq!(tq.used_idx(&m), 2);
        let mut got = [0u8; 5];
        m.read_slice(&mut got, GuestAddress(0x9000)).unwrap();
        assert_eq!(&got, b"hello");
    }

    #[test]
    fn inactive_and_broken_devices_roundtrip() {
        let f = disk(4096);
        let m = mem();
        let blk = Block::new(&BlockConfig { path: f.path().to_owned(), read_only: true }, 0).unwrap();
        let saved = blk.save();
        let restored = Block::restore(args(&f, true, &m), &saved).unwrap();
        assert_eq!(restored.save(), saved);
        let broken = BlockState { broken: true, ..saved };
        let restored = Block::restore(args(&f, true, &m), &broken).unwrap();
        assert!(restored.is_broken());
    }

    #[test]
    fn mismatched_disks_and_bogus_state_are_refused() {
        let f = disk(4096);
        let m = mem();
        let good = Block::new(&BlockConfig { path: f.path().to_owned(), read_only: false }, 0).unwrap().save();
        let err = |s: &BlockState, f: &tempfile::NamedTempFile, ro: bool| {
            Block::restore(args(f, ro, &m), s).err().map(|e| e.to_string()).unwrap_or_default()
        };
        assert!(err(&good, &disk(8192), false).contains("16 sectors"), "a different disk size");
        assert!(err(&good, &f, true).contains("read_only"));
        let q = QueueState {
            max_size: 256,
            size: 8,
            ready: true,
            desc_table: 0x1000,
            avail_ring: 0x1080,
            used_ring: 0x10a0,
            ..Default::default()
        };
        let bad = [
            (BlockState { acked_features: 1 << 40, ..good.clone() }, "acked features"),
            (BlockState { queues: vec![q, q], ..good.clone() }, "2 queues"),
            (BlockState { queues: vec![QueueState { size: 3, ..q }], ..good.clone() }, "queue 0"),
            (BlockState { queues: vec![QueueState { max_size: 1024, ..q }], ..good.clone() }, "max size"),
            (BlockState { queues: vec![QueueState { desc_table: 1 << 40, ..q }], ..good.clone() }, "guest memory"),
        ];
        for (s, needle) in bad {
            assert!(err(&s, &f, false).contains(needle), "{needle}: {}", err(&s, &f, false));
        }
        let gone = BlockConstructorArgs {
            cfg: BlockConfig { path: "/nonexistent/disk".into(), read_only: false },
            ..args(&f, false, &m)
        };
        assert!(matches!(Block::restore(gone, &good), Err(VirtioPersistError::Backend(_))));
    }
}
