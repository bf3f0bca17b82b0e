//! The VMM's API socket (`bulkhead_vmm_api::api`), answered through QEMU's QMP: `pause` is
//! `stop`, `resume` is `cont`, `info` is `query-status`, and `shutdown` asks the stand-in's main
//! thread to stop (it sends the process SIGTERM, which the main thread handles as an orderly
//! stop), `balloon` is QMP's `balloon` (which takes the guest's size, so the stand-in keeps the
//! target) and `info`'s balloon is `query-balloon`. Snapshots and restores are refused: the
//! stand-in has none.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use bulkhead_vmm_api::api::{
    encode_line, parse_request, BalloonInfo, Request, Response, RunState, VmInfo, MAX_REQUEST_LINE,
};
use bulkhead_vmm_api::memory::Mib;

use super::qmp::Qmp;

/// Deadline of one client's request line, and of one QMP exchange.
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Requests one connection may make.
const MAX_REQUESTS: usize = 16;

/// What `info` reports besides the run state.
#[derive(Debug, Clone)]
pub struct Shape {
    pub vcpus: u8,
    pub mem_mib: Mib,
    pub start_unix_ns: u64,
}

pub struct Api {
    pub qmp: PathBuf,
    pub shape: Shape,
    /// The balloon target last set (QEMU reports only what the guest holds).
    pub balloon_target: std::sync::Mutex<Mib>,
}

impl Api {
    /// Serves `listener` on a thread of its own, one client at a time.
    pub fn spawn(self, listener: UnixListener) -> std::io::Result<std::thread::JoinHandle<()>> {
        std::thread::Builder::new().name("api".into()).spawn(move || {
            for stream in listener.incoming().flatten() {
                if let Err(e) = self.serve(stream) {
                    eprintln!("bulkhead-qemu-vmm: API client: {e}");
                }
            }
        })
    }

    fn serve(&self, stream: UnixStream) -> std::io::Result<()> {
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        stream.set_write_timeout(Some(IO_TIMEOUT))?;
        let mut writer = stream.try_clone()?;
        let mut reader = BufReader::new(stream);
        for _ in 0..MAX_REQUESTS {
            let mut line = Vec::new();
            (&mut reader).take(MAX_REQUEST_LINE as u64 + 1).read_until(b'\n', &mut line)?;
            if line.is_empty() {
                return Ok(());
            }
            if line.last() == Some(&b'\n') {
                line.pop();
            }
            let (response, shutdown) = match parse_request(&line) {
                Ok(request) => self.answer(request),
                Err(e) => (Response::error(e.to_string()), false),
            };
            writer.write_all(&encode_line(&response))?;
            if shutdown {
                // SAFETY: kill with our own pid and a valid signal number has no memory effects.
                unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
                return Ok(());
            }
        }
        Ok(())
    }

    /// The answer to `request`, and whether it asks the stand-in to stop.
    pub fn answer(&self, request: Request) -> (Response, bool) {
        let run = |command: &str| Qmp::connect(&self.qmp, IO_TIMEOUT).and_then(|mut q| q.execute(command));
        match request {
            Request::Shutdown => (Response::ok(), true),
            Request::Pause => (reply(run("stop").map(|_| Response::ok())), false),
            Request::Resume => (reply(run("cont").map(|_| Response::ok())), false),
            Request::Info => {
                let info = run("query-status").map(|status| {
                    let running = status.get("running").and_then(serde_json::Value::as_bool).unwrap_or(false);
                    Response {
                        info: Some(VmInfo {
                            state: if running { RunState::Running } else { RunState::Paused },
                            pid: std::process::id(),
                            vcpus: self.shape.vcpus,
                            mem_mib: self.shape.mem_mib,
                            irqchip: false,
                            start_unix_ns: self.shape.start_unix_ns,
                            first_kvm_run_unix_ns: None,
                            restore: None,
                            boot: None,
                            balloon: self.balloon(),
                        }),
                        ..Response::ok()
                    }
                });
                (reply(info), false)
            }
            Request::Snapshot { .. } | Request::Restore { .. } => {
                (Response::error("the QEMU stand-in takes no snapshots and restores none"), false)
            }
            // QEMU's `balloon` takes the guest's size, not the balloon's.
            Request::Balloon { mib } if mib >= self.shape.mem_mib => {
                (Response::error(format!("a balloon of {} MiB would leave the guest nothing", mib.get())), false)
            }
            Request::Balloon { mib } => {
                let size = (self.shape.mem_mib.get() - mib.get()) << 20;
                let set = Qmp::connect(&self.qmp, IO_TIMEOUT)
                    .and_then(|mut q| q.execute_with("balloon", serde_json::json!({ "value": size })));
                if set.is_ok() {
                    *self.balloon_target.lock().unwrap_or_else(|p| p.into_inner()) = mib;
                }
                (reply(set.map(|_| Response::ok())), false)
            }
        }
    }
}

impl Api {
    /// The balloon's target and what QEMU says it holds (its `actual` is the guest's size);
    /// `None` without a balloon device.
    fn balloon(&self) -> Option<BalloonInfo> {
        let size = Qmp::connect(&self.qmp, IO_TIMEOUT).and_then(|mut q| q.execute("query-balloon")).ok()?;
        let guest = size.get("actual").and_then(serde_json::Value::as_u64)? >> 20;
        let target_mib = *self.balloon_target.lock().unwrap_or_else(|p| p.into_inner());
        Some(BalloonInfo { target_mib, actual_mib: Mib(self.shape.mem_mib.get().saturating_sub(guest)) })
    }
}

fn reply(result: Result<Response, super::qmp::QmpError>) -> Response {
    result.unwrap_or_else(|e| Response::error(e.to_string()))
}

/// Binds the API socket, replacing a stale one.
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    UnixListener::bind(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_stand_in_cannot_do_is_refused_and_a_missing_qemu_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let api = Api {
            qmp: dir.path().join("none.sock"),
            shape: Shape { vcpus: 1, mem_mib: Mib(256), start_unix_ns: 0 },
            balloon_target: Default::default(),
        };
        let (r, stop) = api.answer(Request::Snapshot { dir: "/x".into() });
        assert!(!r.ok && r.error.unwrap().contains("no snapshots"));
        assert!(!stop);
        let (r, stop) = api.answer(Request::Pause);
        assert!(!r.ok && r.error.unwrap().contains("none.sock"), "the QMP socket is named");
        assert!(!stop);
        assert_eq!(api.answer(Request::Shutdown), (Response::ok(), true));
    }
}
