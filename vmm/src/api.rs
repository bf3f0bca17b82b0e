//! The API socket's server: JSON lines over a Unix socket, on a thread of its own with the
//! smallest seccomp filter, since it parses input from outside the VM. The messages are
//! `bulkhead_vmm_api::api`'s; every request gets one line back.
//!
//! The API thread only talks: a `snapshot` pauses the vCPUs (as `pause` does) and hands the rest
//! to the event loop (`snapshotter::SnapshotRequests`), which owns the devices and may write
//! files. A `--prepare`d VMM answers on the same socket before its VM exists
//! ([`spawn_prepared`]), on a thread with the same filter, and hands a `restore` request to the
//! main thread, which builds the VM.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_vmm_api::api::{
    encode_line, parse_request, BootReport, MessageError, Request, Response, RestoreReport, RunState, SnapshotReport,
    VmInfo, MAX_REQUEST_LINE,
};
use bulkhead_vmm_api::restore::RestoreConfig;
use event_manager::{EventManager, EventOps, Events, MutEventSubscriber, SubscriberOps};
use seccompiler::BpfProgram;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::exit::{ExitReason, ExitSignal};
use crate::seccomp::{self, ThreadKind};
use crate::snapshotter::SnapshotRequests;
use crate::thread::{spawn_confined, Confine, Mailbox, Slot};
use crate::vcpu::VcpuControl;

const MAX_CLIENTS: usize = 16;
const IO_TIMEOUT: Duration = Duration::from_secs(1);
const PAUSE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a prepared VMM's API thread waits for the main thread to take or refuse a restore
/// (it checks the run's paths: a few stat calls).
const VERDICT_TIMEOUT: Duration = Duration::from_secs(5);

/// What the API may do to the VM.
pub struct VmController {
    pub control: Arc<VcpuControl>,
    pub exit: Arc<ExitSignal>,
    pub vcpus: u8,
    pub mem_mib: u64,
    pub irqchip: bool,
    pub start_unix_ns: u64,
    /// Where snapshots are taken (the event loop); absent only in tests without a VM.
    pub snapshots: Option<SnapshotRequests>,
    /// For a restored VM: how the restore went.
    pub restore: Option<RestoreReport>,
    /// For a booted VM: how the boot went.
    pub boot: Option<BootReport>,
}

impl VmController {
    /// The encoded answer to one request line (without its newline), and the stop it asks for.
    pub fn answer_line(&self, line: &[u8]) -> (Vec<u8>, Option<ExitReason>) {
        let (resp, stop) = match parse_request(line) {
            Ok(req) => self.handle(req),
            Err(e) => (malformed(&e), None),
        };
        (encode_line(&resp), stop)
    }

    /// The answer to `req`, and the stop it asks for, to signal once the client has the answer
    /// (the process may end as soon as the event loop sees it).
    pub fn handle(&self, req: Request) -> (Response, Option<ExitReason>) {
        #[cfg(debug_assertions)]
        crate::crash::probe::on_api_request();
        if req == Request::Shutdown {
            return (Response::ok(), Some(ExitReason::ApiShutdown));
        }
        (self.answer(req), None)
    }

    fn answer(&self, req: Request) -> Response {
        let ok = Response::ok();
        match req {
            Request::Pause => {
                if self.control.pause(usize::from(self.vcpus), PAUSE_TIMEOUT) {
                    ok
                } else {
                    Response::error("vCPUs did not pause in time")
                }
            }
            Request::Resume => {
                self.control.resume();
                ok
            }
            Request::Shutdown => ok,
            Request::Info => Response {
                info: Some(VmInfo {
                    state: self.control.state(),
                    pid: std::process::id(),
                    vcpus: self.vcpus,
                    mem_mib: self.mem_mib,
                    irqchip: self.irqchip,
                    start_unix_ns: self.start_unix_ns,
                    first_kvm_run_unix_ns: self.control.first_run_unix_ns.get().copied(),
                    restore: self.restore.clone(),
                    boot: self.boot.clone(),
                }),
                ..ok
            },
            Request::Snapshot { dir } => match &self.snapshots {
                Some(s) => self.snapshot(s, dir),
                None => Response::error("this VM cannot be snapshotted"),
            },
            Request::Restore { .. } => {
                Response::error("this VM is built already; `restore` is for a VMM started with --prepare")
            }
        }
    }

    /// Pauses the VM here (the kicks are this thread's calls), then lets the event loop save and
    /// write it. The VM stays paused either way.
    fn snapshot(&self, snapshots: &SnapshotRequests, dir: PathBuf) -> Response {
        let started = Instant::now();
        let failed = |e: String| {
            tracing::error!(dir = %dir.display(), error = %e, "snapshot failed; the VM stays paused");
            Response::error(format!("snapshot failed (the VM stays paused): {e}"))
        };
        if !self.control.pause(usize::from(self.vcpus), PAUSE_TIMEOUT) {
            return failed("vCPUs did not pause in time".into());
        }
        let pause_us = started.elapsed().as_micros() as u64;
        match snapshots.take(&dir) {
            Ok(report) => Response { snapshot: Some(SnapshotReport { pause_us, ..report }), ..Response::ok() },
            Err(e) => failed(e),
        }
    }
}

/// Where the API server listens: a path to bind, or a socket a `--prepare`d VMM bound already,
/// with the client that asked for the restore (answered already).
pub enum ApiEndpoint {
    Bind(PathBuf),
    Bound { path: PathBuf, listener: UnixListener, client: UnixStream },
}

impl ApiEndpoint {
    pub fn path(&self) -> &Path {
        match self {
            ApiEndpoint::Bind(path) | ApiEndpoint::Bound { path, .. } => path,
        }
    }
}

struct Client {
    stream: UnixStream,
    lines: RequestLines,
}

/// A client's bytes cut into request lines. Bounded: once more than [`MAX_REQUEST_LINE`] bytes
/// wait without a newline, the client is dropped.
#[derive(Debug, Default)]
pub struct RequestLines {
    buf: Vec<u8>,
}

impl RequestLines {
    /// Adds bytes the client sent.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete line, without its newline.
    pub fn next_line(&mut self) -> Option<Vec<u8>> {
        let pos = self.buf.iter().position(|&b| b == b'\n')?;
        let mut line: Vec<u8> = self.buf.drain(..=pos).collect();
        line.pop();
        Some(line)
    }

    /// Bytes already received after the last complete line.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The client sent an overlong line: drop it.
    pub fn overlong(&self) -> bool {
        self.buf.len() > MAX_REQUEST_LINE
    }
}

struct ApiServer {
    listener: UnixListener,
    clients: HashMap<RawFd, Client>,
    controller: VmController,
}

/// Binds `path` as an API socket, replacing a stale one; mode 0600 (the VMM's umask already
/// keeps it from others, `main`). The socket is bound and listening under a sibling name first
/// and renamed into place, so a client that waits for `path` to appear and then connects never
/// meets a socket that is bound but not yet listening (ECONNREFUSED).
pub fn bind_api_socket(path: &Path) -> std::io::Result<UnixListener> {
    let mut binding = path.as_os_str().to_owned();
    binding.push("~");
    let binding = PathBuf::from(binding);
    // A stale socket from a previous run would make bind fail.
    for stale in [path, binding.as_path()] {
        if stale.exists() {
            std::fs::remove_file(stale)?;
        }
    }
    let listener = UnixListener::bind(&binding)?;
    let placed = std::fs::set_permissions(&binding, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .and_then(|()| std::fs::rename(&binding, path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&binding);
        return Err(e);
    }
    Ok(listener)
}

impl ApiServer {
    fn new(endpoint: ApiEndpoint, controller: VmController) -> std::io::Result<Self> {
        let (listener, first) = match endpoint {
            ApiEndpoint::Bind(path) => (bind_api_socket(&path)?, None),
            ApiEndpoint::Bound { listener, client, .. } => (listener, Some(client)),
        };
        listener.set_nonblocking(true)?;
        let mut clients = HashMap::new();
        if let Some(stream) = first {
            stream.set_read_timeout(Some(IO_TIMEOUT))?;
            stream.set_write_timeout(Some(IO_TIMEOUT))?;
            clients.insert(stream.as_raw_fd(), Client { stream, lines: RequestLines::default() });
        }
        Ok(Self { listener, clients, controller })
    }

    fn accept(&mut self, ops: &mut EventOps) {
        while let Ok((stream, _)) = self.listener.accept() {
            if self.clients.len() >= MAX_CLIENTS {
                tracing::warn!("too many API clients; dropping a new connection");
                continue;
            }
            let _ = stream.set_read_timeout(Some(IO_TIMEOUT));
            let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
            let fd = stream.as_raw_fd();
            if ops.add(Events::new(&stream, EventSet::IN)).is_ok() {
                self.clients.insert(fd, Client { stream, lines: RequestLines::default() });
            }
        }
    }

    /// Returns false when the client should be dropped.
    fn serve(&mut self, fd: RawFd) -> bool {
        let Some(client) = self.clients.get_mut(&fd) else { return false };
        let mut chunk = [0u8; 1024];
        let n = match client.stream.read(&mut chunk) {
            Ok(0) | Err(_) => return false,
            Ok(n) => n,
        };
        client.lines.push(&chunk[..n]);
        while let Some(line) = client.lines.next_line() {
            let (answer, stop) = self.controller.answer_line(&line);
            let written = client.stream.write_all(&answer);
            if let Some(reason) = stop {
                self.controller.exit.signal(reason);
            }
            if written.is_err() {
                return false;
            }
        }
        !client.lines.overlong()
    }
}

/// Binds the API socket here (or takes the one a prepared VMM bound), then serves it on the `api`
/// thread, which installs `filter` before it reads anything. The thread lives as long as the
/// process; if it cannot serve, the VM stops.
pub fn spawn(endpoint: ApiEndpoint, controller: VmController, filter: BpfProgram) -> std::io::Result<()> {
    let exit = controller.exit.clone();
    let server = ApiServer::new(endpoint, controller)?;
    let mut em: EventManager<ApiServer> =
        EventManager::new().map_err(|e| std::io::Error::other(format!("API event loop: {e}")))?;
    em.add_subscriber(server);
    std::thread::Builder::new().name("api".into()).spawn(move || {
        if let Err(e) = seccomp::install(ThreadKind::Api, &filter) {
            exit.signal(ExitReason::ApiFailed(e.to_string()));
            return;
        }
        loop {
            if let Err(e) = em.run() {
                exit.signal(ExitReason::ApiFailed(format!("event loop: {e}")));
                return;
            }
        }
    })?;
    Ok(())
}

impl MutEventSubscriber for ApiServer {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.listener, EventSet::IN)) {
            tracing::error!(error = ?e, "cannot watch the API socket");
        }
        for c in self.clients.values() {
            if let Err(e) = ops.add(Events::new(&c.stream, EventSet::IN)) {
                tracing::error!(error = ?e, "cannot watch an API client");
            }
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let fd = events.fd();
        if fd == self.listener.as_raw_fd() {
            self.accept(ops);
            return;
        }
        let hangup = events.event_set().intersects(EventSet::HANG_UP | EventSet::ERROR);
        if hangup || !self.serve(fd) {
            if let Some(c) = self.clients.remove(&fd) {
                let _ = ops.remove(Events::new(&c.stream, EventSet::IN));
            }
        }
    }
}

/// What a prepared VMM does with one request line.
#[derive(Debug)]
pub enum PreparedRequest {
    /// Answered at once (refused or malformed).
    Answer(Response),
    Info,
    /// To check against the snapshot, then hand to the main thread.
    Restore(RestoreConfig),
    Shutdown,
}

/// Decides what a prepared VMM does with `line` (without its newline); `more_pending` says the
/// client already sent bytes after it, which a `restore` must not have (its answer comes first).
pub fn prepared_request(line: &[u8], more_pending: bool) -> PreparedRequest {
    match parse_request(line) {
        Ok(Request::Restore { config }) if !more_pending => PreparedRequest::Restore(config),
        Ok(Request::Restore { .. }) => {
            PreparedRequest::Answer(Response::error("send nothing after `restore` before its answer"))
        }
        Ok(Request::Info) => PreparedRequest::Info,
        Ok(Request::Shutdown) => PreparedRequest::Shutdown,
        Ok(_) => PreparedRequest::Answer(Response::error("this VMM is prepared and waits for `restore`")),
        Err(e) => PreparedRequest::Answer(malformed(&e)),
    }
}

/// The answer to a line that is not a request. The parser's message may quote the line (an
/// unknown command, say), and JSON escaping can make that up to six times longer: bounded, so
/// the answer always fits a client's response limit.
fn malformed(e: &MessageError) -> Response {
    const MAX_ERROR_TEXT: usize = 512;
    let mut text = e.to_string();
    if text.len() > MAX_ERROR_TEXT {
        let mut end = MAX_ERROR_TEXT;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str("...");
    }
    Response::error(text)
}

/// What a prepared VMM's API thread tells the main thread.
pub enum PreparedEvent {
    /// A `restore` whose run settings fit the snapshot. The main thread checks the run's paths
    /// and puts its verdict in `verdict`: refused, the API thread answers and keeps waiting;
    /// taken, it hands its socket and the client over and ends.
    Restore { config: RestoreConfig, requested_unix_ns: u64, verdict: Arc<Slot<Result<(), String>>> },
    /// `shutdown` (answered); the API thread has ended.
    Shutdown,
    /// The API thread could not go on serving.
    Failed(String),
}

/// The socket and client a prepared VMM's API thread hands over once the main thread took a
/// restore: the running VM's API server answers the client and serves both from then on.
pub struct Handover {
    pub listener: UnixListener,
    pub client: UnixStream,
}

/// The main thread's end of a prepared VMM's API thread.
pub struct PreparedApi {
    events: Arc<Mailbox<PreparedEvent>>,
    /// Signalled with every event; the main thread polls it beside the signalfd.
    wake: EventFd,
    handover: Arc<Slot<Handover>>,
}

impl PreparedApi {
    pub fn wake_fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }

    /// The events since the last call.
    pub fn events(&self) -> Vec<PreparedEvent> {
        let _ = self.wake.read();
        self.events.drain()
    }

    /// What the API thread hands over after a restore was taken (it does so at once).
    pub fn handover(&self) -> Result<Handover, String> {
        self.handover
            .take_until(Instant::now() + VERDICT_TIMEOUT)
            .ok_or_else(|| "the API thread did not hand its socket over".to_string())
    }
}

/// Serves a prepared VMM's API on the `api` thread, confined like the running VM's, until a
/// `restore` is taken: `info` reports `prepared`, `shutdown` stops, anything else is refused.
/// `check` vets a restore's run settings against the snapshot (no I/O); the main thread then
/// checks the paths. Clients are served one at a time, each bounded by the I/O timeout.
pub fn spawn_prepared(
    listener: UnixListener,
    info: VmInfo,
    check: impl Fn(&RestoreConfig) -> Result<(), String> + Send + 'static,
    confine: Confine,
) -> std::io::Result<PreparedApi> {
    let events = Mailbox::new();
    let wake = EventFd::new(libc::EFD_NONBLOCK)?;
    let handover = Slot::new();
    let server = PreparedServer {
        listener,
        info,
        check,
        events: Arc::clone(&events),
        wake: wake.try_clone()?,
        handover: Arc::clone(&handover),
    };
    spawn_confined("api".into(), confine, move || server.serve())?;
    Ok(PreparedApi { events, wake, handover })
}

/// What the prepared API thread does with one request.
enum Step {
    /// This line (encoded) goes back to the client.
    Answer(Vec<u8>),
    /// The main thread took the restore: hand over.
    Taken,
    Stop,
}

fn answer(response: Response) -> Step {
    Step::Answer(encode_line(&response))
}

struct PreparedServer<C> {
    listener: UnixListener,
    info: VmInfo,
    check: C,
    events: Arc<Mailbox<PreparedEvent>>,
    wake: EventFd,
    handover: Arc<Slot<Handover>>,
}

impl<C: Fn(&RestoreConfig) -> Result<(), String>> PreparedServer<C> {
    fn tell_main(&self, event: PreparedEvent) {
        self.events.post(event);
        if let Err(e) = self.wake.write(1) {
            tracing::error!(error = %e, "cannot wake the main thread of a prepared VMM");
        }
    }

    /// Accepts (blocking: this thread has nothing else to do) and serves clients until a restore
    /// is taken (the socket and client are handed over) or `shutdown`.
    fn serve(self) {
        loop {
            let mut client = match self.listener.accept() {
                Ok((c, _)) => c,
                Err(e) => {
                    self.tell_main(PreparedEvent::Failed(format!("accept on the API socket: {e}")));
                    return;
                }
            };
            if client.set_read_timeout(Some(IO_TIMEOUT)).is_err() || client.set_write_timeout(Some(IO_TIMEOUT)).is_err()
            {
                continue;
            }
            let mut lines = RequestLines::default();
            'client: loop {
                let mut chunk = [0u8; 1024];
                let n = match client.read(&mut chunk) {
                    Ok(0) | Err(_) => break 'client,
                    Ok(n) => n,
                };
                lines.push(&chunk[..n]);
                while let Some(line) = lines.next_line() {
                    let step = match prepared_request(&line, lines.pending() > 0) {
                        PreparedRequest::Answer(response) => answer(response),
                        PreparedRequest::Info => answer(Response { info: Some(self.info.clone()), ..Response::ok() }),
                        PreparedRequest::Restore(config) => self.restore(config),
                        PreparedRequest::Shutdown => Step::Stop,
                    };
                    match step {
                        Step::Answer(line) => {
                            if client.write_all(&line).is_err() {
                                break 'client;
                            }
                        }
                        Step::Taken => {
                            self.handover.put(Handover { listener: self.listener, client });
                            return;
                        }
                        Step::Stop => {
                            let _ = client.write_all(&encode_line(&Response::ok()));
                            self.tell_main(PreparedEvent::Shutdown);
                            return;
                        }
                    }
                }
                if lines.overlong() {
                    break 'client;
                }
            }
        }
    }

    /// Checks the run against the snapshot, then asks the main thread, which checks the run's
    /// paths and restores.
    fn restore(&self, config: RestoreConfig) -> Step {
        if let Err(e) = (self.check)(&config) {
            return answer(Response::error(format!("restore refused: {e}")));
        }
        let verdict = Slot::new();
        let requested_unix_ns = crate::vcpu::unix_ns();
        self.tell_main(PreparedEvent::Restore { config, requested_unix_ns, verdict: Arc::clone(&verdict) });
        match verdict.take_until(Instant::now() + VERDICT_TIMEOUT) {
            Some(Ok(())) => Step::Taken,
            Some(Err(e)) => answer(Response::error(format!("restore refused: {e}"))),
            None => answer(Response::error("the VMM did not take the restore in time")),
        }
    }
}

/// What `info` says about a prepared VMM.
pub fn prepared_info(vcpus: u8, mem_mib: u64, irqchip: bool, start_unix_ns: u64, restore: RestoreReport) -> VmInfo {
    VmInfo {
        state: RunState::Prepared,
        pid: std::process::id(),
        vcpus,
        mem_mib,
        irqchip,
        start_unix_ns,
        first_kvm_run_unix_ns: None,
        restore: Some(restore),
        boot: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::thread::unconfined;
    use std::io::{BufRead, BufReader};

    #[test]
    fn controller_shutdown_and_info() {
        let c = VmController {
            control: Arc::new(VcpuControl::new()),
            exit: Arc::new(ExitSignal::new().unwrap()),
            vcpus: 2,
            mem_mib: 64,
            irqchip: true,
            start_unix_ns: 5,
            snapshots: None,
            restore: None,
            boot: None,
        };
        let info = c.handle(Request::Info).0.info.unwrap();
        assert_eq!((info.state, info.vcpus, info.first_kvm_run_unix_ns), (RunState::Running, 2, None));
        assert!(!c.handle(Request::Snapshot { dir: "/tmp/x".into() }).0.ok, "no snapshotter here");
        assert!(!c.handle(Request::Restore { config: Default::default() }).0.ok, "only for --prepare");
        let (answer, stop) = c.handle(Request::Shutdown);
        assert!(answer.ok);
        assert_eq!(stop, Some(ExitReason::ApiShutdown), "signalled once the client has the answer");
        assert_eq!(c.exit.reason(), None);
        // No vCPU threads exist, so a pause cannot be acknowledged.
        assert!(!c.control.pause(1, Duration::from_millis(20)));
        c.control.resume();
    }

    #[test]
    fn request_lines_are_cut_bounded_and_every_line_gets_an_answer() {
        let mut lines = RequestLines::default();
        lines.push(b"{\"cmd\":\"info\"}\n\xff\n{\"cmd\":");
        let c = VmController {
            control: Arc::new(VcpuControl::new()),
            exit: Arc::new(ExitSignal::new().unwrap()),
            vcpus: 0,
            mem_mib: 64,
            irqchip: true,
            start_unix_ns: 5,
            snapshots: None,
            restore: None,
            boot: None,
        };
        let answers: Vec<Response> = std::iter::from_fn(|| lines.next_line())
            .map(|line| {
                let (answer, stop) = c.answer_line(&line);
                assert_eq!((answer.last(), stop), (Some(&b'\n'), None));
                bulkhead_vmm_api::api::parse_response(&answer[..answer.len() - 1]).unwrap()
            })
            .collect();
        assert_eq!(answers.iter().map(|a| a.ok).collect::<Vec<_>>(), [true, false], "info, then a malformed line");
        assert_eq!(lines.pending(), 7);
        assert!(!lines.overlong());
        lines.push(&[b' '; MAX_REQUEST_LINE]);
        assert!(lines.overlong(), "no newline within the limit");
        assert!(matches!(prepared_request(br#"{"cmd":"restore","config":{}}"#, true), PreparedRequest::Answer(_)));
        assert!(matches!(prepared_request(br#"{"cmd":"restore","config":{}}"#, false), PreparedRequest::Restore(_)));
        assert!(matches!(prepared_request(br#"{"cmd":"pause"}"#, false), PreparedRequest::Answer(r) if !r.ok));
        // An unknown command of control characters: the error quotes it, escaped six times longer.
        let mut evil = br#"{"cmd":""#.to_vec();
        evil.extend(std::iter::repeat_n(1u8, MAX_REQUEST_LINE - 20));
        evil.extend_from_slice(br#""}"#);
        let (answer, _) = c.answer_line(&evil);
        assert!(answer.len() < 1024, "{} bytes", answer.len());
    }

    fn call(stream: &mut UnixStream, line: &str) -> Response {
        stream.write_all(format!("{line}\n").as_bytes()).unwrap();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut answer = String::new();
        reader.read_line(&mut answer).unwrap();
        serde_json::from_str(&answer).unwrap()
    }

    /// Waits (bounded) for the API thread's next event.
    fn next_event(api: &PreparedApi) -> PreparedEvent {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(e) = api.events().into_iter().next() {
                return e;
            }
            assert!(Instant::now() < deadline, "no event from the API thread");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn the_api_socket_appears_listening_and_replaces_stale_ones() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let binding = dir.path().join("api.sock~");
        // What a killed VMM leaves: its socket, and one it had not renamed yet.
        for stale in [&path, &binding] {
            drop(UnixListener::bind(stale).unwrap());
        }
        let listener = bind_api_socket(&path).unwrap();
        assert!(!binding.exists(), "the binding name is gone");
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let _client = UnixStream::connect(&path).expect("listening as soon as it is there");
        assert!(listener.accept().is_ok());
    }

    #[test]
    fn a_prepared_api_answers_checks_and_hands_a_taken_restore_over() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let info = prepared_info(1, 32, true, 7, RestoreReport::default());
        let check = |run: &RestoreConfig| if run.vsock_uds_path.is_some() { Ok(()) } else { Err("no vsock".into()) };
        let api = spawn_prepared(bind_api_socket(&path).unwrap(), info, check, unconfined()).unwrap();
        let mut client = UnixStream::connect(&path).unwrap();
        assert_eq!(call(&mut client, r#"{"cmd":"info"}"#).info.unwrap().state, RunState::Prepared);
        assert!(!call(&mut client, r#"{"cmd":"pause"}"#).ok);
        let refused = call(&mut client, r#"{"cmd":"restore","config":{}}"#);
        assert!(refused.error.unwrap().contains("no vsock"), "refused on the API thread");

        // The main thread refuses the first (its paths), takes the second.
        let restore = r#"{"cmd":"restore","config":{"vsock_uds_path":"/nonexistent/v.sock"}}"#;
        client.write_all(format!("{restore}\n").as_bytes()).unwrap();
        let PreparedEvent::Restore { verdict, .. } = next_event(&api) else { panic!("not a restore") };
        verdict.put(Err("vsock uds_path: no such directory".into()));
        let mut reader = BufReader::new(client.try_clone().unwrap());
        let mut answer = String::new();
        reader.read_line(&mut answer).unwrap();
        assert!(answer.contains("no such directory"), "{answer}");
        client.write_all(format!("{restore}\n").as_bytes()).unwrap();
        let PreparedEvent::Restore { config, verdict, .. } = next_event(&api) else { panic!("not a restore") };
        assert_eq!(config.vsock_uds_path, Some("/nonexistent/v.sock".into()));
        verdict.put(Ok(()));
        let handover = api.handover().unwrap();
        // The handed-over client is the one that asked: it sees what the new owner writes.
        (&handover.client).write_all(b"answer\n").unwrap();
        let mut answer = String::new();
        reader.read_line(&mut answer).unwrap();
        assert_eq!(answer, "answer\n");
    }

    #[test]
    fn a_prepared_api_stops_on_shutdown() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let info = prepared_info(1, 32, true, 7, RestoreReport::default());
        let api = spawn_prepared(bind_api_socket(&path).unwrap(), info, |_| Ok(()), unconfined()).unwrap();
        let mut client = UnixStream::connect(&path).unwrap();
        assert!(call(&mut client, r#"{"cmd":"shutdown"}"#).ok);
        assert!(matches!(next_event(&api), PreparedEvent::Shutdown));
    }
}
