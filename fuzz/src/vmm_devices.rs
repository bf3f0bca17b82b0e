//! Fuzz bodies for `bulkhead-vmm`'s whole devices behind the virtio-mmio transport, driven as a
//! hostile driver would, and the vsock muxer's connection state machine.

use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use arbitrary::{Result, Unstructured};
use bulkhead_vmm::config::{BlockConfig, LinkState, NetConfig};
use bulkhead_vmm::devices::bus::BusDevice;
use bulkhead_vmm::devices::virtio::block::Block;
use bulkhead_vmm::devices::virtio::mmio::MmioTransport;
use bulkhead_vmm::devices::virtio::mmio_regs as reg;
use bulkhead_vmm::devices::virtio::net::packet::MAX_BUFFER_LEN;
use bulkhead_vmm::devices::virtio::net::tap::FrameIo;
use bulkhead_vmm::devices::virtio::net::{self, Net};
use bulkhead_vmm::devices::virtio::vsock::packet::{TxPacket, VsockHeader};
use bulkhead_vmm::devices::virtio::vsock::unix::muxer::VsockMuxer;
use bulkhead_vmm::devices::virtio::vsock::{self, Vsock, HOST_CID};
use bulkhead_vmm::devices::virtio::{IrqTrigger, VirtioDevice};
use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use crate::vmm_packets::layout;
use crate::*;

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
