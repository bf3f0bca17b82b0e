//! The vhost-user frontend of the virtio-fs device: one connection to a backend such as
//! virtiofsd and the three exchanges the device needs (handshake, start the vrings, stop them).
//!
//! Boundaries: this module speaks vhost-user through the `vhost` crate. It knows nothing about
//! the virtio-mmio transport, and nothing about FUSE, which flows between guest and backend only.
//!
//! Every exchange is bounded by a deadline, enforced by the device's `Watchdog`. The calls here
//! block: they run on the device's backend thread (`worker.rs`), never on a vCPU or the event
//! loop.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};
use vhost::vhost_user::message::VhostUserHeaderFlag;
use vhost::vhost_user::{Frontend, VhostUserFrontend, VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::watchdog::Watchdog;
use crate::devices::virtio::VIRTIO_F_VERSION_1;

/// vhost-user's own feature bit: rings start disabled and are enabled one by one.
pub const VHOST_USER_F_PROTOCOL_FEATURES: u64 = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();

/// MQ lets us check the backend serves every queue; REPLY_ACK makes the backend acknowledge each
/// message, so a refused message is seen at once rather than as a silent, dead ring.
const WANTED_PROTOCOL_FEATURES: VhostUserProtocolFeatures =
    VhostUserProtocolFeatures::MQ.union(VhostUserProtocolFeatures::REPLY_ACK);

/// Pause between connection attempts while the backend's socket is not (yet) accepting.
const CONNECT_RETRY: Duration = Duration::from_millis(50);

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("cannot connect: {0}")]
    Connect(Errno),
    #[error("{step}: no answer within {limit:?}")]
    Timeout { step: &'static str, limit: Duration },
    #[error("{step}: {source}")]
    Message { step: &'static str, source: vhost::Error },
    #[error("the backend lacks virtio features {missing:#x} (it offers {offered:#x})")]
    Features { missing: u64, offered: u64 },
    #[error("the backend serves {have} queues; the device needs {need}")]
    Queues { have: u64, need: usize },
    #[error("guest memory region at {0:#x} is not backed by a file the backend can map")]
    Memory(u64),
    #[error("guest memory region at {0:#x} is a private mapping (a restored snapshot's memory file): the backend would not see the guest's writes")]
    PrivateMemory(u64),
    #[error("vring {0} does not lie inside one guest memory region")]
    Vring(usize),
    #[error("cannot set up the exchange: {0}")]
    Io(std::io::Error),
    #[error("the backend closed the connection")]
    HungUp,
    #[error("the backend broke the shadow vring rules: {0}")]
    Relay(String),
}

/// When an exchange (or a series of them) must be over, and the limit it came from, for the
/// error message.
#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    at: Instant,
    limit: Duration,
}

impl Deadline {
    pub fn after(limit: Duration) -> Self {
        Self { at: Instant::now() + limit, limit }
    }

    pub fn at(&self) -> Instant {
        self.at
    }
}

/// What the backend needs to serve one vring: the queue the driver set up, the eventfd the
/// transport signals on QueueNotify (kick) and the one the backend signals when it used buffers
/// (call).
pub struct Vring<'a> {
    pub queue: &'a Queue,
    pub kick: &'a EventFd,
    pub call: &'a EventFd,
}

/// A live connection to a vhost-user backend, past the handshake.
pub struct Backend {
    frontend: Frontend,
    /// A second handle on the connection, for the watchdog and the event loop's hang-up watch.
    sock: UnixStream,
    /// Virtio features the backend offers.
    features: u64,
}

impl Backend {
    /// Connects and runs the handshake (owner, features, protocol features, queue count).
    pub fn connect(path: &Path, queues: usize, deadline: Deadline, watchdog: &Watchdog) -> Result<Self, BackendError> {
        let stream = connect_until(path, deadline.at)?;
        let sock = stream.try_clone().map_err(BackendError::Io)?;
        let mut backend = Self { frontend: Frontend::from_stream(stream, queues as u64), sock, features: 0 };
        backend.features = backend.bounded(deadline, watchdog, |fe| handshake(fe, queues))?;
        Ok(backend)
    }

    /// A new handle on the connection's socket (for the event loop's hang-up watch).
    pub fn try_clone_socket(&self) -> std::io::Result<UnixStream> {
        self.sock.try_clone()
    }

    /// Tells the backend the driver's features and guest memory, then starts every vring at the
    /// queue's next available index.
    pub fn start(
        &mut self,
        mem: &GuestMemoryMmap,
        driver_features: u64,
        vrings: &[Vring<'_>],
        deadline: Deadline,
        watchdog: &Watchdog,
    ) -> Result<(), BackendError> {
        let missing = driver_features & !self.features;
        if missing != 0 {
            return Err(BackendError::Features { missing, offered: self.features });
        }
        let regions = memory_regions(mem)?;
        let configs =
            vrings.iter().enumerate().map(|(i, v)| vring_config(mem, i, v.queue)).collect::<Result<Vec<_>, _>>()?;
        self.bounded(deadline, watchdog, |fe| {
            step("SET_FEATURES", fe.set_features(driver_features | VHOST_USER_F_PROTOCOL_FEATURES))?;
            step("SET_MEM_TABLE", fe.set_mem_table(&regions))?;
            for (i, (v, cfg)) in vrings.iter().zip(&configs).enumerate() {
                step("SET_VRING_NUM", fe.set_vring_num(i, v.queue.size()))?;
                step("SET_VRING_ADDR", fe.set_vring_addr(i, cfg))?;
                step("SET_VRING_BASE", fe.set_vring_base(i, v.queue.next_avail()))?;
                step("SET_VRING_CALL", fe.set_vring_call(i, v.call))?;
                step("SET_VRING_KICK", fe.set_vring_kick(i, v.kick))?;
                step("SET_VRING_ENABLE", fe.set_vring_enable(i, true))?;
            }
            Ok(())
        })
    }

    /// Stops the first `count` vrings; returns where the backend stopped in each (its next
    /// available index).
    pub fn stop(&mut self, count: usize, deadline: Deadline, watchdog: &Watchdog) -> Result<Vec<u32>, BackendError> {
        self.bounded(deadline, watchdog, |fe| {
            (0..count)
                .map(|i| {
                    step("SET_VRING_ENABLE", fe.set_vring_enable(i, false))?;
                    step("GET_VRING_BASE", fe.get_vring_base(i))
                })
                .collect()
        })
    }

    /// Runs `f` against the backend; if it has not finished by the deadline, the watchdog shuts
    /// the connection down (it is unusable from then on) and the step that was waiting reports
    /// the timeout.
    fn bounded<T>(
        &mut self,
        deadline: Deadline,
        watchdog: &Watchdog,
        f: impl FnOnce(&mut Frontend) -> Result<T, BackendError>,
    ) -> Result<T, BackendError> {
        let frontend = &mut self.frontend;
        let (res, fired) = watchdog.bound(&self.sock, deadline.at, || f(frontend));
        if !fired {
            return res;
        }
        let limit = deadline.limit;
        Err(match res {
            Err(BackendError::Message { step, .. }) => BackendError::Timeout { step, limit },
            Err(e) => e,
            Ok(_) => BackendError::Timeout { step: "the last message", limit },
        })
    }
}

/// SET_OWNER, then features and protocol features. Returns the backend's virtio features.
fn handshake(fe: &mut Frontend, queues: usize) -> Result<u64, BackendError> {
    step("SET_OWNER", fe.set_owner())?;
    let offered = step("GET_FEATURES", fe.get_features())?;
    let needed = VIRTIO_F_VERSION_1 | VHOST_USER_F_PROTOCOL_FEATURES;
    if offered & needed != needed {
        return Err(BackendError::Features { missing: needed & !offered, offered });
    }
    let protocol = step("GET_PROTOCOL_FEATURES", fe.get_protocol_features())? & WANTED_PROTOCOL_FEATURES;
    step("SET_PROTOCOL_FEATURES", fe.set_protocol_features(protocol))?;
    if protocol.contains(VhostUserProtocolFeatures::REPLY_ACK) {
        fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    }
    if protocol.contains(VhostUserProtocolFeatures::MQ) {
        let have = step("GET_QUEUE_NUM", fe.get_queue_num())?;
        if have < queues as u64 {
            return Err(BackendError::Queues { have, need: queues });
        }
    }
    Ok(offered)
}

fn step<T>(step: &'static str, res: vhost::Result<T>) -> Result<T, BackendError> {
    res.map_err(|source| BackendError::Message { step, source })
}

/// Connects to the backend's socket without ever blocking past `deadline`. A socket that is not
/// there yet, not listening yet or has a full backlog is retried: the backend may be starting.
fn connect_until(path: &Path, deadline: Instant) -> Result<UnixStream, BackendError> {
    let addr = UnixAddr::new(path).map_err(BackendError::Connect)?;
    loop {
        let fd = socket::socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            None,
        )
        .map_err(BackendError::Connect)?;
        match socket::connect(fd.as_raw_fd(), &addr) {
            Ok(()) => {
                let stream = UnixStream::from(fd);
                stream.set_nonblocking(false).map_err(BackendError::Io)?;
                return Ok(stream);
            }
            Err(Errno::ENOENT | Errno::ECONNREFUSED | Errno::EAGAIN) if Instant::now() + CONNECT_RETRY < deadline => {
                std::thread::sleep(CONNECT_RETRY);
            }
            Err(e) => return Err(BackendError::Connect(e)),
        }
    }
}

/// The SET_MEM_TABLE payload: every region of the backend's memory (the relay's shared region)
/// with its memfd and offset. Only shared mappings qualify: the backend maps the file shared, so
/// a private copy-on-write mapping's pages would differ between the VMM and the backend.
pub fn memory_regions(mem: &GuestMemoryMmap) -> Result<Vec<VhostUserMemoryRegionInfo>, BackendError> {
    use vm_memory::GuestMemoryRegion;
    mem.iter()
        .map(|r| {
            if r.flags() & libc::MAP_SHARED == 0 {
                return Err(BackendError::PrivateMemory(r.start_addr().0));
            }
            VhostUserMemoryRegionInfo::from_guest_region(r).map_err(|_| BackendError::Memory(r.start_addr().0))
        })
        .collect()
}

/// SET_VRING_ADDR takes addresses in this process (the backend maps them through the memory
/// table), so each ring must lie inside one region.
pub fn vring_config(mem: &GuestMemoryMmap, index: usize, q: &Queue) -> Result<VringConfigData, BackendError> {
    let size = usize::from(q.size());
    let host = |gpa: u64, len: usize| {
        mem.get_slice(GuestAddress(gpa), len)
            .and_then(|_| mem.get_host_address(GuestAddress(gpa)))
            .map(|p| p as u64)
            .map_err(|_| BackendError::Vring(index))
    };
    Ok(VringConfigData {
        queue_max_size: q.max_size(),
        queue_size: q.size(),
        flags: 0,
        desc_table_addr: host(q.desc_table(), 16 * size)?,
        used_ring_addr: host(q.used_ring(), 6 + 8 * size)?,
        avail_ring_addr: host(q.avail_ring(), 6 + 2 * size)?,
        log_addr: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::create_guest_memory;
    use crate::thread::unconfined;
    use std::os::unix::net::UnixListener;

    fn watchdog() -> Watchdog {
        Watchdog::spawn("test-watchdog".into(), unconfined(), &Default::default()).unwrap()
    }

    #[test]
    fn memory_table_names_the_memfd_of_every_region() {
        let mem = create_guest_memory(16 << 20).unwrap();
        let regions = memory_regions(&mem).unwrap();
        assert_eq!(regions.len(), 1);
        assert_eq!((regions[0].guest_phys_addr, regions[0].memory_size, regions[0].mmap_offset), (0, 16 << 20, 0));
        assert!(regions[0].mmap_handle >= 0);
        assert_eq!(regions[0].userspace_addr, mem.get_host_address(GuestAddress(0)).unwrap() as u64);
    }

    #[test]
    fn anonymous_or_private_memory_cannot_be_shared() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        assert!(matches!(memory_regions(&mem), Err(BackendError::PrivateMemory(0) | BackendError::Memory(0))));
        // A restored snapshot's memory file, mapped private.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory");
        std::fs::File::create(&path).unwrap().set_len(16 << 20).unwrap();
        let private = crate::memory::map_snapshot_memory(std::fs::File::open(&path).unwrap(), &path, 16 << 20).unwrap();
        assert!(matches!(memory_regions(&private), Err(BackendError::PrivateMemory(0))));
    }

    #[test]
    fn vring_addresses_are_translated_and_checked() {
        let mem = create_guest_memory(16 << 20).unwrap();
        let base = mem.get_host_address(GuestAddress(0)).unwrap() as u64;
        let mut q = Queue::new(256).unwrap();
        q.set_size(8);
        q.set_desc_table_address(Some(0x1000), Some(0));
        q.set_avail_ring_address(Some(0x2000), Some(0));
        q.set_used_ring_address(Some(0x3000), Some(0));
        let cfg = vring_config(&mem, 1, &q).unwrap();
        assert_eq!(
            (cfg.desc_table_addr, cfg.avail_ring_addr, cfg.used_ring_addr),
            (base + 0x1000, base + 0x2000, base + 0x3000)
        );
        assert_eq!((cfg.queue_size, cfg.queue_max_size), (8, 256));
        // A used ring running off the end of guest memory.
        q.set_used_ring_address(Some((16 << 20) - 8), Some(0));
        assert!(matches!(vring_config(&mem, 1, &q), Err(BackendError::Vring(1))));
    }

    #[test]
    fn a_silent_backend_times_out_at_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fs.sock");
        let _listener = UnixListener::bind(&path).unwrap(); // never accepts, never answers
        let start = Instant::now();
        let err = Backend::connect(&path, 2, Deadline::after(Duration::from_millis(300)), &watchdog()).err().unwrap();
        assert_eq!(err.to_string(), "GET_FEATURES: no answer within 300ms");
        assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    }

    #[test]
    fn a_missing_socket_fails_after_retrying_until_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let deadline = Deadline::after(Duration::from_millis(200));
        let err = Backend::connect(&dir.path().join("absent.sock"), 2, deadline, &watchdog()).err().unwrap();
        assert!(matches!(err, BackendError::Connect(Errno::ENOENT)), "{err}");
    }
}
