//! Taking the driver's chains: the one `pop` every device uses, and the one bounded walk of a
//! chain. Every guest-supplied (address, length) a device will access is checked against guest
//! memory, the chain length is capped and a chain that loops or runs off the table is reported
//! instead of being silently truncated.

use std::ops::Deref;

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT};
use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryBackend, GuestMemoryError, GuestMemoryMmap};

/// Longest chain any device here accepts.
pub const MAX_CHAIN_DESCRIPTORS: usize = 64;

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ChainError {
    #[error("chain has more than {0} descriptors")]
    TooLong(usize),
    #[error("chain does not terminate (loop, bad next index or unreadable descriptor)")]
    Unterminated,
    #[error("descriptor {addr:#x}+{len:#x} is outside guest memory")]
    OutOfRange { addr: u64, len: u32 },
    #[error("chain carries {total} bytes, more than the {limit} allowed")]
    TooManyBytes { total: u64, limit: u64 },
    #[error("empty chain")]
    Empty,
    #[error("available ring index is corrupt")]
    AvailRing,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    pub addr: GuestAddress,
    pub len: u32,
    pub writable: bool,
}

impl Desc {
    /// The address `off` bytes into this descriptor. Only for `off` < `len`: `collect` range-checked
    /// the whole descriptor, so the sum stays inside guest memory.
    pub(crate) fn addr_at(&self, off: u64) -> GuestAddress {
        GuestAddress(self.addr.0.wrapping_add(off))
    }
}

/// Total bytes a collected chain carries (a bounded count of u32 lengths, so no overflow).
pub(crate) fn total_len(descs: &[Desc]) -> u64 {
    descs.iter().map(|d| u64::from(d.len)).sum()
}

/// Writes `buf` across `descs` in order, stopping when either runs out; returns the bytes written.
pub(crate) fn scatter(buf: &[u8], descs: &[Desc], mem: &GuestMemoryMmap) -> Result<usize, GuestMemoryError> {
    let mut off = 0;
    for d in descs {
        if off == buf.len() {
            break;
        }
        let n = (d.len as usize).min(buf.len() - off);
        mem.write_slice(&buf[off..off + n], d.addr)?;
        off += n;
    }
    Ok(off)
}

/// Walks `chain`, checking every descriptor. `max_bytes` caps the chain's total length.
pub fn collect<M>(chain: DescriptorChain<M>, mem: &GuestMemoryMmap, max_bytes: u64) -> Result<Vec<Desc>, ChainError>
where
    M: Deref,
    M::Target: GuestMemory,
{
    collect_up_to(chain, mem, max_bytes, MAX_CHAIN_DESCRIPTORS)
}

/// [`collect`] for a device whose chains may be longer (virtio-fs: a page per descriptor).
pub fn collect_up_to<M>(
    chain: DescriptorChain<M>,
    mem: &GuestMemoryMmap,
    max_bytes: u64,
    max_descs: usize,
) -> Result<Vec<Desc>, ChainError>
where
    M: Deref,
    M::Target: GuestMemory,
{
    let mut total = 0u64;
    walk(chain, max_descs, |d| {
        total += u64::from(d.len);
        if total > max_bytes {
            return Err(ChainError::TooManyBytes { total, limit: max_bytes });
        }
        if !GuestMemoryBackend::check_range(mem, d.addr, d.len as usize) {
            return Err(ChainError::OutOfRange { addr: d.addr.0, len: d.len });
        }
        Ok(())
    })
}

/// Walks a chain whose descriptors name guest memory instead of carrying bytes the device
/// accesses (the balloon's free page reports): what they name is the device's own business to
/// check, so only the walk is bounded here.
pub fn collect_names<M>(chain: DescriptorChain<M>) -> Result<Vec<Desc>, ChainError>
where
    M: Deref,
    M::Target: GuestMemory,
{
    walk(chain, MAX_CHAIN_DESCRIPTORS, |_| Ok(()))
}

/// The one walk: at most `max_descs` descriptors, each passed to `check` as it comes, and the
/// chain must end and carry at least one.
fn walk<M>(
    chain: DescriptorChain<M>,
    max_descs: usize,
    mut check: impl FnMut(&Desc) -> Result<(), ChainError>,
) -> Result<Vec<Desc>, ChainError>
where
    M: Deref,
    M::Target: GuestMemory,
{
    let mut out = Vec::new();
    let mut last_has_next = false;
    for d in chain {
        if out.len() >= max_descs {
            return Err(ChainError::TooLong(max_descs));
        }
        let desc = Desc { addr: d.addr(), len: d.len(), writable: d.is_write_only() };
        check(&desc)?;
        last_has_next = d.has_next();
        out.push(desc);
    }
    if last_has_next {
        return Err(ChainError::Unterminated);
    }
    if out.is_empty() {
        return Err(ChainError::Empty);
    }
    Ok(out)
}

/// The driver's next chain on `q`, if it posted one. An avail index more than the queue's size
/// ahead is a fatal guest error, not "nothing yet".
pub fn pop<'m>(
    q: &mut Queue,
    mem: &'m GuestMemoryMmap,
) -> Result<Option<DescriptorChain<&'m GuestMemoryMmap>>, ChainError> {
    let mut it = q.iter(mem).map_err(|_| ChainError::AvailRing)?;
    Ok(it.next())
}

#[cfg(test)]
pub(crate) mod test_utils {
    //! A tiny split-virtqueue driver over in-memory guest memory, for device unit tests.
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::{Queue, QueueT};
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    use super::Desc;

    pub const F_NEXT: u16 = 1;
    pub const F_WRITE: u16 = 2;

    /// 1 MiB of guest memory at address 0.
    pub fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    pub fn desc(addr: u64, len: u32, writable: bool) -> Desc {
        Desc { addr: GuestAddress(addr), len, writable }
    }

    pub struct TestQueue {
        pub size: u16,
        pub desc: u64,
        pub avail: u64,
        pub used: u64,
        avail_idx: u16,
    }

    impl TestQueue {
        pub fn new(base: u64, size: u16) -> Self {
            let desc = base;
            let avail = desc + 16 * u64::from(size);
            let used = (avail + 6 + 2 * u64::from(size) + 3) & !3;
            Self { size, desc, avail, used, avail_idx: 0 }
        }

        pub fn queue(&self) -> Queue {
            self.device_queue(self.size)
        }

        /// The queue as a device offering `max` entries sees it once the driver set it up.
        pub fn device_queue(&self, max: u16) -> Queue {
            let mut q = Queue::new(max).unwrap();
            q.set_size(self.size);
            q.set_desc_table_address(Some(self.desc as u32), Some((self.desc >> 32) as u32));
            q.set_avail_ring_address(Some(self.avail as u32), Some((self.avail >> 32) as u32));
            q.set_used_ring_address(Some(self.used as u32), Some((self.used >> 32) as u32));
            q.set_ready(true);
            q
        }

        pub fn set_desc(&self, mem: &GuestMemoryMmap, idx: u16, addr: u64, len: u32, flags: u16, next: u16) {
            let d = RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next));
            mem.write_obj(d, GuestAddress(self.desc + 16 * u64::from(idx))).unwrap();
        }

        /// Publishes chain head `head` in the available ring.
        pub fn publish(&mut self, mem: &GuestMemoryMmap, head: u16) {
            let slot = self.avail + 4 + 2 * u64::from(self.avail_idx % self.size);
            mem.write_obj(head, GuestAddress(slot)).unwrap();
            self.avail_idx = self.avail_idx.wrapping_add(1);
            mem.write_obj(self.avail_idx, GuestAddress(self.avail + 2)).unwrap();
        }

        pub fn used_idx(&self, mem: &GuestMemoryMmap) -> u16 {
            mem.read_obj(GuestAddress(self.used + 2)).unwrap()
        }

        /// (head id, len) of used element `i`.
        pub fn used_elem(&self, mem: &GuestMemoryMmap, i: u16) -> (u32, u32) {
            let base = self.used + 4 + 8 * u64::from(i % self.size);
            (mem.read_obj(GuestAddress(base)).unwrap(), mem.read_obj(GuestAddress(base + 4)).unwrap())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_utils::*;
    use super::*;
    use virtio_queue::QueueOwnedT;

    fn first_chain(mem: &GuestMemoryMmap, tq: &TestQueue) -> Result<Vec<Desc>, ChainError> {
        let mut q = tq.queue();
        let chain = q.iter(mem).unwrap().next().unwrap();
        collect(chain, mem, 1 << 20)
    }

    #[test]
    fn good_chain_is_collected() {
        let m = mem();
        let mut tq = TestQueue::new(0x1000, 8);
        tq.set_desc(&m, 0, 0x8000, 16, F_NEXT, 1);
        tq.set_desc(&m, 1, 0x9000, 512, F_WRITE, 0);
        tq.publish(&m, 0);
        let c = first_chain(&m, &tq).unwrap();
        assert_eq!(c.len(), 2);
        assert!(!c[0].writable && c[1].writable);
    }

    #[test]
    fn out_of_range_address_is_rejected() {
        let m = mem();
        let mut tq = TestQueue::new(0x1000, 8);
        tq.set_desc(&m, 0, 0xffff_0000_0000, 16, 0, 0);
        tq.publish(&m, 0);
        assert!(matches!(first_chain(&m, &tq), Err(ChainError::OutOfRange { .. })));
    }

    #[test]
    fn straddling_the_end_of_memory_is_rejected() {
        let m = mem();
        let mut tq = TestQueue::new(0x1000, 8);
        tq.set_desc(&m, 0, (1 << 20) - 8, 16, 0, 0);
        tq.publish(&m, 0);
        assert!(matches!(first_chain(&m, &tq), Err(ChainError::OutOfRange { .. })));
    }

    #[test]
    fn loop_is_detected() {
        let m = mem();
        let mut tq = TestQueue::new(0x1000, 8);
        tq.set_desc(&m, 0, 0x8000, 16, F_NEXT, 1);
        tq.set_desc(&m, 1, 0x9000, 16, F_NEXT, 0);
        tq.publish(&m, 0);
        assert_eq!(first_chain(&m, &tq), Err(ChainError::Unterminated));
    }

    #[test]
    fn next_index_past_the_table_is_detected() {
        let m = mem();
        let mut tq = TestQueue::new(0x1000, 8);
        tq.set_desc(&m, 0, 0x8000, 16, F_NEXT, 200);
        tq.publish(&m, 0);
        assert_eq!(first_chain(&m, &tq), Err(ChainError::Unterminated));
    }

    #[test]
    fn oversized_length_is_rejected() {
        let m = mem();
        let mut tq = TestQueue::new(0x1000, 8);
        tq.set_desc(&m, 0, 0x8000, 0xffff_0000, 0, 0);
        tq.publish(&m, 0);
        assert!(matches!(first_chain(&m, &tq), Err(ChainError::TooManyBytes { .. })));
    }
}
