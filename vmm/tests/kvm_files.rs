//! What the VMM creates is its own uid's alone, whatever umask it is started with: the API and
//! vsock sockets and the serial log are 0600 (the shim reaches them as root).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod common;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::time::Duration;

use common::*;

#[test]
fn sockets_and_serial_log_are_0600_under_umask_000() {
    let Some(guest) = guest_or_skip("idle") else { return };
    let dir = tempfile::tempdir().unwrap();
    let api = dir.path().join("api.sock");
    let vsock = dir.path().join("v.sock");
    let mut cfg = raw_config(dir.path(), &guest);
    cfg["api_socket"] = serde_json::json!(api);
    cfg["vsock"] = serde_json::json!({"uds_path": vsock, "guest_cid": 3});
    let vmm = VmmProcess::spawn_with(dir.path(), &cfg, GUEST_TIMEOUT, |cmd| {
        // SAFETY: umask is async-signal-safe and touches only the child's own mask.
        unsafe {
            cmd.pre_exec(|| {
                libc::umask(0);
                Ok(())
            });
        }
    });
    wait_for_socket(&api, Duration::from_secs(10));
    wait_for_serial(dir.path(), "idle guest up", GUEST_TIMEOUT);
    for path in [&api, &vsock, &dir.path().join("serial.log")] {
        let mode = std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{} is {mode:o}", path.display());
    }
    vmm.kill_and_collect();
}
