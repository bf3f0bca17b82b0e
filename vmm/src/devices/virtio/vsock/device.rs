//! virtio-vsock device semantics: features, config (guest CID), and moving packets between the
//! virtqueues and the muxer.

use std::path::Path;

use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::packet::{rx_capacity, write_rx, TxPacket, HDR_LEN};
use super::unix::VsockMuxer;
use super::MAX_PKT_PAYLOAD;
use crate::devices::virtio::chain;
use crate::devices::virtio::{
    read_config_bytes, validate_queues, DeviceError, DeviceLogs, DeviceState, IrqTrigger, PendingReset, VirtioDevice,
    TYPE_VSOCK, VIRTIO_F_VERSION_1, VIRTIO_MMIO_INT_VRING,
};
use crate::throttled;

pub const RXQ: usize = 0;
pub const TXQ: usize = 1;
pub const EVQ: usize = 2;
pub const QUEUE_SIZE: u16 = 256;
pub(super) const QUEUE_SIZES: [u16; 3] = [QUEUE_SIZE; 3];
/// Largest chain we look at: one maximal packet plus slack for the header.
const MAX_CHAIN_BYTES: u64 = (HDR_LEN + MAX_PKT_PAYLOAD) as u64 + 4096;
/// An event is one le32 id; larger event buffers are fine, absurd ones are refused.
const EVENT_LEN: u32 = 4;
const MAX_EVENT_CHAIN_BYTES: u64 = 4096;

/// The event the guest gets when every connection is gone (virtio spec 5.10.6.5): after a restore.
pub const VIRTIO_VSOCK_EVENT_TRANSPORT_RESET: u32 = 0;

pub struct Active {
    pub(super) mem: GuestMemoryMmap,
    pub(super) queues: Vec<Queue>,
    pub(super) irq: IrqTrigger,
    /// A TRANSPORT_RESET event waits for a buffer on the event queue.
    pub(super) reset_event_pending: bool,
}

pub struct Vsock {
    pub(super) guest_cid: u64,
    pub(super) uds_path: String,
    pub(super) acked_features: u64,
    pub(super) queue_evts: [EventFd; 3],
    pub(super) muxer: VsockMuxer,
    pub(super) state: DeviceState<Active>,
    pub(super) timer: Option<vmm_sys_util::timerfd::TimerFd>,
    pub(super) logs: DeviceLogs,
}

impl Vsock {
    pub fn new(guest_cid: u64, uds_path: &Path) -> std::io::Result<Self> {
        Ok(Self {
            guest_cid,
            uds_path: uds_path.display().to_string(),
            acked_features: 0,
            queue_evts: [
                EventFd::new(libc::EFD_NONBLOCK)?,
                EventFd::new(libc::EFD_NONBLOCK)?,
                EventFd::new(libc::EFD_NONBLOCK)?,
            ],
            muxer: VsockMuxer::new(guest_cid, uds_path)?,
            state: DeviceState::Inactive,
            timer: None,
            logs: DeviceLogs::default(),
        })
    }

    pub fn queue_evt(&self, i: usize) -> &EventFd {
        &self.queue_evts[i]
    }

    fn fail(&mut self, e: DeviceError) {
        throttled!(self.logs.faults, error, device = "vsock", error = %e,
            "guest sent a malformed packet; device stops serving until reset");
        self.muxer.reset();
        self.state = DeviceState::Broken(e);
    }

    /// Guest -> host packets.
    pub fn process_tx(&mut self) {
        self.process(drain_tx);
    }

    /// Host -> guest packets, as long as the guest has RX buffers.
    pub fn process_rx(&mut self) {
        self.process(fill_rx);
    }

    /// Delivers a pending transport event once the guest has an event buffer posted.
    pub fn process_events(&mut self) {
        self.process(post_event);
    }

    /// Runs one queue's work if the device is live: interrupts the guest when a buffer was
    /// used, stops serving on a malformed chain.
    fn process(&mut self, work: fn(&mut Active, &mut VsockMuxer) -> Result<bool, DeviceError>) {
        let DeviceState::Active(a) = &mut self.state else { return };
        match work(a, &mut self.muxer) {
            Ok(true) => a.irq.trigger(VIRTIO_MMIO_INT_VRING),
            Ok(false) => {}
            Err(e) => self.fail(e),
        }
    }
}

fn drain_tx(a: &mut Active, muxer: &mut VsockMuxer) -> Result<bool, DeviceError> {
    let mem = a.mem.clone();
    let q = &mut a.queues[TXQ];
    let mut used = false;
    for _ in 0..=q.size() {
        let chain = match chain::pop(q, &mem)? {
            Some(c) => c,
            None => break,
        };
        let head = chain.head_index();
        let descs = chain::collect(chain, &mem, MAX_CHAIN_BYTES)?;
        let pkt = TxPacket::parse(&descs, &mem).map_err(DeviceError::request)?;
        q.add_used(&mem, head, 0).map_err(DeviceError::memory)?;
        used = true;
        muxer.send_from_guest(pkt);
    }
    Ok(used)
}

fn post_event(a: &mut Active, _: &mut VsockMuxer) -> Result<bool, DeviceError> {
    let q = &mut a.queues[EVQ];
    // The event queue is optional for drivers that never expect events.
    if !a.reset_event_pending || !q.ready() {
        return Ok(false);
    }
    let mem = a.mem.clone();
    let chain = match chain::pop(q, &mem)? {
        Some(c) => c,
        None => return Ok(false), // no buffer yet: wait for the guest's notify
    };
    let head = chain.head_index();
    let descs = chain::collect(chain, &mem, MAX_EVENT_CHAIN_BYTES)?;
    if descs.iter().any(|d| !d.writable) || chain::total_len(&descs) < EVENT_LEN as u64 {
        return Err(DeviceError::Request("event buffer is not a writable 4-byte buffer".into()));
    }
    chain::scatter(&VIRTIO_VSOCK_EVENT_TRANSPORT_RESET.to_le_bytes(), &descs, &mem).map_err(DeviceError::memory)?;
    q.add_used(&mem, head, EVENT_LEN).map_err(DeviceError::memory)?;
    a.reset_event_pending = false;
    tracing::info!(device = "vsock", "guest told that the transport was reset");
    Ok(true)
}

fn fill_rx(a: &mut Active, muxer: &mut VsockMuxer) -> Result<bool, DeviceError> {
    let mem = a.mem.clone();
    let q = &mut a.queues[RXQ];
    let mut used = false;
    for _ in 0..=q.size() {
        if !muxer.has_rx() {
            break;
        }
        let chain = match chain::pop(q, &mem)? {
            Some(c) => c,
            None => break, // no buffers: wait for the guest's RX notify
        };
        let head = chain.head_index();
        let descs = chain::collect(chain, &mem, MAX_CHAIN_BYTES)?;
        let room = rx_capacity(&descs).map_err(DeviceError::request)?;
        match muxer.next_rx(room) {
            Some((hdr, data)) => {
                let n = write_rx(&descs, &mem, &hdr, &data).map_err(DeviceError::request)?;
                q.add_used(&mem, head, n).map_err(DeviceError::memory)?;
                used = true;
            }
            None => {
                // Nothing after all: give the buffer back.
                q.go_to_previous_position();
                break;
            }
        }
    }
    Ok(used)
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        TYPE_VSOCK
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1
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
        // Config space: guest_cid (le64).
        read_config_bytes(&self.guest_cid.to_le_bytes(), offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        throttled!(self.logs.config_writes, warn, device = "vsock", offset, "write to read-only vsock config ignored");
    }

    fn activate(&mut self, mem: GuestMemoryMmap, queues: Vec<Queue>, irq: IrqTrigger) -> Result<(), DeviceError> {
        // The event queue is optional for us (we send one event only, after a restore).
        validate_queues(&mem, &queues[..EVQ.min(queues.len())])?;
        if queues.len() != QUEUE_SIZES.len() {
            return Err(DeviceError::QueueNotReady(queues.len()));
        }
        self.state = DeviceState::Active(Active { mem, queues, irq, reset_event_pending: false });
        tracing::debug!(device = "vsock", "activated");
        Ok(())
    }

    fn reset(&mut self) -> Option<PendingReset> {
        // Host connections waiting for a guest that has not started its driver yet survive the
        // driver's initial reset; after the device was live, every connection is gone.
        if !matches!(self.state, DeviceState::Inactive) {
            self.muxer.reset();
        }
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
    use super::super::packet::{VsockHeader, OP_REQUEST, OP_RESPONSE, OP_RW, TYPE_STREAM};
    use super::*;
    use crate::devices::virtio::chain::test_utils::{TestQueue, F_WRITE};
    use std::io::{Read, Write};
    use std::os::unix::net::{UnixListener, UnixStream};
    use vm_memory::{Bytes, GuestAddress};

    struct Rig {
        dev: Vsock,
        mem: GuestMemoryMmap,
        rx: TestQueue,
        tx: TestQueue,
        dir: tempfile::TempDir,
    }

    fn rig() -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let mut dev = Vsock::new(3, &dir.path().join("v.sock")).unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let rx = TestQueue::new(0x1000, 8);
        let tx = TestQueue::new(0x2000, 8);
        let ev = TestQueue::new(0x3000, 8);
        let qs = [&rx, &tx, &ev]
            .iter()
            .map(|t| {
                let mut q = t.queue();
                q.set_size(8);
                q
            })
            .collect();
        dev.activate(mem.clone(), qs, IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap())).unwrap();
        Rig { dev, mem, rx, tx, dir }
    }

    fn send(r: &mut Rig, slot: u16, hdr: VsockHeader, data: &[u8], claimed_extra: u32) {
        let addr = 0x10000 + u64::from(slot) * 0x1000;
        let mut bytes = hdr.to_bytes().to_vec();
        bytes.extend_from_slice(data);
        r.mem.write_slice(&bytes, GuestAddress(addr)).unwrap();
        r.tx.set_desc(&r.mem, slot, addr, bytes.len() as u32 - claimed_extra, 0, 0);
        r.tx.publish(&r.mem, slot);
        r.dev.process_tx();
    }

    fn post_rx(r: &mut Rig, slot: u16) {
        r.rx.set_desc(&r.mem, slot, 0x40000 + u64::from(slot) * 0x1000, 4096, F_WRITE, 0);
        r.rx.publish(&r.mem, slot);
    }

    fn hdr(op: u16, src_port: u32, dst_port: u32, len: u32) -> VsockHeader {
        VsockHeader {
            src_cid: 3,
            dst_cid: 2,
            src_port,
            dst_port,
            len,
            type_: TYPE_STREAM,
            op,
            buf_alloc: 4096,
            ..Default::default()
        }
    }

    fn rx_header(r: &Rig, slot: u16) -> VsockHeader {
        let mut b = [0u8; 44];
        r.mem.read_slice(&mut b, GuestAddress(0x40000 + u64::from(slot) * 0x1000)).unwrap();
        VsockHeader::from_bytes(&b)
    }

    #[test]
    fn config_reports_cid() {
        let r = rig();
        let mut b = [0u8; 8];
        r.dev.read_config(0, &mut b);
        assert_eq!(u64::from_le_bytes(b), 3);
    }

    #[test]
    fn guest_connects_and_sends_data_through_queues() {
        let mut r = rig();
        let l = UnixListener::bind(r.dir.path().join("v.sock_700")).unwrap();
        post_rx(&mut r, 0);
        send(&mut r, 0, hdr(OP_REQUEST, 9, 700, 0), b"", 0);
        r.dev.process_rx();
        assert_eq!(r.rx.used_idx(&r.mem), 1);
        assert_eq!(rx_header(&r, 0).op, OP_RESPONSE);
        send(&mut r, 1, hdr(OP_RW, 9, 700, 3), b"abc", 0);
        let (mut s, _) = l.accept().unwrap();
        let mut got = [0u8; 3];
        s.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"abc");
        s.write_all(b"xyz").unwrap();
        post_rx(&mut r, 1);
        std::thread::sleep(std::time::Duration::from_millis(20));
        r.dev.process_rx();
        assert_eq!(r.rx.used_idx(&r.mem), 2);
        let h = rx_header(&r, 1);
        assert_eq!((h.op, h.len), (OP_RW, 3));
        assert!(!r.dev.is_broken());
    }

    #[test]
    fn driver_reset_before_activation_keeps_waiting_host_connections() {
        let dir = tempfile::tempdir().unwrap();
        let mut dev = Vsock::new(3, &dir.path().join("v.sock")).unwrap();
        let mut host = UnixStream::connect(dir.path().join("v.sock")).unwrap();
        host.write_all(b"CONNECT 1024\n").unwrap();
        dev.muxer.accept();
        dev.reset();
        assert!(dev.muxer.has_rx(), "the REQUEST still waits for the guest");
        let mut r = rig();
        let _h = UnixStream::connect(r.dir.path().join("v.sock")).map(|mut s| s.write_all(b"CONNECT 5\n"));
        r.dev.muxer.accept();
        r.dev.reset();
        assert!(!r.dev.muxer.has_rx(), "a reset of a live device drops everything");
    }

    #[test]
    fn lying_length_breaks_the_device() {
        let mut r = rig();
        send(&mut r, 0, hdr(OP_RW, 9, 700, 60000), b"12345678", 0);
        assert!(r.dev.is_broken());
        r.dev.reset();
        assert!(!r.dev.is_broken());
    }

    #[test]
    fn short_rx_buffer_breaks_the_device() {
        let mut r = rig();
        let _c = UnixStream::connect(r.dir.path().join("v.sock")).map(|mut s| s.write_all(b"CONNECT 5\n"));
        r.dev.muxer.accept();
        r.rx.set_desc(&r.mem, 0, 0x40000, 16, F_WRITE, 0);
        r.rx.publish(&r.mem, 0);
        r.dev.process_rx();
        assert!(r.dev.is_broken());
        assert!(crate::persist::Persist::save(&r.dev).broken);
    }
}
