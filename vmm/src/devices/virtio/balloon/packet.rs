//! virtio-balloon wire parsing: the reporting queue's page ranges and the inflate queue's PFN
//! arrays, turned into page ranges checked against guest RAM.
//!
//! Every range a guest names is checked before anything acts on it: no wrap-around, trimmed
//! inward to whole pages, inside one RAM region. A range that fails is skipped and counted (a
//! guest that reports memory wrongly can only fail to free its own pages), never trusted. A
//! chain that cannot be walked (a loop, too many descriptors) is a malformed chain and stops the
//! device, as on every other device.
//!
//! Boundaries: no syscalls here; `discard.rs` gives the ranges back to the host.

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use crate::devices::virtio::chain::Desc;

/// The unit of everything the balloon gives back. x86-64 hosts and guests both use 4 KiB base
/// pages, and balloon PFNs are 4 KiB units whatever the guest's page size (spec 5.5.6).
pub const PAGE_SIZE: u64 = 4096;
const PAGE_MASK: u64 = PAGE_SIZE - 1;
pub const PFN_SHIFT: u32 = 12;
/// Largest inflate or deflate chain accepted, in bytes. Linux sends at most 256 PFNs (1 KiB) per
/// buffer; anything far beyond is not a PFN array but an attack on the event loop's time.
pub const MAX_PFN_CHAIN_BYTES: u64 = 16 << 10;

/// Whole guest pages, inside one RAM region: `addr` and `len` are multiples of [`PAGE_SIZE`],
/// `len` is not zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRange {
    pub addr: GuestAddress,
    pub len: u64,
}

impl PageRange {
    pub fn end(&self) -> u64 {
        // A checked range lies inside a RAM region, so this cannot wrap.
        self.addr.0 + self.len
    }
}

/// Why a range the guest named is skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    #[error("the range wraps around the address space")]
    Overflow,
    #[error("the range holds no whole page")]
    NoWholePage,
    #[error("the range starts outside guest RAM")]
    OutsideRam,
    #[error("the range runs past the end of its RAM region")]
    CrossesRegion,
    #[error("the descriptor has the wrong direction (reports are device-writable, PFN arrays device-readable)")]
    WrongDirection,
    #[error("the PFN array's length is not a multiple of 4 bytes")]
    PartialPfn,
}

/// Checks `len` bytes at `addr` against guest RAM and trims it inward to whole pages. Returns the
/// pages and whether trimming changed the range.
pub fn page_range(mem: &GuestMemoryMmap, addr: u64, len: u64) -> Result<(PageRange, bool), Rejected> {
    let end = addr.checked_add(len).ok_or(Rejected::Overflow)?;
    let start = addr.checked_add(PAGE_MASK).ok_or(Rejected::Overflow)? & !PAGE_MASK;
    let end_down = end & !PAGE_MASK;
    if end_down <= start {
        return Err(Rejected::NoWholePage);
    }
    let region = mem.find_region(GuestAddress(start)).ok_or(Rejected::OutsideRam)?;
    let region_end = region.start_addr().0.checked_add(region.len()).ok_or(Rejected::Overflow)?;
    if end_down > region_end {
        return Err(Rejected::CrossesRegion);
    }
    let trimmed = start != addr || end_down != end;
    Ok((PageRange { addr: GuestAddress(start), len: end_down - start }, trimmed))
}

/// What one chain asks the device to give back.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pages {
    /// Checked ranges, in the guest's order; adjacent PFNs are merged.
    pub ranges: Vec<PageRange>,
    /// Bytes the guest named, accepted or not.
    pub named_bytes: u64,
    /// Ranges skipped.
    pub rejected: u64,
    /// Ranges accepted after trimming.
    pub trimmed: u64,
    /// The first skipped range and why, for the log line.
    pub first_rejected: Option<(u64, u64, Rejected)>,
}

impl Pages {
    fn reject(&mut self, addr: u64, len: u64, why: Rejected) {
        self.rejected += 1;
        self.first_rejected.get_or_insert((addr, len, why));
    }

    /// Appends a checked range, merged with the previous one when they touch inside one region.
    fn push(&mut self, mem: &GuestMemoryMmap, r: PageRange) {
        if let Some(last) = self.ranges.last_mut() {
            let same_region = |a: GuestAddress| mem.find_region(a).map(|reg| reg.start_addr());
            if last.end() == r.addr.0 && same_region(last.addr) == same_region(r.addr) {
                last.len += r.len;
                return;
            }
        }
        self.ranges.push(r);
    }

    pub fn bytes(&self) -> u64 {
        self.ranges.iter().map(|r| r.len).sum()
    }
}

/// A report chain (reporting queue): each descriptor names a block of free guest memory. Linux
/// adds them as device-writable buffers (`virtqueue_add_inbuf`) though the device writes nothing;
/// a device-readable one is skipped, as QEMU skips it.
pub fn parse_report(descs: &[Desc], mem: &GuestMemoryMmap) -> Pages {
    let mut pages = Pages::default();
    for d in descs {
        let len = u64::from(d.len);
        pages.named_bytes = pages.named_bytes.saturating_add(len);
        if !d.writable {
            pages.reject(d.addr.0, len, Rejected::WrongDirection);
            continue;
        }
        match page_range(mem, d.addr.0, len) {
            Ok((r, trimmed)) => {
                pages.trimmed += u64::from(trimmed);
                pages.push(mem, r);
            }
            Err(why) => pages.reject(d.addr.0, len, why),
        }
    }
    pages
}

/// An inflate chain: device-readable arrays of le32 PFNs (4 KiB units). The descriptors were
/// checked against guest memory and capped at [`MAX_PFN_CHAIN_BYTES`] by `chain::collect`.
pub fn parse_pfns(descs: &[Desc], mem: &GuestMemoryMmap) -> Result<Pages, vm_memory::GuestMemoryError> {
    let mut pages = Pages::default();
    let mut buf = Vec::new();
    for d in descs {
        if d.writable {
            pages.reject(d.addr.0, u64::from(d.len), Rejected::WrongDirection);
            continue;
        }
        if d.len % 4 != 0 {
            // The whole PFNs before the stray bytes still count.
            pages.reject(d.addr.0, u64::from(d.len), Rejected::PartialPfn);
        }
        buf.resize(d.len as usize, 0);
        mem.read_slice(&mut buf, d.addr)?;
        for raw in buf.chunks_exact(4) {
            let pfn = u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
            // A u32 PFN shifted by 12 stays far below 2^64.
            let addr = u64::from(pfn) << PFN_SHIFT;
            pages.named_bytes += PAGE_SIZE;
            match page_range(mem, addr, PAGE_SIZE) {
                Ok((r, _)) => pages.push(mem, r),
                Err(why) => pages.reject(addr, PAGE_SIZE, why),
            }
        }
    }
    Ok(pages)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::chain::test_utils::{desc as d, mem, TestQueue, F_NEXT, F_WRITE};
    use crate::devices::virtio::chain::{ChainError, MAX_CHAIN_DESCRIPTORS};
    use virtio_queue::QueueOwnedT;

    const MIB: u64 = 1 << 20;

    /// Two regions with a hole between them, like RAM around the MMIO hole.
    fn split_mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MIB as usize), (GuestAddress(4 * MIB), MIB as usize)]).unwrap()
    }

    fn range(addr: u64, len: u64) -> PageRange {
        PageRange { addr: GuestAddress(addr), len }
    }

    #[test]
    fn aligned_ranges_inside_ram_pass_untouched() {
        let m = split_mem();
        assert_eq!(page_range(&m, 0, MIB), Ok((range(0, MIB), false)));
        assert_eq!(page_range(&m, 4 * MIB + 0x2000, 0x3000), Ok((range(4 * MIB + 0x2000, 0x3000), false)));
    }

    #[test]
    fn unaligned_ranges_are_trimmed_inward() {
        let m = split_mem();
        assert_eq!(page_range(&m, 0x1001, 0x3000), Ok((range(0x2000, 0x2000), true)));
        assert_eq!(page_range(&m, 0x1000, 0x1fff), Ok((range(0x1000, 0x1000), true)));
        assert_eq!(page_range(&m, 0x1001, 0x1ffe), Err(Rejected::NoWholePage), "one byte short of a page");
        assert_eq!(page_range(&m, 0x1000, 0xfff), Err(Rejected::NoWholePage));
        assert_eq!(page_range(&m, 0x1000, 0), Err(Rejected::NoWholePage));
    }

    #[test]
    fn ranges_outside_ram_across_regions_or_wrapping_are_rejected() {
        let m = split_mem();
        assert_eq!(page_range(&m, 2 * MIB, 0x1000), Err(Rejected::OutsideRam), "in the hole");
        assert_eq!(page_range(&m, 1 << 40, 0x1000), Err(Rejected::OutsideRam));
        assert_eq!(page_range(&m, MIB - 0x1000, 0x2000), Err(Rejected::CrossesRegion));
        assert_eq!(page_range(&m, 0, 5 * MIB), Err(Rejected::CrossesRegion), "spans the hole");
        assert_eq!(page_range(&m, 5 * MIB - 0x1000, 0x2000), Err(Rejected::CrossesRegion), "past the end");
        assert_eq!(page_range(&m, u64::MAX - 0xfff, 0x1000), Err(Rejected::Overflow));
        assert_eq!(page_range(&m, u64::MAX - 2, 1), Err(Rejected::Overflow), "rounding up wraps");
        assert_eq!(page_range(&m, 0x1000, u64::MAX), Err(Rejected::Overflow));
    }

    #[test]
    fn a_report_keeps_good_ranges_and_counts_the_rest() {
        let m = split_mem();
        let descs = [
            d(0x10_0000 - 0x4000, 0x2000, true),
            d(0x10_0000 - 0x2000, 0x2000, true), // touches the previous one: merged
            d(4 * MIB, 0x1000, false),           // device-readable
            d(2 * MIB, 0x1000, true),            // in the hole
            d(4 * MIB + 0x10, 0x2000, true),     // trimmed to one page
            d(u64::MAX - 0xfff, 0x1000, true),   // wraps
        ];
        let p = parse_report(&descs, &m);
        assert_eq!(p.ranges, vec![range(MIB - 0x4000, 0x4000), range(4 * MIB + 0x1000, 0x1000)]);
        assert_eq!(p.named_bytes, 0x2000 * 3 + 0x1000 * 3);
        assert_eq!((p.rejected, p.trimmed, p.bytes()), (3, 1, 0x5000));
        assert_eq!(p.first_rejected, Some((4 * MIB, 0x1000, Rejected::WrongDirection)));
    }

    #[test]
    fn ranges_at_the_end_of_one_region_and_the_start_of_the_next_are_not_merged() {
        let m = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MIB as usize), (GuestAddress(MIB), MIB as usize)])
            .unwrap();
        let p = parse_report(&[d(MIB - 0x1000, 0x1000, true), d(MIB, 0x1000, true)], &m);
        assert_eq!(p.ranges, vec![range(MIB - 0x1000, 0x1000), range(MIB, 0x1000)]);
    }

    #[test]
    fn pfn_arrays_become_page_ranges() {
        let m = mem();
        let pfns: [u32; 6] = [0x10, 0x11, 0x12, 0x40, 0xffff_ffff, 0x100];
        let bytes: Vec<u8> = pfns.iter().flat_map(|p| p.to_le_bytes()).collect();
        m.write_slice(&bytes, GuestAddress(0x8000)).unwrap();
        let p = parse_pfns(&[d(0x8000, 24, false)], &m).unwrap();
        // 0x100 is 1 MiB: just past this memory.
        assert_eq!(p.ranges, vec![range(0x10_000, 0x3000), range(0x40_000, 0x1000)]);
        assert_eq!((p.rejected, p.named_bytes), (2, 6 * PAGE_SIZE));
        assert_eq!(p.first_rejected, Some((0xffff_ffffu64 << 12, PAGE_SIZE, Rejected::OutsideRam)));
    }

    #[test]
    fn malformed_pfn_arrays_are_counted_not_trusted() {
        let m = mem();
        m.write_slice(&[0x10, 0, 0, 0, 0x20, 0], GuestAddress(0x8000)).unwrap();
        let p = parse_pfns(&[d(0x8000, 6, false)], &m).unwrap();
        assert_eq!(p.ranges, vec![range(0x10_000, 0x1000)], "the whole PFN before the stray bytes");
        assert_eq!(p.first_rejected.map(|r| r.2), Some(Rejected::PartialPfn));
        let p = parse_pfns(&[d(0x8000, 4, true)], &m).unwrap();
        assert!(p.ranges.is_empty());
        assert_eq!(p.first_rejected.map(|r| r.2), Some(Rejected::WrongDirection));
    }

    /// Every accepted range is whole pages inside one region, and everything named is counted.
    fn assert_sound(p: &Pages, m: &GuestMemoryMmap, named: u64, descs: usize) {
        assert_eq!(p.named_bytes, named);
        for r in &p.ranges {
            assert!(r.len > 0 && r.addr.0 % PAGE_SIZE == 0 && r.len % PAGE_SIZE == 0, "{r:?}");
            let region = m.find_region(r.addr).expect("range starts in RAM");
            assert!(r.end() <= region.start_addr().0 + region.len(), "{r:?} leaves its region");
        }
        assert!(p.bytes() <= named, "more accepted than named");
        assert!(p.first_rejected.is_some() == (p.rejected > 0));
        assert!(p.trimmed <= descs as u64);
    }

    /// Malformed input of every kind (addresses anywhere, lengths of any size, both directions,
    /// PFN arrays of noise): the parsers never accept a range off a page or outside RAM.
    #[test]
    fn random_descriptors_never_yield_a_range_outside_ram_or_off_a_page() {
        let m = split_mem();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            x.wrapping_mul(0x2545_f491_4f6c_dd1d)
        };
        for _ in 0..2000 {
            let n = (next() % (MAX_CHAIN_DESCRIPTORS as u64 + 1)) as usize;
            let descs: Vec<Desc> = (0..n)
                .map(|_| {
                    let addr = match next() % 5 {
                        0 => next(),
                        1 => u64::MAX - next() % 0x3000,
                        2 => next() % (6 * MIB),
                        _ => (next() % (6 * MIB)) & !0xfff,
                    };
                    let len = match next() % 3 {
                        0 => next() as u32,
                        _ => (next() % (3 * MIB)) as u32,
                    };
                    d(addr, len, next() % 4 != 0)
                })
                .collect();
            let named: u64 = descs.iter().map(|d| u64::from(d.len)).sum();
            assert_sound(&parse_report(&descs, &m), &m, named, n);

            // PFN arrays: noise in guest memory, read through descriptors that (as
            // `chain::collect` ensures) lie inside it.
            let noise: Vec<u8> = (0..512).map(|_| next() as u8).collect();
            m.write_slice(&noise, GuestAddress(0x8000)).unwrap();
            let arrays: Vec<Desc> =
                (0..n % 8).map(|_| d(0x8000 + next() % 256, (next() % 256) as u32, next() % 4 != 0)).collect();
            let p = parse_pfns(&arrays, &m).unwrap();
            let pfns: u64 = arrays.iter().filter(|d| !d.writable).map(|d| u64::from(d.len / 4)).sum();
            assert_sound(&p, &m, pfns * PAGE_SIZE, arrays.len());
        }
    }

    fn walked(m: &GuestMemoryMmap, tq: &TestQueue) -> Result<Vec<Desc>, ChainError> {
        let mut q = tq.queue();
        let chain = q.iter(m).unwrap().next().unwrap();
        crate::devices::virtio::chain::collect_names(chain)
    }

    #[test]
    fn a_walk_takes_addresses_outside_memory_but_not_endless_or_overlong_chains() {
        let m = mem();
        let mut tq = TestQueue::new(0x1000, 128);
        tq.set_desc(&m, 0, 1 << 40, 0x20_0000, F_WRITE | F_NEXT, 1);
        tq.set_desc(&m, 1, 0x8000, 0x1000, F_WRITE, 0);
        tq.publish(&m, 0);
        assert_eq!(walked(&m, &tq).unwrap(), vec![d(1 << 40, 0x20_0000, true), d(0x8000, 0x1000, true)]);

        // A ring smaller than the descriptor cap, so the loop ends the walk before the cap does.
        let mut tq = TestQueue::new(0x1000, 16);
        tq.set_desc(&m, 0, 0x8000, 0x1000, F_WRITE | F_NEXT, 1);
        tq.set_desc(&m, 1, 0x9000, 0x1000, F_WRITE | F_NEXT, 0);
        tq.publish(&m, 0);
        assert_eq!(walked(&m, &tq), Err(ChainError::Unterminated), "a loop");

        let mut tq = TestQueue::new(0x1000, 128);
        let n = MAX_CHAIN_DESCRIPTORS as u16 + 1;
        for i in 0..n {
            let (flags, next) = if i + 1 < n { (F_WRITE | F_NEXT, i + 1) } else { (F_WRITE, 0) };
            tq.set_desc(&m, i, 0x10_000 + u64::from(i) * 0x1000, 0x1000, flags, next);
        }
        tq.publish(&m, 0);
        assert_eq!(walked(&m, &tq), Err(ChainError::TooLong(MAX_CHAIN_DESCRIPTORS)));
    }
}
