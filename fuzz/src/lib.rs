//! Fuzz bodies for bulkhead's decoders of guest- and peer-supplied bytes.
//!
//! Each `fuzz_targets/<name>.rs` is a one-line libFuzzer wrapper around the function of the same
//! name here, so the bodies also run as ordinary `cargo test` seeds (see `tests/seeds.rs`) on a
//! toolchain without sanitizer support. A body returns normally for any input; a panic (or a
//! sanitizer report) is a bug in the decoder under test, never in the input.
//!
//! Boundaries: only PUBLIC APIs of `bulkhead-vmm`, `bulkhead-protocol` and `bulkhead-shim` are used; this crate
//! never patches them. Guest memory is a small in-memory `GuestMemoryMmap` so that fuzzed
//! addresses land inside it often enough to reach the interesting paths.

mod shim;
pub use shim::{agent_reply, shim_options, shim_pod_config, shim_spec};

use std::cell::RefCell;
use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex, Once};
use std::task::{Context, Poll, Waker};

use arbitrary::{Result, Unstructured};
use bulkhead_protocol::{handshake, stream};
use bulkhead_vmm::config::{BlockConfig, LinkState, NetConfig};
use bulkhead_vmm::devices::bus::BusDevice;
use bulkhead_vmm::devices::virtio::block::packet::Request;
use bulkhead_vmm::devices::virtio::block::Block;
use bulkhead_vmm::devices::virtio::chain::{self, Desc, MAX_CHAIN_DESCRIPTORS};
use bulkhead_vmm::devices::virtio::fs::relay;
use bulkhead_vmm::devices::virtio::mmio::MmioTransport;
use bulkhead_vmm::devices::virtio::mmio_regs as reg;
use bulkhead_vmm::devices::virtio::net::packet::{
    self as net_packet, TxOffloads, VnetHeader, ETH_HLEN, HDR_F_NEEDS_CSUM, MAX_BUFFER_LEN, MAX_FRAME_LEN, VNET_HDR_LEN,
};
use bulkhead_vmm::devices::virtio::net::tap::FrameIo;
use bulkhead_vmm::devices::virtio::net::{self, Net};
use bulkhead_vmm::devices::virtio::vsock::packet::{self, TxPacket, VsockHeader, HDR_LEN};
use bulkhead_vmm::devices::virtio::vsock::unix::muxer::{self, VsockMuxer};
use bulkhead_vmm::devices::virtio::vsock::{self, Vsock, HOST_CID, MAX_PKT_PAYLOAD};
use bulkhead_vmm::devices::virtio::{IrqTrigger, VirtioDevice};
use bulkhead_vmm::snapshot::file as state_file;
use bulkhead_vmm::snapshot::state::{FpuState, KvmVmState, VcpuState, VmState, XSAVE_WORDS};
use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

/// Guest memory size for every target: small, so fuzzed addresses hit it.
pub const MEM_SIZE: usize = 64 * 1024;
const GUEST_CID: u64 = 3;

/// Runs `f` to completion on the current thread. The readers used here (`&[u8]`) never return
/// `Pending`, so a no-op waker suffices; a body that does pend is reported as a bug.
fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    for _ in 0..1_000_000 {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
    panic!("future over an in-memory reader did not finish");
}

thread_local! {
    static RT: tokio::runtime::Runtime =
        tokio::runtime::Builder::new_current_thread().enable_time().build().expect("tokio runtime");
}

/// libFuzzer's `main` is C's, so Rust's usual SIGPIPE=ignore is missing; the VMM binary has it.
pub fn ignore_sigpipe() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: setting a signal disposition to SIG_IGN has no preconditions.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
    });
}

fn guest_mem() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).expect("guest memory")
}

/// Copies `image` to guest address 0 (truncated to memory) and zeroes the rest.
fn load_image(mem: &GuestMemoryMmap, image: &[u8]) {
    let n = image.len().min(MEM_SIZE);
    mem.write_slice(&image[..n], GuestAddress(0)).expect("image fits");
    let zeros = vec![0u8; MEM_SIZE - n];
    mem.write_slice(&zeros, GuestAddress(n as u64)).expect("zero fill fits");
}

/// A guest address biased towards guest memory but able to point anywhere.
fn addr(u: &mut Unstructured<'_>) -> Result<u64> {
    Ok(match u.int_in_range(0u8..=7)? {
        0 => u.arbitrary()?,
        1 => (MEM_SIZE as u64).wrapping_sub(u.int_in_range(0u64..=64)?),
        _ => u.int_in_range(0..=MEM_SIZE as u64 - 1)?,
    })
}

fn len32(u: &mut Unstructured<'_>) -> Result<u32> {
    Ok(match u.int_in_range(0u8..=7)? {
        0 => u.arbitrary()?,
        1 => u.int_in_range(0..=MEM_SIZE as u32 * 2)?,
        _ => u.int_in_range(0..=4096)?,
    })
}

fn descs(u: &mut Unstructured<'_>, max: usize) -> Result<Vec<Desc>> {
    let n = u.int_in_range(0..=max)?;
    (0..n).map(|_| Ok(Desc { addr: GuestAddress(addr(u)?), len: len32(u)?, writable: u.arbitrary()? })).collect()
}

// ---------------------------------------------------------------------------------------------
// Protocol crate: handshake lines and stdio stream header / ack.

/// `CONNECT <port>\n` / `OK <port>\n` lines: the agent's and the VMM muxer's parsers, and the
/// bounded line reader.
pub fn handshake(data: &[u8]) {
    for (parsed, encode) in [
        (handshake::parse_connect(data), handshake::encode_connect as fn(u32) -> String),
        (handshake::parse_ok(data), handshake::encode_ok),
    ] {
        if let Ok(port) = parsed {
            assert!(data.len() <= handshake::MAX_LINE, "accepted an over-long line");
            let canon = encode(port);
            // Leading zeros are accepted, so compare through a second parse.
            let again = if canon.starts_with('C') {
                handshake::parse_connect(canon.as_bytes())
            } else {
                handshake::parse_ok(canon.as_bytes())
            };
            assert_eq!(again.ok(), Some(port));
        }
    }

    // The VMM's host-side parser gets the line without its newline; it must accept at least
    // what the protocol crate accepts, with the same port.
    let vmm_port = muxer::parse_connect(data.strip_suffix(b"\n").unwrap_or(data));
    if let Ok(p) = handshake::parse_connect(data) {
        assert_eq!(vmm_port, Some(p), "VMM and agent disagree on {data:?}");
    }

    let mut reader = data;
    match block_on(handshake::read_line(&mut reader, handshake::MAX_LINE)) {
        Ok(line) => {
            assert!(line.len() <= handshake::MAX_LINE);
            assert_eq!(line.last(), Some(&b'\n'));
            assert_eq!(&data[..line.len()], &line[..], "read_line returned bytes it was not given");
            assert_eq!(reader.len(), data.len() - line.len(), "read past the newline");
        }
        Err(handshake::HandshakeError::TooLong) => {
            assert!(!data[..handshake::MAX_LINE].contains(&b'\n'));
        }
        Err(handshake::HandshakeError::Closed) => {
            assert!(data.len() < handshake::MAX_LINE && !data.contains(&b'\n'));
        }
        Err(e) => panic!("unexpected read_line error {e}"),
    }
}

/// The stdio stream header (agent side: decodes what the shim sends) and the stream ack (host
/// side: decodes what the agent in the guest sends).
pub fn stream_header(data: &[u8]) {
    match stream::StreamHeader::decode(data) {
        Ok((h, used)) => {
            assert!(used <= data.len() && used <= stream::MAX_HEADER_LEN);
            assert_eq!(h.encode().as_deref(), Ok(&data[..used]), "decode/encode not inverse");
            let mut reader = data;
            let via_reader =
                RT.with(|rt| rt.block_on(stream::StreamHeader::read_from(&mut reader, handshake::DEFAULT_TIMEOUT)));
            assert_eq!(via_reader, Ok(h), "read_from disagrees with decode");
            assert_eq!(reader.len(), data.len() - used, "read_from read past the header");
        }
        Err(stream::HeaderError::Truncated { needed, have }) => {
            assert_eq!(have, data.len());
            assert!(needed > have && needed <= stream::MAX_HEADER_LEN);
        }
        Err(_) => {}
    }

    let mut reader = data;
    match block_on(stream::StreamAck::read_from(&mut reader)) {
        Ok(stream::StreamAck::Attached) => assert_eq!(&data[..3], &[0, 0, 0]),
        // Lossy UTF-8 turns each bad byte into a 3-byte U+FFFD at most.
        Ok(stream::StreamAck::Rejected(r)) => assert!(r.len() <= 3 * stream::MAX_ACK_REASON),
        Err(_) => {}
    }
    let consumed = data.len() - reader.len();
    assert!(consumed <= 3 + stream::MAX_ACK_REASON, "ack reader consumed {consumed} bytes");

    // Structured side: anything encode() accepts must decode to itself.
    let mut u = Unstructured::new(data);
    if let Ok((cid, exec, kind)) =
        (|| -> Result<(String, Option<String>, u8)> { Ok((u.arbitrary()?, u.arbitrary()?, u.int_in_range(1..=4)?)) })()
    {
        let kind = stream::StreamKind::from_wire(kind).expect("1..=4 are kinds");
        let h = stream::StreamHeader::new(&cid, exec.as_deref().filter(|e| !e.is_empty()), kind);
        if let Ok(bytes) = h.encode() {
            assert_eq!(stream::StreamHeader::decode(&bytes), Ok((h, bytes.len())));
        }
    }
}

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

struct Layout {
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
}

/// Queue size and ring addresses, mostly valid (aligned, inside the first 16 KiB) so the
/// memory image decides what the rings contain; sometimes anything at all.
fn layout(u: &mut Unstructured<'_>) -> Result<Layout> {
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
fn ready_queue(l: &Layout, mem: &GuestMemoryMmap) -> Option<Queue> {
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

// ---------------------------------------------------------------------------------------------
// VMM: whole devices behind the virtio-mmio transport, driven like a hostile driver would.

fn w(t: &mut MmioTransport, off: u64, v: u32) {
    t.write(off, &v.to_le_bytes());
}

/// Resets the transport, then runs the virtio init sequence with fuzzed feature bits and queue
/// layouts (the driver may lie about both).
fn init_device(t: &mut MmioTransport, u: &mut Unstructured<'_>, queues: u32) -> Result<()> {
    w(t, reg::STATUS, 0);
    w(t, reg::STATUS, 1);
    w(t, reg::STATUS, 3);
    w(t, reg::DRIVER_FEATURES_SEL, 1);
    w(t, reg::DRIVER_FEATURES, if u.ratio(1, 8)? { u.arbitrary()? } else { 1 });
    w(t, reg::DRIVER_FEATURES_SEL, 0);
    w(t, reg::DRIVER_FEATURES, if u.ratio(1, 8)? { u.arbitrary()? } else { 0 });
    w(t, reg::STATUS, 0xb);
    for i in 0..queues {
        let l = layout(u)?;
        w(t, reg::QUEUE_SEL, i);
        w(t, reg::QUEUE_NUM, u32::from(l.size));
        w(t, reg::QUEUE_DESC_LOW, l.desc as u32);
        w(t, reg::QUEUE_DESC_HIGH, (l.desc >> 32) as u32);
        w(t, reg::QUEUE_DRIVER_LOW, l.avail as u32);
        w(t, reg::QUEUE_DRIVER_HIGH, (l.avail >> 32) as u32);
        w(t, reg::QUEUE_DEVICE_LOW, l.used as u32);
        w(t, reg::QUEUE_DEVICE_HIGH, (l.used >> 32) as u32);
        w(t, reg::QUEUE_READY, 1);
    }
    w(t, reg::STATUS, 0xf);
    Ok(())
}

#[derive(arbitrary::Arbitrary, Debug)]
enum Op {
    /// The guest kicked the queue(s): the device serves them.
    Process,
    /// A 32-bit register write anywhere in the device's 4 KiB window.
    Write {
        offset: u16,
        value: u32,
    },
    /// An odd-sized access.
    WriteBytes {
        offset: u16,
        bytes: Vec<u8>,
    },
    Read {
        offset: u16,
        len: u8,
    },
    /// The guest rewrites part of its memory between kicks.
    Poke {
        at: u16,
        bytes: Vec<u8>,
    },
}

fn run_ops(t: &mut MmioTransport, mem: &GuestMemoryMmap, u: &mut Unstructured<'_>, mut process: impl FnMut()) {
    for _ in 0..32 {
        let Ok(op) = u.arbitrary::<Op>() else { return };
        match op {
            Op::Process => process(),
            Op::Write { offset, value } => w(t, u64::from(offset) & 0xfff, value),
            Op::WriteBytes { offset, bytes } => t.write(u64::from(offset) & 0xfff, &bytes[..bytes.len().min(16)]),
            Op::Read { offset, len } => {
                let mut buf = vec![0u8; usize::from(len % 17)];
                t.read(u64::from(offset) & 0xfff, &mut buf);
            }
            Op::Poke { at, bytes } => {
                let at = usize::from(at).min(MEM_SIZE);
                let n = bytes.len().min(MEM_SIZE - at);
                let _ = mem.write_slice(&bytes[..n], GuestAddress(at as u64));
            }
        }
    }
}

struct BlockRig {
    _dir: tempfile::TempDir,
    mem: GuestMemoryMmap,
    dev: Arc<Mutex<Block>>,
    t: MmioTransport,
}

fn irq() -> IrqTrigger {
    IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"))
}

impl BlockRig {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("disk.img");
        std::fs::write(&path, vec![0u8; 64 * 1024]).expect("disk image");
        let dev = Arc::new(Mutex::new(Block::new(&BlockConfig { path, read_only: false }, 0).expect("block device")));
        let mem = guest_mem();
        let as_dyn: Arc<Mutex<dyn VirtioDevice>> = dev.clone();
        let t = MmioTransport::new("fuzz-blk".into(), mem.clone(), as_dyn, irq()).expect("transport");
        Self { _dir: dir, mem, dev, t }
    }
}

thread_local! {
    static BLOCK: RefCell<Option<BlockRig>> = const { RefCell::new(None) };
    static VSOCK: RefCell<Option<VsockRig>> = const { RefCell::new(None) };
    static NET: RefCell<Option<NetRig>> = const { RefCell::new(None) };
}

/// virtio-blk end to end: mmio init with fuzzed queue layout, fuzzed guest memory (rings,
/// descriptors, request headers), then a fuzzed mix of kicks, register writes and memory pokes.
pub fn virtio_blk(data: &[u8]) {
    BLOCK.with(|cell| {
        let mut slot = cell.borrow_mut();
        let rig = slot.get_or_insert_with(BlockRig::new);
        let mut u = Unstructured::new(data);
        if init_device(&mut rig.t, &mut u, 1).is_err() {
            return;
        }
        let image_len = u.arbitrary_len::<u8>().unwrap_or(0).min(MEM_SIZE);
        let image = u.bytes(image_len).unwrap_or(&[]);
        load_image(&rig.mem, image);
        let dev = rig.dev.clone();
        run_ops(&mut rig.t, &rig.mem, &mut u, || lock(&dev).process_queue());
        lock(&dev).process_queue();
    });
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

type Subscriber = Arc<Mutex<dyn MutEventSubscriber + Send>>;

struct VsockRig {
    dir: tempfile::TempDir,
    mem: GuestMemoryMmap,
    dev: Arc<Mutex<Vsock>>,
    t: MmioTransport,
    /// The device's own event handler (queue kicks, host sockets, fd bookkeeping), as the VMM
    /// runs it.
    em: EventManager<Subscriber>,
    /// A host listener at `<uds>_1024`, so guest REQUESTs to port 1024 connect.
    host: std::os::unix::net::UnixListener,
}

impl VsockRig {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let uds = dir.path().join("v.sock");
        let host = std::os::unix::net::UnixListener::bind(dir.path().join("v.sock_1024")).expect("host listener");
        host.set_nonblocking(true).expect("nonblocking");
        let dev = Arc::new(Mutex::new(Vsock::new(GUEST_CID, &uds).expect("vsock device")));
        let mem = guest_mem();
        let as_dyn: Arc<Mutex<dyn VirtioDevice>> = dev.clone();
        let t = MmioTransport::new("fuzz-vsock".into(), mem.clone(), as_dyn, irq()).expect("transport");
        let mut em: EventManager<Subscriber> = EventManager::new().expect("event manager");
        em.add_subscriber(dev.clone());
        Self { dir, mem, dev, t, em, host }
    }
}

/// virtio-vsock end to end, like [`virtio_blk`]: a kick signals the TX and RX queue eventfds
/// and runs the device's event loop without blocking. Host connections the guest opens are
/// accepted, sent a few bytes, and dropped at the end of the iteration.
pub fn virtio_vsock(data: &[u8]) {
    ignore_sigpipe();
    VSOCK.with(|cell| {
        let mut slot = cell.borrow_mut();
        let rig = slot.get_or_insert_with(VsockRig::new);
        let _ = &rig.dir;
        let mut u = Unstructured::new(data);
        if init_device(&mut rig.t, &mut u, 3).is_err() {
            return;
        }
        let image_len = u.arbitrary_len::<u8>().unwrap_or(0).min(MEM_SIZE);
        let image = u.bytes(image_len).unwrap_or(&[]);
        load_image(&rig.mem, image);
        let dev = rig.dev.clone();
        let (host, em) = (&rig.host, &mut rig.em);
        let mut accepted = Vec::new();
        let mut kick = || {
            {
                let d = lock(&dev);
                let _ = d.queue_evt(vsock::device::TXQ).write(1);
                let _ = d.queue_evt(vsock::device::RXQ).write(1);
            }
            for _ in 0..4 {
                if !matches!(em.run_with_timeout(0), Ok(n) if n > 0) {
                    break;
                }
                while let Ok((mut s, _)) = host.accept() {
                    use std::io::Write;
                    let _ = s.set_nonblocking(true);
                    let _ = s.write(b"host says hi");
                    accepted.push(s);
                }
            }
        };
        run_ops(&mut rig.t, &rig.mem, &mut u, &mut kick);
        kick();
    });
}

/// The host end of the fuzzed net device: a datagram socket pair keeps frame boundaries like a
/// tap, and claims every offload so the fuzzer reaches the checksum/TSO header checks.
struct SocketTap(std::os::unix::net::UnixDatagram);

impl FrameIo for SocketTap {
    fn read_frame(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.recv(buf)
    }
    fn write_frame(&mut self, frame: &[u8]) -> std::io::Result<usize> {
        self.0.send(frame)
    }
    fn offloads(&self) -> u32 {
        libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6
    }
    fn set_offload(&mut self, _flags: u32) -> std::io::Result<()> {
        Ok(())
    }
    fn raw_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.0)
    }
}

struct NetRig {
    mem: GuestMemoryMmap,
    dev: Arc<Mutex<Net>>,
    t: MmioTransport,
    em: EventManager<Subscriber>,
    /// The "network": frames the guest sends arrive here; frames sent here reach the guest.
    host: std::os::unix::net::UnixDatagram,
}

impl NetRig {
    fn new() -> Self {
        let (dev_end, host) = std::os::unix::net::UnixDatagram::pair().expect("socket pair");
        dev_end.set_nonblocking(true).expect("nonblocking");
        host.set_nonblocking(true).expect("nonblocking");
        let cfg = NetConfig {
            tap: "fuzz".into(),
            mac: "02:00:00:00:00:02".into(),
            mtu: Some(1500),
            rate_limiter: None,
            link: LinkState::Up,
        };
        let dev = Arc::new(Mutex::new(Net::with_backend(&cfg, 0, Box::new(SocketTap(dev_end))).expect("net device")));
        let mem = guest_mem();
        let as_dyn: Arc<Mutex<dyn VirtioDevice>> = dev.clone();
        let t = MmioTransport::new("fuzz-net".into(), mem.clone(), as_dyn, irq()).expect("transport");
        let mut em: EventManager<Subscriber> = EventManager::new().expect("event manager");
        em.add_subscriber(dev.clone());
        Self { mem, dev, t, em, host }
    }
}

/// virtio-net end to end, like [`virtio_blk`]: fuzzed init (feature bits included), rings and
/// frames in guest memory; a kick signals both queue events, the host sends a fuzzed frame and
/// the device's own event handler runs without blocking. Frames the guest sent are drained.
pub fn virtio_net(data: &[u8]) {
    NET.with(|cell| {
        let mut slot = cell.borrow_mut();
        let rig = slot.get_or_insert_with(NetRig::new);
        let mut u = Unstructured::new(data);
        if init_device(&mut rig.t, &mut u, 2).is_err() {
            return;
        }
        let image_len = u.arbitrary_len::<u8>().unwrap_or(0).min(MEM_SIZE);
        let image = u.bytes(image_len).unwrap_or(&[]);
        load_image(&rig.mem, image);
        let frame_len = u.arbitrary_len::<u8>().unwrap_or(0).min(2048);
        let host_frame = u.bytes(frame_len).unwrap_or(&[]).to_vec();
        let (dev, host, em) = (rig.dev.clone(), &rig.host, &mut rig.em);
        let mut sink = vec![0u8; MAX_BUFFER_LEN];
        let mut kick = || {
            {
                let d = lock(&dev);
                let _ = d.queue_evt(net::device::TXQ).write(1);
                let _ = d.queue_evt(net::device::RXQ).write(1);
            }
            let _ = host.send(&host_frame);
            for _ in 0..4 {
                if !matches!(em.run_with_timeout(0), Ok(n) if n > 0) {
                    break;
                }
            }
            while let Ok(n) = host.recv(&mut sink) {
                assert!(n <= MAX_BUFFER_LEN, "device sent an oversized frame");
            }
        };
        run_ops(&mut rig.t, &rig.mem, &mut u, &mut kick);
        kick();
    });
}

// ---------------------------------------------------------------------------------------------
// VMM: the vsock connection state machine fed with parsed guest packets.

#[derive(arbitrary::Arbitrary, Debug)]
struct GuestPkt {
    src_cid_ok: bool,
    port_sel: u8,
    src_port: u32,
    op: u8,
    type_: u16,
    flags: u32,
    buf_alloc: u32,
    fwd_cnt: u32,
    data: Vec<u8>,
    /// RX room the guest offers after this packet (0 = none).
    rx_room: u16,
}

/// Feeds `VsockMuxer::send_from_guest` a sequence of guest packets and drains `next_rx`.
/// Checks that every packet for the guest is addressed to it and fits the offered room.
pub fn vsock_muxer(data: &[u8]) {
    ignore_sigpipe();
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(_) => return,
    };
    let uds = dir.path().join("m.sock");
    let Ok(host) = std::os::unix::net::UnixListener::bind(dir.path().join("m.sock_1024")) else { return };
    let _ = host.set_nonblocking(true);
    let Ok(mut mx) = VsockMuxer::new(GUEST_CID, &uds) else { return };
    let mut u = Unstructured::new(data);
    let mut accepted = Vec::new();
    for _ in 0..64 {
        let Ok(p) = u.arbitrary::<GuestPkt>() else { break };
        let hdr = VsockHeader {
            src_cid: if p.src_cid_ok { GUEST_CID } else { u64::from(p.op) },
            dst_cid: HOST_CID,
            src_port: p.src_port % 4,
            dst_port: if p.port_sel % 2 == 0 { 1024 } else { u32::from(p.port_sel) },
            len: p.data.len() as u32,
            type_: if p.type_ < 0xf000 { 1 } else { p.type_ },
            op: u16::from(p.op % 9),
            flags: p.flags,
            buf_alloc: p.buf_alloc,
            fwd_cnt: p.fwd_cnt,
        };
        mx.send_from_guest(TxPacket { hdr, data: p.data });
        while let Ok((s, _)) = host.accept() {
            let _ = s.set_nonblocking(true);
            accepted.push(s);
        }
        for s in &mut accepted {
            use std::io::Write;
            let _ = s.write(b"host says hi");
        }
        let _ = mx.take_fd_ops();
        mx.bury();
        let room = usize::from(p.rx_room);
        if room == 0 {
            continue;
        }
        for _ in 0..8 {
            let Some((h, payload)) = mx.next_rx(room) else { break };
            assert_eq!((h.src_cid, h.dst_cid), (HOST_CID, GUEST_CID), "RX packet misaddressed");
            assert!(payload.len() <= room, "RX payload larger than the guest's buffer");
            assert_eq!(h.len as usize, payload.len());
        }
    }
    assert!(mx.connection_count() <= 64 * 4);
}

/// This host's CPU as the snapshot decoder sees it in the `snapshot_state` target.
const FUZZ_CPU: (&str, &[u8; 32]) = ("FuzzCPU", &[7; 32]);

/// A small valid state (one vCPU, a serial port, no virtio devices), to mutate.
fn sample_state() -> VmState {
    use bulkhead_vmm::config::{BootSource, RawFormat, RawGuestConfig, ValidConfig};
    use bulkhead_vmm::device_manager::persist::DevicesState;
    let config = ValidConfig {
        boot: BootSource::Raw(RawGuestConfig { image: "/g".into(), format: RawFormat::Elf, load_addr: 0x10_0000 }),
        vcpus: 1,
        mem_bytes: 32 << 20,
        serial_log: None,
        vsock: None,
        block: vec![],
        fs: vec![],
        net: vec![],
        api_socket: None,
        balloon: None,
    };
    let vcpu = VcpuState {
        id: 0,
        cpuid: vec![kvm_bindings::kvm_cpuid_entry2 { function: 1, ..Default::default() }],
        mp_state: Default::default(),
        regs: Default::default(),
        sregs: Default::default(),
        fpu: FpuState::default(),
        xsave: vec![0; XSAVE_WORDS],
        xcrs: None,
        debugregs: Default::default(),
        lapic: None,
        msrs: vec![kvm_bindings::kvm_msr_entry { index: 0x10, ..Default::default() }],
        vcpu_events: Default::default(),
        tsc_khz: None,
    };
    VmState {
        config,
        host_cpu: "FuzzCPU".into(),
        mem_file_bytes: 32 << 20,
        vm: KvmVmState { irqchip: None, pit: None, clock: Default::default() },
        vcpus: vec![vcpu],
        devices: DevicesState { serial: Default::default(), i8042: Default::default(), virtio: vec![] },
    }
}

/// The snapshot state-file decoder, three ways by the first byte: the input as a whole file
/// (header checks), as a correctly sealed body (the postcard decoder and the state checks), or
/// as XOR noise over a valid sample body (near-valid states). A decoded state must re-encode.
pub fn snapshot_state(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    let file = match mode % 3 {
        0 => rest.to_vec(),
        1 => state_file::seal(rest, FUZZ_CPU.1),
        _ => {
            let Ok(mut body) = postcard::to_stdvec(&sample_state()) else { return };
            for (b, x) in body.iter_mut().zip(rest) {
                *b ^= x;
            }
            state_file::seal(&body, FUZZ_CPU.1)
        }
    };
    if let Ok(state) = state_file::decode(&file, FUZZ_CPU) {
        state.check().expect("decode returns only checked states");
        let again = state_file::encode(&state, FUZZ_CPU.1).expect("a decoded state encodes");
        assert!(state_file::decode(&again, FUZZ_CPU).is_ok(), "re-encoded state does not decode");
    }
}

// ---------------------------------------------------------------------------------------------
// VMM: the API socket's request handling.

/// The snapshot a prepared VMM holds in the `api_request` target: vsock, a disk, a virtio-fs
/// and a net device, so a `restore`'s run settings have something to fit.
fn api_saved_config() -> bulkhead_vmm::config::ValidConfig {
    use bulkhead_vmm::config::{BootSource, FsConfig, RawFormat, RawGuestConfig, ValidConfig, VsockConfig};
    ValidConfig {
        boot: BootSource::Raw(RawGuestConfig { image: "/g".into(), format: RawFormat::Elf, load_addr: 0x10_0000 }),
        vcpus: 1,
        mem_bytes: 32 << 20,
        serial_log: None,
        vsock: Some(VsockConfig { uds_path: "/run/v.sock".into(), guest_cid: GUEST_CID }),
        block: vec![BlockConfig { path: "/snap/disk".into(), read_only: true }],
        fs: vec![FsConfig { tag: "rootfs".into(), socket: "/run/fs.sock".into(), queue_size: 1024 }],
        net: vec![NetConfig {
            tap: "tap0".into(),
            mac: "02:00:00:00:00:01".into(),
            mtu: None,
            rate_limiter: None,
            link: LinkState::Down,
        }],
        api_socket: None,
        balloon: None,
    }
}

/// The API socket's request handling, as a client's bytes arrive (the first byte picks the read
/// size): cut into bounded lines, each answered by a running VM's controller (no vCPUs, no
/// snapshotter, so nothing blocks) and decided on by a prepared VMM, whose `restore` run settings
/// are checked against a saved config. Every line gets exactly one answer line that a client's
/// parser accepts within its limit; only `shutdown` stops the VM.
pub fn api_request(data: &[u8]) {
    use bulkhead_vmm::api::{prepared_request, PreparedRequest, RequestLines, VmController};
    use bulkhead_vmm::exit::{ExitReason, ExitSignal};
    use bulkhead_vmm::vcpu::VcpuControl;
    use bulkhead_vmm_api::api::{parse_request, parse_response, Request, MAX_RESPONSE_LINE};
    use bulkhead_vmm_api::restore::restored_config;

    let Some((&mode, rest)) = data.split_first() else { return };
    let Ok(exit) = ExitSignal::new() else { return };
    let controller = VmController {
        control: Arc::new(VcpuControl::new()),
        exit: Arc::new(exit),
        vcpus: 0,
        mem_mib: 32,
        irqchip: true,
        start_unix_ns: 1,
        snapshots: None,
        restore: None,
        boot: None,
    };
    let saved = api_saved_config();
    let mut lines = RequestLines::default();
    for piece in rest.chunks(usize::from(mode % 64) + 1) {
        lines.push(piece);
        while let Some(line) = lines.next_line() {
            let (answer, stop) = controller.answer_line(&line);
            assert!(answer.len() <= MAX_RESPONSE_LINE && answer.ends_with(b"\n"), "answer of {} bytes", answer.len());
            let response = parse_response(&answer[..answer.len() - 1]).expect("an answer the client parses");
            let shutdown = parse_request(&line) == Ok(Request::Shutdown);
            assert_eq!(stop, shutdown.then_some(ExitReason::ApiShutdown), "only `shutdown` stops the VM");
            assert!(!shutdown || response.ok);
            match prepared_request(&line, lines.pending() > 0) {
                PreparedRequest::Restore(run) => {
                    if let Ok(cfg) = restored_config(&saved, &run) {
                        assert_eq!((cfg.net.len(), cfg.fs.len(), cfg.vcpus), (1, 1, 1), "the snapshot's shape");
                        assert!(cfg.vsock.is_some_and(|v| Some(v.uds_path) == run.vsock_uds_path));
                    }
                }
                PreparedRequest::Answer(r) => assert!(!r.ok, "a prepared VMM only refuses at once"),
                PreparedRequest::Info | PreparedRequest::Shutdown => {}
            }
        }
        if lines.overlong() {
            return;
        }
    }
}
