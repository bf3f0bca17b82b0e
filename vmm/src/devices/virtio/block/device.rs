//! virtio-blk device semantics: features, config space (capacity) and request execution.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::packet::{
    Request, RequestType, ID_BYTES, MAX_REQUEST_BYTES, SECTOR_SIZE, STATUS_IOERR, STATUS_OK, STATUS_UNSUPP,
};
use crate::config::BlockConfig;
use crate::devices::virtio::chain::{self, Desc};
use crate::devices::virtio::{
    read_config_bytes, validate_queues, DeviceError, DeviceLogs, DeviceState, IrqTrigger, PendingReset, VirtioDevice,
    TYPE_BLOCK, VIRTIO_F_VERSION_1, VIRTIO_MMIO_INT_VRING,
};
use crate::throttled;

pub const VIRTIO_BLK_F_RO: u64 = 1 << 5;
pub const VIRTIO_BLK_F_FLUSH: u64 = 1 << 9;
pub const QUEUE_SIZE: u16 = 256;
pub(super) const QUEUE_SIZES: [u16; 1] = [QUEUE_SIZE];

pub struct Active {
    pub(super) mem: GuestMemoryMmap,
    pub(super) queue: Queue,
    pub(super) irq: IrqTrigger,
}

pub struct Block {
    pub(super) name: String,
    pub(super) file: File,
    pub(super) path: String,
    pub(super) read_only: bool,
    pub(super) capacity_sectors: u64,
    pub(super) acked_features: u64,
    pub(super) queue_evts: [EventFd; 1],
    pub(super) state: DeviceState<Active>,
    pub(super) logs: DeviceLogs,
}

impl Block {
    pub fn new(cfg: &BlockConfig, index: usize) -> std::io::Result<Self> {
        let file = OpenOptions::new().read(true).write(!cfg.read_only).open(&cfg.path)?;
        let len = file.metadata()?.len();
        Ok(Self {
            name: format!("blk{index}"),
            file,
            path: cfg.path.display().to_string(),
            read_only: cfg.read_only,
            capacity_sectors: len / SECTOR_SIZE,
            acked_features: 0,
            queue_evts: [EventFd::new(libc::EFD_NONBLOCK)?],
            state: DeviceState::Inactive,
            logs: DeviceLogs::default(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn queue_evt(&self) -> &EventFd {
        &self.queue_evts[0]
    }

    /// Serves every available request. A malformed chain stops the device.
    pub fn process_queue(&mut self) {
        let DeviceState::Active(active) = &mut self.state else { return };
        match serve(active, &self.file, self.read_only, self.capacity_sectors) {
            Ok(0) => {}
            Ok(_) => active.irq.trigger(VIRTIO_MMIO_INT_VRING),
            Err(e) => {
                throttled!(self.logs.faults, error, device = %self.name, error = %e,
                    "guest sent a malformed request; device stops serving until reset");
                self.state = DeviceState::Broken(e);
            }
        }
    }
}

/// Returns the number of requests completed.
fn serve(a: &mut Active, file: &File, read_only: bool, capacity: u64) -> Result<usize, DeviceError> {
    let mem = a.mem.clone();
    let mut done = 0;
    // Bounded by the queue size: the avail index check rejects more than `size` pending chains.
    for _ in 0..=a.queue.size() {
        let chain = match chain::pop(&mut a.queue, &mem)? {
            Some(c) => c,
            None => return Ok(done),
        };
        let head = chain.head_index();
        let descs = chain::collect(chain, &mem, MAX_REQUEST_BYTES + 17)?;
        let req = Request::parse(&descs, &mem).map_err(DeviceError::request)?;
        let (status, written) = execute(&req, &mem, file, read_only, capacity)?;
        mem.write_obj(status, req.status_addr).map_err(DeviceError::memory)?;
        a.queue.add_used(&mem, head, written + 1).map_err(DeviceError::memory)?;
        done += 1;
    }
    Ok(done)
}

/// Runs one request; returns (status, bytes written into guest data buffers).
fn execute(
    req: &Request,
    mem: &GuestMemoryMmap,
    file: &File,
    read_only: bool,
    capacity: u64,
) -> Result<(u8, u32), DeviceError> {
    let in_disk = |len: u64| {
        len.is_multiple_of(SECTOR_SIZE)
            && req
                .sector
                .checked_mul(SECTOR_SIZE)
                .and_then(|o| o.checked_add(len))
                .is_some_and(|end| end <= capacity * SECTOR_SIZE)
    };
    let mem_err = |e: vm_memory::GuestMemoryError| DeviceError::Memory(e.to_string());
    match req.kind {
        RequestType::In => {
            if !in_disk(req.data_len) {
                return Ok((STATUS_IOERR, 0));
            }
            let mut buf = vec![0u8; req.data_len as usize];
            if file.read_exact_at(&mut buf, req.sector * SECTOR_SIZE).is_err() {
                return Ok((STATUS_IOERR, 0));
            }
            chain::scatter(&buf, &req.data, mem).map_err(mem_err)?;
            Ok((STATUS_OK, req.data_len as u32))
        }
        RequestType::Out => {
            if read_only || !in_disk(req.data_len) {
                return Ok((STATUS_IOERR, 0));
            }
            let buf = gather(&req.data, mem).map_err(mem_err)?;
            if file.write_all_at(&buf, req.sector * SECTOR_SIZE).is_err() {
                return Ok((STATUS_IOERR, 0));
            }
            Ok((STATUS_OK, 0))
        }
        RequestType::Flush => Ok((if file.sync_data().is_ok() { STATUS_OK } else { STATUS_IOERR }, 0)),
        RequestType::GetId => {
            let mut id = [0u8; ID_BYTES];
            let tag = b"bulkhead-blk";
            id[..tag.len()].copy_from_slice(tag);
            let n = (req.data_len as usize).min(ID_BYTES);
            chain::scatter(&id[..n], &req.data, mem).map_err(mem_err)?;
            Ok((STATUS_OK, n as u32))
        }
        RequestType::Unsupported(_) => Ok((STATUS_UNSUPP, 0)),
    }
}

fn gather(descs: &[Desc], mem: &GuestMemoryMmap) -> Result<Vec<u8>, vm_memory::GuestMemoryError> {
    let mut buf = Vec::new();
    for d in descs {
        let start = buf.len();
        buf.resize(start + d.len as usize, 0);
        mem.read_slice(&mut buf[start..], d.addr)?;
    }
    Ok(buf)
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        TYPE_BLOCK
    }

    fn avail_features(&self) -> u64 {
        let mut f = VIRTIO_F_VERSION_1 | VIRTIO_BLK_F_FLUSH;
        if self.read_only {
            f |= VIRTIO_BLK_F_RO;
        }
        f
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked_features = features;
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn queue_events(&self) -> &[EventFd] {
        &self.queue_evts
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // Config space: capacity (le64) first; everything else reads as zero.
        read_config_bytes(&self.capacity_sectors.to_le_bytes(), offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        throttled!(self.logs.config_writes, warn, device = %self.name, offset, "write to read-only block config ignored");
    }

    fn activate(&mut self, mem: GuestMemoryMmap, mut queues: Vec<Queue>, irq: IrqTrigger) -> Result<(), DeviceError> {
        validate_queues(&mem, &queues)?;
        let queue = queues.pop().ok_or(DeviceError::QueueNotReady(0))?;
        self.state = DeviceState::Active(Active { mem, queue, irq });
        tracing::debug!(device = %self.name, "activated");
        Ok(())
    }

    fn reset(&mut self) -> Option<PendingReset> {
        self.state = DeviceState::Inactive;
        self.acked_features = 0;
        None
    }

    fn is_broken(&self) -> bool {
        self.state.is_broken()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::chain::test_utils::{TestQueue, F_NEXT, F_WRITE};
    use crate::persist::Persist;
    use std::io::Write;
    use vm_memory::GuestAddress;

    struct Rig {
        blk: Block,
        mem: GuestMemoryMmap,
        tq: TestQueue,
        irq: IrqTrigger,
        _file: tempfile::NamedTempFile,
    }

    fn rig(read_only: bool) -> Rig {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let mut disk = vec![0u8; 4096];
        disk[..5].copy_from_slice(b"hello");
        f.write_all(&disk).unwrap();
        let mut blk = Block::new(&BlockConfig { path: f.path().to_owned(), read_only }, 0).unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let tq = TestQueue::new(0x1000, 16);
        let irq = IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let mut q = tq.queue();
        q.set_size(16);
        blk.activate(mem.clone(), vec![q], irq.clone()).unwrap();
        Rig { blk, mem, tq, irq, _file: f }
    }

    fn request(r: &mut Rig, kind: u32, sector: u64, data_flags: u16, len: u32) {
        r.mem.write_obj(kind, GuestAddress(0x8000)).unwrap();
        r.mem.write_obj(sector, GuestAddress(0x8008)).unwrap();
        r.tq.set_desc(&r.mem, 0, 0x8000, 16, F_NEXT, 1);
        r.tq.set_desc(&r.mem, 1, 0x9000, len, data_flags | F_NEXT, 2);
        r.tq.set_desc(&r.mem, 2, 0xa000, 1, F_WRITE, 0);
        r.mem.write_obj(0xffu8, GuestAddress(0xa000)).unwrap();
        r.tq.publish(&r.mem, 0);
        r.blk.process_queue();
    }

    fn status(r: &Rig) -> u8 {
        r.mem.read_obj(GuestAddress(0xa000)).unwrap()
    }

    #[test]
    fn config_space_reports_capacity() {
        let r = rig(false);
        let mut b = [0u8; 8];
        r.blk.read_config(0, &mut b);
        assert_eq!(u64::from_le_bytes(b), 8);
        let mut tail = [0xffu8; 4];
        r.blk.read_config(6, &mut tail);
        assert_eq!(tail, [0, 0, 0, 0]);
    }

    #[test]
    fn read_then_write_a_sector() {
        let mut r = rig(false);
        request(&mut r, 0, 0, F_WRITE, 512);
        assert_eq!(status(&r), STATUS_OK);
        let mut got = [0u8; 5];
        r.mem.read_slice(&mut got, GuestAddress(0x9000)).unwrap();
        assert_eq!(&got, b"hello");
        assert_eq!(r.tq.used_idx(&r.mem), 1);
        assert_eq!(r.tq.used_elem(&r.mem, 0), (0, 513));
        assert_ne!(r.irq.status() & VIRTIO_MMIO_INT_VRING, 0);

        r.mem.write_slice(b"world", GuestAddress(0x9000)).unwrap();
        request(&mut r, 1, 3, 0, 512);
        assert_eq!(status(&r), STATUS_OK);
        let mut disk = [0u8; 5];
        r.blk.file.read_exact_at(&mut disk, 3 * 512).unwrap();
        assert_eq!(&disk, b"world");
    }

    #[test]
    fn out_of_disk_and_read_only_give_ioerr_without_breaking() {
        let mut r = rig(true);
        request(&mut r, 0, 8, F_WRITE, 512);
        assert_eq!(status(&r), STATUS_IOERR);
        request(&mut r, 1, 0, 0, 512);
        assert_eq!(status(&r), STATUS_IOERR);
        request(&mut r, 0, u64::MAX / 2, F_WRITE, 512);
        assert_eq!(status(&r), STATUS_IOERR);
        request(&mut r, 77, 0, F_WRITE, 512);
        assert_eq!(status(&r), STATUS_UNSUPP);
        assert!(!r.blk.is_broken());
    }

    #[test]
    fn hostile_chains_break_the_device() {
        for (addr, len, next) in [(0xffff_0000_0000u64, 512u32, 2u16), (0x9000, 0x4000_0000, 2), (0x9000, 512, 0)] {
            let mut r = rig(false);
            r.mem.write_obj(0u32, GuestAddress(0x8000)).unwrap();
            r.tq.set_desc(&r.mem, 0, 0x8000, 16, F_NEXT, 1);
            // next == 0 builds a loop back to the head.
            r.tq.set_desc(&r.mem, 1, addr, len, F_WRITE | F_NEXT, next);
            r.tq.set_desc(&r.mem, 2, 0xa000, 1, F_WRITE, 0);
            r.tq.publish(&r.mem, 0);
            r.blk.process_queue();
            assert!(r.blk.is_broken(), "addr {addr:#x} len {len:#x} next {next}");
            assert_eq!(r.tq.used_idx(&r.mem), 0);
            // A broken device ignores further work until reset.
            r.blk.process_queue();
            r.blk.reset();
            assert!(!r.blk.is_broken());
        }
    }

    /// The whole register state machine: a driver talks to the transport, the transport to blk.
    #[test]
    fn driver_sequence_through_mmio_transport() {
        use crate::devices::bus::BusDevice;
        use crate::devices::virtio::mmio::MmioTransport;
        use crate::devices::virtio::mmio_regs as reg;
        use std::sync::{Arc, Mutex};

        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&[7u8; 1024]).unwrap();
        let blk =
            Arc::new(Mutex::new(Block::new(&BlockConfig { path: f.path().to_owned(), read_only: false }, 0).unwrap()));
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let irq = IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let mut t = MmioTransport::new("blk0".into(), mem.clone(), blk.clone(), irq.clone()).unwrap();
        let w = |t: &mut MmioTransport, off: u64, v: u32| t.write(off, &v.to_le_bytes());
        let r = |t: &mut MmioTransport, off: u64| {
            let mut b = [0u8; 4];
            t.read(off, &mut b);
            u32::from_le_bytes(b)
        };
        assert_eq!(r(&mut t, reg::DEVICE_ID), TYPE_BLOCK);
        w(&mut t, reg::STATUS, 1);
        w(&mut t, reg::STATUS, 3);
        w(&mut t, reg::DRIVER_FEATURES_SEL, 1);
        w(&mut t, reg::DRIVER_FEATURES, 1);
        w(&mut t, reg::STATUS, 0xb);
        assert_eq!(r(&mut t, reg::STATUS), 0xb);
        let mut tq = TestQueue::new(0x1000, 8);
        w(&mut t, reg::QUEUE_SEL, 0);
        assert_eq!(r(&mut t, reg::QUEUE_NUM_MAX), u32::from(QUEUE_SIZE));
        w(&mut t, reg::QUEUE_NUM, 8);
        w(&mut t, reg::QUEUE_DESC_LOW, tq.desc as u32);
        w(&mut t, reg::QUEUE_DRIVER_LOW, tq.avail as u32);
        w(&mut t, reg::QUEUE_DEVICE_LOW, tq.used as u32);
        w(&mut t, reg::QUEUE_READY, 1);
        w(&mut t, reg::STATUS, 0xf);
        assert_eq!(r(&mut t, reg::STATUS), 0xf);

        mem.write_obj(0u32, GuestAddress(0x8000)).unwrap();
        mem.write_obj(1u64, GuestAddress(0x8008)).unwrap();
        tq.set_desc(&mem, 0, 0x8000, 16, F_NEXT, 1);
        tq.set_desc(&mem, 1, 0x9000, 512, F_WRITE | F_NEXT, 2);
        tq.set_desc(&mem, 2, 0xa000, 1, F_WRITE, 0);
        tq.publish(&mem, 0);
        w(&mut t, reg::QUEUE_NOTIFY, 0);
        // What the event loop does on the queue eventfd.
        assert_eq!(blk.lock().unwrap().queue_evt().read().unwrap(), 1);
        blk.lock().unwrap().process_queue();
        assert_eq!(tq.used_idx(&mem), 1);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(0x9000)).unwrap(), 7);
        assert_eq!(r(&mut t, reg::INTERRUPT_STATUS), VIRTIO_MMIO_INT_VRING);
        w(&mut t, reg::INTERRUPT_ACK, VIRTIO_MMIO_INT_VRING);
        assert_eq!(r(&mut t, reg::INTERRUPT_STATUS), 0);
        let snap = blk.lock().unwrap().save();
        assert_eq!((snap.queues.len(), snap.queues[0].next_avail, snap.queues[0].next_used), (1, 1, 1));
        w(&mut t, reg::STATUS, 0);
        assert!(blk.lock().unwrap().save().queues.is_empty(), "reset drops the queues");
    }

    #[test]
    fn corrupt_avail_index_breaks_the_device() {
        let mut r = rig(false);
        r.mem.write_obj(500u16, GuestAddress(r.tq.avail + 2)).unwrap();
        r.blk.process_queue();
        assert!(r.blk.is_broken());
        assert!(r.blk.save().broken);
    }
}
