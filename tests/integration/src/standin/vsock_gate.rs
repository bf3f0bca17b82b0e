//! Hides the hybrid-vsock socket until the guest's vsock driver is up. `vhost-device-vsock`
//! 0.3.0 (the newest release) accepts a host connection as soon as QEMU has handed it guest
//! memory, and if that connection's request meets an RX queue the driver has not set up yet, its
//! worker thread fails and never serves again: every later `CONNECT` waits forever. The shim
//! dials from the moment the socket exists, so the stand-in lets `vhost-device-vsock` listen on
//! a private path and renames it to the hybrid socket's path (a bound socket stays bound under
//! its new name) once QMP reports the device's driver ready and its backend started.
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
    pub deadline: Duration,
}

impl Gate {
    /// Polls until the driver is ready, then publishes the socket. Gives up (and says why) at the
    /// deadline; the shim's own connect timeout then reports the guest's console.
    pub fn run(&self) -> Result<Duration, String> {
        let start = Instant::now();
        let path = format!("/machine/peripheral/{DEVICE_ID}");
        let mut last = String::from("QMP never answered");
        while start.elapsed() < self.deadline {
            let asked = Qmp::connect(&self.qmp, Duration::from_secs(2))
                .and_then(|mut q| q.execute_with("x-query-virtio-status", json!({ "path": path })));
            match asked {
                Ok(status) if driver_ready(&status) => {
                    publish(&self.private, &self.public)?;
                    return Ok(start.elapsed());
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
