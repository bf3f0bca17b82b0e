//! KVM integration: the vhost-user-fs device inside the real `bulkhead-vmm`, against a real
//! virtiofsd (started and stopped here by PID), driven by the `fs` test guest speaking FUSE.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod common;

use std::io::BufReader;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::virtiofsd::Virtiofsd;
use common::*;

const CONTENT: &str = "bulkhead virtio-fs: these bytes came from the host through virtiofsd\n";
const TAG: &str = "shared";

/// `dir/shared` (the shared directory, with hello.txt) and `dir/outside.txt` next to it, which
/// the guest must not reach.
fn shared_dir(dir: &Path) -> PathBuf {
    let shared = dir.join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::write(shared.join("hello.txt"), CONTENT).unwrap();
    std::fs::write(dir.join("outside.txt"), "outside the shared directory\n").unwrap();
    shared
}

fn fs_config(dir: &Path, guest: &Path, socket: &Path) -> serde_json::Value {
    let mut cfg = raw_config(dir, guest);
    cfg["fs"] = serde_json::json!([{ "tag": TAG, "socket": socket }]);
    cfg
}

/// Runs the guest to its end against a fresh virtiofsd; `markers` are empty files put in the
/// shared directory to choose the guest's extra steps. Returns (run, virtiofsd log).
fn run_with_virtiofsd(guest: &Path, markers: &[&str]) -> (Run, String) {
    let dir = tempfile::tempdir().unwrap();
    let shared = shared_dir(dir.path());
    for m in markers {
        std::fs::write(shared.join(m), "").unwrap();
    }
    let socket = dir.path().join("virtiofsd.sock");
    let virtiofsd = Virtiofsd::start(&shared, &socket, &dir.path().join("virtiofsd.log"));
    let run = VmmProcess::spawn(dir.path(), &fs_config(dir.path(), guest, &socket), GUEST_TIMEOUT).wait();
    let log = virtiofsd.log_text();
    assert!(
        run.status.success(),
        "{:?}\nstderr:\n{}\nserial:\n{}\nvirtiofsd:\n{log}",
        run.status,
        run.stderr,
        run.serial
    );
    assert!(run.serial.contains("fs done\n"), "serial:\n{}\nstderr:\n{}\nvirtiofsd:\n{log}", run.serial, run.stderr);
    (run, log)
}

/// The VMM's backend-failure log lines, without terminal colours.
fn backend_failures(stderr: &str) -> Vec<String> {
    let mut plain = String::new();
    let mut chars = stderr.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ parameters final-letter
            chars.by_ref().find(|c| c.is_ascii_alphabetic());
        } else {
            plain.push(c);
        }
    }
    plain.lines().filter(|l| l.contains("virtio-fs backend failed")).map(str::to_owned).collect()
}

#[test]
fn guest_reads_the_bytes_of_a_host_file_through_virtiofsd() {
    let Some(guest) = guest_or_skip("fs") else { return };
    let (run, _) = run_with_virtiofsd(&guest, &[]);
    assert!(run.serial.starts_with(&format!("fs tag {TAG} queues 1\ndriver ok\ninit 7.")), "{}", run.serial);
    assert!(run.serial.contains(&format!("data<{CONTENT}>\n")), "serial:\n{}", run.serial);
    assert!(backend_failures(&run.stderr).is_empty(), "{}", run.stderr);
}

#[test]
fn dotdot_from_the_root_stays_in_the_shared_directory() {
    let Some(guest) = guest_or_skip("fs") else { return };
    let (run, _) = run_with_virtiofsd(&guest, &[]);
    // `..` of the root is the root itself (FUSE node 1): the file inside is found through it,
    // the one next to the shared directory is not (ENOENT).
    assert!(run.serial.contains(".. nodeid 1\n"), "serial:\n{}", run.serial);
    assert!(run.serial.contains("../hello.txt nodeid "), "serial:\n{}", run.serial);
    assert!(run.serial.contains("../outside.txt error 2\n"), "serial:\n{}", run.serial);
}

#[test]
fn a_driver_reset_restarts_the_vrings_on_the_same_backend_session() {
    let Some(guest) = guest_or_skip("fs") else { return };
    let (run, log) = run_with_virtiofsd(&guest, &["reset"]);
    // virtiofsd serves one connection: had the reset dropped it, nothing would answer now.
    assert!(run.serial.contains("after reset hello.txt nodeid 2\n"), "serial:\n{}\nvirtiofsd:\n{log}", run.serial);
    assert!(backend_failures(&run.stderr).is_empty(), "{}", run.stderr);
}

#[test]
fn killing_virtiofsd_mid_request_fails_only_the_device() {
    let Some(guest) = guest_or_skip("fs") else { return };
    let dir = tempfile::tempdir().unwrap();
    let shared = shared_dir(dir.path());
    std::fs::write(shared.join("loop"), "").unwrap();
    let socket = dir.path().join("virtiofsd.sock");
    let api = dir.path().join("api.sock");
    let mut virtiofsd = Virtiofsd::start(&shared, &socket, &dir.path().join("virtiofsd.log"));
    let mut cfg = fs_config(dir.path(), &guest, &socket);
    cfg["api_socket"] = serde_json::json!(api);
    let vmm = VmmProcess::spawn(dir.path(), &cfg, GUEST_TIMEOUT);

    // The guest keeps a READ in flight from now on.
    wait_for_serial(dir.path(), "looping\n", GUEST_TIMEOUT);
    virtiofsd.kill();
    wait_for_serial(dir.path(), "heartbeat 1\n", GUEST_TIMEOUT);
    assert!(
        read_serial(dir.path()).contains("loop read: device failed status 4f\n"),
        "the guest saw DEVICE_NEEDS_RESET; serial:\n{}",
        read_serial(dir.path())
    );

    let mut s = UnixStream::connect(&api).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let info = api_call(&mut s, &mut r, "info");
    assert_eq!(info["ok"], true, "{info}");
    assert_eq!(info["info"]["state"], "running", "{info}");
    assert_eq!(api_call(&mut s, &mut r, "shutdown")["ok"], true);
    let run = vmm.wait();
    assert!(run.status.success(), "{:?}\n{}", run.status, run.stderr);
    assert!(run.stderr.contains("ApiShutdown"), "stopped on request, not by the guest:\n{}", run.stderr);
    let failures = backend_failures(&run.stderr);
    assert_eq!(failures.len(), 1, "one clear line:\n{}", run.stderr);
    for needle in [format!("tag={TAG}"), socket.display().to_string(), "closed the connection".into()] {
        assert!(failures[0].contains(needle.as_str()), "{needle:?} missing from {:?}", failures[0]);
    }
}

#[test]
fn a_backend_that_never_answers_fails_the_device_without_holding_the_vcpu() {
    let Some(guest) = guest_or_skip("fs") else { return };
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("silent.sock");
    let _silent = UnixListener::bind(&socket).unwrap(); // accepts into its backlog, never answers
    let api = dir.path().join("api.sock");
    let mut cfg = fs_config(dir.path(), &guest, &socket);
    cfg["api_socket"] = serde_json::json!(api);
    let vmm = VmmProcess::spawn(dir.path(), &cfg, GUEST_TIMEOUT);

    // The DRIVER_OK write returns at once: the guest reads the status right after it and finds
    // the device live (it would print "driver ok: device failed" had the write waited out the
    // handshake). It then sends INIT, unanswered until the deadline (5 s) fails the device;
    // meanwhile the API keeps answering.
    wait_for_serial(dir.path(), "driver ok\n", GUEST_TIMEOUT);
    let mut s = UnixStream::connect(&api).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let asked = Instant::now();
    assert_eq!(api_call(&mut s, &mut r, "info")["ok"], true);
    assert!(asked.elapsed() < Duration::from_secs(2), "the API waited {:?} for the handshake", asked.elapsed());
    assert!(!read_serial(dir.path()).contains("device failed"), "the API answered only after the handshake gave up");

    // At the deadline the device fails; the guest sees it and goes on.
    wait_for_serial(dir.path(), "heartbeat 1\n", GUEST_TIMEOUT);
    assert!(
        read_serial(dir.path()).contains("init: device failed status 4f\n"),
        "serial:\n{}",
        read_serial(dir.path())
    );
    assert_eq!(api_call(&mut s, &mut r, "info")["ok"], true);
    assert_eq!(api_call(&mut s, &mut r, "shutdown")["ok"], true);
    let run = vmm.wait();
    assert!(run.status.success(), "{:?}\n{}", run.status, run.stderr);
    let failures = backend_failures(&run.stderr);
    assert_eq!(failures.len(), 1, "one clear line:\n{}", run.stderr);
    for needle in [format!("tag={TAG}"), socket.display().to_string(), "GET_FEATURES: no answer within 5s".into()] {
        assert!(failures[0].contains(needle.as_str()), "{needle:?} missing from {:?}", failures[0]);
    }
}
