//! virtio-net device semantics: features (checksum and TSO offloads only where the tap takes
//! them), the config space (MAC, link status, MTU), and moving frames between the RX/TX queues
//! and the tap, with backpressure (at most one host frame waits for a guest buffer) and rate
//! limiting.

use std::io;

use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_TSO6,
    VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6, VIRTIO_NET_F_MAC, VIRTIO_NET_F_MTU, VIRTIO_NET_F_STATUS,
    VIRTIO_NET_S_LINK_UP,
};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::packet::{read_tx, rx_capacity, write_rx, TxOffloads, ETH_HLEN, MAX_BUFFER_LEN, VNET_HDR_LEN};
use super::rate_limiter::RateLimiter;
use super::tap::{FrameIo, Tap, TapError};
use crate::config::{parse_mac, LinkState, NetConfig};
use crate::devices::virtio::chain;
use crate::devices::virtio::{
    read_config_bytes, validate_queues, DeviceError, DeviceState, IrqTrigger, PendingReset, VirtioDevice, TYPE_NET,
    VIRTIO_F_VERSION_1, VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_INT_VRING,
};
use crate::log_throttle::LogThrottle;

pub const RXQ: usize = 0;
pub const TXQ: usize = 1;
pub const QUEUE_SIZE: u16 = 256;
const QUEUE_SIZES: [u16; 2] = [QUEUE_SIZE; 2];
/// Frames moved (or dropped) per event before the device yields to the rest of the event
/// loop; it kicks its own queue event to come back for the rest.
pub const MAX_FRAMES_PER_PASS: usize = 64;
/// Longest RX chain accepted. Only a frame's worth is ever written, but a driver without
/// mergeable buffers posts one page per fragment for GSO frames (up to ~190 KiB); anything far
/// beyond that is not a buffer but an attack.
pub const MAX_RX_CHAIN_LEN: u64 = 1 << 20;
/// mac[6], status (u16), max_virtqueue_pairs (u16), mtu (u16).
pub const CONFIG_SPACE_LEN: usize = 12;

const fn bit(b: u32) -> u64 {
    1 << b
}

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error(transparent)]
    Tap(#[from] TapError),
    #[error("mac {0:?} is not a unicast aa:bb:cc:dd:ee:ff address")]
    Mac(String),
    #[error("rate limiter timer: {0}")]
    Timer(io::Error),
    #[error("eventfd: {0}")]
    EventFd(io::Error),
}

/// Features for a tap accepting `tun_offloads` (TUN_F_*): offloads only where it takes them.
/// Link status always: a template's link is down until a restore raises it.
pub fn features_for(tun_offloads: u32, mtu: bool) -> u64 {
    let mut f = VIRTIO_F_VERSION_1 | bit(VIRTIO_NET_F_MAC) | bit(VIRTIO_NET_F_STATUS);
    if mtu {
        f |= bit(VIRTIO_NET_F_MTU);
    }
    if tun_offloads & libc::TUN_F_CSUM != 0 {
        f |= bit(VIRTIO_NET_F_CSUM) | bit(VIRTIO_NET_F_GUEST_CSUM);
        if tun_offloads & libc::TUN_F_TSO4 != 0 {
            f |= bit(VIRTIO_NET_F_GUEST_TSO4) | bit(VIRTIO_NET_F_HOST_TSO4);
        }
        if tun_offloads & libc::TUN_F_TSO6 != 0 {
            f |= bit(VIRTIO_NET_F_GUEST_TSO6) | bit(VIRTIO_NET_F_HOST_TSO6);
        }
    }
    f
}

/// What guest TX headers may ask for, given the acked features. TSO without CSUM is ignored
/// (the spec makes it depend on CSUM).
pub fn tx_offloads(acked: u64) -> TxOffloads {
    let csum = acked & bit(VIRTIO_NET_F_CSUM) != 0;
    TxOffloads {
        csum,
        tso4: csum && acked & bit(VIRTIO_NET_F_HOST_TSO4) != 0,
        tso6: csum && acked & bit(VIRTIO_NET_F_HOST_TSO6) != 0,
    }
}

/// TUN_F_* offloads the tap may use for guest-bound frames, given the acked features.
pub fn guest_tun_offloads(acked: u64) -> u32 {
    if acked & bit(VIRTIO_NET_F_GUEST_CSUM) == 0 {
        return 0;
    }
    let mut f = libc::TUN_F_CSUM;
    if acked & bit(VIRTIO_NET_F_GUEST_TSO4) != 0 {
        f |= libc::TUN_F_TSO4;
    }
    if acked & bit(VIRTIO_NET_F_GUEST_TSO6) != 0 {
        f |= libc::TUN_F_TSO6;
    }
    f
}

pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

pub struct Active {
    mem: GuestMemoryMmap,
    pub(super) rx: Queue,
    pub(super) tx: Queue,
    irq: IrqTrigger,
}

/// What one pass over a queue did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Pass {
    /// Buffers went back to the guest: interrupt it.
    used: bool,
    /// Stopped at [`MAX_FRAMES_PER_PASS`]: come back for the rest.
    more: bool,
}

pub struct Net {
    name: String,
    pub(super) tap_name: String,
    backend: Box<dyn FrameIo>,
    pub(super) mac: [u8; 6],
    pub(super) mtu: Option<u16>,
    pub(super) link: LinkState,
    /// A restore changed the link the driver last saw: it is told once the VM's interrupt state
    /// is back ([`Net::tell_link_change`]).
    link_change_untold: bool,
    avail_features: u64,
    pub(super) acked_features: u64,
    queue_evts: [EventFd; 2],
    pub(super) rx_limiter: RateLimiter,
    pub(super) tx_limiter: RateLimiter,
    /// Length of a frame in `rx_buf` read from the tap that no guest buffer has taken yet.
    rx_pending: Option<usize>,
    rx_buf: Vec<u8>,
    tx_buf: Vec<u8>,
    pub(super) state: DeviceState<Active>,
    faults: LogThrottle,
    drops: LogThrottle,
    config_writes: LogThrottle,
}

impl Net {
    /// The `index`-th net device, attached to the existing tap `cfg.tap`.
    pub fn new(cfg: &NetConfig, index: usize) -> Result<Self, NetError> {
        let tap = Tap::open(&cfg.tap)?;
        Self::with_backend(cfg, index, Box::new(tap))
    }

    /// Like [`Net::new`] on a host end the caller opened (`cfg.tap` only names it in logs).
    pub fn with_backend(cfg: &NetConfig, index: usize, backend: Box<dyn FrameIo>) -> Result<Self, NetError> {
        let mac = parse_mac(&cfg.mac).filter(|m| m[0] & 1 == 0).ok_or_else(|| NetError::Mac(cfg.mac.clone()))?;
        let limits = cfg.rate_limiter.as_ref();
        Ok(Self {
            name: format!("net{index}"),
            tap_name: cfg.tap.clone(),
            avail_features: features_for(backend.offloads(), cfg.mtu.is_some()),
            backend,
            mac,
            mtu: cfg.mtu,
            link: cfg.link,
            link_change_untold: false,
            acked_features: 0,
            queue_evts: [
                EventFd::new(libc::EFD_NONBLOCK).map_err(NetError::EventFd)?,
                EventFd::new(libc::EFD_NONBLOCK).map_err(NetError::EventFd)?,
            ],
            rx_limiter: RateLimiter::new(limits.and_then(|l| l.rx.as_ref())).map_err(NetError::Timer)?,
            tx_limiter: RateLimiter::new(limits.and_then(|l| l.tx.as_ref())).map_err(NetError::Timer)?,
            rx_pending: None,
            rx_buf: vec![0u8; MAX_BUFFER_LEN],
            tx_buf: Vec::with_capacity(MAX_BUFFER_LEN),
            state: DeviceState::Inactive,
            faults: LogThrottle::default(),
            drops: LogThrottle::default(),
            config_writes: LogThrottle::default(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn queue_evt(&self, i: usize) -> &EventFd {
        &self.queue_evts[i]
    }

    pub(super) fn backend_fd(&self) -> std::os::fd::RawFd {
        self.backend.raw_fd()
    }

    /// Whether a host frame is waiting for a guest RX buffer (backpressure).
    pub fn rx_pending(&self) -> bool {
        self.rx_pending.is_some()
    }

    /// Guest -> tap frames, until the queue is empty or the TX limiter says stop.
    pub fn process_tx(&mut self) {
        let Self { state, backend, tx_limiter, tx_buf, drops, name, acked_features, .. } = self;
        let DeviceState::Active(a) = state else { return };
        let res = drain_tx(a, backend.as_mut(), tx_limiter, tx_buf, tx_offloads(*acked_features), &mut |why, e| {
            note_drop(name, drops, why, e)
        });
        self.finish(TXQ, res);
    }

    /// Tap -> guest frames, while the guest has RX buffers and the RX limiter allows.
    pub fn process_rx(&mut self) {
        let Self { state, backend, rx_limiter, rx_buf, rx_pending, drops, name, .. } = self;
        let DeviceState::Active(a) = state else { return };
        let res =
            fill_rx(a, backend.as_mut(), rx_limiter, rx_buf, rx_pending, &mut |why, e| note_drop(name, drops, why, e));
        self.finish(RXQ, res);
    }

    fn finish(&mut self, queue: usize, res: Result<Pass, DeviceError>) {
        let DeviceState::Active(a) = &self.state else { return };
        match res {
            Ok(pass) => {
                if pass.used {
                    a.irq.trigger(VIRTIO_MMIO_INT_VRING);
                }
                if pass.more {
                    if let Err(e) = self.queue_evts[queue].write(1) {
                        tracing::warn!(device = %self.name, error = %e, "cannot reschedule queue work");
                    }
                }
            }
            Err(e) => self.fail(e),
        }
    }

    /// After a restore: the driver saw `saved` (the snapshot's link), and the device now reports
    /// its own. A driver that negotiated link status on a live device is told at
    /// [`Net::tell_link_change`]; one that has not set the device up reads the status when it does.
    pub(super) fn restored_link(&mut self, saved: LinkState) {
        let told_of_status = self.acked_features & bit(VIRTIO_NET_F_STATUS) != 0;
        self.link_change_untold = saved != self.link && told_of_status && matches!(self.state, DeviceState::Active(_));
    }

    /// Raises the config interrupt of a link change a restore made, once; call after the VM's
    /// irqchip state is back (a restored irqchip would drop an interrupt raised before it).
    /// The config generation stays: one two-byte field cannot be read torn.
    pub fn tell_link_change(&mut self) {
        if !std::mem::take(&mut self.link_change_untold) {
            return;
        }
        if let DeviceState::Active(a) = &self.state {
            a.irq.trigger(VIRTIO_MMIO_INT_CONFIG);
            tracing::info!(device = %self.name, tap = %self.tap_name, link = ?self.link,
                "link changed by the restore; the guest is told");
        }
    }

    /// Restores the "stopped until reset" state of a snapshot.
    pub(super) fn mark_broken(&mut self) {
        self.rx_pending = None;
        self.state =
            DeviceState::Broken(DeviceError::Request("the device was stopped when the snapshot was taken".into()));
    }

    fn fail(&mut self, e: DeviceError) {
        crate::throttled!(self.faults, error, device = %self.name, tap = %self.tap_name, error = %e,
            "guest sent a malformed chain; device stops serving until the driver resets it");
        self.rx_pending = None;
        self.state = DeviceState::Broken(e);
    }
}

fn note_drop(name: &str, drops: &mut LogThrottle, why: &'static str, error: Option<&io::Error>) {
    let error = error.map(|e| e.to_string());
    crate::throttled!(*drops, warn, device = %name, why, error, "frame dropped");
}

type DropFn<'a> = dyn FnMut(&'static str, Option<&io::Error>) + 'a;

fn drain_tx(
    a: &mut Active,
    io: &mut dyn FrameIo,
    limiter: &mut RateLimiter,
    buf: &mut Vec<u8>,
    offloads: TxOffloads,
    drop: &mut DropFn<'_>,
) -> Result<Pass, DeviceError> {
    let mem = a.mem.clone();
    let mut pass = Pass::default();
    for _ in 0..MAX_FRAMES_PER_PASS {
        if limiter.is_blocked() {
            return Ok(pass);
        }
        let Some(chain) = chain::pop(&mut a.tx, &mem)? else { return Ok(pass) };
        let head = chain.head_index();
        let descs = chain::collect(chain, &mem, MAX_BUFFER_LEN as u64)?;
        read_tx(&descs, &mem, offloads, buf).map_err(DeviceError::request)?;
        if !limiter.consume((buf.len() - VNET_HDR_LEN) as u64) {
            a.tx.go_to_previous_position();
            return Ok(pass);
        }
        if let Err(e) = io.write_frame(buf) {
            drop("tap refused a guest frame", Some(&e));
        }
        a.tx.add_used(&mem, head, 0).map_err(DeviceError::memory)?;
        pass.used = true;
    }
    pass.more = true;
    Ok(pass)
}

fn fill_rx(
    a: &mut Active,
    io: &mut dyn FrameIo,
    limiter: &mut RateLimiter,
    buf: &mut [u8],
    pending: &mut Option<usize>,
    drop: &mut DropFn<'_>,
) -> Result<Pass, DeviceError> {
    let mem = a.mem.clone();
    let mut pass = Pass::default();
    for _ in 0..MAX_FRAMES_PER_PASS {
        if limiter.is_blocked() {
            return Ok(pass);
        }
        let len = match pending.take() {
            Some(len) => len,
            None => match io.read_frame(buf) {
                Ok(n) if n >= VNET_HDR_LEN + ETH_HLEN => {
                    // The tap fills only the first 10 header bytes; without mergeable buffers
                    // every frame is in one buffer.
                    buf[VNET_HDR_LEN - 2..VNET_HDR_LEN].copy_from_slice(&1u16.to_le_bytes());
                    n
                }
                Ok(_) => {
                    drop("runt frame from the tap", None);
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(pass),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    drop("tap read failed", Some(&e));
                    return Ok(pass);
                }
            },
        };
        let Some(chain) = chain::pop(&mut a.rx, &mem)? else {
            // Backpressure: keep the frame, leave the rest in the tap until the guest posts
            // buffers (its RX notify brings us back).
            *pending = Some(len);
            return Ok(pass);
        };
        let head = chain.head_index();
        let descs = chain::collect(chain, &mem, MAX_RX_CHAIN_LEN)?;
        if rx_capacity(&descs).map_err(DeviceError::request)? < len {
            drop("guest RX buffer smaller than the frame", None);
            a.rx.go_to_previous_position();
            continue;
        }
        if !limiter.consume((len - VNET_HDR_LEN) as u64) {
            a.rx.go_to_previous_position();
            *pending = Some(len);
            return Ok(pass);
        }
        let written = write_rx(&descs, &mem, &buf[..len]).map_err(DeviceError::request)?;
        a.rx.add_used(&mem, head, written).map_err(DeviceError::memory)?;
        pass.used = true;
    }
    pass.more = true;
    Ok(pass)
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        TYPE_NET
    }

    fn avail_features(&self) -> u64 {
        self.avail_features
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked_features = features & self.avail_features;
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn queue_events(&self) -> &[EventFd] {
        &self.queue_evts
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let mut cfg = [0u8; CONFIG_SPACE_LEN];
        cfg[..6].copy_from_slice(&self.mac);
        let status = match self.link {
            LinkState::Up => VIRTIO_NET_S_LINK_UP as u16,
            LinkState::Down => 0,
        };
        cfg[6..8].copy_from_slice(&status.to_le_bytes());
        cfg[10..12].copy_from_slice(&self.mtu.unwrap_or(0).to_le_bytes());
        read_config_bytes(&cfg, offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        crate::throttled!(self.config_writes, warn, device = %self.name, offset, "write to read-only net config ignored");
    }

    fn activate(&mut self, mem: GuestMemoryMmap, queues: Vec<Queue>, irq: IrqTrigger) -> Result<(), DeviceError> {
        validate_queues(&mem, &queues)?;
        let [rx, tx]: [Queue; 2] = queues.try_into().map_err(|q: Vec<Queue>| DeviceError::QueueNotReady(q.len()))?;
        let offloads = guest_tun_offloads(self.acked_features);
        if let Err(e) = self.backend.set_offload(offloads) {
            // The tap keeps no offloads, so the guest still gets only frames it can take.
            tracing::warn!(device = %self.name, tap = %self.tap_name, offloads, error = %e,
                "tap refused the negotiated offloads; guest frames arrive fully checksummed");
        }
        self.state = DeviceState::Active(Active { mem, rx, tx, irq });
        tracing::debug!(device = %self.name, tap = %self.tap_name, features = self.acked_features, "activated");
        Ok(())
    }

    fn reset(&mut self) -> Option<PendingReset> {
        if !matches!(self.state, DeviceState::Inactive) {
            if let Err(e) = self.backend.set_offload(0) {
                tracing::warn!(device = %self.name, tap = %self.tap_name, error = %e, "cannot clear tap offloads");
            }
        }
        self.state = DeviceState::Inactive;
        self.acked_features = 0;
        self.rx_pending = None;
        None
    }

    fn is_broken(&self) -> bool {
        self.state.is_broken()
    }
}

#[cfg(test)]
pub(crate) mod test_utils {
    //! A host end over a datagram socket pair (frame boundaries kept, like a tap) and a rig
    //! that activates a net device on in-memory guest memory.
    use std::os::fd::{AsRawFd, RawFd};
    use std::os::unix::net::UnixDatagram;
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::devices::virtio::chain::test_utils::TestQueue;
    use vm_memory::GuestAddress;

    pub struct SocketEnd {
        pub sock: UnixDatagram,
        pub offloads: u32,
        /// Every `set_offload` call, shared with the test.
        pub set: Arc<Mutex<Vec<u32>>>,
    }

    impl FrameIo for SocketEnd {
        fn read_frame(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.sock.recv(buf)
        }
        fn write_frame(&mut self, frame: &[u8]) -> io::Result<usize> {
            self.sock.send(frame)
        }
        fn offloads(&self) -> u32 {
            self.offloads
        }
        fn set_offload(&mut self, flags: u32) -> io::Result<()> {
            self.set.lock().unwrap().push(flags);
            Ok(())
        }
        fn raw_fd(&self) -> RawFd {
            self.sock.as_raw_fd()
        }
    }

    pub struct Rig {
        pub dev: Net,
        pub mem: GuestMemoryMmap,
        pub rx: TestQueue,
        pub tx: TestQueue,
        pub irq: IrqTrigger,
        /// The "host network": what the guest sends arrives here; what is sent here reaches the guest.
        pub host: UnixDatagram,
        pub offloads_set: Arc<Mutex<Vec<u32>>>,
    }

    pub fn net_config() -> NetConfig {
        NetConfig {
            tap: "tap-test".into(),
            mac: "02:00:00:00:00:02".into(),
            mtu: Some(1400),
            rate_limiter: None,
            link: LinkState::Up,
        }
    }

    pub fn device(cfg: &NetConfig, offloads: u32) -> (Net, UnixDatagram, Arc<Mutex<Vec<u32>>>) {
        let (dev_end, host) = UnixDatagram::pair().unwrap();
        dev_end.set_nonblocking(true).unwrap();
        host.set_nonblocking(true).unwrap();
        let set = Arc::new(Mutex::new(Vec::new()));
        let end = SocketEnd { sock: dev_end, offloads, set: set.clone() };
        (Net::with_backend(cfg, 0, Box::new(end)).unwrap(), host, set)
    }

    /// A live device with `acked` features and `size`-entry queues at 0x1000 (RX) and 0x2000 (TX).
    pub fn rig_sized(cfg: &NetConfig, offloads: u32, acked: u64, size: u16) -> Rig {
        let (mut dev, host, offloads_set) = device(cfg, offloads);
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let rx = TestQueue::new(0x1000, size);
        let tx = TestQueue::new(0x2000, size);
        // As the transport hands them over: the device's maximum, the driver's size.
        let qs = [&rx, &tx].iter().map(|t| t.device_queue(QUEUE_SIZE)).collect();
        let irq = IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        dev.set_acked_features(acked);
        dev.activate(mem.clone(), qs, irq.clone()).unwrap();
        Rig { dev, mem, rx, tx, irq, host, offloads_set }
    }

    pub fn rig_with(cfg: &NetConfig, offloads: u32, acked: u64) -> Rig {
        rig_sized(cfg, offloads, acked, 8)
    }

    pub fn rig() -> Rig {
        rig_with(&net_config(), 0, VIRTIO_F_VERSION_1 | bit(VIRTIO_NET_F_MAC))
    }
}

#[cfg(test)]
mod tests {
    use super::test_utils::*;
    use super::*;
    use crate::config::{NetRateLimiterConfig, RateLimiterConfig, TokenBucketConfig};
    use crate::devices::virtio::chain::test_utils::{F_NEXT, F_WRITE};
    use crate::devices::virtio::net::packet::{VnetHeader, HDR_F_NEEDS_CSUM};
    use vm_memory::{Bytes, GuestAddress};

    const BASIC: u64 = VIRTIO_F_VERSION_1 | bit(VIRTIO_NET_F_MAC) | bit(VIRTIO_NET_F_STATUS);
    const ALL_TUN: u32 = libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6;

    /// An Ethernet frame of `len` bytes (header included), vnet header first.
    fn frame(hdr: VnetHeader, len: usize) -> Vec<u8> {
        let mut v = hdr.to_bytes().to_vec();
        v.extend((0..len).map(|i| (i * 7) as u8));
        v
    }

    fn send(r: &mut Rig, slot: u16, bytes: &[u8]) {
        let addr = 0x10000 + u64::from(slot) * 0x1000;
        r.mem.write_slice(bytes, GuestAddress(addr)).unwrap();
        r.tx.set_desc(&r.mem, slot, addr, bytes.len() as u32, 0, 0);
        r.tx.publish(&r.mem, slot);
        r.dev.process_tx();
    }

    fn post_rx(r: &mut Rig, slot: u16, len: u32) {
        r.rx.set_desc(&r.mem, slot, 0x40000 + u64::from(slot) * 0x1000, len, F_WRITE, 0);
        r.rx.publish(&r.mem, slot);
    }

    fn rx_bytes(r: &Rig, slot: u16, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        r.mem.read_slice(&mut b, GuestAddress(0x40000 + u64::from(slot) * 0x1000)).unwrap();
        b
    }

    fn host_recv(r: &Rig) -> Option<Vec<u8>> {
        let mut b = vec![0u8; MAX_BUFFER_LEN];
        r.host.recv(&mut b).ok().map(|n| b[..n].to_vec())
    }

    #[test]
    fn features_follow_the_tap_and_the_config() {
        let plain = features_for(0, false);
        assert_eq!(plain, BASIC);
        let csum_only = features_for(libc::TUN_F_CSUM, true);
        assert_eq!(csum_only, BASIC | bit(VIRTIO_NET_F_MTU) | bit(VIRTIO_NET_F_CSUM) | bit(VIRTIO_NET_F_GUEST_CSUM));
        let all = features_for(ALL_TUN, false);
        for f in [VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_TSO6, VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6] {
            assert_ne!(all & bit(f), 0, "feature {f}");
        }
        // A tap that would take TSO but not checksums gets neither offered.
        assert_eq!(features_for(libc::TUN_F_TSO4, false), BASIC);
    }

    #[test]
    fn negotiated_offloads_reach_the_tap_and_tx_checks() {
        let acked = BASIC | bit(VIRTIO_NET_F_GUEST_CSUM) | bit(VIRTIO_NET_F_GUEST_TSO4) | bit(VIRTIO_NET_F_HOST_TSO6);
        assert_eq!(guest_tun_offloads(acked), libc::TUN_F_CSUM | libc::TUN_F_TSO4);
        assert_eq!(guest_tun_offloads(acked & !bit(VIRTIO_NET_F_GUEST_CSUM)), 0, "TSO depends on CSUM");
        assert_eq!(tx_offloads(acked), TxOffloads::default(), "HOST_TSO6 without CSUM means nothing");
        let with_csum = acked | bit(VIRTIO_NET_F_CSUM);
        assert_eq!(tx_offloads(with_csum), TxOffloads { csum: true, tso4: false, tso6: true });

        let r = rig_with(&net_config(), ALL_TUN, acked);
        let mut dev = r.dev;
        assert_eq!(*r.offloads_set.lock().unwrap(), vec![libc::TUN_F_CSUM | libc::TUN_F_TSO4]);
        dev.reset();
        assert_eq!(*r.offloads_set.lock().unwrap(), vec![libc::TUN_F_CSUM | libc::TUN_F_TSO4, 0]);
    }

    #[test]
    fn unoffered_features_are_not_acked() {
        let (mut dev, _host, _) = device(&net_config(), 0);
        dev.set_acked_features(u64::MAX);
        assert_eq!(dev.acked_features, dev.avail_features());
    }

    #[test]
    fn config_space_holds_mac_link_and_mtu() {
        let (dev, _host, _) = device(&net_config(), 0);
        let mut cfg = [0xffu8; 12];
        dev.read_config(0, &mut cfg);
        assert_eq!(cfg[..6], [2, 0, 0, 0, 0, 2]);
        assert_eq!(cfg[6..10], [1, 0, 0, 0], "link up, one queue pair");
        assert_eq!(u16::from_le_bytes([cfg[10], cfg[11]]), 1400);
        let mut mtu = [0u8; 2];
        dev.read_config(10, &mut mtu);
        assert_eq!(u16::from_le_bytes(mtu), 1400);
        let mut past = [0xffu8; 4];
        dev.read_config(u64::MAX - 1, &mut past);
        assert_eq!(past, [0; 4]);
        assert_ne!(dev.avail_features() & bit(VIRTIO_NET_F_MTU), 0);

        let (no_mtu, _h, _) = device(&NetConfig { mtu: None, ..net_config() }, 0);
        assert_eq!(no_mtu.avail_features() & bit(VIRTIO_NET_F_MTU), 0);
        let (down, _h, _) = device(&NetConfig { link: LinkState::Down, ..net_config() }, 0);
        let mut status = [0xffu8; 2];
        down.read_config(6, &mut status);
        assert_eq!(status, [0, 0], "a template's link is down");
        let (_, spare, _) = device(&net_config(), 0);
        let end = SocketEnd { sock: spare, offloads: 0, set: Default::default() };
        let multicast = NetConfig { mac: "01:00:00:00:00:01".into(), ..net_config() };
        assert!(matches!(Net::with_backend(&multicast, 0, Box::new(end)), Err(NetError::Mac(_))));
    }

    #[test]
    fn config_writes_are_ignored() {
        let (mut dev, _host, _) = device(&net_config(), 0);
        dev.write_config(0, &[9, 9, 9, 9, 9, 9]);
        let mut mac = [0u8; 6];
        dev.read_config(0, &mut mac);
        assert_eq!(mac, [2, 0, 0, 0, 0, 2]);
    }

    #[test]
    fn guest_frame_reaches_the_host_and_the_buffer_comes_back() {
        let mut r = rig();
        let bytes = frame(VnetHeader::default(), 60);
        send(&mut r, 0, &bytes);
        assert_eq!(host_recv(&r), Some(bytes));
        assert_eq!(r.tx.used_idx(&r.mem), 1);
        assert_eq!(r.tx.used_elem(&r.mem, 0), (0, 0));
        assert_ne!(r.irq.status() & VIRTIO_MMIO_INT_VRING, 0);
        assert!(!r.dev.is_broken());
    }

    #[test]
    fn host_frame_reaches_the_guest_with_num_buffers_set() {
        let mut r = rig();
        post_rx(&mut r, 0, 2048);
        let mut bytes = frame(VnetHeader::default(), 60);
        bytes[10] = 0xee; // the tap leaves num_buffers alone
        r.host.send(&bytes).unwrap();
        r.dev.process_rx();
        assert_eq!(r.rx.used_idx(&r.mem), 1);
        assert_eq!(r.rx.used_elem(&r.mem, 0), (0, bytes.len() as u32));
        let got = rx_bytes(&r, 0, bytes.len());
        assert_eq!(VnetHeader::from_bytes(got[..12].try_into().unwrap()).num_buffers, 1);
        assert_eq!(got[12..], bytes[12..]);
    }

    #[test]
    fn without_guest_buffers_one_frame_waits_and_the_rest_stays_in_the_tap() {
        let mut r = rig();
        for i in 0..3u8 {
            let mut f = frame(VnetHeader::default(), 60);
            f[12] = i;
            r.host.send(&f).unwrap();
        }
        r.dev.process_rx();
        assert!(r.dev.rx_pending(), "first frame held");
        assert_eq!(r.rx.used_idx(&r.mem), 0);
        // The guest posts one buffer and kicks: exactly the held frame arrives, in order.
        post_rx(&mut r, 0, 2048);
        r.dev.process_rx();
        assert_eq!(r.rx.used_idx(&r.mem), 1);
        assert_eq!(rx_bytes(&r, 0, 13)[12], 0);
        assert!(r.dev.rx_pending(), "second frame now held");
        post_rx(&mut r, 1, 2048);
        post_rx(&mut r, 2, 2048);
        r.dev.process_rx();
        assert_eq!(r.rx.used_idx(&r.mem), 3);
        assert_eq!((rx_bytes(&r, 1, 13)[12], rx_bytes(&r, 2, 13)[12]), (1, 2));
        assert!(!r.dev.rx_pending());
    }

    #[test]
    fn frame_larger_than_the_guest_buffer_is_dropped_and_the_buffer_kept() {
        let mut r = rig();
        post_rx(&mut r, 0, 100);
        r.host.send(&frame(VnetHeader::default(), 200)).unwrap();
        r.host.send(&frame(VnetHeader::default(), 50)).unwrap();
        r.dev.process_rx();
        assert_eq!(r.rx.used_idx(&r.mem), 1);
        assert_eq!(r.rx.used_elem(&r.mem, 0), (0, 62), "the small frame took the buffer");
        assert!(!r.dev.is_broken());
    }

    #[test]
    fn runt_host_frames_are_dropped() {
        let mut r = rig();
        post_rx(&mut r, 0, 2048);
        r.host.send(&[0u8; 20]).unwrap();
        r.dev.process_rx();
        assert_eq!(r.rx.used_idx(&r.mem), 0);
        assert!(!r.dev.rx_pending() && !r.dev.is_broken());
    }

    #[test]
    fn rx_chain_spanning_descriptors() {
        let mut r = rig();
        r.rx.set_desc(&r.mem, 0, 0x40000, 12, F_WRITE | F_NEXT, 1);
        r.rx.set_desc(&r.mem, 1, 0x50000, 1514, F_WRITE, 0);
        r.rx.publish(&r.mem, 0);
        let bytes = frame(VnetHeader::default(), 100);
        r.host.send(&bytes).unwrap();
        r.dev.process_rx();
        assert_eq!(r.rx.used_elem(&r.mem, 0), (0, 112));
        let mut payload = vec![0u8; 100];
        r.mem.read_slice(&mut payload, GuestAddress(0x50000)).unwrap();
        assert_eq!(payload, bytes[12..]);
    }

    fn assert_breaks(r: &mut Rig, what: &str) {
        assert!(r.dev.is_broken(), "{what}");
        // A broken device ignores further work until reset, then serves again.
        r.dev.process_tx();
        r.dev.process_rx();
        r.dev.reset();
        assert!(!r.dev.is_broken(), "{what}: reset recovers");
    }

    #[test]
    fn hostile_tx_chains_break_only_the_device() {
        // Descriptor outside guest memory.
        let mut r = rig();
        r.tx.set_desc(&r.mem, 0, 0xffff_0000_0000, 64, 0, 0);
        r.tx.publish(&r.mem, 0);
        r.dev.process_tx();
        assert_breaks(&mut r, "out of range");

        // A loop (the chain-length cap).
        let mut r = rig();
        r.tx.set_desc(&r.mem, 0, 0x10000, 32, F_NEXT, 1);
        r.tx.set_desc(&r.mem, 1, 0x11000, 32, F_NEXT, 0);
        r.tx.publish(&r.mem, 0);
        r.dev.process_tx();
        assert_breaks(&mut r, "loop");

        // A chain longer than the descriptor cap.
        let mut r = rig_sized(&net_config(), 0, BASIC, 128);
        let n = chain::MAX_CHAIN_DESCRIPTORS as u16 + 1;
        for i in 0..n {
            let last = i + 1 == n;
            r.tx.set_desc(&r.mem, i, 0x10000 + u64::from(i) * 16, 16, if last { 0 } else { F_NEXT }, i + 1);
        }
        r.tx.publish(&r.mem, 0);
        r.dev.process_tx();
        assert!(matches!(r.dev.state, DeviceState::Broken(DeviceError::Chain(chain::ChainError::TooLong(_)))));
        assert_breaks(&mut r, "too long");

        // A frame over the byte cap.
        let mut r = rig();
        r.tx.set_desc(&r.mem, 0, 0x10000, MAX_BUFFER_LEN as u32 + 1, 0, 0);
        r.tx.publish(&r.mem, 0);
        r.dev.process_tx();
        assert_breaks(&mut r, "too big");

        // A lying header: checksum offload (not even negotiated) far past the frame.
        let mut r = rig();
        let h = VnetHeader { flags: HDR_F_NEEDS_CSUM, csum_start: 1000, csum_offset: 6, ..Default::default() };
        send(&mut r, 0, &frame(h, 60));
        assert_breaks(&mut r, "lying header");
        assert_eq!(host_recv(&r), None, "nothing reached the host");

        // A device-writable TX buffer.
        let mut r = rig();
        r.tx.set_desc(&r.mem, 0, 0x10000, 100, F_WRITE, 0);
        r.tx.publish(&r.mem, 0);
        r.dev.process_tx();
        assert_breaks(&mut r, "writable tx");

        // An avail index jump.
        let mut r = rig();
        r.mem.write_obj(500u16, GuestAddress(r.tx.avail + 2)).unwrap();
        r.dev.process_tx();
        assert_breaks(&mut r, "avail jump");
    }

    #[test]
    fn hostile_rx_chains_break_only_the_device() {
        for (len, flags, what) in
            [(100, 0, "device-readable rx buffer"), (8, F_WRITE, "rx buffer shorter than the header")]
        {
            let mut r = rig();
            r.rx.set_desc(&r.mem, 0, 0x40000, len, flags, 0);
            r.rx.publish(&r.mem, 0);
            r.host.send(&frame(VnetHeader::default(), 60)).unwrap();
            r.dev.process_rx();
            assert_breaks(&mut r, what);
        }
        let mut r = rig();
        r.rx.set_desc(&r.mem, 0, 0x40000, (MAX_RX_CHAIN_LEN + 1) as u32, F_WRITE, 0);
        r.rx.publish(&r.mem, 0);
        r.host.send(&frame(VnetHeader::default(), 60)).unwrap();
        r.dev.process_rx();
        assert_breaks(&mut r, "absurd rx chain");
    }

    #[test]
    fn offloaded_tx_frames_pass_when_negotiated() {
        let acked = BASIC | bit(VIRTIO_NET_F_CSUM) | bit(VIRTIO_NET_F_HOST_TSO4);
        let mut r = rig_with(&net_config(), ALL_TUN, acked);
        let h = VnetHeader {
            flags: HDR_F_NEEDS_CSUM,
            gso_type: 1,
            hdr_len: 54,
            gso_size: 1448,
            csum_start: 34,
            csum_offset: 16,
            num_buffers: 0,
        };
        let bytes = frame(h, 3000);
        send(&mut r, 0, &bytes);
        assert_eq!(host_recv(&r), Some(bytes));
        assert!(!r.dev.is_broken());
    }

    #[test]
    fn queue_work_is_bounded_per_pass() {
        let mut r = rig();
        for _ in 0..MAX_FRAMES_PER_PASS + 5 {
            r.host.send(&[0u8; 20]).unwrap(); // runts: dropped without needing guest buffers
        }
        r.dev.process_rx();
        assert_eq!(r.dev.queue_evt(RXQ).read().unwrap(), 1, "the device rescheduled itself");
        r.dev.process_rx();
        assert!(r.dev.queue_evt(RXQ).read().is_err(), "the rest fit in one more pass");
    }

    fn limited(dir: &str, bucket: TokenBucketConfig) -> NetConfig {
        let l = RateLimiterConfig { ops: Some(bucket), bandwidth: None };
        let rate_limiter = Some(match dir {
            "rx" => NetRateLimiterConfig { rx: Some(l), tx: None },
            _ => NetRateLimiterConfig { rx: None, tx: Some(l) },
        });
        NetConfig { rate_limiter, ..net_config() }
    }

    #[test]
    fn tx_limiter_holds_frames_in_the_queue() {
        let hour = TokenBucketConfig { size: 1, one_time_burst: 0, refill_time_ms: 3_600_000 };
        let mut r = rig_with(&limited("tx", hour), 0, BASIC);
        send(&mut r, 0, &frame(VnetHeader::default(), 60));
        send(&mut r, 1, &frame(VnetHeader::default(), 60));
        assert_eq!(r.tx.used_idx(&r.mem), 1, "the second frame waits for tokens");
        assert!(host_recv(&r).is_some() && host_recv(&r).is_none());
        assert!(r.dev.tx_limiter.is_blocked());
        r.dev.tx_limiter.on_timer();
        r.dev.process_tx();
        assert_eq!(r.tx.used_idx(&r.mem), 1, "still no tokens: the chain stays available");
        assert!(!r.dev.is_broken());
    }

    #[test]
    fn rx_limiter_holds_the_frame_and_keeps_the_buffer() {
        let hour = TokenBucketConfig { size: 1, one_time_burst: 0, refill_time_ms: 3_600_000 };
        let mut r = rig_with(&limited("rx", hour), 0, BASIC);
        post_rx(&mut r, 0, 2048);
        post_rx(&mut r, 1, 2048);
        r.host.send(&frame(VnetHeader::default(), 60)).unwrap();
        r.host.send(&frame(VnetHeader::default(), 60)).unwrap();
        r.dev.process_rx();
        assert_eq!(r.rx.used_idx(&r.mem), 1);
        assert!(r.dev.rx_pending() && r.dev.rx_limiter.is_blocked());
    }

    #[test]
    fn reset_drops_the_held_frame_and_queues() {
        let mut r = rig();
        r.host.send(&frame(VnetHeader::default(), 60)).unwrap();
        r.dev.process_rx();
        assert!(r.dev.rx_pending());
        assert!(matches!(r.dev.state, DeviceState::Active(_)));
        r.dev.reset();
        assert!(!r.dev.rx_pending());
        assert!(matches!(r.dev.state, DeviceState::Inactive), "reset drops the queues");
        r.dev.process_rx(); // inactive: nothing happens
        assert!(!r.dev.rx_pending());
    }
}
