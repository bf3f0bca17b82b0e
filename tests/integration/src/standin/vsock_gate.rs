//! Hides the hybrid-vsock socket until the guest's vsock driver is up. `vhost-device-vsock`
//! 0.3.0 (the newest release) accepts a host connection as soon as QEMU has handed it guest
//! memory, and if that connection's request meets an RX queue the driver has not set up yet, its
//! worker thread fails and never serves again: every later `CONNECT` waits forever. The shim
//! dials from the moment the socket exists, so the stand-in lets `vhost-device-vsock` listen on
//! a private path and renames it to the hybrid socket's path (a bound socket stays bound under
//! its new name) once QMP reports the device's driver ready and its backend started, and the
//! guest's console shows the agent listening on vsock. DRIVER_OK alone is not enough: Linux's
//! virtio_vsock probe sets it (virtio_device_ready) before it fills the RX queue, and under load
//! (TCG beside a CPU hog and a log flood) a CONNECT landed in that window and wedged the pod's
//! vsock for good; the agent listens only after the probe has finished.
//! `bulkhead-vmm` has no such window: its own vsock device queues host connections until the
//! driver is ready.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::qmp::Qmp;

/// QEMU's id of the vsock device (`-device vhost-user-vsock-device,id=...`).
pub const DEVICE_ID: &str = "vsock0";
/// How often QMP is asked.
const POLL: Duration = Duration::from_millis(20);
/// What the agent prints on the console once it listens on vsock (`guest-agent/src/transport.rs`).
pub const AGENT_LISTENING: &str = "listening (vsock)";
/// The console is read up to this much for that line (the boot log before it is ~50 KiB).
const MAX_CONSOLE_READ: u64 = 4 << 20;

/// Whether an `x-query-virtio-status` reply says the driver is ready and the backend started.
pub fn driver_ready(status: &Value) -> bool {
    let started = status.get("started").and_then(Value::as_bool) == Some(true);
    let driver_ok = status
        .pointer("/status/statuses")
        .and_then(Value::as_array)
        .is_some_and(|s| s.iter().filter_map(Value::as_str).any(|s| s.starts_with("VIRTIO_CONFIG_S_DRIVER_OK")));
    started && driver_ok
}

pub struct Gate {
    pub qmp: PathBuf,
    /// Where `vhost-device-vsock` listens.
    pub private: PathBuf,
    /// The hybrid socket the shim dials.
    pub public: PathBuf,
    /// The guest's console log, where the agent says it listens; without one, DRIVER_OK alone.
    pub console: Option<PathBuf>,
    pub deadline: Duration,
}

/// Whether the console at `path` shows the agent listening on vsock.
pub fn agent_listening(path: &Path) -> bool {
    use std::io::Read;
    let Ok(file) = std::fs::File::open(path) else { return false };
    let mut text = Vec::new();
    if file.take(MAX_CONSOLE_READ).read_to_end(&mut text).is_err() {
        return false;
    }
    text.windows(AGENT_LISTENING.len()).any(|w| w == AGENT_LISTENING.as_bytes())
}

impl Gate {
    /// Polls until the driver is ready and the agent listens, then publishes the socket. Gives up
    /// (and says why) at the deadline; the shim's own connect timeout then reports the guest's
    /// console.
    pub fn run(&self) -> Result<Duration, String> {
        let start = Instant::now();
        let path = format!("/machine/peripheral/{DEVICE_ID}");
        let mut last = String::from("QMP never answered");
        while start.elapsed() < self.deadline {
            let asked = Qmp::connect(&self.qmp, Duration::from_secs(2))
                .and_then(|mut q| q.execute_with("x-query-virtio-status", json!({ "path": path })));
            match asked {
                Ok(status) if driver_ready(&status) => {
                    if self.console.as_deref().is_none_or(agent_listening) {
                        publish(&self.private, &self.public)?;
                        return Ok(start.elapsed());
                    }
                    last = "the guest's vsock driver is ready, the agent does not listen yet".into();
                }
                Ok(_) => last = "the guest's vsock driver is not ready".into(),
                Err(e) => last = e.to_string(),
            }
            std::thread::sleep(POLL);
        }
        Err(format!("vsock not published within {:?}: {last}", self.deadline))
    }
}

fn publish(private: &Path, public: &Path) -> Result<(), String> {
    std::fs::rename(private, public).map_err(|e| format!("publish {} as {}: {e}", private.display(), public.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_means_driver_ok_and_started() {
        let status = |started: bool, statuses: &[&str]| json!({"started": started, "status": {"statuses": statuses}});
        let ok = "VIRTIO_CONFIG_S_DRIVER_OK: Driver setup and ready";
        let driver = "VIRTIO_CONFIG_S_DRIVER: Guest OS compatible with device";
        assert!(driver_ready(&status(true, &[driver, ok])));
        assert!(!driver_ready(&status(false, &[driver, ok])), "the backend has not started");
        assert!(!driver_ready(&status(true, &[driver])), "the driver is still probing");
        assert!(!driver_ready(&json!({})));
    }

    #[test]
    fn the_agent_listens_once_its_line_is_on_the_console() {
        let dir = tempfile::tempdir().unwrap();
        let console = dir.path().join("console.log");
        assert!(!agent_listening(&console), "no console yet");
        std::fs::write(&console, "[    1.76] INFO bulkhead_agent::shared_fs: pod shared directory mounted\n").unwrap();
        assert!(!agent_listening(&console));
        std::fs::write(&console, "[    1.80] INFO bulkhead_agent::transport: listening (vsock) port=1024\n").unwrap();
        assert!(agent_listening(&console));
    }

    #[test]
    fn a_published_socket_still_accepts() {
        let dir = tempfile::tempdir().unwrap();
        let private = dir.path().join("vh.sock");
        let public = dir.path().join("v.sock");
        let listener = std::os::unix::net::UnixListener::bind(&private).unwrap();
        publish(&private, &public).unwrap();
        assert!(!private.exists());
        let _client = std::os::unix::net::UnixStream::connect(&public).unwrap();
        assert!(listener.accept().is_ok());
    }
}
