//! Ends a QEMU that outlives its guest. With `-no-reboot`, QEMU should exit as soon as the guest
//! shuts down or resets, as `bulkhead-vmm` does. But QEMU 7.2 stops its vhost-user devices on the
//! way out and waits, without a timeout, for each backend's answer: with `vhost-device-vsock`
//! stopped, QEMU outlived its reset guest by more than 100 s and ignored SIGTERM. In CI a
//! panicked guest's stand-in outlived the shim's 45 s connect timeout (once for certain, likely
//! twice), which fits. The watch reads QEMU's events monitor for the guest's `SHUTDOWN`, and if
//! the process is still there a grace period later, it calls the caller's `late`, which kills
//! QEMU.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::qmp::Qmp;

/// How one watch ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Watched {
    /// The guest shut down or reset (QEMU's reason) and the grace passed: `late` was called.
    OutlivedItsGuest { reason: String },
    /// QEMU closed the monitor: it is exiting, the usual end.
    Closed,
    /// The monitor never answered within the time given: no watch.
    NoMonitor(String),
}

/// Watches the events monitor at `events` (which may take `ready_within` to appear). A stop the
/// host asked for (QMP `quit`, a signal) is not the guest's and is left to the caller.
pub fn watch(events: &Path, ready_within: Duration, grace: Duration, late: impl FnOnce()) -> Watched {
    let started = Instant::now();
    let mut monitor = loop {
        match Qmp::connect(events, Duration::from_secs(2)) {
            Ok(monitor) => break monitor,
            Err(_) if started.elapsed() < ready_within => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Watched::NoMonitor(e.to_string()),
        }
    };
    loop {
        let Ok(data) = monitor.wait_for_event("SHUTDOWN") else { return Watched::Closed };
        if data.get("guest").and_then(Value::as_bool) != Some(true) {
            continue;
        }
        let reason = data.get("reason").and_then(Value::as_str).unwrap_or("?").to_string();
        eprintln!("bulkhead-qemu-vmm: the guest shut down ({reason}) {:?} after QEMU started", started.elapsed());
        // QEMU's exit closes the monitor; anything else read meanwhile does not matter.
        std::thread::sleep(grace);
        late();
        return Watched::OutlivedItsGuest { reason };
    }
}

#[cfg(test)]
mod tests {
    use super::super::qmp::tests::{peer, GREETING};
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A monitor that answers `qmp_capabilities`, sends `events`, and closes a while later.
    fn monitor(dir: &Path, events: &'static str) -> std::path::PathBuf {
        let reply: &'static str = Box::leak(format!("{{\"return\": {{}}}}\n{events}").into_boxed_str());
        peer(dir, GREETING, vec![reply])
    }

    #[test]
    fn a_qemu_still_there_after_its_guests_reset_is_ended() {
        let dir = tempfile::tempdir().unwrap();
        let events = concat!(
            "{\"event\": \"SHUTDOWN\", \"data\": {\"guest\": false, \"reason\": \"host-qmp-quit\"}}\n",
            "{\"event\": \"SHUTDOWN\", \"data\": {\"guest\": true, \"reason\": \"guest-reset\"}}\n"
        );
        let path = monitor(dir.path(), events);
        let called = AtomicBool::new(false);
        let watched =
            watch(&path, Duration::from_secs(5), Duration::from_millis(10), || called.store(true, Ordering::SeqCst));
        assert_eq!(watched, Watched::OutlivedItsGuest { reason: "guest-reset".into() });
        assert!(called.load(Ordering::SeqCst));
    }

    #[test]
    fn a_host_stop_or_a_closed_monitor_ends_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let events = "{\"event\": \"SHUTDOWN\", \"data\": {\"guest\": false, \"reason\": \"host-signal\"}}\n";
        let path = monitor(dir.path(), events);
        let watched = watch(&path, Duration::from_secs(5), Duration::ZERO, || panic!("QEMU was not late"));
        assert_eq!(watched, Watched::Closed);
    }

    #[test]
    fn a_monitor_that_never_appears_is_given_up_on() {
        let dir = tempfile::tempdir().unwrap();
        let watched = watch(&dir.path().join("none.sock"), Duration::from_millis(100), Duration::ZERO, || {
            panic!("QEMU was not late")
        });
        assert!(matches!(watched, Watched::NoMonitor(_)), "{watched:?}");
    }
}
