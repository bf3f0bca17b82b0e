//! Fuzz bodies for `bulkhead-vmm`'s packet parsers over descriptor lists, and its bounded
//! descriptor-chain walk on a real split virtqueue in guest memory.

use arbitrary::{Result, Unstructured};
use bulkhead_vmm::devices::virtio::block::packet::Request;
use bulkhead_vmm::devices::virtio::chain::{self, Desc, MAX_CHAIN_DESCRIPTORS};
use bulkhead_vmm::devices::virtio::fs::relay;
use bulkhead_vmm::devices::virtio::net::packet::{
    self as net_packet, TxOffloads, VnetHeader, ETH_HLEN, HDR_F_NEEDS_CSUM, MAX_BUFFER_LEN, MAX_FRAME_LEN, VNET_HDR_LEN,
};
use bulkhead_vmm::devices::virtio::vsock::packet::{self, TxPacket, VsockHeader, HDR_LEN};
use bulkhead_vmm::devices::virtio::vsock::MAX_PKT_PAYLOAD;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use crate::*;

// ---------------------------------------------------------------------------------------------
// VMM: packet parsers over pre-collected descriptor lists.

/// `TxPacket::parse`, `rx_capacity` and `write_rx` on arbitrary descriptors over arbitrary
/// guest memory.
pub fn vsock_packet(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(ds) = descs(&mut u, 6) else { return };
    let mem = guest_mem();
    load_image(&mem, u.take_rest());

    let total: u64 = ds.iter().map(|d| u64::from(d.len)).sum();
    match TxPacket::parse(&ds, &mem) {
        Ok(p) => {
            assert!(ds.iter().all(|d| !d.writable));
            assert_eq!(p.data.len(), p.hdr.len as usize, "payload length differs from the header's");
            assert!(p.data.len() <= MAX_PKT_PAYLOAD);
            assert!(HDR_LEN as u64 + p.data.len() as u64 <= total);
        }
        Err(packet::PacketError::LyingLength { claimed, carried }) => assert!(u64::from(claimed) > carried),
        Err(_) => {}
    }
    match packet::rx_capacity(&ds) {
        Ok(room) => {
            assert!(room <= MAX_PKT_PAYLOAD && room as u64 + HDR_LEN as u64 <= total);
            let hdr = VsockHeader { len: room as u32, ..Default::default() };
            let payload = vec![0xa5u8; room];
            if let Ok(n) = packet::write_rx(&ds, &mem, &hdr, &payload) {
                assert!(n as usize <= HDR_LEN + room);
            }
        }
        Err(_) => assert!(ds.iter().any(|d| !d.writable) || total < HDR_LEN as u64),
    }

    let mut raw = [0u8; HDR_LEN];
    let n = data.len().min(HDR_LEN);
    raw[..n].copy_from_slice(&data[..n]);
    assert_eq!(VsockHeader::from_bytes(&raw).to_bytes(), raw);
}

/// virtio-net: `read_tx` (with fuzzed negotiated offloads), `rx_capacity`, `write_rx` and the
/// vnet header codec on arbitrary descriptors over arbitrary guest memory.
pub fn net_packet(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let (Ok(ds), Ok(csum), Ok(tso4), Ok(tso6)) = (descs(&mut u, 6), u.arbitrary(), u.arbitrary(), u.arbitrary()) else {
        return;
    };
    let offloads = TxOffloads { csum, tso4, tso6 };
    let mem = guest_mem();
    load_image(&mem, u.take_rest());

    let total: u64 = ds.iter().map(|d| u64::from(d.len)).sum();
    let mut buf = Vec::new();
    if let Ok(h) = net_packet::read_tx(&ds, &mem, offloads, &mut buf) {
        assert!(ds.iter().all(|d| !d.writable));
        assert_eq!(buf.len() as u64, total, "TX copy differs from the chain");
        let frame_len = total - VNET_HDR_LEN as u64;
        assert!((ETH_HLEN as u64..=MAX_FRAME_LEN as u64).contains(&frame_len));
        let mut hb = [0u8; VNET_HDR_LEN];
        hb.copy_from_slice(&buf[..VNET_HDR_LEN]);
        assert_eq!(VnetHeader::from_bytes(&hb), h);
        if h.flags & HDR_F_NEEDS_CSUM != 0 {
            assert!(offloads.csum, "checksum offload without negotiation");
            assert!(u64::from(h.csum_start) + u64::from(h.csum_offset) + 2 <= frame_len, "checksum past the frame");
        }
        if h.gso_type != 0 {
            assert!((h.gso_type == 1 && offloads.tso4) || (h.gso_type == 4 && offloads.tso6), "GSO not negotiated");
            assert!(u64::from(h.hdr_len) <= frame_len && h.gso_size > 0);
        }
    }
    match net_packet::rx_capacity(&ds) {
        Ok(room) => {
            assert!((VNET_HDR_LEN..=MAX_BUFFER_LEN).contains(&room) && room as u64 <= total);
            let frame = vec![0x5au8; room.min(4096)];
            if let Ok(n) = net_packet::write_rx(&ds, &mem, &frame) {
                assert_eq!(n as usize, frame.len(), "a frame that fits was cut short");
            }
        }
        Err(_) => assert!(ds.iter().any(|d| !d.writable) || total < VNET_HDR_LEN as u64),
    }

    let mut raw = [0u8; VNET_HDR_LEN];
    let n = data.len().min(VNET_HDR_LEN);
    raw[..n].copy_from_slice(&data[..n]);
    assert_eq!(VnetHeader::from_bytes(&raw).to_bytes(), raw);
}

/// `block::packet::Request::parse` on arbitrary descriptors over arbitrary guest memory.
pub fn block_request(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(ds) = descs(&mut u, 8) else { return };
    let mem = guest_mem();
    load_image(&mem, u.take_rest());
    if let Ok(r) = Request::parse(&ds, &mem) {
        assert!(ds.len() >= 2 && !ds[0].writable && ds[ds.len() - 1].writable);
        assert_eq!(r.data.as_slice(), &ds[1..ds.len() - 1]);
        assert_eq!(r.data_len, r.data.iter().map(|d| u64::from(d.len)).sum::<u64>());
        assert_eq!(r.status_addr, ds[ds.len() - 1].addr);
    }
}

/// virtio-balloon's parsers on arbitrary descriptors over arbitrary guest memory: the reporting
/// queue's ranges (`parse_report`, descriptors anywhere) and the inflate queue's PFN arrays
/// (`parse_pfns`, descriptors inside memory, as `chain::collect` hands them over). Nothing they
/// accept may be off a page, empty or outside RAM, and every byte named is counted.
pub fn balloon_report(data: &[u8]) {
    use bulkhead_vmm::devices::virtio::balloon::packet::{parse_pfns, parse_report, Pages, PAGE_SIZE};
    let mut u = Unstructured::new(data);
    let (Ok(reported), Ok(arrays)) = (descs(&mut u, MAX_CHAIN_DESCRIPTORS + 2), descs(&mut u, 8)) else { return };
    let mem = guest_mem();
    load_image(&mem, u.take_rest());
    let sound = |p: &Pages, named: u64| {
        assert_eq!(p.named_bytes, named);
        assert!(p.bytes() <= named);
        for r in &p.ranges {
            assert!(r.len > 0 && r.addr.0 % PAGE_SIZE == 0 && r.len % PAGE_SIZE == 0, "{r:?}");
            assert!(r.end() <= MEM_SIZE as u64, "{r:?} outside guest memory");
        }
    };
    let named = reported.iter().map(|d| u64::from(d.len)).sum();
    sound(&parse_report(&reported, &mem), named);
    let inside: Vec<Desc> =
        arrays.into_iter().filter(|d| GuestMemoryBackend::check_range(&mem, d.addr, d.len as usize)).collect();
    let pfns: u64 = inside.iter().filter(|d| !d.writable).map(|d| u64::from(d.len / 4)).sum();
    let p = parse_pfns(&inside, &mem).expect("descriptors inside memory read");
    sound(&p, pfns * PAGE_SIZE);
}

// ---------------------------------------------------------------------------------------------
// VMM: descriptor chain walking on a real split virtqueue in guest memory.

pub(crate) struct Layout {
    pub(crate) size: u16,
    pub(crate) desc: u64,
    pub(crate) avail: u64,
    pub(crate) used: u64,
}

/// Queue size and ring addresses, mostly valid (aligned, inside the first 16 KiB) so the
/// memory image decides what the rings contain; sometimes anything at all.
pub(crate) fn layout(u: &mut Unstructured<'_>) -> Result<Layout> {
    let size = 1u16 << u.int_in_range(0..=8)?;
    if u.ratio(1, 16)? {
        return Ok(Layout { size: u.arbitrary()?, desc: addr(u)?, avail: addr(u)?, used: addr(u)? });
    }
    let desc = u.int_in_range(0..=0x3ffu64)? * 16;
    let avail = u.int_in_range(0..=0x1fffu64)? * 2;
    let used = u.int_in_range(0..=0xfffu64)? * 4;
    Ok(Layout { size, desc, avail, used })
}

/// A device's queue (up to 256 entries) as a driver set it up by `l`, if it is valid in `mem`.
pub(crate) fn ready_queue(l: &Layout, mem: &GuestMemoryMmap) -> Option<Queue> {
    let mut q = Queue::new(256).ok()?;
    q.try_set_size(l.size).ok()?;
    q.set_desc_table_address(Some(l.desc as u32), Some((l.desc >> 32) as u32));
    q.set_avail_ring_address(Some(l.avail as u32), Some((l.avail >> 32) as u32));
    q.set_used_ring_address(Some(l.used as u32), Some((l.used >> 32) as u32));
    q.set_ready(true);
    q.is_valid(mem).then_some(q)
}

/// Walks every available chain with `chain::collect`, returning each used head, like a device
/// does, and checks what `collect` promises.
pub fn desc_chain(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let (Ok(l), Ok(max_bytes)) = (layout(&mut u), u.int_in_range(0..=(1u64 << 21))) else { return };
    let mem = guest_mem();
    load_image(&mem, u.take_rest());

    let Some(mut q) = ready_queue(&l, &mem) else { return };
    for _ in 0..=q.size() {
        let chain = {
            let Ok(mut it) = q.iter(&mem) else { return };
            match it.next() {
                Some(c) => c,
                None => return,
            }
        };
        let head = chain.head_index();
        match chain::collect(chain, &mem, max_bytes) {
            Ok(ds) => {
                assert!(!ds.is_empty() && ds.len() <= MAX_CHAIN_DESCRIPTORS);
                assert!(ds.iter().map(|d| u64::from(d.len)).sum::<u64>() <= max_bytes);
                for d in &ds {
                    assert!(GuestMemoryBackend::check_range(&mem, d.addr, d.len as usize), "{d:?} escapes memory");
                }
            }
            Err(_) => return, // devices stop serving on the first bad chain
        }
        if q.add_used(&mem, head, 0).is_err() {
            return;
        }
    }
}

/// The virtio-fs relay (`fs/relay.rs`) between a hostile driver's request queue and a hostile
/// backend's shadow vring: the driver's chains are taken and offered, the backend's forged used
/// elements (any id, any length, any index) are answered, over and over. Whatever either side
/// writes, the relay errs or keeps its bounds; it never panics.
pub fn fs_relay(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(l) = layout(&mut u) else { return };
    let Ok(answers) = u.arbitrary::<Vec<(u16, u32, u32)>>() else { return };
    let mem = guest_mem();
    load_image(&mem, u.take_rest());
    let Some(mut q) = ready_queue(&l, &mem) else { return };
    let shared = bulkhead_vmm::memory::create_guest_memory(relay::region_bytes()).expect("shared region");
    let Ok(mut r) = relay::Relay::new(shared.clone()) else { return };
    let used_ring = r.backend_queues()[1].used_ring;
    let mut used_idx = 0u16;
    for (bump, id, len) in std::iter::once((0, 0, 0)).chain(answers).take(64) {
        match r.take_from_driver(1, &mem, &mut q) {
            Ok(n) => assert!(n <= usize::from(relay::SHADOW_QUEUE_SIZE)),
            Err(_) => return, // the device stops serving on the first broken rule
        }
        assert!(r.in_flight() <= usize::from(relay::SHADOW_QUEUE_SIZE));
        let slot = used_ring + 4 + 8 * u64::from(used_idx % relay::SHADOW_QUEUE_SIZE);
        let _ = shared.write_obj(id, GuestAddress(slot));
        let _ = shared.write_obj(len, GuestAddress(slot + 4));
        used_idx = used_idx.wrapping_add(bump);
        let _ = shared.write_obj(used_idx, GuestAddress(used_ring + 2));
        if r.return_to_driver(1, &mem, &mut q).is_err() {
            return;
        }
    }
}
