//! virtio-balloon device semantics: features (VERSION_1, plus REPORTING when configured), the
//! config space (`num_pages`, the pages the host asks the guest to hold in the balloon, set
//! through the API; `actual` as the driver writes it) and serving the inflate, deflate and
//! reporting queues. DEFLATE_ON_OOM is not offered: a guest under pressure cannot take back
//! what the host asked for, so an inflated balloon bounds the guest's memory.
//!
//! Queue numbering: the spec (5.5.2) lists inflateq 0, deflateq 1, statsq 2, free_page_vq 3 and
//! reporting_vq 4, each optional queue existing only with its feature. Linux's virtio-mmio
//! `find_vqs` numbers only the queues that exist, and QEMU, cloud-hypervisor and Firecracker lay
//! their queues out the same way, so without stats and hinting the reporting queue is index 2.
//! This device offers neither, so the two readings cannot disagree: its queues are inflate and
//! deflate, plus reporting when free page reporting is configured. A driver that declines
//! REPORTING sets up the first two only, and the third is ignored.
//!
//! What the guest reports goes back to the host (`discard.rs`) before the buffer is used: the
//! driver may reuse the pages as soon as it sees the buffer come back (spec 5.5.6.5).

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::discard::discard;
use super::metrics::BalloonCounters;
use super::packet::{parse_pfns, parse_report, Pages, MAX_PFN_CHAIN_BYTES};
use crate::config::BalloonConfig;
use crate::devices::virtio::chain;
use crate::devices::virtio::{
    read_config_bytes, validate_queues, DeviceError, DeviceLogs, DeviceState, IrqTrigger, PendingReset, VirtioDevice,
    TYPE_BALLOON, VIRTIO_F_VERSION_1, VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_INT_VRING,
};
use crate::log_throttle::LogThrottle;
use crate::throttled;

pub const INFLATEQ: usize = 0;
pub const DEFLATEQ: usize = 1;
pub const REPORTQ: usize = 2;
pub const VIRTIO_BALLOON_F_REPORTING: u64 = 1 << 5;
/// Linux's driver sends one inflate or deflate buffer at a time.
pub const QUEUE_SIZE: u16 = 64;
/// Linux refuses free page reporting on a queue smaller than its 32-entry reports
/// (PAGE_REPORTING_CAPACITY), and sends one report at a time.
pub const REPORT_QUEUE_SIZE: u16 = 32;
pub(super) const QUEUE_SIZES: [u16; 3] = [QUEUE_SIZE, QUEUE_SIZE, REPORT_QUEUE_SIZE];
/// Chains served per notify before the device yields to the rest of the event loop; it kicks its
/// own queue event to come back for the rest. One report is up to 64 ranges, each a syscall.
pub const MAX_CHAINS_PER_PASS: usize = 8;
/// num_pages, actual, free_page_hint_cmd_id, poison_val: le32 each.
pub const CONFIG_SPACE_LEN: usize = 16;
/// The one field the driver writes.
const ACTUAL: std::ops::Range<u64> = 4..8;

pub struct Active {
    pub(super) mem: GuestMemoryMmap,
    /// inflate, deflate, and reporting when REPORTING was negotiated.
    pub(super) queues: Vec<Queue>,
    pub(super) irq: IrqTrigger,
}

/// The balloon's guest-triggered log lines, throttled per kind.
#[derive(Debug, Default)]
pub(super) struct BalloonLogs {
    pub(super) device: DeviceLogs,
    /// Ranges skipped as outside RAM, unaligned to nothing, wrapping or misdirected.
    pub(super) rejected: LogThrottle,
    /// Ranges the host kernel refused to drop.
    pub(super) host: LogThrottle,
    /// One line per report served (debug), with the running totals.
    pub(super) reports: LogThrottle,
}

pub struct Balloon {
    pub(super) free_page_reporting: bool,
    pub(super) acked_features: u64,
    /// The host's `num_pages` (pages it asks the balloon to hold).
    pub(super) num_pages: u32,
    /// The driver's `actual` (pages it says are in the balloon).
    pub(super) actual: u32,
    pub(super) queue_evts: Vec<EventFd>,
    pub(super) state: DeviceState<Active>,
    pub(super) counters: BalloonCounters,
    pub(super) logs: BalloonLogs,
}

/// What one pass over a queue did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Pass {
    /// Buffers went back to the guest: interrupt it.
    used: bool,
    /// Stopped at [`MAX_CHAINS_PER_PASS`]: come back for the rest.
    more: bool,
}

impl Balloon {
    pub fn new(cfg: &BalloonConfig) -> std::io::Result<Self> {
        let queues = if cfg.free_page_reporting { 3 } else { 2 };
        Ok(Self {
            free_page_reporting: cfg.free_page_reporting,
            acked_features: 0,
            num_pages: 0,
            actual: 0,
            queue_evts: (0..queues).map(|_| EventFd::new(libc::EFD_NONBLOCK)).collect::<Result<_, _>>()?,
            state: DeviceState::Inactive,
            counters: BalloonCounters::default(),
            logs: BalloonLogs::default(),
        })
    }

    pub fn name(&self) -> &'static str {
        "balloon"
    }

    pub fn counters(&self) -> BalloonCounters {
        self.counters
    }

    /// Asks the guest to hold `pages` in the balloon (inflating or deflating to it); a driver
    /// already up is told at once, one still to come reads it when it starts.
    pub fn set_target(&mut self, pages: u32) {
        self.num_pages = pages;
        if let DeviceState::Active(a) = &self.state {
            a.irq.trigger(VIRTIO_MMIO_INT_CONFIG);
        }
    }

    /// The pages asked for, and those the driver says the balloon holds.
    pub fn pages(&self) -> (u32, u32) {
        (self.num_pages, self.actual)
    }

    /// The notify eventfds, one per queue the device has.
    pub fn queue_evts(&self) -> &[EventFd] {
        &self.queue_evts
    }

    /// Serves the chains the guest posted on `queue` (one of [`INFLATEQ`], [`DEFLATEQ`],
    /// [`REPORTQ`]). A malformed chain stops the device until the driver resets it.
    pub fn process_queue(&mut self, queue: usize) {
        let Self { state, counters, logs, .. } = self;
        let DeviceState::Active(a) = state else { return };
        if queue >= a.queues.len() {
            // REPORTING not negotiated: a notify on the third queue has nothing behind it.
            return;
        }
        match serve(a, queue, counters, logs) {
            Ok(pass) => {
                if pass.used {
                    a.irq.trigger(VIRTIO_MMIO_INT_VRING);
                }
                if pass.more {
                    if let Err(e) = self.queue_evts[queue].write(1) {
                        tracing::warn!(device = "balloon", queue, error = %e, "cannot reschedule queue work");
                    }
                }
            }
            Err(e) => {
                throttled!(self.logs.device.faults, error, device = "balloon", queue, error = %e,
                    "guest sent a malformed chain; device stops serving until reset");
                self.state = DeviceState::Broken(e);
            }
        }
    }
}

fn serve(
    a: &mut Active,
    queue: usize,
    counters: &mut BalloonCounters,
    logs: &mut BalloonLogs,
) -> Result<Pass, DeviceError> {
    let mem = a.mem.clone();
    let q = &mut a.queues[queue];
    let mut pass = Pass::default();
    for _ in 0..MAX_CHAINS_PER_PASS {
        let Some(chain) = chain::pop(q, &mem)? else { return Ok(pass) };
        let head = chain.head_index();
        match queue {
            INFLATEQ => {
                let descs = chain::collect(chain, &mem, MAX_PFN_CHAIN_BYTES)?;
                let pages = parse_pfns(&descs, &mem).map_err(DeviceError::memory)?;
                counters.inflated_pages += pages.bytes() / super::packet::PAGE_SIZE;
                give_back(&mem, &pages, counters, logs);
            }
            DEFLATEQ => {
                // The pages fault back in when the guest touches them: nothing to do but
                // acknowledge (MUST_TELL_HOST is not offered). The chain is still checked.
                chain::collect(chain, &mem, MAX_PFN_CHAIN_BYTES)?;
                counters.deflate_buffers += 1;
            }
            _ => {
                let pages = parse_report(&chain::collect_names(chain)?, &mem);
                counters.reports += 1;
                counters.reported_bytes = counters.reported_bytes.saturating_add(pages.named_bytes);
                give_back(&mem, &pages, counters, logs);
                let c = *counters;
                throttled!(
                    logs.reports,
                    debug,
                    device = "balloon",
                    ranges = pages.ranges.len(),
                    bytes = pages.bytes(),
                    reports = c.reports,
                    reported_bytes = c.reported_bytes,
                    freed_bytes = c.freed_bytes,
                    rejected_ranges = c.rejected_ranges,
                    "free page report served"
                );
            }
        }
        // The device writes nothing into these buffers.
        q.add_used(&mem, head, 0).map_err(DeviceError::memory)?;
        pass.used = true;
    }
    pass.more = true;
    Ok(pass)
}

/// Drops every checked range and counts what happened to the rest.
fn give_back(mem: &GuestMemoryMmap, pages: &Pages, counters: &mut BalloonCounters, logs: &mut BalloonLogs) {
    for r in &pages.ranges {
        match discard(mem, *r) {
            Ok(_) => counters.freed_bytes = counters.freed_bytes.saturating_add(r.len),
            Err(e) => {
                counters.discard_errors += 1;
                throttled!(logs.host, warn, device = "balloon", error = %e, "host kept reported pages");
            }
        }
    }
    counters.rejected_ranges += pages.rejected;
    counters.trimmed_ranges += pages.trimmed;
    if let Some((addr, len, why)) = pages.first_rejected {
        throttled!(logs.rejected, warn, device = "balloon", addr, len, why = %why, in_chain = pages.rejected,
            rejected_ranges = counters.rejected_ranges, "guest named pages that cannot be given back; skipped");
    }
}

impl VirtioDevice for Balloon {
    fn device_type(&self) -> u32 {
        TYPE_BALLOON
    }

    fn avail_features(&self) -> u64 {
        let mut f = VIRTIO_F_VERSION_1;
        if self.free_page_reporting {
            f |= VIRTIO_BALLOON_F_REPORTING;
        }
        f
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked_features = features & self.avail_features();
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES[..self.queue_evts.len()]
    }

    fn queue_events(&self) -> &[EventFd] {
        &self.queue_evts
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let mut cfg = [0u8; CONFIG_SPACE_LEN];
        cfg[..4].copy_from_slice(&self.num_pages.to_le_bytes());
        cfg[ACTUAL.start as usize..ACTUAL.end as usize].copy_from_slice(&self.actual.to_le_bytes());
        read_config_bytes(&cfg, offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        let mut actual = self.actual.to_le_bytes();
        let mut stray = false;
        for (i, b) in data.iter().enumerate() {
            match offset.checked_add(i as u64) {
                Some(o) if ACTUAL.contains(&o) => actual[(o - ACTUAL.start) as usize] = *b,
                _ => stray = true,
            }
        }
        self.actual = u32::from_le_bytes(actual);
        if stray {
            throttled!(
                self.logs.device.config_writes,
                warn,
                device = "balloon",
                offset,
                len = data.len(),
                "write to read-only balloon config ignored"
            );
        }
    }

    fn activate(&mut self, mem: GuestMemoryMmap, mut queues: Vec<Queue>, irq: IrqTrigger) -> Result<(), DeviceError> {
        // Without REPORTING the driver never sets the third queue up.
        let wanted = if self.acked_features & VIRTIO_BALLOON_F_REPORTING != 0 { 3 } else { 2 };
        if queues.len() < wanted {
            return Err(DeviceError::QueueNotReady(queues.len()));
        }
        queues.truncate(wanted);
        validate_queues(&mem, &queues)?;
        self.state = DeviceState::Active(Active { mem, queues, irq });
        tracing::debug!(device = "balloon", reporting = wanted == 3, "activated");
        Ok(())
    }

    fn reset(&mut self) -> Option<PendingReset> {
        self.state = DeviceState::Inactive;
        self.acked_features = 0;
        self.actual = 0;
        None
    }

    fn is_broken(&self) -> bool {
        self.state.is_broken()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::devices::virtio::chain::test_utils::{TestQueue, F_NEXT, F_WRITE};
    use std::os::unix::fs::MetadataExt;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

    const MIB: u64 = 1 << 20;

    pub(crate) struct Rig {
        pub(crate) dev: Balloon,
        pub(crate) mem: GuestMemoryMmap,
        pub(crate) inflate: TestQueue,
        pub(crate) deflate: TestQueue,
        pub(crate) report: TestQueue,
        pub(crate) irq: IrqTrigger,
    }

    /// A live balloon over 16 MiB of memfd guest memory (as a booted VM has), queues in the
    /// first 64 KiB, with REPORTING negotiated when `reporting`.
    pub(crate) fn rig(reporting: bool) -> Rig {
        let mem = crate::memory::create_guest_memory(16 * MIB).unwrap();
        let mut dev = Balloon::new(&BalloonConfig { free_page_reporting: true }).unwrap();
        let irq = IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let (inflate, deflate, report) =
            (TestQueue::new(0x1000, 16), TestQueue::new(0x2000, 16), TestQueue::new(0x3000, 32));
        let mut features = VIRTIO_F_VERSION_1;
        if reporting {
            features |= VIRTIO_BALLOON_F_REPORTING;
        }
        dev.set_acked_features(features);
        let queues = vec![inflate.device_queue(QUEUE_SIZE), deflate.device_queue(QUEUE_SIZE), {
            let mut q = report.device_queue(REPORT_QUEUE_SIZE);
            q.set_ready(reporting);
            q
        }];
        dev.activate(mem.clone(), queues, irq.clone()).unwrap();
        Rig { dev, mem, inflate, deflate, report, irq }
    }

    fn allocated(mem: &GuestMemoryMmap) -> u64 {
        let region = mem.find_region(GuestAddress(0)).unwrap();
        region.file_offset().unwrap().file().metadata().unwrap().blocks() * 512
    }

    fn touch(mem: &GuestMemoryMmap, addr: u64, len: u64) {
        mem.write_slice(&vec![0x5a; len as usize], GuestAddress(addr)).unwrap();
    }

    /// Posts one report chain of `(addr, len, flags)` descriptors at head 0.
    pub(crate) fn report(r: &mut Rig, ranges: &[(u64, u32, u16)]) {
        let n = ranges.len() as u16;
        for (i, (addr, len, flags)) in ranges.iter().enumerate() {
            let i = i as u16;
            let (flags, next) = if i + 1 < n { (flags | F_NEXT, i + 1) } else { (*flags, 0) };
            r.report.set_desc(&r.mem, i, *addr, *len, flags, next);
        }
        r.report.publish(&r.mem, 0);
        r.dev.process_queue(REPORTQ);
    }

    #[test]
    fn features_queues_and_config_space() {
        let on = Balloon::new(&BalloonConfig { free_page_reporting: true }).unwrap();
        assert_eq!(on.avail_features(), VIRTIO_F_VERSION_1 | VIRTIO_BALLOON_F_REPORTING);
        assert_eq!(on.queue_max_sizes(), &[64, 64, 32]);
        assert_eq!(on.queue_events().len(), 3);
        let mut off = Balloon::new(&BalloonConfig { free_page_reporting: false }).unwrap();
        assert_eq!(off.avail_features(), VIRTIO_F_VERSION_1);
        assert_eq!(off.queue_max_sizes(), &[64, 64]);
        off.set_acked_features(VIRTIO_F_VERSION_1 | VIRTIO_BALLOON_F_REPORTING);
        assert_eq!(off.acked_features, VIRTIO_F_VERSION_1, "never more than offered");

        let mut b = on;
        let mut cfg = [0xffu8; 16];
        b.read_config(0, &mut cfg);
        assert_eq!(cfg, [0; 16], "num_pages 0: the device never asks for memory");
        b.write_config(4, &7u32.to_le_bytes());
        b.write_config(6, &[1]);
        let mut actual = [0u8; 4];
        b.read_config(4, &mut actual);
        assert_eq!(u32::from_le_bytes(actual), 0x1_0007);
        // num_pages and the rest are the device's: ignored, and `actual` keeps its bytes.
        b.write_config(0, &[9; 16]);
        b.write_config(u64::MAX, &[9; 4]);
        let mut all = [0u8; 16];
        b.read_config(0, &mut all);
        assert_eq!(&all[..4], &[0; 4]);
        assert_eq!(&all[4..8], &[9; 4], "the bytes inside `actual` land");
        assert_eq!(&all[8..], &[0; 8]);
        b.reset();
        b.read_config(4, &mut actual);
        assert_eq!(actual, [0; 4]);
    }

    #[test]
    fn the_hosts_target_is_in_num_pages_and_a_running_driver_is_told() {
        // Before the driver starts: it reads the target when it does; nothing to interrupt.
        let mut b = Balloon::new(&BalloonConfig { free_page_reporting: false }).unwrap();
        b.set_target(300);
        let mut num_pages = [0u8; 4];
        b.read_config(0, &mut num_pages);
        assert_eq!(u32::from_le_bytes(num_pages), 300);
        // The driver cannot move the host's target, only report `actual`.
        b.write_config(0, &[0; 4]);
        b.write_config(4, &120u32.to_le_bytes());
        assert_eq!(b.pages(), (300, 120));
        b.reset();
        assert_eq!(b.pages(), (300, 0), "a driver reset keeps what the host asked for");

        let mut r = rig(false);
        assert_eq!(r.irq.status() & VIRTIO_MMIO_INT_CONFIG, 0);
        r.dev.set_target(64);
        assert_ne!(r.irq.status() & VIRTIO_MMIO_INT_CONFIG, 0, "the driver is told of the change");
        r.dev.read_config(0, &mut num_pages);
        assert_eq!(u32::from_le_bytes(num_pages), 64);
    }

    #[test]
    fn a_valid_report_frees_the_memfd_pages_and_returns_the_buffer() {
        let mut r = rig(true);
        touch(&r.mem, 4 * MIB, 4 * MIB);
        let before = allocated(&r.mem);
        report(&mut r, &[(4 * MIB, 2 << 20, F_WRITE), (6 * MIB, 2 << 20, F_WRITE)]);
        assert_eq!(r.report.used_idx(&r.mem), 1);
        assert_eq!(r.report.used_elem(&r.mem, 0), (0, 0), "head 0, nothing written");
        assert_ne!(r.irq.status() & VIRTIO_MMIO_INT_VRING, 0);
        let after = allocated(&r.mem);
        assert!(before >= 4 * MIB && after <= 0x4000, "only the rings' pages remain: {before} -> {after}");
        assert_eq!(r.mem.read_obj::<u64>(GuestAddress(5 * MIB)).unwrap(), 0);
        let c = r.dev.counters();
        assert_eq!((c.reports, c.reported_bytes, c.freed_bytes, c.rejected_ranges), (1, 4 * MIB, 4 * MIB, 0));
        assert!(!r.dev.is_broken());
    }

    #[test]
    fn out_of_range_unaligned_and_overflowing_ranges_are_skipped_and_counted() {
        let mut r = rig(true);
        touch(&r.mem, MIB, 2 * MIB);
        report(
            &mut r,
            &[
                (1 << 40, 0x20_0000, F_WRITE),             // outside RAM
                (16 * MIB - 0x1000, 0x2000, F_WRITE),      // runs past the end of RAM
                (u64::MAX - 0xfff, 0x1000, F_WRITE),       // wraps
                (MIB + 0x800, 0x1000, F_WRITE),            // no whole page
                (MIB + 0x10, 0x0010_2000 - 0x10, F_WRITE), // trimmed: MIB+0x1000 .. MIB+0x10_2000
            ],
        );
        assert_eq!(r.report.used_idx(&r.mem), 1, "the buffer still comes back");
        let c = r.dev.counters();
        assert_eq!((c.rejected_ranges, c.trimmed_ranges, c.freed_bytes), (4, 1, 0x10_1000));
        assert_eq!(r.mem.read_obj::<u8>(GuestAddress(MIB)).unwrap(), 0x5a, "the partial page stays");
        assert_eq!(r.mem.read_obj::<u8>(GuestAddress(MIB + 0x1000)).unwrap(), 0);
        assert_eq!(r.mem.read_obj::<u8>(GuestAddress(MIB + 0x10_2000)).unwrap(), 0x5a);
        assert!(!r.dev.is_broken());
    }

    #[test]
    fn read_only_report_descriptors_are_skipped() {
        let mut r = rig(true);
        touch(&r.mem, 2 * MIB, MIB);
        report(&mut r, &[(2 * MIB, 0x10_0000, 0)]);
        assert_eq!(r.report.used_idx(&r.mem), 1);
        assert_eq!(r.mem.read_obj::<u8>(GuestAddress(2 * MIB)).unwrap(), 0x5a, "not dropped");
        assert_eq!(r.dev.counters().rejected_ranges, 1);
    }

    #[test]
    fn an_overlong_or_looping_report_chain_breaks_the_device() {
        // A loop back to the head.
        let mut r = rig(true);
        r.report.set_desc(&r.mem, 0, MIB, 0x1000, F_WRITE | F_NEXT, 1);
        r.report.set_desc(&r.mem, 1, MIB, 0x1000, F_WRITE | F_NEXT, 0);
        r.report.publish(&r.mem, 0);
        r.dev.process_queue(REPORTQ);
        assert!(r.dev.is_broken());
        assert_eq!(r.report.used_idx(&r.mem), 0);

        // Too long: a 128-entry reporting ring (the driver picks the size) with 65 descriptors.
        let mut r = rig(true);
        let mut big = TestQueue::new(0x8000, 128);
        let mut q = big.device_queue(128);
        q.set_ready(true);
        r.dev.state = DeviceState::Inactive;
        let queues = vec![r.inflate.device_queue(QUEUE_SIZE), r.deflate.device_queue(QUEUE_SIZE), q];
        r.dev.activate(r.mem.clone(), queues, r.irq.clone()).unwrap();
        for i in 0..65u16 {
            let (flags, next) = if i < 64 { (F_WRITE | F_NEXT, i + 1) } else { (F_WRITE, 0) };
            big.set_desc(&r.mem, i, MIB + u64::from(i) * 0x1000, 0x1000, flags, next);
        }
        big.publish(&r.mem, 0);
        r.dev.process_queue(REPORTQ);
        assert!(r.dev.is_broken());
        assert_eq!(big.used_idx(&r.mem), 0);
        assert_eq!(r.dev.counters().freed_bytes, 0, "nothing of a malformed chain is acted on");
        r.dev.reset();
        assert!(!r.dev.is_broken());
    }

    #[test]
    fn inflate_drops_pfns_and_deflate_only_acknowledges() {
        let mut r = rig(true);
        touch(&r.mem, 8 * MIB, 0x3000);
        let pfns: Vec<u8> = [0x800u32, 0x801, 0x802, 0xffff_ffff].iter().flat_map(|p| p.to_le_bytes()).collect();
        r.mem.write_slice(&pfns, GuestAddress(0xa000)).unwrap();
        r.inflate.set_desc(&r.mem, 0, 0xa000, 16, 0, 0);
        r.inflate.publish(&r.mem, 0);
        r.dev.process_queue(INFLATEQ);
        assert_eq!(r.inflate.used_idx(&r.mem), 1);
        assert_eq!(r.mem.read_obj::<u8>(GuestAddress(8 * MIB + 0x2fff)).unwrap(), 0);
        let c = r.dev.counters();
        assert_eq!((c.inflated_pages, c.freed_bytes, c.rejected_ranges), (3, 0x3000, 1));

        r.deflate.set_desc(&r.mem, 0, 0xa000, 12, 0, 0);
        r.deflate.publish(&r.mem, 0);
        r.dev.process_queue(DEFLATEQ);
        assert_eq!(r.deflate.used_idx(&r.mem), 1);
        assert_eq!(r.dev.counters().deflate_buffers, 1);

        // A PFN array outside guest memory is a malformed chain, not a list of PFNs.
        r.inflate.set_desc(&r.mem, 1, 1 << 40, 16, 0, 0);
        r.inflate.publish(&r.mem, 1);
        r.dev.process_queue(INFLATEQ);
        assert!(r.dev.is_broken());
    }

    #[test]
    fn a_device_writable_pfn_array_is_skipped() {
        let mut r = rig(true);
        touch(&r.mem, 8 * MIB, 0x1000);
        r.mem.write_obj(0x800u32, GuestAddress(0xa000)).unwrap();
        r.inflate.set_desc(&r.mem, 0, 0xa000, 4, F_WRITE, 0);
        r.inflate.publish(&r.mem, 0);
        r.dev.process_queue(INFLATEQ);
        assert_eq!(r.inflate.used_idx(&r.mem), 1);
        assert_eq!(r.mem.read_obj::<u8>(GuestAddress(8 * MIB)).unwrap(), 0x5a);
        assert_eq!(r.dev.counters().rejected_ranges, 1);
    }

    #[test]
    fn work_is_bounded_per_notify_and_rescheduled() {
        let mut r = rig(true);
        for head in 0..(MAX_CHAINS_PER_PASS as u16 + 2) {
            r.report.set_desc(&r.mem, head, MIB + u64::from(head) * 0x1000, 0x1000, F_WRITE, 0);
            r.report.publish(&r.mem, head);
        }
        r.dev.process_queue(REPORTQ);
        assert_eq!(r.report.used_idx(&r.mem), MAX_CHAINS_PER_PASS as u16);
        assert_eq!(r.dev.queue_evts()[REPORTQ].read().unwrap(), 1, "the device kicked itself");
        r.dev.process_queue(REPORTQ);
        assert_eq!(r.report.used_idx(&r.mem), MAX_CHAINS_PER_PASS as u16 + 2);
        assert!(r.dev.queue_evts()[REPORTQ].read().is_err(), "nothing left: no kick");
    }

    #[test]
    fn without_reporting_the_third_queue_is_ignored() {
        let mut r = rig(false);
        report(&mut r, &[(MIB, 0x1000, F_WRITE)]);
        assert_eq!(r.report.used_idx(&r.mem), 0);
        assert!(!r.dev.is_broken());
        // REPORTING acked but its queue not set up: activation fails.
        let mut dev = Balloon::new(&BalloonConfig { free_page_reporting: true }).unwrap();
        dev.set_acked_features(VIRTIO_F_VERSION_1 | VIRTIO_BALLOON_F_REPORTING);
        let mut q = r.report.device_queue(REPORT_QUEUE_SIZE);
        q.set_ready(false);
        let queues = vec![r.inflate.device_queue(QUEUE_SIZE), r.deflate.device_queue(QUEUE_SIZE), q];
        assert_eq!(dev.activate(r.mem.clone(), queues, r.irq.clone()), Err(DeviceError::QueueNotReady(2)));
    }

    #[test]
    fn a_corrupt_avail_index_breaks_the_device() {
        let mut r = rig(true);
        r.mem.write_obj(500u16, GuestAddress(r.report.avail + 2)).unwrap();
        r.dev.process_queue(REPORTQ);
        assert!(r.dev.is_broken());
    }

    /// The whole register sequence a Linux driver performs, through the transport: REPORTING
    /// negotiated, the reporting queue at index 2, a report served.
    #[test]
    fn driver_sequence_through_mmio_transport() {
        use crate::devices::bus::BusDevice;
        use crate::devices::virtio::mmio::MmioTransport;
        use crate::devices::virtio::mmio_regs as reg;
        use std::sync::{Arc, Mutex};

        let mem = crate::memory::create_guest_memory(16 * MIB).unwrap();
        let dev = Arc::new(Mutex::new(Balloon::new(&BalloonConfig { free_page_reporting: true }).unwrap()));
        let irq = IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let mut t = MmioTransport::new("balloon".into(), mem.clone(), dev.clone(), irq.clone()).unwrap();
        let w = |t: &mut MmioTransport, off: u64, v: u32| t.write(off, &v.to_le_bytes());
        let rd = |t: &mut MmioTransport, off: u64| {
            let mut b = [0u8; 4];
            t.read(off, &mut b);
            u32::from_le_bytes(b)
        };
        assert_eq!(rd(&mut t, reg::DEVICE_ID), TYPE_BALLOON);
        w(&mut t, reg::STATUS, 1);
        w(&mut t, reg::STATUS, 3);
        w(&mut t, reg::DEVICE_FEATURES_SEL, 0);
        assert_eq!(rd(&mut t, reg::DEVICE_FEATURES), 1 << 5);
        w(&mut t, reg::DRIVER_FEATURES_SEL, 0);
        w(&mut t, reg::DRIVER_FEATURES, 1 << 5);
        w(&mut t, reg::DRIVER_FEATURES_SEL, 1);
        w(&mut t, reg::DRIVER_FEATURES, 1);
        w(&mut t, reg::STATUS, 0xb);
        assert_eq!(rd(&mut t, reg::STATUS), 0xb);
        let mut qs = [TestQueue::new(0x1000, 16), TestQueue::new(0x2000, 16), TestQueue::new(0x3000, 32)];
        for (i, tq) in qs.iter().enumerate() {
            w(&mut t, reg::QUEUE_SEL, i as u32);
            assert_eq!(rd(&mut t, reg::QUEUE_NUM_MAX), u32::from(QUEUE_SIZES[i]));
            w(&mut t, reg::QUEUE_NUM, u32::from(tq.size));
            w(&mut t, reg::QUEUE_DESC_LOW, tq.desc as u32);
            w(&mut t, reg::QUEUE_DRIVER_LOW, tq.avail as u32);
            w(&mut t, reg::QUEUE_DEVICE_LOW, tq.used as u32);
            w(&mut t, reg::QUEUE_READY, 1);
        }
        w(&mut t, reg::QUEUE_SEL, 3);
        assert_eq!(rd(&mut t, reg::QUEUE_NUM_MAX), 0, "no fourth queue");
        w(&mut t, reg::STATUS, 0xf);
        assert_eq!(rd(&mut t, reg::STATUS), 0xf);

        touch(&mem, 2 * MIB, 2 * MIB);
        qs[2].set_desc(&mem, 0, 2 * MIB, 2 << 20, F_WRITE, 0);
        qs[2].publish(&mem, 0);
        w(&mut t, reg::QUEUE_NOTIFY, 2);
        assert_eq!(dev.lock().unwrap().queue_evts()[REPORTQ].read().unwrap(), 1);
        dev.lock().unwrap().process_queue(REPORTQ);
        assert_eq!(qs[2].used_idx(&mem), 1);
        assert_eq!(mem.read_obj::<u64>(GuestAddress(3 * MIB)).unwrap(), 0);
        assert_eq!(rd(&mut t, reg::INTERRUPT_STATUS), VIRTIO_MMIO_INT_VRING);
        assert_eq!(dev.lock().unwrap().counters().freed_bytes, 2 * MIB);
    }
}
