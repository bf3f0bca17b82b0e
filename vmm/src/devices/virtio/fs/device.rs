//! virtio-fs device semantics (virtio spec 5.11): device type 26, a config space holding the tag
//! and the number of request queues, one hiprio queue plus one request queue, and the device's
//! life around its vhost-user backend.
//!
//! The backend is connected on the first DRIVER_OK (so the pod's virtiofsd may start alongside
//! the VMM) and kept across driver resets, which only stop the vrings. Activation runs on the
//! vCPU thread that wrote DRIVER_OK, so every backend exchange is bounded by `BACKEND_TIMEOUT`.
//! A backend that fails, refuses a message or hangs up breaks the device
//! (DEVICE_NEEDS_RESET); the rest of the VM carries on.

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::persist::FsSnapshot;
use super::vhost_user::{Backend, BackendError, Deadline, Vring};
use crate::config::FsConfig;
use crate::devices::virtio::persist::QueueSnapshot;
use crate::devices::virtio::{
    read_config_bytes, validate_queues, DeviceError, DeviceState, IrqTrigger, VirtioDevice, TYPE_FS,
    VIRTIO_F_VERSION_1, VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_INT_VRING,
};

pub const NUM_REQUEST_QUEUES: u32 = 1;
/// The hiprio queue, then the request queues.
pub const NUM_QUEUES: usize = 1 + NUM_REQUEST_QUEUES as usize;
pub const TAG_LEN: usize = 36;
/// tag[36] then num_request_queues (le32).
pub const CONFIG_LEN: usize = TAG_LEN + 4;
pub const VIRTIO_RING_F_INDIRECT_DESC: u64 = 1 << 28;
pub const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;
/// What the driver is offered. The ring features concern only driver and backend (the VMM never
/// walks these rings); a backend lacking one the driver acked fails activation.
pub const AVAIL_FEATURES: u64 = VIRTIO_F_VERSION_1 | VIRTIO_RING_F_INDIRECT_DESC | VIRTIO_RING_F_EVENT_IDX;
/// Bound on each activation (connect, handshake, vring setup) and each reset, start to end.
pub const BACKEND_TIMEOUT: Duration = Duration::from_secs(5);
/// Backend failures are logged at error level at most this often; a guest that resets and
/// re-activates in a loop gets the rest at debug level.
const FAILURE_LOG_PERIOD: Duration = Duration::from_secs(10);

pub struct Active {
    mem: GuestMemoryMmap,
    queues: Vec<Queue>,
    irq: IrqTrigger,
}

/// The event loop's own handle on a backend connection, registered for hang-up.
pub struct Watch {
    /// Which connection (see `Fs::backend_id`).
    pub id: u64,
    pub sock: UnixStream,
}

pub struct Fs {
    name: String,
    tag: String,
    socket: PathBuf,
    config: [u8; CONFIG_LEN],
    queue_sizes: [u16; NUM_QUEUES],
    acked_features: u64,
    /// Kicks: the transport signals them on QueueNotify and the backend reads them.
    queue_evts: [EventFd; NUM_QUEUES],
    /// Calls: the backend signals them when it used buffers; the event loop turns them into
    /// interrupts.
    pub(super) call_evts: [EventFd; NUM_QUEUES],
    /// Signalled whenever the connection comes or goes, so the event loop re-syncs its watch.
    pub(super) conn_evt: EventFd,
    backend: Option<Backend>,
    /// Numbers connections, so the event loop can tell whether its watch is on the current one.
    backend_id: u64,
    pub(super) watch: Option<Watch>,
    state: DeviceState<Active>,
    timeout: Duration,
    last_failure_log: Option<Instant>,
}

impl Fs {
    pub fn new(cfg: &FsConfig, index: usize) -> std::io::Result<Self> {
        let tag = cfg.tag.as_bytes();
        if tag.is_empty() || tag.len() > TAG_LEN {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "virtio-fs tag must be 1..=36 bytes"));
        }
        let mut config = [0u8; CONFIG_LEN];
        config[..tag.len()].copy_from_slice(tag);
        config[TAG_LEN..].copy_from_slice(&NUM_REQUEST_QUEUES.to_le_bytes());
        let evt = || EventFd::new(libc::EFD_NONBLOCK);
        Ok(Self {
            name: format!("fs{index}"),
            tag: cfg.tag.clone(),
            socket: cfg.socket.clone(),
            config,
            queue_sizes: [cfg.queue_size; NUM_QUEUES],
            acked_features: 0,
            queue_evts: [evt()?, evt()?],
            call_evts: [evt()?, evt()?],
            conn_evt: evt()?,
            backend: None,
            backend_id: 0,
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

    /// Which connection is current, if any (the event loop compares its watch against it).
    pub fn backend_id(&self) -> Option<u64> {
        self.backend.as_ref().map(|_| self.backend_id)
    }

    pub fn backend_socket(&self) -> Option<std::io::Result<UnixStream>> {
        self.backend.as_ref().map(Backend::try_clone_socket)
    }

    /// The backend owns the ring positions. Each vring is saved at the used index the backend
    /// published to the driver: a fresh backend restarts there, so requests the old one had
    /// taken but not completed are offered again. Open files live in the backend and are not
    /// part of this state.
    pub fn snapshot(&self) -> FsSnapshot {
        FsSnapshot {
            tag: self.tag.clone(),
            socket: self.socket.display().to_string(),
            queue_size: self.queue_sizes[0],
            acked_features: self.acked_features,
            vrings: match &self.state {
                DeviceState::Active(a) => a.queues.iter().map(|q| published_position(&a.mem, q)).collect(),
                _ => vec![],
            },
            broken: self.state.is_broken(),
        }
    }

    /// The backend used buffers on some queue: tell the driver.
    pub fn backend_used_buffers(&self) {
        if let DeviceState::Active(a) = &self.state {
            a.irq.trigger(VIRTIO_MMIO_INT_VRING);
        }
    }

    /// The event loop saw the backend close the current connection.
    pub fn backend_hung_up(&mut self) {
        if self.backend.is_none() {
            return;
        }
        if matches!(self.state, DeviceState::Active(_)) {
            self.fail(BackendError::HungUp);
        } else {
            self.report(&BackendError::HungUp, false);
            self.drop_backend();
        }
    }

    /// Connects if needed, then hands the backend guest memory and the vrings. One deadline
    /// bounds the whole exchange. The event loop hears of a new connection only afterwards
    /// (`activate`), so it never waits on this device's lock while a backend is slow.
    /// A connection that fails to start is dropped.
    fn start(&mut self, mem: &GuestMemoryMmap, queues: &[Queue]) -> Result<(), BackendError> {
        let deadline = Deadline::after(self.timeout);
        let mut backend = match self.backend.take() {
            Some(b) => b,
            None => {
                self.backend_id += 1;
                Backend::connect(&self.socket, NUM_QUEUES, deadline)?
            }
        };
        let vrings: Vec<Vring<'_>> = queues
            .iter()
            .zip(&self.queue_evts)
            .zip(&self.call_evts)
            .map(|((queue, kick), call)| Vring { queue, kick, call })
            .collect();
        backend.start(mem, self.acked_features, &vrings, deadline)?;
        self.backend = Some(backend);
        Ok(())
    }

    /// Stops serving until the driver resets the device, and tells the driver so.
    fn fail(&mut self, err: BackendError) {
        self.report(&err, true);
        if let DeviceState::Active(a) = &self.state {
            a.irq.trigger(VIRTIO_MMIO_INT_CONFIG);
        }
        self.drop_backend();
        self.state = DeviceState::Broken(DeviceError::Backend(err.to_string()));
    }

    /// The one log line of a backend failure, naming tag and socket. `broken`: the device
    /// stopped serving (otherwise it was inactive and the next activation reconnects).
    fn report(&mut self, err: &BackendError, broken: bool) {
        let now = Instant::now();
        let loud = self.last_failure_log.is_none_or(|t| now.duration_since(t) >= FAILURE_LOG_PERIOD);
        let (device, tag, socket) = (&self.name, &self.tag, self.socket.display());
        match (loud, broken) {
            (true, true) => tracing::error!(%device, %tag, %socket, error = %err,
                "virtio-fs backend failed; the device needs a reset"),
            (true, false) => tracing::error!(%device, %tag, %socket, error = %err,
                "virtio-fs backend failed while the device was inactive; the next activation reconnects"),
            (false, _) => {
                tracing::debug!(%device, %tag, %socket, error = %err, broken, "virtio-fs backend failed again")
            }
        }
        if loud {
            self.last_failure_log = Some(now);
        }
    }

    fn drop_backend(&mut self) {
        if self.backend.take().is_some() {
            self.connection_changed();
        }
    }

    fn connection_changed(&self) {
        if let Err(e) = self.conn_evt.write(1) {
            tracing::warn!(device = %self.name, error = %e, "cannot wake the event loop about the backend connection");
        }
    }
}

fn published_position(mem: &GuestMemoryMmap, q: &Queue) -> QueueSnapshot {
    let mut s = QueueSnapshot::from(q);
    if let Ok(used) = q.used_idx(mem, Ordering::Acquire) {
        s.next_avail = used.0;
        s.next_used = used.0;
    }
    s
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

    /// Bad queues are the driver's fault (the transport fails the driver); a backend problem is
    /// the device's, reported as DEVICE_NEEDS_RESET.
    fn activate(&mut self, mem: GuestMemoryMmap, queues: Vec<Queue>, irq: IrqTrigger) -> Result<(), DeviceError> {
        validate_queues(&mem, &queues)?;
        if queues.len() != NUM_QUEUES {
            return Err(DeviceError::QueueNotReady(queues.len()));
        }
        let res = self.start(&mem, &queues);
        self.state = DeviceState::Active(Active { mem, queues, irq });
        match res {
            Ok(()) => tracing::debug!(device = %self.name, tag = %self.tag, "virtio-fs backend serving"),
            Err(e) => self.fail(e),
        }
        self.connection_changed();
        Ok(())
    }

    /// Stops the vrings but keeps the connection, as a backend serves one connection only.
    fn reset(&mut self) {
        if matches!(self.state, DeviceState::Active(_)) {
            if let Some(Err(e)) = self.backend.as_mut().map(|b| b.stop(NUM_QUEUES, Deadline::after(self.timeout))) {
                self.report(&e, false);
                self.drop_backend();
            }
        }
        self.state = DeviceState::Inactive;
        self.acked_features = 0;
    }

    fn is_broken(&self) -> bool {
        self.state.is_broken()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::bus::BusDevice;
    use crate::devices::virtio::chain::test_utils::TestQueue;
    use crate::devices::virtio::fs::test_utils::{self as fake, FakeBackend, Script};
    use crate::devices::virtio::mmio::{MmioTransport, STATUS_FAILED, STATUS_NEEDS_RESET};
    use crate::memory::create_guest_memory;
    use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
    use std::path::Path;
    use std::sync::{Arc, Mutex};
    use vm_memory::{Bytes, GuestAddress};

    const STATUS: u64 = 0x070;
    const INTERRUPT_STATUS: u64 = 0x060;
    const INTERRUPT_ACK: u64 = 0x064;

    fn fs_at(socket: &Path) -> Fs {
        let cfg = FsConfig { tag: "rootfs".into(), socket: socket.to_owned(), queue_size: 256 };
        Fs::new(&cfg, 0).unwrap().with_backend_timeout(Duration::from_millis(500))
    }

    /// A transport over memfd-backed guest memory (the backend maps it) and the device.
    struct Rig {
        t: MmioTransport,
        fs: Arc<Mutex<Fs>>,
        mem: GuestMemoryMmap,
        irq: IrqTrigger,
    }

    fn rig(socket: &Path) -> Rig {
        rig_with(fs_at(socket))
    }

    fn rig_with(fs: Fs) -> Rig {
        let mem = create_guest_memory(16 << 20).unwrap();
        let fs = Arc::new(Mutex::new(fs));
        let irq = IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let t = MmioTransport::new("fs0".into(), mem.clone(), fs.clone(), irq.clone()).unwrap();
        Rig { t, fs, mem, irq }
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
            w(t, 0x024, sel);
            w(t, 0x020, (features >> (32 * sel)) as u32);
        }
        w(t, STATUS, 0xb);
        r(t, STATUS)
    }

    fn queues() -> [TestQueue; NUM_QUEUES] {
        [TestQueue::new(0x1_0000, 8), TestQueue::new(0x2_0000, 8)]
    }

    /// Sets up both queues and writes DRIVER_OK; returns the status read back.
    fn driver_ok(t: &mut MmioTransport, features: u64) -> u32 {
        assert_eq!(negotiate(t, features), 0xb);
        for (i, q) in queues().iter().enumerate() {
            w(t, 0x030, i as u32);
            w(t, 0x038, u32::from(q.size));
            w(t, 0x080, q.desc as u32);
            w(t, 0x090, q.avail as u32);
            w(t, 0x0a0, q.used as u32);
            w(t, 0x044, 1);
        }
        w(t, STATUS, 0xf);
        r(t, STATUS)
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
            assert!(Fs::new(&cfg, 0).is_err(), "tag {tag:?}");
        }
        let cfg = FsConfig { tag: "t".repeat(TAG_LEN), socket: "/tmp/s".into(), queue_size: 8 };
        let mut tag = [0u8; TAG_LEN];
        Fs::new(&cfg, 0).unwrap().read_config(0, &mut tag);
        assert_eq!(tag, [b't'; TAG_LEN], "a 36-byte tag fills the field without a NUL");
    }

    #[test]
    fn feature_negotiation_through_the_transport() {
        let mut rig = rig(Path::new("/nonexistent/fs.sock"));
        let offered = |t: &mut MmioTransport| {
            w(t, 0x014, 0);
            let lo = r(t, 0x010);
            w(t, 0x014, 1);
            u64::from(lo) | (u64::from(r(t, 0x010)) << 32)
        };
        assert_eq!(offered(&mut rig.t), VIRTIO_F_VERSION_1 | VIRTIO_RING_F_INDIRECT_DESC | VIRTIO_RING_F_EVENT_IDX);
        assert_eq!(r(&mut rig.t, 0x008), TYPE_FS);

        // VIRTIO_FS_F_NOTIFICATION (bit 0) is not offered: negotiation fails.
        assert_eq!(negotiate(&mut rig.t, VIRTIO_F_VERSION_1 | 1) & 0x8, 0);
        w(&mut rig.t, STATUS, 0);
        // Without VERSION_1 it fails too.
        assert_eq!(negotiate(&mut rig.t, VIRTIO_RING_F_EVENT_IDX) & 0x8, 0);
        w(&mut rig.t, STATUS, 0);
        assert_eq!(negotiate(&mut rig.t, VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX), 0xb);
        assert_eq!(rig.fs.lock().unwrap().acked_features, VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX);
        w(&mut rig.t, STATUS, 0);
        assert_eq!(rig.fs.lock().unwrap().acked_features, 0, "reset forgets the driver's features");
    }

    #[test]
    fn activation_hands_the_backend_memory_and_both_vrings() {
        let backend = FakeBackend::start(Script::virtiofsd_like());
        let mut rig = rig(&backend.path);
        assert_eq!(driver_ok(&mut rig.t, VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX), 0xf);
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
        assert!(!rig.fs.lock().unwrap().is_broken());
        let snap = rig.fs.lock().unwrap().snapshot();
        assert_eq!(snap.vrings.len(), NUM_QUEUES);
        assert_eq!((snap.vrings[1].desc_table, snap.vrings[1].size), (0x2_0000, 8));
    }

    #[test]
    fn backend_calls_become_vring_interrupts_and_a_hang_up_breaks_the_device() {
        let backend = FakeBackend::start(Script::virtiofsd_like());
        let mut rig = rig(&backend.path);
        let mut em: EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>> = EventManager::new().unwrap();
        em.add_subscriber(rig.fs.clone());
        assert_eq!(driver_ok(&mut rig.t, VIRTIO_F_VERSION_1), 0xf);
        em.run_with_timeout(100).unwrap(); // the connection watch goes on
        assert!(rig.fs.lock().unwrap().watch.is_some());

        // What the backend does after it used a buffer on the request queue.
        rig.fs.lock().unwrap().call_evts[1].write(1).unwrap();
        em.run_with_timeout(100).unwrap();
        assert_eq!(r(&mut rig.t, INTERRUPT_STATUS), VIRTIO_MMIO_INT_VRING);
        w(&mut rig.t, INTERRUPT_ACK, VIRTIO_MMIO_INT_VRING);

        backend.hang_up();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !rig.fs.lock().unwrap().is_broken() {
            assert!(Instant::now() < deadline, "hang-up not noticed");
            em.run_with_timeout(100).unwrap();
        }
        assert_eq!(r(&mut rig.t, STATUS), 0xf | STATUS_NEEDS_RESET);
        assert_eq!(r(&mut rig.t, INTERRUPT_STATUS), VIRTIO_MMIO_INT_CONFIG, "the driver is told");
        assert!(broken_reason(&rig.fs).contains("closed the connection"));
        em.run_with_timeout(100).unwrap();
        assert!(rig.fs.lock().unwrap().watch.is_none(), "the dead connection is no longer watched");
        assert!(rig.fs.lock().unwrap().snapshot().broken);

        // A driver reset clears the failure; the next DRIVER_OK would connect afresh.
        w(&mut rig.t, STATUS, 0);
        assert_eq!(r(&mut rig.t, STATUS), 0);
    }

    #[test]
    fn a_refused_message_breaks_the_device() {
        let backend = FakeBackend::start(Script { refuse: Some(fake::SET_MEM_TABLE), ..Script::virtiofsd_like() });
        let mut rig = rig(&backend.path);
        assert_eq!(driver_ok(&mut rig.t, VIRTIO_F_VERSION_1), 0xf | STATUS_NEEDS_RESET);
        assert!(broken_reason(&rig.fs).contains("SET_MEM_TABLE"), "{}", broken_reason(&rig.fs));
        assert_eq!(rig.fs.lock().unwrap().backend_id(), None, "the connection is dropped");
    }

    #[test]
    fn a_silent_backend_breaks_the_device_within_the_timeout() {
        let backend = FakeBackend::start(Script { silent_on: Some(fake::SET_MEM_TABLE), ..Script::virtiofsd_like() });
        let mut rig = rig(&backend.path);
        let start = Instant::now();
        assert_eq!(driver_ok(&mut rig.t, VIRTIO_F_VERSION_1), 0xf | STATUS_NEEDS_RESET);
        assert!(start.elapsed() < Duration::from_secs(3), "vCPU held for {:?}", start.elapsed());
        let reason = broken_reason(&rig.fs);
        assert!(reason.contains("SET_MEM_TABLE: no answer within 500ms"), "{reason}");
    }

    #[test]
    fn the_event_loop_never_waits_on_a_slow_activation() {
        let backend = FakeBackend::start(Script { silent_on: Some(fake::SET_MEM_TABLE), ..Script::virtiofsd_like() });
        let mut rig = rig_with(fs_at(&backend.path).with_backend_timeout(Duration::from_secs(1)));
        let fs = rig.fs.clone();
        let mut em: EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>> = EventManager::new().unwrap();
        em.add_subscriber(fs.clone());
        // The vCPU thread: DRIVER_OK holds the device for the whole (silent) exchange.
        let vcpu = std::thread::spawn(move || driver_ok(&mut rig.t, VIRTIO_F_VERSION_1));
        while backend.requests().len() < 6 {
            std::thread::sleep(Duration::from_millis(5)); // connected, handshake done
        }
        let start = Instant::now();
        em.run_with_timeout(200).unwrap();
        assert!(start.elapsed() < Duration::from_millis(700), "event loop blocked for {:?}", start.elapsed());
        assert_eq!(vcpu.join().unwrap(), 0xf | STATUS_NEEDS_RESET);
    }

    #[test]
    fn no_backend_breaks_the_device() {
        let dir = tempfile::tempdir().unwrap();
        let mut rig = rig(&dir.path().join("absent.sock"));
        assert_eq!(driver_ok(&mut rig.t, VIRTIO_F_VERSION_1), 0xf | STATUS_NEEDS_RESET);
        assert!(broken_reason(&rig.fs).contains("cannot connect"));
    }

    #[test]
    fn a_backend_without_a_ring_feature_the_driver_acked_breaks_the_device() {
        let script = Script {
            features: VIRTIO_F_VERSION_1 | super::super::vhost_user::VHOST_USER_F_PROTOCOL_FEATURES,
            ..Script::virtiofsd_like()
        };
        let backend = FakeBackend::start(script);
        let mut rig = rig(&backend.path);
        assert_eq!(driver_ok(&mut rig.t, VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX), 0xf | STATUS_NEEDS_RESET);
        assert!(broken_reason(&rig.fs).contains("lacks virtio features 0x20000000"), "{}", broken_reason(&rig.fs));
    }

    #[test]
    fn a_backend_with_too_few_queues_breaks_the_device() {
        let backend = FakeBackend::start(Script { queue_num: 1, ..Script::virtiofsd_like() });
        let mut rig = rig(&backend.path);
        assert_eq!(driver_ok(&mut rig.t, VIRTIO_F_VERSION_1), 0xf | STATUS_NEEDS_RESET);
        assert!(broken_reason(&rig.fs).contains("serves 1 queues"));
    }

    #[test]
    fn reset_stops_the_vrings_and_keeps_the_connection() {
        let backend = FakeBackend::start(Script::virtiofsd_like());
        let mut rig = rig(&backend.path);
        assert_eq!(driver_ok(&mut rig.t, VIRTIO_F_VERSION_1), 0xf);
        let before = backend.requests().len();
        w(&mut rig.t, STATUS, 0);
        let stops = &backend.requests()[before..];
        assert_eq!(stops, [fake::SET_VRING_ENABLE, fake::GET_VRING_BASE, fake::SET_VRING_ENABLE, fake::GET_VRING_BASE]);
        assert_eq!(rig.fs.lock().unwrap().backend_id(), Some(1));

        assert_eq!(driver_ok(&mut rig.t, VIRTIO_F_VERSION_1), 0xf);
        assert_eq!(rig.fs.lock().unwrap().backend_id(), Some(1), "same connection");
        assert_eq!(backend.requests().iter().filter(|&&r| r == fake::SET_OWNER).count(), 1);
        assert_eq!(backend.requests().iter().filter(|&&r| r == fake::SET_MEM_TABLE).count(), 2);
    }

    #[test]
    fn queues_the_driver_did_not_set_up_fail_the_driver_not_the_backend() {
        let backend = FakeBackend::start(Script::virtiofsd_like());
        let mut rig = rig(&backend.path);
        assert_eq!(negotiate(&mut rig.t, VIRTIO_F_VERSION_1), 0xb);
        w(&mut rig.t, STATUS, 0xf); // no queue is ready
        assert_eq!(r(&mut rig.t, STATUS), STATUS_FAILED);
        assert!(backend.requests().is_empty(), "the backend was never bothered");
    }

    #[test]
    fn snapshot_saves_the_used_index_the_backend_published() {
        let backend = FakeBackend::start(Script::virtiofsd_like());
        let mut rig = rig(&backend.path);
        assert_eq!(driver_ok(&mut rig.t, VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX), 0xf);
        let q = &queues()[1];
        rig.mem.write_obj(3u16, GuestAddress(q.used + 2)).unwrap(); // as the backend would
        let snap = rig.fs.lock().unwrap().snapshot();
        assert_eq!((snap.vrings[1].next_avail, snap.vrings[1].next_used), (3, 3));
        assert_eq!(snap.vrings[0].next_used, 0);
        assert_eq!((snap.tag.as_str(), snap.queue_size), ("rootfs", 256));
        assert_eq!(snap.acked_features, VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX);
        let json = serde_json::to_string(&snap).unwrap();
        assert_eq!(serde_json::from_str::<FsSnapshot>(&json).unwrap(), snap);
        let _ = rig.irq.status();
    }
}
