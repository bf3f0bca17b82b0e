//! The API socket's server: JSON lines over a Unix socket, on a thread of its own with the
//! smallest seccomp filter, since it parses input from outside the VM. The messages are
//! `bulkhead_vmm_api::api`'s; every request gets one line back.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bulkhead_vmm_api::api::{encode_line, parse_request, Request, Response, VmInfo, MAX_REQUEST_LINE};
use event_manager::{EventManager, EventOps, Events, MutEventSubscriber, SubscriberOps};
use seccompiler::BpfProgram;
use vmm_sys_util::epoll::EventSet;

use crate::exit::{ExitReason, ExitSignal};
use crate::seccomp::{self, ThreadKind};
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
                ok: true,
                error: None,
                info: Some(VmInfo {
                    state: self.control.state(),
                    pid: std::process::id(),
                    vcpus: self.vcpus,
                    mem_mib: self.mem_mib,
                    irqchip: self.irqchip,
                    start_unix_ns: self.start_unix_ns,
                    first_kvm_run_unix_ns: self.control.first_run_unix_ns.get().copied(),
                }),
            },
        }
    }
}

struct Client {
    stream: UnixStream,
    buf: Vec<u8>,
}

struct ApiServer {
    listener: UnixListener,
    clients: HashMap<RawFd, Client>,
    controller: VmController,
}

impl ApiServer {
    fn bind(path: &Path, controller: VmController) -> std::io::Result<Self> {
        // A stale socket from a previous run would make bind fail.
        if path.exists() {
            std::fs::remove_file(path)?;
        }
        let listener = UnixListener::bind(path)?;
        listener.set_nonblocking(true)?;
        Ok(Self { listener, clients: HashMap::new(), controller })
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

/// Binds the API socket here, then serves it on the `api` thread, which installs `filter` before
/// it accepts anyone. The thread lives as long as the process; if it cannot serve, the VM stops.
pub fn spawn(path: &Path, controller: VmController, filter: BpfProgram) -> std::io::Result<()> {
    let exit = controller.exit.clone();
    let server = ApiServer::bind(path, controller)?;
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
        };
        let info = c.handle(Request::Info).info.unwrap();
        assert_eq!((info.state, info.vcpus, info.first_kvm_run_unix_ns), (RunState::Running, 2, None));
        assert!(c.handle(Request::Shutdown).ok);
        assert_eq!(c.exit.reason(), Some(ExitReason::ApiShutdown));
        // No vCPU threads exist, so a pause cannot be acknowledged.
        assert!(!c.control.pause(1, Duration::from_millis(20)));
        c.control.resume();
    }
}
