//! The relay between the driver's virtqueues, in guest memory, and the backend's own vrings
//! ("shadow" vrings), in a small region the VMM shares with the backend. The backend
//! (virtiofsd) never maps guest memory.
//!
//! Why: a restored pod's guest memory is a private, copy-on-write map of its template, so pods
//! share the template's clean pages. A vhost-user backend that maps guest memory needs it shared
//! (a memfd), which forced a full copy of the template into every pod: `make bench`'s
//! `vmm_restore` measured 66.95 ms and +65.2 MiB PSS per pod with 64 MiB of data. The relay
//! costs a copy of each request and reply instead (memcpy, no syscall), and the backend, which a
//! hostile guest talks to, no longer sees guest memory at all, only the bytes of the requests.
//! An in-VMM FUSE server would also have kept the private map, but would put file-system
//! syscalls and the pod's share into the VMM's jail; userfaultfd alone cannot work, as it
//! registers per process and virtiofsd's own map of the memory would fault in zero pages.
//!
//! Each chain the driver posts is copied into its queue's data area (the readable bytes, then
//! room for the writable ones), offered to the backend as a chain of at most two descriptors
//! and, once the backend used it, the bytes it wrote are copied back into the driver's writable
//! descriptors and the driver's chain is used with that length.
//!
//! Both sides are bounded. From the driver: the chain's descriptors and bytes, their order, and
//! the room in the data area (a chain that does not fit now waits, taken but not offered, until
//! replies free room). From the backend: a used element must name a chain it holds, with a
//! length within that chain's writable room.

use std::sync::atomic::{fence, Ordering};

use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use super::NUM_QUEUES;
use crate::devices::virtio::chain::{self, ChainError, Desc};

/// Entries in each shadow vring. A request takes at most two descriptors, so up to 128 requests
/// per queue are with the backend at once.
pub const SHADOW_QUEUE_SIZE: u16 = 256;
const PAGE: u64 = 4096;
/// Per queue: the descriptor table (4 KiB), then the available and used rings, a page each.
const AVAIL_OFFSET: u64 = 16 * SHADOW_QUEUE_SIZE as u64;
const USED_OFFSET: u64 = AVAIL_OFFSET + PAGE;
const RINGS_BYTES: u64 = USED_OFFSET + PAGE;
/// Room for request and reply bytes: FORGETs and INTERRUPTs on hiprio, every other request on
/// the request queue (room for three of the largest at once).
pub const DATA_BYTES: [u64; NUM_QUEUES] = [64 << 10, 4 << 20];
/// The largest chain accepted: Linux's virtio-fs sends at most 256 pages of data per request
/// (FUSE_MAX_MAX_PAGES), plus FUSE headers.
pub const MAX_CHAIN_BYTES: u64 = (1 << 20) + (16 << 10);
/// A descriptor per page, plus the headers' (with room to spare).
pub const MAX_CHAIN_DESCS: usize = 512;
/// Virtio features of the shadow vrings: the relay needs no ring feature from the backend.
pub const SHADOW_FEATURES: u64 = crate::devices::virtio::VIRTIO_F_VERSION_1;

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;

/// Bytes of the region shared with the backend (rings and data areas of every queue).
pub fn region_bytes() -> u64 {
    DATA_BYTES.iter().map(|d| RINGS_BYTES + d).sum()
}

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("malformed descriptor chain: {0}")]
    Chain(#[from] ChainError),
    #[error("chain {head}: a readable descriptor follows a writable one")]
    Order { head: u16 },
    #[error("chain {head} carries no bytes")]
    Empty { head: u16 },
    #[error("guest memory access failed: {0}")]
    Guest(String),
    #[error("the backend published used index {published}, {ahead} entries past the last one seen")]
    UsedIndex { published: u16, ahead: u16 },
    #[error("the backend used descriptor {id}, which it does not hold")]
    UnknownId { id: u32 },
    #[error("the backend wrote {len} bytes into a reply of at most {room}")]
    ReplyTooLong { len: u32, room: u32 },
    #[error("the region shared with the backend: {0}")]
    Shared(String),
}

impl RelayError {
    /// Whether the backend, not the driver, broke the rules.
    pub fn is_backends(&self) -> bool {
        matches!(self, Self::UsedIndex { .. } | Self::UnknownId { .. } | Self::ReplyTooLong { .. } | Self::Shared(_))
    }
}

fn guest_err(e: vm_memory::GuestMemoryError) -> RelayError {
    RelayError::Guest(e.to_string())
}

fn shared_err(e: vm_memory::GuestMemoryError) -> RelayError {
    RelayError::Shared(e.to_string())
}

/// Where one queue's rings and data sit in the shared region (addresses as the backend sees
/// them: the region is its only memory, from address 0).
#[derive(Debug, Clone, Copy)]
struct Layout {
    desc: u64,
    avail: u64,
    used: u64,
    data: u64,
    data_pages: usize,
    /// The largest chain this queue accepts.
    max_chain: u64,
}

/// A chain taken from the driver: its head and checked descriptors, readable ones first.
struct Taken {
    head: u16,
    descs: Vec<Desc>,
    /// Index of the first writable descriptor.
    split: usize,
}

impl Taken {
    fn readable(&self) -> u32 {
        chain::total_len(&self.descs[..self.split]) as u32
    }
    fn writable(&self) -> u32 {
        chain::total_len(&self.descs[self.split..]) as u32
    }
}

/// A request the backend holds.
struct InFlight {
    guest_head: u16,
    /// Where the driver wants the reply.
    writable: Vec<Desc>,
    reply_at: u64,
    reply_room: u32,
    first_page: usize,
    pages: usize,
    descs: Vec<u16>,
}

struct Shadow {
    layout: Layout,
    free_descs: Vec<u16>,
    /// By the head descriptor the backend was offered.
    in_flight: Vec<Option<InFlight>>,
    /// Which pages of the data area are taken.
    pages: Vec<bool>,
    /// Next available index to publish; the next used index to read.
    avail_idx: u16,
    used_idx: u16,
    /// A chain taken from the driver that did not fit yet.
    waiting: Option<Taken>,
}

impl Shadow {
    fn new(layout: Layout) -> Self {
        Self {
            layout,
            free_descs: (0..SHADOW_QUEUE_SIZE).rev().collect(),
            in_flight: (0..SHADOW_QUEUE_SIZE).map(|_| None).collect(),
            pages: vec![false; layout.data_pages],
            avail_idx: 0,
            used_idx: 0,
            waiting: None,
        }
    }

    /// First fit: the first run of `n` free pages.
    fn find_pages(&self, n: usize) -> Option<usize> {
        let mut run = 0;
        for (i, taken) in self.pages.iter().enumerate() {
            run = if *taken { 0 } else { run + 1 };
            if run == n {
                return Some(i + 1 - n);
            }
        }
        None
    }

    /// Copies `t` into the data area and writes its shadow descriptors and avail entry (not yet
    /// published). False: no room now.
    fn offer(&mut self, shared: &GuestMemoryMmap, mem: &GuestMemoryMmap, t: &Taken) -> Result<bool, RelayError> {
        let (readable, writable) = (t.readable(), t.writable());
        let needed_descs = usize::from(readable > 0) + usize::from(writable > 0);
        let bytes = u64::from(readable) + u64::from(writable);
        let pages = bytes.div_ceil(PAGE) as usize;
        if self.free_descs.len() < needed_descs {
            return Ok(false);
        }
        let Some(first_page) = self.find_pages(pages) else { return Ok(false) };
        let at = self.layout.data + first_page as u64 * PAGE;
        let mut off = at;
        for d in &t.descs[..t.split] {
            guest_to_shared(mem, d, shared, off)?;
            off += u64::from(d.len);
        }
        let reply_at = at + u64::from(readable);
        let mut parts = Vec::with_capacity(2);
        if readable > 0 {
            parts.push((at, readable, 0));
        }
        if writable > 0 {
            parts.push((reply_at, writable, F_WRITE));
        }
        let ids: Vec<u16> = (0..parts.len()).filter_map(|_| self.free_descs.pop()).collect();
        for (i, (addr, len, flags)) in parts.iter().enumerate() {
            let (flags, next) = match ids.get(i + 1) {
                Some(&n) => (flags | F_NEXT, n),
                None => (*flags, 0),
            };
            let raw = RawDescriptor::from(SplitDescriptor::new(*addr, *len, flags, next));
            let slot = self.layout.desc + 16 * u64::from(ids[i]);
            shared.write_obj(raw, GuestAddress(slot)).map_err(shared_err)?;
        }
        let head = ids[0];
        let entry = self.layout.avail + 4 + 2 * u64::from(self.avail_idx % SHADOW_QUEUE_SIZE);
        shared.write_obj(head, GuestAddress(entry)).map_err(shared_err)?;
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.pages[first_page..first_page + pages].iter_mut().for_each(|p| *p = true);
        self.in_flight[usize::from(head)] = Some(InFlight {
            guest_head: t.head,
            writable: t.descs[t.split..].to_vec(),
            reply_at,
            reply_room: writable,
            first_page,
            pages,
            descs: ids,
        });
        Ok(true)
    }

    /// Makes the entries written so far visible to the backend.
    fn publish(&self, shared: &GuestMemoryMmap) -> Result<(), RelayError> {
        // The descriptors and ring entries must be seen before the index that offers them.
        fence(Ordering::Release);
        shared.store(self.avail_idx, GuestAddress(self.layout.avail + 2), Ordering::Release).map_err(shared_err)
    }

    fn release(&mut self, f: &InFlight) {
        self.pages[f.first_page..f.first_page + f.pages].iter_mut().for_each(|p| *p = false);
        self.free_descs.extend(f.descs.iter().rev());
    }
}

/// The relay of every queue of one activation of the device.
pub struct Relay {
    shared: GuestMemoryMmap,
    shadows: Vec<Shadow>,
}

impl Relay {
    /// Clears the shadow rings in `shared` (a region of [`region_bytes`]) and lays them out.
    pub fn new(shared: GuestMemoryMmap) -> Result<Self, RelayError> {
        let mut base = 0;
        let mut shadows = Vec::with_capacity(NUM_QUEUES);
        for (i, data_bytes) in DATA_BYTES.iter().enumerate() {
            let layout = Layout {
                desc: base,
                avail: base + AVAIL_OFFSET,
                used: base + USED_OFFSET,
                data: base + RINGS_BYTES,
                data_pages: (data_bytes / PAGE) as usize,
                max_chain: MAX_CHAIN_BYTES.min(*data_bytes),
            };
            let rings = shared.get_slice(GuestAddress(base), RINGS_BYTES as usize).map_err(shared_err)?;
            rings
                .write_slice(&[0; RINGS_BYTES as usize], 0)
                .map_err(|e| RelayError::Shared(format!("queue {i}: {e}")))?;
            shadows.push(Shadow::new(layout));
            base += RINGS_BYTES + data_bytes;
        }
        Ok(Self { shared, shadows })
    }

    /// The region, as the backend's only memory.
    pub fn shared(&self) -> &GuestMemoryMmap {
        &self.shared
    }

    /// The shadow vrings as the backend is to start them.
    pub fn backend_queues(&self) -> Vec<QueueState> {
        self.shadows
            .iter()
            .map(|s| QueueState {
                max_size: SHADOW_QUEUE_SIZE,
                next_avail: 0,
                next_used: 0,
                event_idx_enabled: false,
                size: SHADOW_QUEUE_SIZE,
                ready: true,
                desc_table: s.layout.desc,
                avail_ring: s.layout.avail,
                used_ring: s.layout.used,
            })
            .collect()
    }

    /// Takes the chains the driver posted on queue `q` and offers the backend those that fit.
    /// Returns how many were offered (the backend is to be kicked if any).
    pub fn take_from_driver(
        &mut self,
        q: usize,
        mem: &GuestMemoryMmap,
        queue: &mut Queue,
    ) -> Result<usize, RelayError> {
        let Some(shadow) = self.shadows.get_mut(q) else { return Ok(0) };
        let mut offered = 0;
        // Bounded: each turn offers a chain, and at most the queue's size are pending.
        for _ in 0..=queue.size() {
            let taken = match shadow.waiting.take() {
                Some(t) => t,
                None => match next_chain(queue, mem, shadow.layout.max_chain)? {
                    Some(t) => t,
                    None => break,
                },
            };
            if !shadow.offer(&self.shared, mem, &taken)? {
                shadow.waiting = Some(taken);
                break;
            }
            offered += 1;
        }
        if offered > 0 {
            shadow.publish(&self.shared)?;
        }
        Ok(offered)
    }

    /// Copies back the replies the backend finished on queue `q` and uses the driver's chains.
    /// Returns how many (the driver is to be interrupted if any).
    pub fn return_to_driver(
        &mut self,
        q: usize,
        mem: &GuestMemoryMmap,
        queue: &mut Queue,
    ) -> Result<usize, RelayError> {
        let Some(shadow) = self.shadows.get_mut(q) else { return Ok(0) };
        let used = shadow.layout.used;
        let published: u16 = self.shared.load(GuestAddress(used + 2), Ordering::Acquire).map_err(shared_err)?;
        let ahead = published.wrapping_sub(shadow.used_idx);
        if ahead > SHADOW_QUEUE_SIZE {
            return Err(RelayError::UsedIndex { published, ahead });
        }
        for _ in 0..ahead {
            let elem = used + 4 + 8 * u64::from(shadow.used_idx % SHADOW_QUEUE_SIZE);
            let id: u32 = self.shared.read_obj(GuestAddress(elem)).map_err(shared_err)?;
            let len: u32 = self.shared.read_obj(GuestAddress(elem + 4)).map_err(shared_err)?;
            shadow.used_idx = shadow.used_idx.wrapping_add(1);
            let f = usize::try_from(id)
                .ok()
                .and_then(|i| shadow.in_flight.get_mut(i))
                .and_then(Option::take)
                .ok_or(RelayError::UnknownId { id })?;
            shadow.release(&f);
            if len > f.reply_room {
                return Err(RelayError::ReplyTooLong { len, room: f.reply_room });
            }
            shared_to_guest(&self.shared, f.reply_at, len, &f.writable, mem)?;
            queue.add_used(mem, f.guest_head, len).map_err(|e| RelayError::Guest(e.to_string()))?;
        }
        Ok(usize::from(ahead))
    }

    /// Requests the backend holds, on every queue (for tests and logs).
    pub fn in_flight(&self) -> usize {
        self.shadows.iter().map(|s| s.in_flight.iter().flatten().count()).sum()
    }
}

/// Pops the driver's next chain and checks it: bounded descriptors and bytes, readable first.
fn next_chain(queue: &mut Queue, mem: &GuestMemoryMmap, max_bytes: u64) -> Result<Option<Taken>, RelayError> {
    let Some(chain) = chain::pop(queue, mem)? else { return Ok(None) };
    let head = chain.head_index();
    let descs = chain::collect_up_to(chain, mem, max_bytes, MAX_CHAIN_DESCS)?;
    let split = descs.iter().position(|d| d.writable).unwrap_or(descs.len());
    if descs[split..].iter().any(|d| !d.writable) {
        return Err(RelayError::Order { head });
    }
    if chain::total_len(&descs) == 0 {
        return Err(RelayError::Empty { head });
    }
    Ok(Some(Taken { head, descs, split }))
}

/// Copies descriptor `d`'s bytes (checked to lie in guest memory) to `at` in the region.
fn guest_to_shared(mem: &GuestMemoryMmap, d: &Desc, shared: &GuestMemoryMmap, at: u64) -> Result<(), RelayError> {
    let mut off = at;
    for src in mem.get_slices(d.addr, d.len as usize) {
        let src = src.map_err(guest_err)?;
        let dst = shared.get_slice(GuestAddress(off), src.len()).map_err(shared_err)?;
        src.copy_to_volatile_slice(dst);
        off += src.len() as u64;
    }
    Ok(())
}

/// Copies `len` reply bytes from `at` in the region across the driver's writable descriptors.
fn shared_to_guest(
    shared: &GuestMemoryMmap,
    at: u64,
    len: u32,
    writable: &[Desc],
    mem: &GuestMemoryMmap,
) -> Result<(), RelayError> {
    let mut left = u64::from(len);
    let mut off = at;
    for d in writable {
        if left == 0 {
            break;
        }
        let n = left.min(u64::from(d.len));
        for dst in mem.get_slices(d.addr, n as usize) {
            let dst = dst.map_err(guest_err)?;
            let src = shared.get_slice(GuestAddress(off), dst.len()).map_err(shared_err)?;
            src.copy_to_volatile_slice(dst);
            off += dst.len() as u64;
        }
        left -= n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::chain::test_utils::{TestQueue, F_NEXT as NEXT, F_WRITE as WRITE};
    use crate::memory::create_guest_memory;

    /// Guest memory, the driver's request queue, the shared region and a relay on it.
    struct Rig {
        mem: GuestMemoryMmap,
        tq: TestQueue,
        queue: Queue,
        relay: Relay,
    }

    fn rig() -> Rig {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 8 << 20)]).unwrap();
        let tq = TestQueue::new(0x1000, 16);
        let queue = tq.queue();
        let relay = Relay::new(create_guest_memory(region_bytes()).unwrap()).unwrap();
        Rig { mem, tq, queue, relay }
    }

    type ShadowDesc = (u64, u32, u16);

    /// A backend's view: the shadow request queue.
    struct Backend {
        shared: GuestMemoryMmap,
        layout: Layout,
        seen: u16,
        used: u16,
    }

    impl Backend {
        fn of(relay: &Relay) -> Self {
            Self { shared: relay.shared.clone(), layout: relay.shadows[1].layout, seen: 0, used: 0 }
        }

        /// The next offered chain: its head and (addr, len, flags) of each descriptor.
        fn next(&mut self) -> Option<(u16, Vec<ShadowDesc>)> {
            let idx: u16 = self.shared.read_obj(GuestAddress(self.layout.avail + 2)).unwrap();
            if idx == self.seen {
                return None;
            }
            let entry = self.layout.avail + 4 + 2 * u64::from(self.seen % SHADOW_QUEUE_SIZE);
            let head: u16 = self.shared.read_obj(GuestAddress(entry)).unwrap();
            self.seen += 1;
            let mut out = vec![];
            let mut i = head;
            loop {
                let raw: RawDescriptor =
                    self.shared.read_obj(GuestAddress(self.layout.desc + 16 * u64::from(i))).unwrap();
                let d = SplitDescriptor::from(raw);
                out.push((d.addr().0, d.len(), d.flags()));
                if d.flags() & F_NEXT == 0 {
                    break;
                }
                i = d.next();
            }
            Some((head, out))
        }

        fn read(&self, addr: u64, len: u32) -> Vec<u8> {
            let mut b = vec![0; len as usize];
            self.shared.read_slice(&mut b, GuestAddress(addr)).unwrap();
            b
        }

        fn reply(&mut self, id: u32, addr: u64, bytes: &[u8]) {
            self.shared.write_slice(bytes, GuestAddress(addr)).unwrap();
            self.used_raw(id, bytes.len() as u32);
        }

        fn used_raw(&mut self, id: u32, len: u32) {
            let elem = self.layout.used + 4 + 8 * u64::from(self.used % SHADOW_QUEUE_SIZE);
            self.shared.write_obj(id, GuestAddress(elem)).unwrap();
            self.shared.write_obj(len, GuestAddress(elem + 4)).unwrap();
            self.used = self.used.wrapping_add(1);
            self.shared.write_obj(self.used, GuestAddress(self.layout.used + 2)).unwrap();
        }
    }

    /// Posts a request: `out` in two readable descriptors, then `reply_room` bytes in two writable ones.
    fn post(r: &mut Rig, head: u16, out: &[u8], reply_room: u32, at: u64) {
        let (a, b) = out.split_at(out.len() / 2);
        r.mem.write_slice(a, GuestAddress(at)).unwrap();
        r.mem.write_slice(b, GuestAddress(at + 0x1000)).unwrap();
        let half = reply_room / 2;
        r.tq.set_desc(&r.mem, head, at, a.len() as u32, NEXT, head + 1);
        r.tq.set_desc(&r.mem, head + 1, at + 0x1000, b.len() as u32, NEXT, head + 2);
        r.tq.set_desc(&r.mem, head + 2, at + 0x2000, half, NEXT | WRITE, head + 3);
        r.tq.set_desc(&r.mem, head + 3, at + 0x3000, reply_room - half, WRITE, 0);
        r.tq.publish(&r.mem, head);
    }

    #[test]
    fn a_request_and_its_reply_cross_the_relay_byte_for_byte() {
        let mut r = rig();
        post(&mut r, 0, b"FUSE_LOOKUP name=hello", 64, 0x10_0000);
        assert_eq!(r.relay.take_from_driver(1, &r.mem, &mut r.queue).unwrap(), 1);
        let mut be = Backend::of(&r.relay);
        let (head, descs) = be.next().unwrap();
        assert_eq!(descs.len(), 2, "one readable and one writable descriptor: {descs:?}");
        assert_eq!((descs[0].1, descs[0].2), (22, F_NEXT));
        assert_eq!(be.read(descs[0].0, descs[0].1), b"FUSE_LOOKUP name=hello");
        assert_eq!((descs[1].1, descs[1].2), (64, F_WRITE));
        // The reply spans both of the driver's writable descriptors (32 bytes each).
        let reply: Vec<u8> = (0..40).collect();
        be.reply(u32::from(head), descs[1].0, &reply);
        assert_eq!(r.relay.return_to_driver(1, &r.mem, &mut r.queue).unwrap(), 1);
        assert_eq!(r.tq.used_idx(&r.mem), 1);
        assert_eq!(r.tq.used_elem(&r.mem, 0), (0, 40));
        let mut got = vec![0u8; 40];
        r.mem.read_slice(&mut got[..32], GuestAddress(0x10_2000)).unwrap();
        r.mem.read_slice(&mut got[32..], GuestAddress(0x10_3000)).unwrap();
        assert_eq!(got, reply);
        assert_eq!(r.relay.in_flight(), 0);
    }

    #[test]
    fn chains_that_do_not_fit_wait_for_replies_to_free_room() {
        let mut r = rig();
        // Three requests of 1.5 MiB of reply room each: two fit in the 4 MiB data area.
        for (i, at) in [0x10_0000u64, 0x20_0000, 0x30_0000].iter().enumerate() {
            let head = 4 * i as u16;
            r.tq.set_desc(&r.mem, head, *at, 16, NEXT, head + 1);
            r.tq.set_desc(&r.mem, head + 1, at + 0x1000, 1 << 20, WRITE, 0);
            r.tq.publish(&r.mem, head);
        }
        assert_eq!(r.relay.take_from_driver(1, &r.mem, &mut r.queue).unwrap(), 3, "1 MiB each: all three fit");
        let mut r = rig();
        for (i, at) in [0x10_0000u64, 0x20_0000, 0x30_0000, 0x40_0000, 0x50_0000].iter().enumerate() {
            let head = 3 * i as u16;
            r.tq.set_desc(&r.mem, head, *at, 16, NEXT, head + 1);
            r.tq.set_desc(&r.mem, head + 1, at + 0x1000, 1 << 20, NEXT | WRITE, head + 2);
            r.tq.set_desc(&r.mem, head + 2, at + 0x1000, 8 << 10, WRITE, 0);
            r.tq.publish(&r.mem, head);
        }
        assert_eq!(r.relay.take_from_driver(1, &r.mem, &mut r.queue).unwrap(), 3);
        assert_eq!(r.relay.in_flight(), 3);
        assert_eq!(r.relay.take_from_driver(1, &r.mem, &mut r.queue).unwrap(), 0, "still no room");
        let mut be = Backend::of(&r.relay);
        let (head, _) = be.next().unwrap();
        be.used_raw(u32::from(head), 0);
        assert_eq!(r.relay.return_to_driver(1, &r.mem, &mut r.queue).unwrap(), 1);
        assert_eq!(r.relay.take_from_driver(1, &r.mem, &mut r.queue).unwrap(), 1, "the waiting chain goes first");
        let heads: Vec<u16> = std::iter::from_fn(|| be.next().map(|c| c.0)).collect();
        assert_eq!(heads, [2, 4, 0], "the fourth chain reuses the freed descriptors");
        assert_eq!(r.relay.in_flight(), 3);
    }

    #[test]
    fn malformed_chains_are_the_drivers_fault() {
        // A writable descriptor, then a readable one.
        let mut r = rig();
        r.tq.set_desc(&r.mem, 0, 0x10_0000, 64, NEXT | WRITE, 1);
        r.tq.set_desc(&r.mem, 1, 0x11_0000, 64, 0, 0);
        r.tq.publish(&r.mem, 0);
        let err = r.relay.take_from_driver(1, &r.mem, &mut r.queue).unwrap_err();
        assert!(matches!(err, RelayError::Order { head: 0 }) && !err.is_backends(), "{err}");
        // More bytes than any FUSE request.
        let mut r = rig();
        r.tq.set_desc(&r.mem, 0, 0x10_0000, 16, NEXT, 1);
        r.tq.set_desc(&r.mem, 1, 0x10_0000, 4 << 20, WRITE, 0);
        r.tq.publish(&r.mem, 0);
        let err = r.relay.take_from_driver(1, &r.mem, &mut r.queue).unwrap_err();
        assert!(matches!(err, RelayError::Chain(ChainError::TooManyBytes { .. })), "{err}");
        // hiprio's limit is its data area.
        let mut r = rig();
        r.tq.set_desc(&r.mem, 0, 0x10_0000, 128 << 10, 0, 0);
        r.tq.publish(&r.mem, 0);
        let err = r.relay.take_from_driver(0, &r.mem, &mut r.queue).unwrap_err();
        assert!(matches!(err, RelayError::Chain(ChainError::TooManyBytes { .. })), "{err}");
        // Zero-length descriptors only.
        let mut r = rig();
        r.tq.set_desc(&r.mem, 0, 0x10_0000, 0, 0, 0);
        r.tq.publish(&r.mem, 0);
        assert!(matches!(r.relay.take_from_driver(1, &r.mem, &mut r.queue), Err(RelayError::Empty { head: 0 })));
        // Outside guest memory.
        let mut r = rig();
        r.tq.set_desc(&r.mem, 0, 0xffff_0000, 64, 0, 0);
        r.tq.publish(&r.mem, 0);
        let err = r.relay.take_from_driver(1, &r.mem, &mut r.queue).unwrap_err();
        assert!(matches!(err, RelayError::Chain(ChainError::OutOfRange { .. })), "{err}");
    }

    #[test]
    fn a_backend_that_breaks_the_ring_rules_is_caught() {
        // It uses a descriptor it was never given.
        let mut r = rig();
        post(&mut r, 0, b"request", 64, 0x10_0000);
        r.relay.take_from_driver(1, &r.mem, &mut r.queue).unwrap();
        let mut be = Backend::of(&r.relay);
        be.used_raw(200, 0);
        let err = r.relay.return_to_driver(1, &r.mem, &mut r.queue).unwrap_err();
        assert!(matches!(err, RelayError::UnknownId { id: 200 }) && err.is_backends(), "{err}");
        // It claims to have written more than the reply room.
        let mut r = rig();
        post(&mut r, 0, b"request", 64, 0x10_0000);
        r.relay.take_from_driver(1, &r.mem, &mut r.queue).unwrap();
        let mut be = Backend::of(&r.relay);
        let (head, _) = be.next().unwrap();
        be.used_raw(u32::from(head), 65);
        let err = r.relay.return_to_driver(1, &r.mem, &mut r.queue).unwrap_err();
        assert!(matches!(err, RelayError::ReplyTooLong { len: 65, room: 64 }), "{err}");
        assert_eq!(r.tq.used_idx(&r.mem), 0, "nothing reaches the driver");
        // It publishes a used index far ahead.
        let mut r = rig();
        let used = r.relay.shadows[1].layout.used;
        r.relay.shared.write_obj(1000u16, GuestAddress(used + 2)).unwrap();
        let err = r.relay.return_to_driver(1, &r.mem, &mut r.queue).unwrap_err();
        assert!(matches!(err, RelayError::UsedIndex { published: 1000, .. }), "{err}");
        // Using the same descriptor twice.
        let mut r = rig();
        post(&mut r, 0, b"request", 64, 0x10_0000);
        r.relay.take_from_driver(1, &r.mem, &mut r.queue).unwrap();
        let mut be = Backend::of(&r.relay);
        let (head, _) = be.next().unwrap();
        be.used_raw(u32::from(head), 0);
        be.used_raw(u32::from(head), 0);
        assert!(matches!(r.relay.return_to_driver(1, &r.mem, &mut r.queue), Err(RelayError::UnknownId { .. })));
        assert_eq!(r.tq.used_idx(&r.mem), 1, "the first use reached the driver, once");
    }

    #[test]
    fn the_backend_sees_only_the_shared_region() {
        let r = rig();
        let queues = r.relay.backend_queues();
        assert_eq!(queues.len(), NUM_QUEUES);
        for q in &queues {
            for addr in [q.desc_table, q.avail_ring, q.used_ring] {
                assert!(addr < region_bytes(), "{addr:#x} is outside the shared region");
            }
            assert_eq!((q.size, q.next_avail, q.ready), (SHADOW_QUEUE_SIZE, 0, true));
        }
        assert!(region_bytes() < 5 << 20, "{}", region_bytes());
    }
}
