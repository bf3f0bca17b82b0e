//! A running VM's API server: each client's request lines answered by [`VmController`] on the
//! API thread, which touches no device but the balloon's target (a config field and an
//! interrupt); a `snapshot` goes to the event loop.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bulkhead_vmm_api::api::{
    encode_line, parse_request, BalloonInfo, BootReport, Request, Response, RestoreReport, SnapshotReport, VmInfo,
};
use bulkhead_vmm_api::memory::Mib;
use event_manager::{EventManager, EventOps, Events, MutEventSubscriber, SubscriberOps};
use seccompiler::BpfProgram;
use vmm_sys_util::epoll::EventSet;

use crate::devices::virtio::balloon::Balloon;
use crate::exit::{ExitReason, ExitSignal};
use crate::seccomp::{self, ThreadKind};
use crate::snapshotter::SnapshotRequests;
use crate::vcpu::VcpuControl;

use super::{bind_api_socket, malformed, RequestLines, IO_TIMEOUT};

const MAX_CLIENTS: usize = 16;
const PAUSE_TIMEOUT: Duration = Duration::from_secs(2);
/// virtio-balloon counts 4 KiB pages.
const PAGES_PER_MIB: u64 = 256;

/// What the API may do to the VM.
pub struct VmController {
    pub control: Arc<VcpuControl>,
    pub exit: Arc<ExitSignal>,
    pub vcpus: u8,
    pub mem_mib: Mib,
    pub irqchip: bool,
    pub start_unix_ns: u64,
    /// Where snapshots are taken (the event loop); absent only in tests without a VM.
    pub snapshots: Option<SnapshotRequests>,
    /// For a restored VM: how the restore went.
    pub restore: Option<RestoreReport>,
    /// For a booted VM: how the boot went.
    pub boot: Option<BootReport>,
    /// The balloon device, for a VM that has one.
    pub balloon: Option<Arc<Mutex<Balloon>>>,
}

impl VmController {
    /// A controller of `vcpus` vCPUs that never ran and takes no snapshot, for tests.
    #[cfg(test)]
    pub(crate) fn idle(vcpus: u8) -> Self {
        Self {
            control: Arc::new(VcpuControl::new()),
            exit: Arc::new(ExitSignal::new().expect("an eventfd")),
            vcpus,
            mem_mib: Mib(64),
            irqchip: true,
            start_unix_ns: 5,
            snapshots: None,
            restore: None,
            boot: None,
            balloon: None,
        }
    }

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
                    balloon: self.balloon_info(),
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
            Request::Balloon { mib } => self.set_balloon(mib),
        }
    }

    /// A balloon of `mib`: less than the VM's memory, which the guest cannot do without.
    fn set_balloon(&self, mib: Mib) -> Response {
        let Some(balloon) = &self.balloon else { return Response::error("this VM has no balloon device") };
        if mib >= self.mem_mib {
            return Response::error(format!(
                "a balloon of {} MiB would leave the guest nothing of its {} MiB",
                mib.get(),
                self.mem_mib.get()
            ));
        }
        let Some(pages) = mib.get().checked_mul(PAGES_PER_MIB).and_then(|p| u32::try_from(p).ok()) else {
            return Response::error(format!("a balloon of {} MiB is more pages than virtio-balloon counts", mib.get()));
        };
        balloon.lock().unwrap_or_else(|p| p.into_inner()).set_target(pages);
        tracing::info!(mib = mib.get(), "balloon target set");
        Response::ok()
    }

    fn balloon_info(&self) -> Option<BalloonInfo> {
        let (target, actual) = self.balloon.as_ref()?.lock().unwrap_or_else(|p| p.into_inner()).pages();
        let mib = |pages: u32| Mib(u64::from(pages) / PAGES_PER_MIB);
        Some(BalloonInfo { target_mib: mib(target), actual_mib: mib(actual) })
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

struct ApiServer {
    listener: UnixListener,
    clients: HashMap<RawFd, Client>,
    controller: VmController,
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

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_vmm_api::api::RunState;

    #[test]
    fn the_balloons_target_is_set_within_the_vms_memory_and_reported() {
        let balloon = Balloon::new(&crate::config::BalloonConfig { free_page_reporting: false }).unwrap();
        let c = VmController { balloon: Some(Arc::new(Mutex::new(balloon))), ..VmController::idle(1) };
        assert_eq!(
            c.handle(Request::Info).0.info.unwrap().balloon,
            Some(BalloonInfo { target_mib: Mib(0), actual_mib: Mib(0) })
        );
        assert!(c.handle(Request::Balloon { mib: Mib(40) }).0.ok);
        let info = c.handle(Request::Info).0.info.unwrap();
        assert_eq!(info.balloon, Some(BalloonInfo { target_mib: Mib(40), actual_mib: Mib(0) }));
        for too_much in [Mib(64), Mib(u64::MAX)] {
            let err = c.handle(Request::Balloon { mib: too_much }).0.error.unwrap();
            assert!(err.contains("would leave the guest nothing of its 64 MiB"), "{err}");
        }
        assert_eq!(c.handle(Request::Info).0.info.unwrap().balloon.unwrap().target_mib, Mib(40), "unchanged");
    }

    #[test]
    fn controller_shutdown_and_info() {
        let c = VmController::idle(2);
        let info = c.handle(Request::Info).0.info.unwrap();
        assert_eq!((info.state, info.vcpus, info.first_kvm_run_unix_ns), (RunState::Running, 2, None));
        assert!(!c.handle(Request::Snapshot { dir: "/tmp/x".into() }).0.ok, "no snapshotter here");
        assert!(!c.handle(Request::Restore { config: Default::default() }).0.ok, "only for --prepare");
        let no_balloon = c.handle(Request::Balloon { mib: Mib(8) }).0;
        assert_eq!(no_balloon.error.as_deref(), Some("this VM has no balloon device"));
        let (answer, stop) = c.handle(Request::Shutdown);
        assert!(answer.ok);
        assert_eq!(stop, Some(ExitReason::ApiShutdown), "signalled once the client has the answer");
        assert_eq!(c.exit.reason(), None);
        // No vCPU threads exist, so a pause cannot be acknowledged.
        assert!(!c.control.pause(1, Duration::from_millis(20)));
        c.control.resume();
    }
}
