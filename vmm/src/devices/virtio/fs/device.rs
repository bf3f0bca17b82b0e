//! virtio-fs device semantics (virtio spec 5.11): device type 26, a config space holding the tag
//! and the number of request queues, one hiprio queue plus one request queue, and the device's
//! life around its vhost-user backend.
//!
//! The backend serves the relay's shadow vrings in a small shared region (`relay.rs`), never the
//! driver's: guest memory stays private to the VMM, so a restored VM can keep its template's
//! pages shared copy-on-write. The event loop moves requests between the two.
//!
//! The backend is connected on the first DRIVER_OK (so the pod's virtiofsd may start alongside
//! the VMM) and kept across driver resets, which only stop the vrings. Every exchange with it
//! runs on the device's backend thread (`worker.rs`), bounded by `BACKEND_TIMEOUT`: DRIVER_OK
//! only asks for the start and returns, the event loop applies the outcome, and a reset waits
//! (bounded, outside the device lock) until the rings are stopped. A backend that fails,
//! refuses a message or hangs up breaks the device (DEVICE_NEEDS_RESET); the rest of the VM
//! carries on.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::relay::{self, Relay, RelayError};
use super::vhost_user::{BackendError, Deadline};
use super::worker::{BackendThreads, Report, Request, Start, Watch, Worker};
use super::{AVAIL_FEATURES, NUM_QUEUES, NUM_REQUEST_QUEUES};
use crate::config::FsConfig;
use crate::devices::virtio::{
    read_config_bytes, validate_queues, DeviceError, DeviceState, IrqTrigger, PendingReset, VirtioDevice, TYPE_FS,
    VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_INT_VRING,
};
use crate::memory::create_guest_memory;
use crate::thread::Slot;

pub const TAG_LEN: usize = 36;
/// tag[36] then num_request_queues (le32).
pub const CONFIG_LEN: usize = TAG_LEN + 4;
/// Bound on each activation (connect, handshake, vring setup) and each reset, start to end.
pub const BACKEND_TIMEOUT: Duration = Duration::from_secs(5);
/// How long past its deadline a reset waits for the backend thread's word: the watchdog ends the
/// exchange at the deadline, so this only covers the thread reporting it.
const STOP_GRACE: Duration = Duration::from_secs(1);
/// Failures (the backend's, or the driver's malformed requests) are logged loudly at most this
/// often; a guest that resets and re-activates in a loop gets the rest at debug level.
const FAILURE_LOG_PERIOD: Duration = Duration::from_secs(10);

/// Where the backend is with the current activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// DRIVER_OK was written; the backend thread is connecting or setting the vrings up.
    Starting,
    Serving,
}

pub struct Active {
    pub(super) mem: GuestMemoryMmap,
    pub(super) queues: Vec<Queue>,
    relay: Relay,
    irq: IrqTrigger,
    phase: Phase,
}

/// What a report means for the event loop's hang-up watch.
pub enum WatchUpdate {
    Keep,
    Watch(Watch),
    Unwatch,
}

pub struct Fs {
    name: String,
    pub(super) tag: String,
    pub(super) socket: PathBuf,
    config: [u8; CONFIG_LEN],
    pub(super) queue_sizes: [u16; NUM_QUEUES],
    pub(super) acked_features: u64,
    /// The driver's kicks: the transport signals them on QueueNotify; the event loop relays.
    pub(super) queue_evts: [EventFd; NUM_QUEUES],
    /// The relay's kicks to the backend, one per shadow vring. Until the backend has them, an
    /// eventfd keeps counting, so no kick is lost.
    backend_kicks: [EventFd; NUM_QUEUES],
    /// Calls: the backend signals them when it used shadow buffers; the event loop relays the
    /// replies and interrupts the driver.
    pub(super) call_evts: [EventFd; NUM_QUEUES],
    /// The region shared with the backend (shadow vrings and request bytes), reused by every
    /// activation.
    shared: GuestMemoryMmap,
    /// The device's backend thread, which owns the connection.
    pub(super) worker: Worker,
    /// Counts activations and resets: a report about an earlier one is stale.
    activation: u64,
    /// The connection the backend thread reported, registered with the event loop for hang-up.
    pub(super) watch: Option<Watch>,
    pub(super) state: DeviceState<Active>,
    timeout: Duration,
    last_failure_log: Option<Instant>,
}

impl Fs {
    /// The device and its backend threads (confined by `threads`); nothing is connected yet.
    pub fn new(cfg: &FsConfig, index: usize, threads: BackendThreads) -> std::io::Result<Self> {
        let tag = cfg.tag.as_bytes();
        if tag.is_empty() || tag.len() > TAG_LEN {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "virtio-fs tag must be 1..=36 bytes"));
        }
        let mut config = [0u8; CONFIG_LEN];
        config[..tag.len()].copy_from_slice(tag);
        config[TAG_LEN..].copy_from_slice(&NUM_REQUEST_QUEUES.to_le_bytes());
        let evt = || EventFd::new(libc::EFD_NONBLOCK);
        let name = format!("fs{index}");
        let queue_evts = [evt()?, evt()?];
        let backend_kicks = [evt()?, evt()?];
        let call_evts = [evt()?, evt()?];
        let shared = create_guest_memory(relay::region_bytes()).map_err(std::io::Error::other)?;
        let worker = Worker::spawn(&name, cfg.socket.clone(), &backend_kicks, &call_evts, threads)?;
        Ok(Self {
            name,
            tag: cfg.tag.clone(),
            socket: cfg.socket.clone(),
            config,
            queue_sizes: [cfg.queue_size; NUM_QUEUES],
            acked_features: 0,
            queue_evts,
            backend_kicks,
            call_evts,
            shared,
            worker,
            activation: 0,
            watch: None,
            state: DeviceState::Inactive,
            timeout: BACKEND_TIMEOUT,
            last_failure_log: None,
        })
    }

    #[cfg(test)]
    pub fn with_backend_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Which connection the event loop watches, if any.
    #[cfg(test)]
    pub fn connection_id(&self) -> Option<u64> {
        self.watch.as_ref().map(|w| w.id)
    }

    /// Where the backend is with the current activation (None: the device is not active).
    #[cfg(test)]
    pub fn phase(&self) -> Option<Phase> {
        match &self.state {
            DeviceState::Active(a) => Some(a.phase),
            _ => None,
        }
    }

    /// Why this device's state cannot go into a snapshot, if it cannot: once the driver has
    /// posted a request, a FUSE session exists, and it lives in the backend (open files, inode
    /// numbers), which a restored VM does not get back: it gets a fresh backend. So a snapshot
    /// is taken before the guest mounts the tag (the driver probed the device, posted nothing).
    pub fn snapshot_blocker(&self) -> Option<String> {
        let DeviceState::Active(a) = &self.state else { return None };
        let posted: Vec<u16> =
            a.queues.iter().map(|q| q.avail_idx(&a.mem, Ordering::Acquire).map_or(u16::MAX, |i| i.0)).collect();
        if posted.iter().all(|&n| n == 0) {
            return None;
        }
        Some(format!(
            "virtio-fs {} (tag {:?}): the guest has sent FUSE requests (hiprio, request queue: {:?} posted); \
             its FUSE session lives in the backend and cannot be carried into a restore: snapshot before \
             the tag is mounted",
            self.name, self.tag, posted
        ))
    }

    /// A restored device that was broken when saved stays so until the driver resets it.
    pub(super) fn mark_broken(&mut self) {
        self.state = DeviceState::Broken(DeviceError::Backend("the device had failed before the snapshot".into()));
    }

    /// The driver kicked queue `q`: offer the backend what it posted.
    pub fn driver_kicked(&mut self, q: usize) {
        let DeviceState::Active(a) = &mut self.state else { return };
        let Some(queue) = a.queues.get_mut(q) else { return };
        match a.relay.take_from_driver(q, &a.mem, queue) {
            Ok(0) => {}
            Ok(_) => {
                if let Err(e) = self.backend_kicks[q].write(1) {
                    tracing::warn!(device = %self.name, queue = q, error = %e, "cannot kick the virtio-fs backend");
                }
            }
            Err(e) => self.relay_failed(e),
        }
    }

    /// The backend used shadow buffers on queue `q`: hand the replies to the driver, then offer
    /// what waited for the room they freed.
    pub fn backend_used(&mut self, q: usize) {
        let DeviceState::Active(a) = &mut self.state else { return };
        let Some(queue) = a.queues.get_mut(q) else { return };
        match a.relay.return_to_driver(q, &a.mem, queue) {
            Ok(0) => {}
            Ok(_) => {
                a.irq.trigger(VIRTIO_MMIO_INT_VRING);
                self.driver_kicked(q);
            }
            Err(e) => self.relay_failed(e),
        }
    }

    /// A relay rule was broken: by the backend (the device fails as on any backend failure) or
    /// by the driver (the device stops serving until the driver resets it).
    fn relay_failed(&mut self, err: RelayError) {
        if err.is_backends() {
            return self.fail(BackendError::Relay(err.to_string()));
        }
        let DeviceState::Active(a) = &self.state else { return };
        a.irq.trigger(VIRTIO_MMIO_INT_CONFIG);
        if self.log_loudly() {
            tracing::warn!(device = %self.name, tag = %self.tag, error = %err,
                "the guest's virtio-fs driver sent a malformed request; the device needs a reset");
        } else {
            tracing::debug!(device = %self.name, tag = %self.tag, error = %err, "malformed virtio-fs request again");
        }
        self.state = DeviceState::Broken(DeviceError::Request(err.to_string()));
    }

    /// The event loop saw the backend close connection `id` (and stopped watching it).
    pub fn backend_hung_up(&mut self, id: u64) {
        self.worker.post(Request::Disconnect { id });
        match self.state {
            DeviceState::Active(_) => self.fail(BackendError::HungUp),
            DeviceState::Inactive => self.report(&BackendError::HungUp, None),
            DeviceState::Broken(_) => {
                tracing::debug!(device = %self.name, "virtio-fs backend hung up after the device failed")
            }
        }
    }

    /// Applies what the backend thread reported (on the event loop). Only a report about the
    /// current activation moves the device; any report may change the connection.
    pub fn apply(&mut self, report: Report) -> WatchUpdate {
        match report {
            Report::Serving { activation, connection } => {
                if let (true, DeviceState::Active(a)) = (activation == self.activation, &mut self.state) {
                    a.phase = Phase::Serving;
                    tracing::debug!(device = %self.name, tag = %self.tag, "virtio-fs backend serving");
                }
                connection.map_or(WatchUpdate::Keep, WatchUpdate::Watch)
            }
            Report::StartFailed { activation, error } => {
                match (activation == self.activation, &self.state) {
                    (true, DeviceState::Active(_)) => self.fail(error),
                    (true, _) => tracing::debug!(device = %self.name, error = %error,
                        "virtio-fs backend start failed after the device failed"),
                    // The driver reset the device meanwhile.
                    (false, _) => self.report(&error, None),
                }
                WatchUpdate::Unwatch
            }
            Report::StopFailed { error } => {
                self.report(&error, None);
                WatchUpdate::Unwatch
            }
        }
    }

    /// Stops serving until the driver resets the device, and tells the driver so. Only an
    /// active device fails.
    fn fail(&mut self, err: BackendError) {
        let DeviceState::Active(a) = &self.state else { return };
        a.irq.trigger(VIRTIO_MMIO_INT_CONFIG);
        let phase = a.phase;
        self.report(&err, Some(phase));
        self.state = DeviceState::Broken(DeviceError::Backend(err.to_string()));
    }

    /// The one log line of a backend failure, naming tag and socket. `broke`: the phase the
    /// device stopped serving in; None: it was inactive, and the next activation reconnects.
    fn report(&mut self, err: &BackendError, broke: Option<Phase>) {
        let loud = self.log_loudly();
        let (device, tag, socket) = (&self.name, &self.tag, self.socket.display());
        match (loud, broke) {
            (true, Some(phase)) => tracing::error!(%device, %tag, %socket, error = %err, ?phase,
                "virtio-fs backend failed; the device needs a reset"),
            (true, None) => tracing::error!(%device, %tag, %socket, error = %err,
                "virtio-fs backend failed while the device was inactive; the next activation reconnects"),
            (false, _) => {
                tracing::debug!(%device, %tag, %socket, error = %err, ?broke, "virtio-fs backend failed again")
            }
        }
    }

    /// Whether a failure is logged loudly now ([`FAILURE_LOG_PERIOD`]).
    fn log_loudly(&mut self) -> bool {
        let now = Instant::now();
        let loud = self.last_failure_log.is_none_or(|t| now.duration_since(t) >= FAILURE_LOG_PERIOD);
        if loud {
            self.last_failure_log = Some(now);
        }
        loud
    }
}

impl VirtioDevice for Fs {
    fn device_type(&self) -> u32 {
        TYPE_FS
    }

    fn avail_features(&self) -> u64 {
        AVAIL_FEATURES
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked_features = features;
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn queue_events(&self) -> &[EventFd] {
        &self.queue_evts
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        tracing::debug!(device = %self.name, offset, "write to read-only virtio-fs config ignored");
    }

    /// Bad queues are the driver's fault (the transport fails the driver). Otherwise the device
    /// is live at once and the backend thread starts the backend on fresh shadow vrings; a
    /// backend problem comes back later as DEVICE_NEEDS_RESET. Requests the driver posts
    /// meanwhile wait in the shadow vrings.
    fn activate(&mut self, mem: GuestMemoryMmap, queues: Vec<Queue>, irq: IrqTrigger) -> Result<(), DeviceError> {
        validate_queues(&mem, &queues)?;
        if queues.len() != NUM_QUEUES {
            return Err(DeviceError::QueueNotReady(queues.len()));
        }
        let relay = Relay::new(self.shared.clone()).map_err(|e| DeviceError::Memory(e.to_string()))?;
        self.activation += 1;
        self.worker.post(Request::Start(Start {
            activation: self.activation,
            mem: relay.shared().clone(),
            features: relay::SHADOW_FEATURES,
            queues: relay.backend_queues(),
            deadline: Deadline::after(self.timeout),
        }));
        self.state = DeviceState::Active(Active { mem, queues, relay, irq, phase: Phase::Starting });
        Ok(())
    }

    /// Stops the vrings but keeps the connection, as a backend serves one connection only. The
    /// transport waits for the stop outside the device lock, so the shadow vrings are out of
    /// the backend's hands before the next activation clears them. Requests in flight are
    /// dropped with the driver's queues.
    fn reset(&mut self) -> Option<PendingReset> {
        let was = std::mem::replace(&mut self.state, DeviceState::Inactive);
        self.acked_features = 0;
        if matches!(was, DeviceState::Inactive) {
            return None;
        }
        self.activation += 1;
        let deadline = Deadline::after(self.timeout);
        let done = Slot::new();
        self.worker.post(Request::Stop { deadline, done: Arc::clone(&done) });
        let device = self.name.clone();
        Some(PendingReset::new(move || {
            if done.take_until(deadline.at() + STOP_GRACE).is_none() {
                tracing::warn!(%device, "the virtio-fs backend thread did not confirm the reset in time; going on");
            }
        }))
    }

    fn is_broken(&self) -> bool {
        self.state.is_broken()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::bus::BusDevice;
    use crate::devices::virtio::chain::test_utils::{TestQueue, F_NEXT, F_WRITE};
    use crate::devices::virtio::fs::test_utils::{self as fake, FakeBackend, Script};
    use crate::devices::virtio::fs::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
    use crate::devices::virtio::mmio::MmioTransport;
    use crate::devices::virtio::mmio_regs::{
        DEVICE_FEATURES, DEVICE_FEATURES_SEL, DEVICE_ID, DRIVER_FEATURES, DRIVER_FEATURES_SEL, INTERRUPT_ACK,
        INTERRUPT_STATUS, QUEUE_DESC_LOW, QUEUE_DEVICE_LOW, QUEUE_DRIVER_LOW, QUEUE_NOTIFY, QUEUE_NUM, QUEUE_READY,
        QUEUE_SEL, STATUS, STATUS_FAILED, STATUS_NEEDS_RESET,
    };
    use crate::devices::virtio::VIRTIO_F_VERSION_1;
    use crate::memory::create_guest_memory;
    use crate::persist::Persist;
    use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
    use std::path::Path;
    use std::sync::Mutex;
    use vm_memory::{Bytes, GuestAddress};

    fn fs_at(socket: &Path) -> Fs {
        let cfg = FsConfig { tag: "rootfs".into(), socket: socket.to_owned(), queue_size: 256 };
        Fs::new(&cfg, 0, BackendThreads::unconfined()).unwrap().with_backend_timeout(Duration::from_millis(500))
    }

    /// A transport over memfd-backed guest memory (the backend maps it), the device, and an
    /// event loop for the device's events.
    struct Rig {
        t: MmioTransport,
        fs: Arc<Mutex<Fs>>,
        mem: GuestMemoryMmap,
        irq: IrqTrigger,
        em: EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>>,
    }

    fn rig(socket: &Path) -> Rig {
        rig_with(fs_at(socket))
    }

    fn rig_with(fs: Fs) -> Rig {
        let mem = create_guest_memory(16 << 20).unwrap();
        let fs = Arc::new(Mutex::new(fs));
        let irq = IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let t = MmioTransport::new("fs0".into(), mem.clone(), fs.clone(), irq.clone()).unwrap();
        let mut em: EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>> = EventManager::new().unwrap();
        em.add_subscriber(fs.clone());
        Rig { t, fs, mem, irq, em }
    }

    impl Rig {
        /// Runs the event loop until the backend thread's answer to DRIVER_OK is applied.
        fn settle(&mut self) {
            self.run_until("the backend's answer", |fs| fs.phase() != Some(Phase::Starting));
        }

        fn run_until(&mut self, what: &str, done: impl Fn(&Fs) -> bool) {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !done(&self.fs.lock().unwrap()) {
                assert!(Instant::now() < deadline, "timed out waiting for {what}");
                self.em.run_with_timeout(50).unwrap();
            }
        }
    }

    fn r(t: &mut MmioTransport, off: u64) -> u32 {
        let mut b = [0u8; 4];
        t.read(off, &mut b);
        u32::from_le_bytes(b)
    }
    fn w(t: &mut MmioTransport, off: u64, v: u32) {
        t.write(off, &v.to_le_bytes());
    }

    /// ACK, DRIVER, the driver's features, FEATURES_OK; returns the status read back.
    fn negotiate(t: &mut MmioTransport, features: u64) -> u32 {
        w(t, STATUS, 1);
        w(t, STATUS, 3);
        for sel in 0..2u32 {
            w(t, DRIVER_FEATURES_SEL, sel);
            w(t, DRIVER_FEATURES, (features >> (32 * sel)) as u32);
        }
        w(t, STATUS, 0xb);
        r(t, STATUS)
    }

    fn queues() -> [TestQueue; NUM_QUEUES] {
        [TestQueue::new(0x1_0000, 8), TestQueue::new(0x2_0000, 8)]
    }

    /// Sets up both queues and writes DRIVER_OK; returns the status read back at once.
    fn driver_ok(t: &mut MmioTransport, features: u64) -> u32 {
        assert_eq!(negotiate(t, features), 0xb);
        for (i, q) in queues().iter().enumerate() {
            w(t, QUEUE_SEL, i as u32);
            w(t, QUEUE_NUM, u32::from(q.size));
            w(t, QUEUE_DESC_LOW, q.desc as u32);
            w(t, QUEUE_DRIVER_LOW, q.avail as u32);
            w(t, QUEUE_DEVICE_LOW, q.used as u32);
            w(t, QUEUE_READY, 1);
        }
        w(t, STATUS, 0xf);
        r(t, STATUS)
    }

    /// DRIVER_OK, then the status once the backend thread's answer is in.
    fn activate(rig: &mut Rig, features: u64) -> u32 {
        assert_eq!(driver_ok(&mut rig.t, features), 0xf, "DRIVER_OK is taken at once");
        rig.settle();
        r(&mut rig.t, STATUS)
    }

    const REQUEST_AT: u64 = 0x10_0000;
    const REPLY_AT: u64 = 0x11_0000;

    /// The driver's part of a request on `q`: 16 readable bytes, then 64 bytes of reply room.
    fn post_request(mem: &GuestMemoryMmap, q: &mut TestQueue) {
        mem.write_slice(&[7; 16], GuestAddress(REQUEST_AT)).unwrap();
        q.set_desc(mem, 0, REQUEST_AT, 16, F_NEXT, 1);
        q.set_desc(mem, 1, REPLY_AT, 64, F_WRITE, 0);
        q.publish(mem, 0);
    }

    fn shadow_avail_idx_of(fs: &Fs, q: usize) -> u16 {
        let DeviceState::Active(a) = &fs.state else { return 0 };
        let avail = a.relay.backend_queues()[q].avail_ring;
        fs.shared.read_obj(GuestAddress(avail + 2)).unwrap()
    }

    fn shadow_avail_idx(fs: &Mutex<Fs>, q: usize) -> u16 {
        shadow_avail_idx_of(&fs.lock().unwrap(), q)
    }

    /// What a backend does with the first chain of shadow vring `q`: writes `reply` into its
    /// writable descriptor (descriptor 1) and uses descriptor 0.
    fn backend_answers(fs: &Mutex<Fs>, q: usize, reply: &[u8]) {
        use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
        let fs = fs.lock().unwrap();
        let DeviceState::Active(a) = &fs.state else { panic!("inactive") };
        let ring = a.relay.backend_queues()[q];
        let writable: RawDescriptor = fs.shared.read_obj(GuestAddress(ring.desc_table + 16)).unwrap();
        fs.shared.write_slice(reply, SplitDescriptor::from(writable).addr()).unwrap();
        fs.shared.write_obj(0u32, GuestAddress(ring.used_ring + 4)).unwrap();
        fs.shared.write_obj(reply.len() as u32, GuestAddress(ring.used_ring + 8)).unwrap();
        fs.shared.write_obj(1u16, GuestAddress(ring.used_ring + 2)).unwrap();
    }

    fn broken_reason(fs: &Mutex<Fs>) -> String {
        match &fs.lock().unwrap().state {
            DeviceState::Broken(e) => e.to_string(),
            _ => panic!("device is not broken"),
        }
    }

    #[test]
    fn config_space_holds_the_tag_and_one_request_queue() {
        let fs = fs_at(Path::new("/nonexistent/fs.sock"));
        assert_eq!(fs.device_type(), 26);
        let mut cfg = [0xffu8; CONFIG_LEN];
        fs.read_config(0, &mut cfg);
        assert_eq!(&cfg[..6], b"rootfs");
        assert!(cfg[6..TAG_LEN].iter().all(|&b| b == 0), "tag is NUL padded");
        assert_eq!(u32::from_le_bytes(cfg[TAG_LEN..].try_into().unwrap()), 1);
        let mut n = [0u8; 4];
        fs.read_config(TAG_LEN as u64, &mut n);
        assert_eq!(u32::from_le_bytes(n), NUM_REQUEST_QUEUES);
        let mut past = [0xffu8; 8];
        fs.read_config(CONFIG_LEN as u64 - 2, &mut past);
        assert_eq!(past, [0, 0, 0, 0, 0, 0, 0, 0], "bytes past the config read as zero");
        fs.read_config(u64::MAX, &mut past);
        assert_eq!(past, [0; 8]);
        assert_eq!(fs.queue_max_sizes(), &[256, 256], "hiprio + one request queue");
    }

    #[test]
    fn a_tag_the_spec_cannot_carry_is_refused() {
        for tag in ["", &"x".repeat(TAG_LEN + 1)] {
            let cfg = FsConfig { tag: tag.to_string(), socket: "/tmp/s".into(), queue_size: 8 };
            assert!(Fs::new(&cfg, 0, BackendThreads::unconfined()).is_err(), "tag {tag:?}");
        }
        let cfg = FsConfig { tag: "t".repeat(TAG_LEN), socket: "/tmp/s".into(), queue_size: 8 };
        let mut tag = [0u8; TAG_LEN];
        Fs::new(&cfg, 0, BackendThreads::unconfined()).unwrap().read_config(0, &mut tag);
        assert_eq!(tag, [b't'; TAG_LEN], "a 36-byte tag fills the field without a NUL");
    }

    #[test]
    fn feature_negotiation_through_the_transport() {
        let mut rig = rig(Path::new("/nonexistent/fs.sock"));
        let offered = |t: &mut MmioTransport| {
            w(t, DEVICE_FEATURES_SEL, 0);
            let lo = r(t, DEVICE_FEATURES);
            w(t, DEVICE_FEATURES_SEL, 1);
            u64::from(lo) | (u64::from(r(t, DEVICE_FEATURES)) << 32)
        };
        assert_eq!(offered(&mut rig.t), VIRTIO_F_VERSION_1 | VIRTIO_RING_F_INDIRECT_DESC);
        assert_eq!(r(&mut rig.t, DEVICE_ID), TYPE_FS);

        // VIRTIO_FS_F_NOTIFICATION (bit 0) and EVENT_IDX are not offered: negotiation fails.
        assert_eq!(negotiate(&mut rig.t, VIRTIO_F_VERSION_1 | 1) & 0x8, 0);
        w(&mut rig.t, STATUS, 0);
        assert_eq!(negotiate(&mut rig.t, VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX) & 0x8, 0);
        w(&mut rig.t, STATUS, 0);
        // Without VERSION_1 it fails too.
        assert_eq!(negotiate(&mut rig.t, VIRTIO_RING_F_INDIRECT_DESC) & 0x8, 0);
        w(&mut rig.t, STATUS, 0);
        assert_eq!(negotiate(&mut rig.t, VIRTIO_F_VERSION_1 | VIRTIO_RING_F_INDIRECT_DESC), 0xb);
        assert_eq!(rig.fs.lock().unwrap().acked_features, VIRTIO_F_VERSION_1 | VIRTIO_RING_F_INDIRECT_DESC);
        w(&mut rig.t, STATUS, 0);
        assert_eq!(rig.fs.lock().unwrap().acked_features, 0, "reset forgets the driver's features");
    }

    #[test]
    fn activation_hands_the_backend_the_relay_region_and_both_shadow_vrings() {
        let backend = FakeBackend::start(Script::virtiofsd_like());
        let mut rig = rig(&backend.path);
        assert_eq!(activate(&mut rig, VIRTIO_F_VERSION_1 | VIRTIO_RING_F_INDIRECT_DESC), 0xf);
        let vring = [fake::SET_VRING_NUM, fake::SET_VRING_ADDR, fake::SET_VRING_BASE, fake::SET_VRING_CALL];
        let mut expected = vec![
            fake::SET_OWNER,
            fake::GET_FEATURES,
            fake::GET_PROTOCOL_FEATURES,
            fake::SET_PROTOCOL_FEATURES,
            fake::GET_QUEUE_NUM,
            fake::SET_FEATURES,
            fake::SET_MEM_TABLE,
        ];
        for _ in 0..NUM_QUEUES {
            expected.extend(vring);
            expected.extend([fake::SET_VRING_KICK, fake::SET_VRING_ENABLE]);
        }
        assert_eq!(backend.requests(), expected);
        // Not the 16 MiB of guest memory: only the relay's region.
        assert_eq!(backend.mem_tables(), [vec![(0, relay::region_bytes())]]);
        let fs = rig.fs.lock().unwrap();
        assert_eq!((fs.phase(), fs.connection_id()), (Some(Phase::Serving), Some(1)));
        let snap = fs.save();
        assert_eq!(snap.vrings.len(), NUM_QUEUES);
        assert_eq!((snap.vrings[1].desc_table, snap.vrings[1].size), (0x2_0000, 8));
    }

    #[test]
    fn driver_ok_returns_at_once_and_requests_meanwhile_reach_the_backend() {
        let slow =
            Script { slow_on: Some((fake::SET_MEM_TABLE, Duration::from_millis(300))), ..Script::virtiofsd_like() };
        let backend = FakeBackend::start(slow);
        let mut rig = rig_with(fs_at(&backend.path).with_backend_timeout(Duration::from_secs(5)));
        let start = Instant::now();
        assert_eq!(driver_ok(&mut rig.t, VIRTIO_F_VERSION_1), 0xf);
        assert!(start.elapsed() < Duration::from_millis(200), "the vCPU was held for {:?}", start.elapsed());
        assert_eq!(rig.fs.lock().unwrap().phase(), Some(Phase::Starting));
        // The driver posts a request and kicks twice before the backend has its vrings.
        post_request(&rig.mem, &mut queues()[1]);
        w(&mut rig.t, QUEUE_NOTIFY, 1);
        w(&mut rig.t, QUEUE_NOTIFY, 1);
        assert_eq!(backend.kicks_pending(1), None, "the backend has no kick eventfd yet");
        rig.settle();
        assert_eq!(rig.fs.lock().unwrap().phase(), Some(Phase::Serving));
        assert_eq!(backend.kicks_pending(1), Some(1), "the relay's kick waits in the eventfd the backend was given");
        assert_eq!(backend.kicks_pending(0), Some(0));
        assert_eq!(shadow_avail_idx(&rig.fs, 1), 1, "the request is in the shadow vring");
    }

    #[test]
    fn backend_calls_become_vring_interrupts_and_a_hang_up_breaks_the_device() {
        let backend = FakeBackend::start(Script::virtiofsd_like());
        let mut rig = rig(&backend.path);
        assert_eq!(activate(&mut rig, VIRTIO_F_VERSION_1), 0xf);
        assert!(rig.fs.lock().unwrap().watch.is_some(), "the connection is watched");

        // A request goes out; the backend answers it with 5 bytes.
        let mut q = queues().into_iter().nth(1).unwrap();
        post_request(&rig.mem, &mut q);
        w(&mut rig.t, QUEUE_NOTIFY, 1);
        rig.run_until("the relay", |fs| shadow_avail_idx_of(fs, 1) == 1);
        backend_answers(&rig.fs, 1, b"reply");
        rig.fs.lock().unwrap().call_evts[1].write(1).unwrap();
        rig.em.run_with_timeout(100).unwrap();
        assert_eq!(r(&mut rig.t, INTERRUPT_STATUS), VIRTIO_MMIO_INT_VRING);
        assert_eq!((q.used_idx(&rig.mem), q.used_elem(&rig.mem, 0)), (1, (0, 5)));
        assert_eq!(rig.mem.read_obj::<[u8; 5]>(GuestAddress(REPLY_AT)).unwrap(), *b"reply");
        w(&mut rig.t, INTERRUPT_ACK, VIRTIO_MMIO_INT_VRING);

        backend.hang_up();
        rig.run_until("the hang-up", |fs| fs.is_broken());
        assert_eq!(r(&mut rig.t, STATUS), 0xf | STATUS_NEEDS_RESET);
        assert_eq!(r(&mut rig.t, INTERRUPT_STATUS), VIRTIO_MMIO_INT_CONFIG, "the driver is told");
        assert!(broken_reason(&rig.fs).contains("closed the connection"));
        assert!(rig.fs.lock().unwrap().watch.is_none(), "the dead connection is no longer watched");
        assert!(rig.fs.lock().unwrap().save().broken);

        // A driver reset clears the failure; the next DRIVER_OK would connect afresh.
        w(&mut rig.t, STATUS, 0);
        assert_eq!(r(&mut rig.t, STATUS), 0);
    }

    #[test]
    fn a_refused_message_breaks_the_device() {
        let backend = FakeBackend::start(Script { refuse: Some(fake::SET_MEM_TABLE), ..Script::virtiofsd_like() });
        let mut rig = rig(&backend.path);
        assert_eq!(activate(&mut rig, VIRTIO_F_VERSION_1), 0xf | STATUS_NEEDS_RESET);
        assert_eq!(r(&mut rig.t, INTERRUPT_STATUS), VIRTIO_MMIO_INT_CONFIG, "the driver is told");
        assert!(broken_reason(&rig.fs).contains("SET_MEM_TABLE"), "{}", broken_reason(&rig.fs));
        assert_eq!(rig.fs.lock().unwrap().connection_id(), None, "the connection is dropped");
    }

    #[test]
    fn a_silent_backend_breaks_the_device_within_the_timeout_while_the_event_loop_runs() {
        let backend = FakeBackend::start(Script { silent_on: Some(fake::SET_MEM_TABLE), ..Script::virtiofsd_like() });
        let mut rig = rig(&backend.path);
        let start = Instant::now();
        assert_eq!(driver_ok(&mut rig.t, VIRTIO_F_VERSION_1), 0xf);
        while backend.requests().len() < 7 {
            std::thread::sleep(Duration::from_millis(5)); // handshake done, SET_MEM_TABLE unanswered
        }
        // Neither the event loop nor a status read waits on the exchange.
        let looped = Instant::now();
        rig.em.run_with_timeout(100).unwrap();
        assert_eq!(r(&mut rig.t, STATUS), 0xf);
        assert!(looped.elapsed() < Duration::from_millis(400), "event loop blocked for {:?}", looped.elapsed());
        rig.settle();
        assert!(start.elapsed() < Duration::from_secs(3), "took {:?}", start.elapsed());
        assert_eq!(r(&mut rig.t, STATUS), 0xf | STATUS_NEEDS_RESET);
        let reason = broken_reason(&rig.fs);
        assert!(reason.contains("SET_MEM_TABLE: no answer within 500ms"), "{reason}");
    }

    #[test]
    fn no_backend_breaks_the_device() {
        let dir = tempfile::tempdir().unwrap();
        let mut rig = rig(&dir.path().join("absent.sock"));
        assert_eq!(activate(&mut rig, VIRTIO_F_VERSION_1), 0xf | STATUS_NEEDS_RESET);
        assert!(broken_reason(&rig.fs).contains("cannot connect"));
    }

    #[test]
    fn the_drivers_ring_features_are_the_relays_not_the_backends() {
        let script = Script {
            features: VIRTIO_F_VERSION_1 | super::super::vhost_user::VHOST_USER_F_PROTOCOL_FEATURES,
            ..Script::virtiofsd_like()
        };
        let backend = FakeBackend::start(script);
        let mut rig = rig(&backend.path);
        assert_eq!(activate(&mut rig, VIRTIO_F_VERSION_1 | VIRTIO_RING_F_INDIRECT_DESC), 0xf);
        assert_eq!(rig.fs.lock().unwrap().phase(), Some(Phase::Serving));
    }

    #[test]
    fn a_malformed_chain_breaks_the_device_and_keeps_the_backend() {
        let backend = FakeBackend::start(Script::virtiofsd_like());
        let mut rig = rig(&backend.path);
        assert_eq!(activate(&mut rig, VIRTIO_F_VERSION_1), 0xf);
        // A writable descriptor, then a readable one.
        let mut q = queues().into_iter().nth(1).unwrap();
        q.set_desc(&rig.mem, 0, 0x10_0000, 16, F_NEXT | F_WRITE, 1);
        q.set_desc(&rig.mem, 1, 0x10_1000, 16, 0, 0);
        q.publish(&rig.mem, 0);
        w(&mut rig.t, QUEUE_NOTIFY, 1);
        rig.run_until("the device to fail", |fs| fs.is_broken());
        assert_eq!(r(&mut rig.t, STATUS), 0xf | STATUS_NEEDS_RESET);
        assert!(broken_reason(&rig.fs).contains("readable descriptor follows"), "{}", broken_reason(&rig.fs));
        assert_eq!(rig.fs.lock().unwrap().connection_id(), Some(1), "the backend did nothing wrong");
        assert_eq!(backend.kicks_pending(1), Some(0), "nothing was offered");
    }

    #[test]
    fn a_backend_that_answers_what_it_was_not_given_breaks_the_device() {
        let backend = FakeBackend::start(Script::virtiofsd_like());
        let mut rig = rig(&backend.path);
        assert_eq!(activate(&mut rig, VIRTIO_F_VERSION_1), 0xf);
        backend_answers(&rig.fs, 1, b"forged");
        rig.fs.lock().unwrap().call_evts[1].write(1).unwrap();
        rig.run_until("the device to fail", |fs| fs.is_broken());
        let reason = broken_reason(&rig.fs);
        assert!(reason.contains("shadow vring rules") && reason.contains("does not hold"), "{reason}");
        assert_eq!(queues()[1].used_idx(&rig.mem), 0, "nothing reached the driver");
    }

    #[test]
    fn a_backend_with_too_few_queues_breaks_the_device() {
        let backend = FakeBackend::start(Script { queue_num: 1, ..Script::virtiofsd_like() });
        let mut rig = rig(&backend.path);
        assert_eq!(activate(&mut rig, VIRTIO_F_VERSION_1), 0xf | STATUS_NEEDS_RESET);
        assert!(broken_reason(&rig.fs).contains("serves 1 queues"));
    }

    #[test]
    fn reset_stops_the_vrings_before_it_returns_and_keeps_the_connection() {
        let backend = FakeBackend::start(Script::virtiofsd_like());
        let mut rig = rig(&backend.path);
        assert_eq!(activate(&mut rig, VIRTIO_F_VERSION_1), 0xf);
        let before = backend.requests().len();
        w(&mut rig.t, STATUS, 0);
        let stops = &backend.requests()[before..];
        assert_eq!(stops, [fake::SET_VRING_ENABLE, fake::GET_VRING_BASE, fake::SET_VRING_ENABLE, fake::GET_VRING_BASE]);
        assert_eq!(rig.fs.lock().unwrap().connection_id(), Some(1));

        assert_eq!(activate(&mut rig, VIRTIO_F_VERSION_1), 0xf);
        assert_eq!(rig.fs.lock().unwrap().connection_id(), Some(1), "same connection");
        assert_eq!(backend.requests().iter().filter(|&&r| r == fake::SET_OWNER).count(), 1);
        assert_eq!(backend.requests().iter().filter(|&&r| r == fake::SET_MEM_TABLE).count(), 2);
    }

    #[test]
    fn a_reset_during_activation_waits_for_the_start_then_stops() {
        let slow =
            Script { slow_on: Some((fake::SET_MEM_TABLE, Duration::from_millis(200))), ..Script::virtiofsd_like() };
        let backend = FakeBackend::start(slow);
        let mut rig = rig_with(fs_at(&backend.path).with_backend_timeout(Duration::from_secs(5)));
        assert_eq!(driver_ok(&mut rig.t, VIRTIO_F_VERSION_1), 0xf);
        w(&mut rig.t, STATUS, 0);
        // The reset returned after the start finished and both vrings were stopped again.
        let requests = backend.requests();
        assert_eq!(requests.iter().filter(|&&r| r == fake::GET_VRING_BASE).count(), NUM_QUEUES, "{requests:?}");
        assert_eq!(requests.last(), Some(&fake::GET_VRING_BASE));
        // The late "serving" is about an activation the reset ended: the device stays inactive,
        // but the connection it made is watched.
        rig.run_until("the connection", |fs| fs.connection_id().is_some());
        assert_eq!(rig.fs.lock().unwrap().phase(), None);
        assert_eq!(r(&mut rig.t, STATUS), 0);
        assert_eq!(activate(&mut rig, VIRTIO_F_VERSION_1), 0xf);
        assert_eq!(rig.fs.lock().unwrap().connection_id(), Some(1), "same connection");
    }

    #[test]
    fn a_reset_against_a_silent_backend_is_bounded_and_leaves_the_device_reachable() {
        let backend = FakeBackend::start(Script { silent_on: Some(fake::GET_VRING_BASE), ..Script::virtiofsd_like() });
        let mut rig = rig(&backend.path);
        assert_eq!(activate(&mut rig, VIRTIO_F_VERSION_1), 0xf);
        let fs = rig.fs.clone();
        let mut t = rig.t;
        let start = Instant::now();
        let vcpu = std::thread::spawn(move || {
            w(&mut t, STATUS, 0);
            r(&mut t, STATUS)
        });
        while backend.requests().last() != Some(&fake::GET_VRING_BASE) {
            std::thread::sleep(Duration::from_millis(5));
        }
        // While the vCPU waits, the device lock is free for the event loop.
        let locked = Instant::now();
        drop(fs.lock().unwrap());
        rig.em.run_with_timeout(50).unwrap();
        assert!(locked.elapsed() < Duration::from_millis(300), "device held for {:?}", locked.elapsed());
        assert_eq!(vcpu.join().unwrap(), 0);
        assert!(start.elapsed() < Duration::from_secs(3), "vCPU held for {:?}", start.elapsed());
        // The connection that failed to stop is dropped; the next activation reconnects.
        let deadline = Instant::now() + Duration::from_secs(10);
        while fs.lock().unwrap().connection_id().is_some() {
            assert!(Instant::now() < deadline, "the connection was not dropped");
            rig.em.run_with_timeout(50).unwrap();
        }
        assert_eq!(fs.lock().unwrap().phase(), None, "inactive, not broken");
        assert!(!fs.lock().unwrap().is_broken());
    }

    #[test]
    fn queues_the_driver_did_not_set_up_fail_the_driver_not_the_backend() {
        let backend = FakeBackend::start(Script::virtiofsd_like());
        let mut rig = rig(&backend.path);
        assert_eq!(negotiate(&mut rig.t, VIRTIO_F_VERSION_1), 0xb);
        w(&mut rig.t, STATUS, 0xf); // no queue is ready
        assert_eq!(r(&mut rig.t, STATUS), STATUS_FAILED);
        std::thread::sleep(Duration::from_millis(50));
        assert!(backend.requests().is_empty(), "the backend was never bothered");
    }

    #[test]
    fn snapshot_saves_the_used_index_the_backend_published() {
        let backend = FakeBackend::start(Script::virtiofsd_like());
        let mut rig = rig(&backend.path);
        assert_eq!(activate(&mut rig, VIRTIO_F_VERSION_1 | VIRTIO_RING_F_INDIRECT_DESC), 0xf);
        let q = &queues()[1];
        rig.mem.write_obj(3u16, GuestAddress(q.used + 2)).unwrap(); // as the relay would
        let snap = rig.fs.lock().unwrap().save();
        assert_eq!((snap.vrings[1].next_avail, snap.vrings[1].next_used), (3, 3));
        assert_eq!(snap.vrings[0].next_used, 0);
        assert_eq!((snap.tag.as_str(), snap.queue_size), ("rootfs", 256));
        assert_eq!(snap.acked_features, VIRTIO_F_VERSION_1 | VIRTIO_RING_F_INDIRECT_DESC);
        let _ = rig.irq.status();
    }
}
