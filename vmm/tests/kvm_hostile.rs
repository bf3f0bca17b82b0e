//! KVM integration: a hostile guest (unknown MMIO, bad descriptor chains, a lying vsock length,
//! a vsock connection flood, a credit overrun, avail-index jumps, a serial flood) cannot panic or
//! hang the VMM; each fault is logged (throttled) and the device stops serving until reset, and
//! the API keeps answering. A panic on any VMM thread (the debug-only probe) ends the VM cleanly:
//! exit status 1 and the reason on stderr, never a hang.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;

#[test]
fn hostile_guest_is_contained() {
    let Some(guest) = guest_or_skip("hostile") else { return };
    let dir = tempfile::tempdir().unwrap();
    let disk = zero_disk(dir.path(), 8192);
    let mut cfg = raw_config(dir.path(), &guest);
    cfg["block"] = serde_json::json!([{ "path": disk }]);
    cfg["vsock"] = serde_json::json!({ "uds_path": dir.path().join("v.sock"), "guest_cid": 3 });
    let run = VmmProcess::spawn(dir.path(), &cfg, GUEST_TIMEOUT).wait();
    let ctx = format!("serial:\n{}\nstderr:\n{}", run.serial, run.stderr);
    assert!(run.status.success(), "{:?}\n{ctx}", run.status);
    assert!(!run.stderr.contains("panicked"), "{ctx}");

    // The guest saw DEVICE_NEEDS_RESET (0x40) on top of its live status (0xf) each time.
    for what in ["blk out-of-range", "blk loop", "blk oversized", "vsock lying length"] {
        assert!(run.serial.contains(&format!("{what} status=4f\n")), "{what}\n{ctx}");
    }
    assert!(run.serial.contains("unknown mmio survived\n"), "{ctx}");
    assert!(run.serial.contains("blk recovered\n"), "{ctx}");
    assert!(run.serial.contains("hostile done\n"), "{ctx}");

    // And the VMM said why, once per fault.
    for needle in [
        "guest accessed unknown MMIO address",
        "virtio-mmio write ignored",
        "is outside guest memory",
        "does not terminate",
        "more than the",
        "claims 60000 payload bytes",
    ] {
        assert!(run.stderr.contains(needle), "missing log {needle:?}\n{ctx}");
    }
}

/// One `info` on a fresh connection; true if it was answered ok within `timeout`.
fn info_answers(socket: &Path, timeout: Duration) -> bool {
    let Ok(mut s) = UnixStream::connect(socket) else { return false };
    let _ = s.set_read_timeout(Some(timeout));
    let _ = s.set_write_timeout(Some(timeout));
    if s.write_all(b"{\"cmd\":\"info\"}\n").is_err() {
        return false;
    }
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).is_ok() && line.contains("\"ok\":true")
}

/// Asks `info` every 20 ms until `until` holds (each answer bounded by 5 s); returns how many
/// were answered. Panics if one is not, or after GUEST_TIMEOUT.
fn answers_info_until(socket: &Path, until: impl Fn() -> bool) -> usize {
    let deadline = Instant::now() + GUEST_TIMEOUT;
    let mut answered = 0;
    while !until() {
        assert!(Instant::now() < deadline, "gave up after {answered} answers");
        if socket.exists() {
            assert!(info_answers(socket, Duration::from_secs(5)), "the API did not answer `info`");
            answered += 1;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    answered
}

/// How many times `needle` is in `text`.
fn count(text: &str, needle: &str) -> usize {
    text.matches(needle).count()
}

/// The most lines one throttled kind may log over `elapsed` (a burst of 8 per 10 s window).
fn throttle_bound(elapsed: Duration) -> usize {
    8 * (elapsed.as_secs() as usize / 10 + 2)
}

/// A listener at `path` with the smallest backlog (one waiting connection) that never accepts.
fn stalled_listener(path: &Path) -> OwnedFd {
    use nix::sys::socket::{bind, listen, socket, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
    let fd = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).unwrap();
    bind(fd.as_raw_fd(), &UnixAddr::new(path).unwrap()).unwrap();
    listen(&fd, Backlog::new(0).unwrap()).unwrap();
    fd
}

fn vsock_config(dir: &Path, guest: &Path) -> serde_json::Value {
    let mut cfg = raw_config(dir, guest);
    cfg["vsock"] = serde_json::json!({ "uds_path": dir.join("v.sock"), "guest_cid": 3 });
    cfg["api_socket"] = serde_json::json!(dir.join("api.sock"));
    cfg
}

#[test]
fn a_vsock_connection_flood_neither_blocks_nor_floods_the_log() {
    let Some(guest) = guest_or_skip("vsock_flood") else { return };
    let dir = tempfile::tempdir().unwrap();
    // Port 5000 listens but never accepts: a blocking connect would hang the event loop there.
    let _stalled = stalled_listener(&dir.path().join("v.sock_5000"));
    let started = Instant::now();
    let vmm = VmmProcess::spawn(dir.path(), &vsock_config(dir.path(), &guest), GUEST_TIMEOUT);
    wait_for_serial(dir.path(), "flood start", GUEST_TIMEOUT);
    let answered = answers_info_until(&dir.path().join("api.sock"), || {
        read_serial(dir.path()).contains("flood done") || !dir.path().join("api.sock").exists()
    });
    let run = vmm.wait();
    let elapsed = started.elapsed();
    let ctx = format!("serial:\n{}\nstderr:\n{}", run.serial, run.stderr);
    assert!(run.status.success(), "{:?}\n{ctx}", run.status);
    assert!(run.serial.contains("flood done\n"), "every request was consumed\n{ctx}");
    assert!(answered >= 1, "{ctx}");
    // 25600 requests; each kind of complaint stays within its throttle.
    for needle in ["(no host listener)", "too many guest connects", "not draining its RX queue"] {
        let n = count(&run.stderr, needle);
        assert!((1..=throttle_bound(elapsed)).contains(&n), "{n} lines of {needle:?} in {elapsed:?}\n{ctx}");
    }
    assert!(run.stderr.lines().count() < 200, "{ctx}");
    println!("vsock flood: {answered} info answers during {elapsed:?}, {} log lines", run.stderr.lines().count());
}

#[test]
fn a_credit_overrun_resets_only_its_own_connection() {
    let Some(guest) = guest_or_skip("credit_overrun") else { return };
    let dir = tempfile::tempdir().unwrap();
    // Accepts only at the end: the first connection's bytes pile up unread.
    let listener = UnixListener::bind(dir.path().join("v.sock_5002")).unwrap();
    let vmm = VmmProcess::spawn(dir.path(), &vsock_config(dir.path(), &guest), GUEST_TIMEOUT);
    let run = vmm.wait();
    let ctx = format!("serial:\n{}\nstderr:\n{}", run.serial, run.stderr);
    assert!(run.status.success(), "{:?}\n{ctx}", run.status);
    assert!(run.serial.contains("connected\noverrun reset after "), "{ctx}");
    assert!(run.stderr.contains("guest overran the credit we granted"), "{ctx}");

    // The second connection got through, and only it carries the line.
    let (first, _) = listener.accept().unwrap();
    let (mut second, _) = listener.accept().unwrap();
    second.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut line = String::new();
    BufReader::new(&mut second).read_line(&mut line).unwrap();
    assert_eq!(line, "second ok\n");
    let mut first = first;
    first.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = Vec::new();
    let _ = first.read_to_end(&mut got);
    assert!(!got.is_empty() && got.iter().all(|b| *b == 0), "{} bytes before the reset", got.len());
}

#[test]
fn avail_index_jumps_stop_only_the_device_until_its_reset() {
    let Some(guest) = guest_or_skip("avail_jump") else { return };
    let dir = tempfile::tempdir().unwrap();
    let disk = zero_disk(dir.path(), 8192);
    let mut cfg = vsock_config(dir.path(), &guest);
    cfg["block"] = serde_json::json!([{ "path": disk }]);
    let started = Instant::now();
    let run = VmmProcess::spawn(dir.path(), &cfg, GUEST_TIMEOUT).wait();
    let elapsed = started.elapsed();
    let ctx = format!("serial:\n{}\nstderr:\n{}", run.serial, run.stderr);
    assert!(run.status.success(), "{:?}\n{ctx}", run.status);
    for line in ["blk jumps caught 28\n", "blk recovered\n", "vsock jump caught\n", "jumps done\n"] {
        assert!(run.serial.contains(line), "{line:?}\n{ctx}");
    }
    let faults = count(&run.stderr, "guest sent a malformed request");
    assert!((1..=throttle_bound(elapsed)).contains(&faults), "{faults} fault lines for 40 faults\n{ctx}");
    assert!(run.stderr.contains("available ring index is corrupt"), "{ctx}");
}

#[test]
fn a_serial_flood_is_written_whole_and_the_vmm_stays_responsive() {
    let Some(guest) = guest_or_skip("serial_flood") else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = raw_config(dir.path(), &guest);
    cfg["api_socket"] = serde_json::json!(dir.path().join("api.sock"));
    let vmm = VmmProcess::spawn(dir.path(), &cfg, GUEST_TIMEOUT);
    wait_for_serial(dir.path(), "serial flood start", GUEST_TIMEOUT);
    let answered = answers_info_until(&dir.path().join("api.sock"), || {
        read_serial(dir.path()).contains("serial flood done") || !dir.path().join("api.sock").exists()
    });
    let run = vmm.wait();
    let ctx = format!("stderr:\n{}", run.stderr);
    assert!(run.status.success(), "{:?}\n{ctx}", run.status);
    assert!(answered >= 1);
    let expected = "serial flood start\n".len() + 100_000 + "serial flood done\n".len();
    assert_eq!(run.serial.len(), expected, "{ctx}");
    assert!(run.stderr.lines().count() < 50, "guest output never reaches the VMM's log\n{ctx}");
}

#[test]
fn a_serial_flood_into_a_failing_log_is_throttled() {
    let Some(guest) = guest_or_skip("serial_flood") else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = raw_config(dir.path(), &guest);
    // Every write fails (ENOSPC), as on a full disk.
    cfg["serial_log"] = serde_json::json!("/dev/full");
    let started = Instant::now();
    let run = VmmProcess::spawn(dir.path(), &cfg, GUEST_TIMEOUT).wait();
    let elapsed = started.elapsed();
    let ctx = format!("stderr:\n{}", run.stderr);
    assert!(run.status.success(), "{:?}\n{ctx}", run.status);
    let n = count(&run.stderr, "serial write failed");
    assert!((1..=throttle_bound(elapsed)).contains(&n), "{n} lines for 100036 failed writes in {elapsed:?}\n{ctx}");
    assert!(run.stderr.len() < 64 * 1024, "{ctx}");
}

/// Runs the panic-probe guest with the probe aimed at `kind`; returns the finished run.
fn run_panic_probe(kind: &str, poke_api: bool) -> Option<(Run, tempfile::TempDir)> {
    let guest = guest_or_skip("panic_probe")?;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = vsock_config(dir.path(), &guest);
    cfg["vsock"] = serde_json::Value::Null;
    let vmm = VmmProcess::spawn_with(dir.path(), &cfg, GUEST_TIMEOUT, |cmd| {
        cmd.env("BULKHEAD_VMM_PANIC_PROBE", kind);
    });
    wait_for_serial(dir.path(), "probe start", GUEST_TIMEOUT);
    if poke_api {
        // The API socket is bound after the vCPUs start: wait for it, then ask.
        let socket = dir.path().join("api.sock");
        wait_for_socket(&socket, GUEST_TIMEOUT);
        let mut s = UnixStream::connect(&socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"{\"cmd\":\"info\"}\n").unwrap();
        let mut answer = String::new();
        let _ = BufReader::new(s).read_line(&mut answer);
        assert_eq!(answer, "", "the API thread answered");
    }
    Some((vmm.wait(), dir))
}

/// A panicked VMM exits 1 with the panic on stderr, and removes its API socket.
fn assert_clean_panic_exit(run: &Run, dir: &Path, thread: &str, what: &str) {
    let ctx = format!("serial:\n{}\nstderr:\n{}", run.serial, run.stderr);
    assert_eq!(run.status.code(), Some(1), "{:?}\n{ctx}", run.status);
    let reason = format!("thread {thread} panicked at ");
    assert!(run.stderr.contains("bulkhead-vmm: VM failed") && run.stderr.contains(&reason), "{ctx}");
    assert!(run.stderr.contains(what), "{ctx}");
    assert!(!dir.join("api.sock").exists(), "the API socket was left behind\n{ctx}");
}

#[test]
fn a_panic_probe_on_a_vcpu_thread_ends_the_vm_cleanly() {
    let Some((run, dir)) = run_panic_probe("vcpu", false) else { return };
    assert_clean_panic_exit(&run, dir.path(), "vcpu0", "a guest write panicked the vCPU thread");
    assert!(!run.serial.contains("probe written"), "the vCPU thread is gone");
}

#[test]
fn a_panic_probe_on_the_event_loop_ends_the_vm_cleanly() {
    let Some((run, dir)) = run_panic_probe("event_loop", false) else { return };
    assert_clean_panic_exit(&run, dir.path(), "main", "a guest request panicked the event loop");
}

#[test]
fn a_panic_probe_on_the_api_thread_ends_the_vm_cleanly() {
    let Some((run, dir)) = run_panic_probe("api", true) else { return };
    assert_clean_panic_exit(&run, dir.path(), "api", "an API request panicked the API thread");
}
