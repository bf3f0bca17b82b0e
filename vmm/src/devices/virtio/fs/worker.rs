//! The virtio-fs device's backend thread (`<device>-backend`): every exchange with the
//! vhost-user backend (connect, handshake, vring start and stop) runs here, one at a time and in
//! the order asked, never on a vCPU thread or the event loop.
//!
//! Why a thread of its own: the exchanges block (the `vhost` crate's calls are synchronous) and
//! need socket calls (socket, connect, sendmsg/recvmsg with SCM_RIGHTS) that neither a vCPU,
//! which runs guest code, nor the event loop, which serves every other device, should wait on or
//! be allowed. Here they sit behind their own small seccomp list (`seccomp/fs_backend.rs`), and
//! a slow backend delays only this device.
//!
//! The device posts requests: DRIVER_OK posts `Start` and returns at once (the device finishes
//! activation afterwards, as the virtio spec allows; kicks meanwhile stay counted in the kick
//! eventfds, which the backend is handed with the vrings); a reset posts `Stop` and waits for it
//! outside the device lock. Outcomes come back as `Report`s, with an eventfd that wakes the
//! event loop. This thread alone owns the connection, so no lock is held across an exchange.

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;

use virtio_queue::{Queue, QueueState};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::vhost_user::{Backend, BackendError, Deadline, Vring};
use super::watchdog::Watchdog;
use super::NUM_QUEUES;
use crate::thread::{spawn_confined_later, unconfined, Confine, Mailbox, Slot, Unconfirmed};

/// How the device's two threads confine themselves (vmm.rs installs their seccomp filters), and
/// where that is confirmed: the builder confirms every device thread at once before the VM runs.
pub struct BackendThreads {
    pub worker: Confine,
    pub watchdog: Confine,
    pub unconfirmed: Unconfirmed,
}

impl BackendThreads {
    /// Unfiltered threads, for unit tests.
    pub fn unconfined() -> Self {
        Self { worker: unconfined(), watchdog: unconfined(), unconfirmed: Unconfirmed::default() }
    }
}

/// DRIVER_OK: what the backend needs to serve the driver's queues.
pub struct Start {
    /// Which activation of the device this is (reports name it).
    pub activation: u64,
    pub mem: GuestMemoryMmap,
    /// The driver's virtio features.
    pub features: u64,
    /// The driver's queues (addresses, size, where to start).
    pub queues: Vec<QueueState>,
    pub deadline: Deadline,
}

pub enum Request {
    /// Connect if there is no connection, then hand over guest memory and start the vrings.
    Start(Start),
    /// Driver reset: stop the vrings but keep the connection (a backend serves one connection
    /// only). `done` is filled once the backend stopped using the rings, or gave up.
    Stop { deadline: Deadline, done: Arc<Slot<()>> },
    /// The event loop saw connection `id` hang up: drop it, so the next start reconnects.
    Disconnect { id: u64 },
}

/// A connection this thread made, for the event loop's hang-up watch.
pub struct Watch {
    /// Numbers connections, so a hang-up names the one it was seen on.
    pub id: u64,
    pub sock: UnixStream,
}

pub enum Report {
    /// The vrings of `activation` run. `connection`: it took a new connection, to watch from
    /// now on (None: the one reported before).
    Serving { activation: u64, connection: Option<Watch> },
    /// `activation` could not start; the connection, if any, is dropped.
    StartFailed { activation: u64, error: BackendError },
    /// The vrings could not be stopped; the connection is dropped.
    StopFailed { error: BackendError },
}

/// The device's end of its backend thread. Dropping it ends the thread (after the exchange in
/// progress, which the watchdog bounds).
pub struct Worker {
    requests: Arc<Mailbox<Request>>,
    reports: Arc<Mailbox<Report>>,
    /// Signalled with every report; the event loop watches it.
    reports_evt: EventFd,
}

impl Worker {
    /// Starts `<device>-watchdog` and `<device>-backend`, the latter serving the backend at
    /// `socket` with these kick and call eventfds (duplicated: the device keeps its own).
    pub fn spawn(
        device: &str,
        socket: PathBuf,
        kicks: &[EventFd],
        calls: &[EventFd],
        threads: BackendThreads,
    ) -> std::io::Result<Self> {
        let dup = |evts: &[EventFd]| evts.iter().map(EventFd::try_clone).collect::<std::io::Result<Vec<_>>>();
        let requests = Mailbox::new();
        let reports = Mailbox::new();
        let reports_evt = EventFd::new(libc::EFD_NONBLOCK)?;
        let thread = BackendThread {
            device: device.to_string(),
            socket,
            kicks: dup(kicks)?,
            calls: dup(calls)?,
            conn: None,
            connections: 0,
            watchdog: Watchdog::spawn(format!("{device}-watchdog"), threads.watchdog, &threads.unconfirmed)?,
            reports: Arc::clone(&reports),
            wake: reports_evt.try_clone()?,
        };
        let inbox = Arc::clone(&requests);
        // Detached: it ends when this handle closes the mailbox.
        spawn_confined_later(format!("{device}-backend"), threads.worker, &threads.unconfirmed, move || {
            thread.run(&inbox)
        })?;
        Ok(Self { requests, reports, reports_evt })
    }

    pub fn post(&self, request: Request) {
        self.requests.post(request);
    }

    /// The reports that came since the last call.
    pub fn take_reports(&self) -> Vec<Report> {
        self.reports.drain()
    }

    pub fn reports_evt(&self) -> &EventFd {
        &self.reports_evt
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.requests.close();
    }
}

/// A live connection and whether its vrings run.
struct Connection {
    id: u64,
    backend: Backend,
    running: bool,
}

/// The thread's own state.
struct BackendThread {
    device: String,
    socket: PathBuf,
    kicks: Vec<EventFd>,
    calls: Vec<EventFd>,
    conn: Option<Connection>,
    /// Connections made so far (the last one's id).
    connections: u64,
    watchdog: Watchdog,
    reports: Arc<Mailbox<Report>>,
    wake: EventFd,
}

impl BackendThread {
    fn run(mut self, requests: &Mailbox<Request>) {
        while let Some(request) = requests.next() {
            match request {
                Request::Start(start) => {
                    let activation = start.activation;
                    let report = match self.start(&start) {
                        Ok(connection) => Report::Serving { activation, connection },
                        Err(error) => {
                            // A connection that fails to start is dropped.
                            self.conn = None;
                            Report::StartFailed { activation, error }
                        }
                    };
                    self.report(report);
                }
                Request::Stop { deadline, done } => {
                    if let Err(error) = self.stop(deadline) {
                        self.report(Report::StopFailed { error });
                    }
                    done.put(());
                }
                Request::Disconnect { id } => {
                    if self.conn.as_ref().is_some_and(|c| c.id == id) {
                        self.conn = None;
                    }
                }
            }
        }
    }

    /// Connects if needed, then hands the backend guest memory and the vrings, all within the
    /// request's deadline. Returns the new connection's watch, if it made one.
    fn start(&mut self, start: &Start) -> Result<Option<Watch>, BackendError> {
        let queues = start
            .queues
            .iter()
            .enumerate()
            .map(|(i, state)| Queue::try_from(*state).map_err(|_| BackendError::Vring(i)))
            .collect::<Result<Vec<_>, _>>()?;
        let (mut conn, fresh) = match self.conn.take() {
            Some(conn) => (conn, None),
            None => {
                let backend = Backend::connect(&self.socket, NUM_QUEUES, start.deadline, &self.watchdog)?;
                let sock = backend.try_clone_socket().map_err(BackendError::Io)?;
                self.connections += 1;
                let id = self.connections;
                (Connection { id, backend, running: false }, Some(Watch { id, sock }))
            }
        };
        let vrings: Vec<Vring<'_>> = queues
            .iter()
            .zip(&self.kicks)
            .zip(&self.calls)
            .map(|((queue, kick), call)| Vring { queue, kick, call })
            .collect();
        conn.backend.start(&start.mem, start.features, &vrings, start.deadline, &self.watchdog)?;
        conn.running = true;
        self.conn = Some(conn);
        Ok(fresh)
    }

    /// Stops the vrings if they run; a connection that fails to stop is dropped.
    fn stop(&mut self, deadline: Deadline) -> Result<(), BackendError> {
        let Some(conn) = self.conn.as_mut().filter(|c| c.running) else { return Ok(()) };
        conn.running = false;
        match conn.backend.stop(NUM_QUEUES, deadline, &self.watchdog) {
            Ok(_) => Ok(()),
            Err(e) => {
                self.conn = None;
                Err(e)
            }
        }
    }

    fn report(&self, report: Report) {
        self.reports.post(report);
        if let Err(e) = self.wake.write(1) {
            tracing::warn!(device = %self.device, error = %e, "cannot wake the event loop about a virtio-fs backend report");
        }
    }
}
