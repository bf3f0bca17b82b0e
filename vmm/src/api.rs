//! The API socket's server: JSON lines over a Unix socket, on the event loop. The messages are
//! `bulkhead_vmm_api::api`'s; every request gets one line back. A `--prepare`d VMM answers on
//! the same socket before its VM exists ([`await_restore`]), then hands it to the event loop.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bulkhead_vmm_api::api::{
    encode_line, parse_request, Request, Response, RestoreReport, RunState, VmInfo, MAX_REQUEST_LINE,
};
use bulkhead_vmm_api::restore::RestoreConfig;
use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;

use crate::exit::{ExitReason, ExitSignal};
use crate::snapshotter::Snapshotter;
use crate::vcpu::VcpuControl;

const MAX_CLIENTS: usize = 16;
const IO_TIMEOUT: Duration = Duration::from_secs(1);

/// What the API may do to the VM.
pub struct VmController {
    pub control: Arc<VcpuControl>,
    pub exit: Arc<ExitSignal>,
    pub vcpus: u8,
    pub mem_mib: u64,
    pub irqchip: bool,
    pub start_unix_ns: u64,
    /// How the VM can be snapshotted (absent only in tests without KVM).
    pub snapshotter: Option<Snapshotter>,
    /// For a restored VM: how the restore went.
    pub restore: Option<RestoreReport>,
}

impl VmController {
    pub fn handle(&self, req: Request) -> Response {
        let ok = Response::ok();
        match req {
            Request::Pause => {
                if self.control.pause(usize::from(self.vcpus), Duration::from_secs(2)) {
                    ok
                } else {
                    Response::error("vCPUs did not pause in time")
                }
            }
            Request::Resume => {
                self.control.resume();
                ok
            }
            Request::Shutdown => {
                self.exit.signal(ExitReason::ApiShutdown);
                ok
            }
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
                }),
                ..ok
            },
            Request::Snapshot { dir } => match &self.snapshotter {
                Some(s) => match s.take(&self.control, &dir) {
                    Ok(report) => Response { snapshot: Some(report), ..ok },
                    Err(e) => {
                        tracing::error!(dir = %dir.display(), error = %e, "snapshot failed; the VM stays paused");
                        Response::error(format!("snapshot failed (the VM stays paused): {e}"))
                    }
                },
                None => Response::error("this VM cannot be snapshotted"),
            },
            Request::Restore { .. } => {
                Response::error("this VM is built already; `restore` is for a VMM started with --prepare")
            }
        }
    }
}

/// Where the API server listens: a path to bind, or a socket a `--prepare`d VMM bound already,
/// with the client that asked for the restore.
pub enum ApiEndpoint {
    Bind(PathBuf),
    Bound { path: PathBuf, listener: UnixListener, client: UnixStream },
}

/// What [`await_restore`] ends with.
pub enum PreparedOutcome {
    /// A restore request, the client that sent it, and when it arrived.
    Restore { config: RestoreConfig, client: UnixStream, requested_unix_ns: u64 },
    /// `shutdown` or a termination signal.
    Stop(ExitReason),
}

/// Serves a prepared VMM's API until a valid `restore` request arrives: `info` reports
/// `prepared`, `shutdown` and SIGTERM/SIGINT stop, anything else is refused. `check` vets a
/// restore's run settings; a refused one gets its error and the VMM keeps waiting. Clients are
/// served one at a time, each bounded by the I/O timeout.
pub fn await_restore(
    listener: &UnixListener,
    signal_fd: &OwnedFd,
    info: &VmInfo,
    check: impl Fn(&RestoreConfig) -> Result<(), String>,
) -> std::io::Result<PreparedOutcome> {
    loop {
        let mut fds = [
            libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: signal_fd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: fds is a valid array of two pollfd for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if fds[1].revents != 0 {
            tracing::info!("termination signal while prepared; shutting down");
            return Ok(PreparedOutcome::Stop(ExitReason::Signal(libc::SIGTERM)));
        }
        let Ok((mut client, _)) = listener.accept() else { continue };
        client.set_nonblocking(false)?;
        client.set_read_timeout(Some(IO_TIMEOUT))?;
        client.set_write_timeout(Some(IO_TIMEOUT))?;
        let mut buf = Vec::new();
        'client: loop {
            let mut chunk = [0u8; 1024];
            let n = match client.read(&mut chunk) {
                Ok(0) | Err(_) => break 'client,
                Ok(n) => n,
            };
            buf.extend_from_slice(&chunk[..n]);
            while let Some(pos) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=pos).collect();
                let resp = match parse_request(&line[..line.len() - 1]) {
                    Ok(Request::Restore { config }) => match check(&config) {
                        Ok(()) if buf.is_empty() => {
                            return Ok(PreparedOutcome::Restore {
                                config,
                                client,
                                requested_unix_ns: crate::vcpu::unix_ns(),
                            })
                        }
                        Ok(()) => Response::error("send nothing after `restore` before its answer"),
                        Err(e) => Response::error(format!("restore refused: {e}")),
                    },
                    Ok(Request::Info) => Response { info: Some(info.clone()), ..Response::ok() },
                    Ok(Request::Shutdown) => {
                        let _ = client.write_all(&encode_line(&Response::ok()));
                        return Ok(PreparedOutcome::Stop(ExitReason::ApiShutdown));
                    }
                    Ok(_) => Response::error("this VMM is prepared and waits for `restore`"),
                    Err(e) => Response::error(e.to_string()),
                };
                if client.write_all(&encode_line(&resp)).is_err() {
                    break 'client;
                }
            }
            if buf.len() > MAX_REQUEST_LINE {
                break 'client;
            }
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
    }
}

struct Client {
    stream: UnixStream,
    buf: Vec<u8>,
}

pub struct ApiServer {
    path: PathBuf,
    listener: UnixListener,
    clients: HashMap<RawFd, Client>,
    controller: VmController,
}

/// Binds `path` as an API socket, replacing a stale one.
pub fn bind_api_socket(path: &Path) -> std::io::Result<UnixListener> {
    // A stale socket from a previous run would make bind fail.
    if path.exists() {
        std::fs::remove_file(path)?;
    }
    UnixListener::bind(path)
}

impl ApiServer {
    pub fn new(endpoint: ApiEndpoint, controller: VmController) -> std::io::Result<Self> {
        let (path, listener, first) = match endpoint {
            ApiEndpoint::Bind(path) => {
                let listener = bind_api_socket(&path)?;
                (path, listener, None)
            }
            ApiEndpoint::Bound { path, listener, client } => (path, listener, Some(client)),
        };
        listener.set_nonblocking(true)?;
        let mut clients = HashMap::new();
        if let Some(stream) = first {
            stream.set_read_timeout(Some(IO_TIMEOUT))?;
            clients.insert(stream.as_raw_fd(), Client { stream, buf: Vec::new() });
        }
        Ok(Self { path, listener, clients, controller })
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
                self.clients.insert(fd, Client { stream, buf: Vec::new() });
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
        client.buf.extend_from_slice(&chunk[..n]);
        while let Some(pos) = client.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = client.buf.drain(..=pos).collect();
            let resp = match parse_request(&line[..line.len() - 1]) {
                Ok(req) => self.controller.handle(req),
                Err(e) => Response::error(e.to_string()),
            };
            if client.stream.write_all(&encode_line(&resp)).is_err() {
                return false;
            }
        }
        client.buf.len() <= MAX_REQUEST_LINE
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
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
    fn controller_shutdown_and_info() {
        let c = VmController {
            control: Arc::new(VcpuControl::new()),
            exit: Arc::new(ExitSignal::new().unwrap()),
            vcpus: 2,
            mem_mib: 64,
            irqchip: true,
            start_unix_ns: 5,
            snapshotter: None,
            restore: None,
        };
        let info = c.handle(Request::Info).info.unwrap();
        assert_eq!((info.state, info.vcpus, info.first_kvm_run_unix_ns), (RunState::Running, 2, None));
        assert!(!c.handle(Request::Snapshot { dir: "/tmp/x".into() }).ok, "no snapshotter here");
        assert!(!c.handle(Request::Restore { config: Default::default() }).ok, "only for --prepare");
        assert!(c.handle(Request::Shutdown).ok);
        assert_eq!(c.exit.reason(), Some(ExitReason::ApiShutdown));
        // No vCPU threads exist, so a pause cannot be acknowledged.
        assert!(!c.control.pause(1, Duration::from_millis(20)));
        c.control.resume();
    }
}
