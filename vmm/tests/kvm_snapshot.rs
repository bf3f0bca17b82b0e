//! KVM integration: snapshot a running test guest, restore it in new `bulkhead-vmm` processes
//! (at once with `--restore`, or on request with `--prepare`), and check it carries on where it
//! stopped, that restores share nothing writable, that damaged snapshots are refused, that a
//! restored vsock device tells the guest its transport was reset, and that a template with a
//! probed virtio-fs device serves FUSE from a fresh virtiofsd once restored.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::virtiofsd::Virtiofsd;
use common::*;
use serde_json::json;

const API_TIMEOUT: Duration = Duration::from_secs(30);

/// Counts printed so far: the numbers of complete `count <hex>` lines.
fn counts(text: &str) -> Vec<u64> {
    let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
    complete.lines().filter_map(|l| l.strip_prefix("count ")).filter_map(|h| u64::from_str_radix(h, 16).ok()).collect()
}

/// The serial output of a VM up to its snapshot followed by a restored run's output must read
/// as one unbroken count: nothing repeated (not from zero), nothing skipped.
fn assert_continues(before: &str, after: &str) {
    let joined = format!("{before}{after}");
    let all = counts(&joined);
    assert!(all.len() > counts(before).len(), "the restored run printed no count: {after:?}");
    for (i, n) in all.iter().enumerate() {
        assert_eq!(*n, i as u64 + 1, "count broken at line {i}: before {before:?} after {after:?}");
    }
}

struct Snapshotted {
    dir: tempfile::TempDir,
    snap: PathBuf,
    /// The original VM's serial output up to the snapshot.
    serial: String,
}

/// Boots `guest`, waits for `ready` on its console, snapshots it and stops it.
fn boot_and_snapshot(guest: &Path, extra: serde_json::Value, ready: &str) -> Snapshotted {
    let dir = tempfile::tempdir().unwrap();
    let api = dir.path().join("api.sock");
    let mut cfg = raw_config(dir.path(), guest);
    cfg["api_socket"] = json!(api);
    for (k, v) in extra.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    let vmm = VmmProcess::spawn(dir.path(), &cfg, GUEST_TIMEOUT);
    wait_for_socket(&api, Duration::from_secs(10));
    wait_for_serial_text(dir.path(), GUEST_TIMEOUT, ready, |t| t.contains(ready));
    // A snapshot that cannot be written says why and leaves the VM paused, ready for another try.
    let unwritable = dir.path().join("serial.log").join("snap");
    let failed = api_request(&api, &json!({"cmd": "snapshot", "dir": unwritable}), API_TIMEOUT);
    let why = failed["error"].as_str().unwrap_or_default();
    assert!(why.contains("snapshot failed (the VM stays paused)") && why.contains("serial.log/snap"), "{failed}");
    assert_eq!(api_request(&api, &json!({"cmd": "info"}), API_TIMEOUT)["info"]["state"], "paused");
    let snap = dir.path().join("snap");
    let resp = api_request(&api, &json!({"cmd": "snapshot", "dir": snap}), API_TIMEOUT);
    if resp["ok"] != true {
        let run = vmm.kill_and_collect();
        panic!("snapshot failed: {resp}\nstderr:\n{}", run.stderr);
    }
    assert!(resp["snapshot"]["state_bytes"].as_u64().unwrap() > 0);
    assert_eq!(resp["snapshot"]["memory_bytes"], 32 << 20);
    assert_eq!(api_request(&api, &json!({"cmd": "info"}), API_TIMEOUT)["info"]["state"], "paused");
    // Paused: nothing more reaches the console.
    let serial = read_serial(dir.path());
    assert_eq!(api_request(&api, &json!({"cmd": "shutdown"}), API_TIMEOUT)["ok"], true);
    let run = vmm.wait();
    assert!(run.status.success(), "{:?}\n{}", run.status, run.stderr);
    assert_eq!(run.serial, serial, "the VM printed after its snapshot");
    Snapshotted { dir, snap, serial }
}

/// A restored VMM in its own directory (serial.log, api.sock).
fn restore(snap: &Path, run_dir: &Path, extra: serde_json::Value) -> VmmProcess {
    std::fs::create_dir_all(run_dir).unwrap();
    let mut run = json!({"api_socket": run_dir.join("api.sock"), "serial_log": run_dir.join("serial.log")});
    for (k, v) in extra.as_object().unwrap() {
        run[k] = v.clone();
    }
    let run_cfg = run_dir.join("restore.json");
    std::fs::write(&run_cfg, run.to_string()).unwrap();
    VmmProcess::spawn_args(
        run_dir,
        &["--restore".as_ref(), snap.as_os_str(), "--restore-config".as_ref(), run_cfg.as_os_str()],
        GUEST_TIMEOUT,
    )
}

/// Waits until the restored VMM answers, built and paused.
fn await_paused(run_dir: &Path) {
    let api = run_dir.join("api.sock");
    wait_for_socket(&api, Duration::from_secs(10));
    let info = api_request(&api, &json!({"cmd": "info"}), API_TIMEOUT);
    assert_eq!(info["info"]["state"], "paused", "a restored VM waits for resume: {info}");
    assert!(info["info"]["first_kvm_run_unix_ns"].is_null(), "no vCPU ran before resume: {info}");
    assert!(!info["info"]["restore"]["phases"].as_array().unwrap().is_empty(), "{info}");
}

fn resume(run_dir: &Path) {
    await_paused(run_dir);
    assert_eq!(api_request(&run_dir.join("api.sock"), &json!({"cmd": "resume"}), API_TIMEOUT)["ok"], true);
}

fn shutdown(vmm: VmmProcess, run_dir: &Path) -> Run {
    assert_eq!(api_request(&run_dir.join("api.sock"), &json!({"cmd": "shutdown"}), API_TIMEOUT)["ok"], true);
    let run = vmm.wait();
    assert!(run.status.success(), "{:?}\n{}", run.status, run.stderr);
    run
}

/// Waits until `run_dir`'s console shows at least `n` counts.
fn wait_counts(run_dir: &Path, n: usize) -> String {
    wait_for_serial_text(run_dir, GUEST_TIMEOUT, &format!("{n} counts"), |t| counts(t).len() >= n)
}

#[test]
fn restored_guest_continues_counting_in_a_new_process() {
    let Some(guest) = guest_or_skip("counter") else { return };
    // A disk rides along (its slot, transport and device state): the restore keeps its path.
    let disks = tempfile::tempdir().unwrap();
    let s = boot_and_snapshot(&guest, json!({"block": [{"path": zero_disk(disks.path(), 8192)}]}), "count 5\n");
    assert!(counts(&s.serial).len() >= 5);
    let run_dir = s.dir.path().join("restored");
    let vmm = restore(&s.snap, &run_dir, json!({}));
    resume(&run_dir);
    wait_counts(&run_dir, 5);
    let run = shutdown(vmm, &run_dir);
    assert!(!run.serial.contains("counter up"), "the guest started over: {:?}", run.serial);
    assert_continues(&s.serial, &run.serial);
}

/// A restore config that says `resume` (the shim's): the guest runs as soon as it is restored,
/// with no API call, and goes on from the snapshot; the API still answers and can pause it.
#[test]
fn a_restore_that_says_resume_runs_at_once_and_continues() {
    let Some(guest) = guest_or_skip("counter") else { return };
    let s = boot_and_snapshot(&guest, json!({}), "count 3\n");
    let run_dir = s.dir.path().join("resumed");
    let vmm = restore(&s.snap, &run_dir, json!({"resume": true}));
    let text = wait_counts(&run_dir, 3);
    assert!(!text.contains("counter up"), "the guest started over: {text:?}");
    let api = run_dir.join("api.sock");
    let info = api_request(&api, &json!({"cmd": "info"}), API_TIMEOUT);
    assert_eq!(info["info"]["state"], "running", "{info}");
    assert!(info["info"]["first_kvm_run_unix_ns"].is_u64(), "{info}");
    assert_eq!(api_request(&api, &json!({"cmd": "pause"}), API_TIMEOUT)["ok"], true);
    assert_eq!(api_request(&api, &json!({"cmd": "info"}), API_TIMEOUT)["info"]["state"], "paused");
    let run = shutdown(vmm, &run_dir);
    assert_continues(&s.serial, &run.serial);
}

#[test]
fn two_restores_run_side_by_side_and_never_write_the_snapshot() {
    let Some(guest) = guest_or_skip("counter") else { return };
    let disks = tempfile::tempdir().unwrap();
    let s = boot_and_snapshot(&guest, json!({"block": [{"path": zero_disk(disks.path(), 8192)}]}), "count 3\n");
    let memory = std::fs::read(s.snap.join("memory")).unwrap();
    let state = std::fs::read(s.snap.join("state")).unwrap();
    // Each restore gets its own copy of the disk.
    let disk_for = |name: &str| {
        let p = disks.path().join(format!("{name}.img"));
        std::fs::write(&p, vec![0u8; 8192]).unwrap();
        json!([{ "path": p }])
    };
    let wrong_size = disks.path().join("small.img");
    std::fs::write(&wrong_size, vec![0u8; 4096]).unwrap();
    let refused = restore(&s.snap, &s.dir.path().join("small"), json!({"block": [{ "path": wrong_size }]})).wait();
    assert!(refused.stderr.contains("holds 8 sectors, the snapshot's disk held 16"), "{}", refused.stderr);

    // A restores at once; B is prepared ahead and restored on request.
    let (a_dir, b_dir) = (s.dir.path().join("a"), s.dir.path().join("b"));
    let a = restore(&s.snap, &a_dir, json!({"block": disk_for("a")}));
    std::fs::create_dir_all(&b_dir).unwrap();
    let b_api = b_dir.join("api.sock");
    let b = VmmProcess::spawn_args(
        &b_dir,
        &["--prepare".as_ref(), s.snap.as_os_str(), "--api-socket".as_ref(), b_api.as_os_str()],
        GUEST_TIMEOUT,
    );
    wait_for_socket(&b_api, Duration::from_secs(10));
    assert_eq!(api_request(&b_api, &json!({"cmd": "info"}), API_TIMEOUT)["info"]["state"], "prepared");
    let refused = api_request(&b_api, &json!({"cmd": "restore", "config": {"vsock_uds_path": "/tmp/x"}}), API_TIMEOUT);
    assert!(refused["error"].as_str().unwrap().contains("no vsock device"), "{refused}");
    let b_run = json!({"serial_log": b_dir.join("serial.log"), "block": disk_for("b")});
    let restored = api_request(&b_api, &json!({"cmd": "restore", "config": b_run}), API_TIMEOUT);
    assert_eq!(restored["ok"], true, "{restored}");
    assert!(restored["restore"]["requested_unix_ns"].is_u64(), "{restored}");

    // A runs well ahead of B; then both run together. Each must count on from the snapshot on
    // its own: a shared page would show up as skipped numbers.
    resume(&a_dir);
    wait_counts(&a_dir, 10);
    resume(&b_dir);
    wait_counts(&b_dir, 10);
    wait_counts(&a_dir, 20);
    let a_run = shutdown(a, &a_dir);
    let b_run = shutdown(b, &b_dir);
    assert_continues(&s.serial, &a_run.serial);
    assert_continues(&s.serial, &b_run.serial);
    assert!(std::fs::read(s.snap.join("memory")).unwrap() == memory, "a restore wrote to the memory file");
    assert_eq!(std::fs::read(s.snap.join("state")).unwrap(), state);
}

fn copy_snapshot(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for f in ["state", "memory"] {
        std::fs::copy(from.join(f), to.join(f)).unwrap();
    }
}

/// Restoring `snap` must fail at once with `needle` in the error.
fn assert_refused(snap: &Path, run_dir: &Path, needle: &str) {
    let run = restore(snap, run_dir, json!({})).wait();
    assert_eq!(run.status.code(), Some(1), "{needle}: {}", run.stderr);
    assert!(run.stderr.contains(needle), "expected {needle:?} in:\n{}", run.stderr);
    assert!(!run_dir.join("api.sock").exists(), "a refused restore serves no API");
}

#[test]
fn damaged_snapshots_are_refused_with_a_clear_error() {
    let Some(guest) = guest_or_skip("counter") else { return };
    let s = boot_and_snapshot(&guest, json!({}), "count 1\n");
    let state = std::fs::read(s.snap.join("state")).unwrap();
    type Damage<'a> = Box<dyn Fn(&Path) + 'a>;
    let cases: [(&str, Damage, &str); 5] = [
        (
            "truncated",
            Box::new(|d: &Path| std::fs::write(d.join("state"), &state[..state.len() - 100]).unwrap()),
            "state file is truncated",
        ),
        (
            "flipped",
            Box::new(|d: &Path| {
                let mut b = state.clone();
                b[state.len() / 2] ^= 0x01;
                std::fs::write(d.join("state"), b).unwrap();
            }),
            "state file is corrupt: checksum mismatch",
        ),
        (
            "future",
            Box::new(|d: &Path| {
                let mut b = state.clone();
                b[8..12].copy_from_slice(&99u32.to_le_bytes());
                std::fs::write(d.join("state"), b).unwrap();
            }),
            "snapshot format version 99 is not supported",
        ),
        (
            "short-memory",
            Box::new(|d: &Path| {
                std::fs::File::options().write(true).open(d.join("memory")).unwrap().set_len(4096).unwrap()
            }),
            "holds 4096 bytes",
        ),
        ("no-state", Box::new(|d: &Path| std::fs::remove_file(d.join("state")).unwrap()), "cannot read state file"),
    ];
    for (name, damage, needle) in cases {
        let snap = s.dir.path().join(format!("snap-{name}"));
        copy_snapshot(&s.snap, &snap);
        damage(&snap);
        assert_refused(&snap, &s.dir.path().join(format!("run-{name}")), needle);
    }
}

#[test]
fn restored_vsock_tells_the_guest_its_transport_was_reset() {
    let Some(guest) = guest_or_skip("vsock_reset") else { return };
    let orig = tempfile::tempdir().unwrap();
    let vsock = json!({"vsock": {"uds_path": orig.path().join("v.sock"), "guest_cid": 3}});
    let s = boot_and_snapshot(&guest, vsock, "vsock ready\n");
    assert!(!s.serial.contains("event"), "no event before the snapshot: {:?}", s.serial);
    let run_dir = s.dir.path().join("restored");
    let uds = run_dir.join("v.sock");
    // The snapshot's own socket path must not be reused by the restore.
    let refused = restore(&s.snap, &s.dir.path().join("no-vsock"), json!({})).wait();
    assert!(refused.stderr.contains("vsock_uds_path"), "{}", refused.stderr);
    let vmm = restore(&s.snap, &run_dir, json!({"vsock_uds_path": uds}));
    // Checked while paused: once resumed, this guest reports the event and exits, and the VMM
    // removes its socket (checking after resume raced with that exit).
    await_paused(&run_dir);
    assert!(uds.exists(), "the restored VM listens on its own vsock socket");
    resume(&run_dir);
    let run = vmm.wait();
    assert!(run.status.success(), "{:?}\n{}", run.status, run.stderr);
    assert_eq!(run.serial, "event 0 len 4\n", "stderr:\n{}", run.stderr);
}

const FS_TAG: &str = "shared";

/// A directory to share holding `hello.txt` with `content`.
fn share(dir: &Path, content: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("hello.txt"), content).unwrap();
    dir.to_owned()
}

/// The vsock CID that makes a test guest a template (`guests/common.rs`).
const TEMPLATE_CID: u64 = 100;

#[test]
fn a_template_with_virtio_fs_restores_against_a_fresh_virtiofsd_and_serves_fuse() {
    let Some(guest) = guest_or_skip("fs") else { return };
    // The template: the fs driver has probed the device (its virtiofsd connected), nothing is
    // mounted; the guest waits for the transport reset a restore brings.
    let work = tempfile::tempdir().unwrap();
    let template_share = share(&work.path().join("template-share"), "the template's bytes\n");
    let template_fsd =
        Virtiofsd::start(&template_share, &work.path().join("fs.sock"), &work.path().join("virtiofsd.log"));
    let extra = json!({
        "fs": [{ "tag": FS_TAG, "socket": template_fsd.socket }],
        "vsock": { "uds_path": work.path().join("v.sock"), "guest_cid": TEMPLATE_CID },
    });
    let s = boot_and_snapshot(&guest, extra, "waiting for restore\n");
    drop(template_fsd);

    // A pod: its own virtiofsd sharing its own directory, its own sockets.
    let run_dir = s.dir.path().join("restored");
    std::fs::create_dir_all(&run_dir).unwrap();
    let pod_share = share(&work.path().join("pod-share"), "the pod's own bytes\n");
    let pod_fsd = Virtiofsd::start(&pod_share, &run_dir.join("fs.sock"), &run_dir.join("virtiofsd.log"));
    let no_fs = restore(&s.snap, &s.dir.path().join("no-fs"), json!({"vsock_uds_path": run_dir.join("x.sock")})).wait();
    assert!(no_fs.stderr.contains("the run names 0 fs sockets, the snapshot has 1"), "{}", no_fs.stderr);

    let vmm =
        restore(&s.snap, &run_dir, json!({"vsock_uds_path": run_dir.join("v.sock"), "fs_sockets": [pod_fsd.socket]}));
    let api = run_dir.join("api.sock");
    wait_for_socket(&api, Duration::from_secs(10));
    let info = api_request(&api, &json!({"cmd": "info"}), API_TIMEOUT);
    let phases: Vec<&str> =
        info["info"]["restore"]["phases"].as_array().unwrap().iter().filter_map(|p| p["name"].as_str()).collect();
    // virtiofsd sees only the relay's region, so the template stays a private, shared-page map.
    assert!(phases.contains(&"map memory file (MAP_PRIVATE)"), "copy-on-write map of the template: {phases:?}");
    resume(&run_dir);
    let run = vmm.wait();
    let log = pod_fsd.log_text();
    assert!(run.status.success(), "{:?}\nstderr:\n{}\nvirtiofsd:\n{log}", run.status, run.stderr);
    assert!(run.serial.starts_with("restored\ninit 7."), "FUSE began after the restore:\n{}", run.serial);
    assert!(run.serial.contains("data<the pod's own bytes\n>\n"), "serial:\n{}\nvirtiofsd:\n{log}", run.serial);
    assert!(run.serial.ends_with("fs done\n"), "serial:\n{}", run.serial);
    assert!(!run.stderr.contains("virtio-fs backend failed"), "{}", run.stderr);
}

#[test]
fn a_snapshot_is_refused_once_the_guest_has_a_fuse_session() {
    let Some(guest) = guest_or_skip("fs") else { return };
    let dir = tempfile::tempdir().unwrap();
    let shared = share(&dir.path().join("share"), "bytes\n");
    std::fs::write(shared.join("loop"), "").unwrap(); // the guest keeps reading
    let fsd = Virtiofsd::start(&shared, &dir.path().join("fs.sock"), &dir.path().join("virtiofsd.log"));
    let api = dir.path().join("api.sock");
    let mut cfg = raw_config(dir.path(), &guest);
    cfg["fs"] = json!([{ "tag": FS_TAG, "socket": fsd.socket }]);
    cfg["api_socket"] = json!(api);
    let vmm = VmmProcess::spawn(dir.path(), &cfg, GUEST_TIMEOUT);
    wait_for_serial(dir.path(), "looping\n", GUEST_TIMEOUT);

    let snap = dir.path().join("snap");
    let refused = api_request(&api, &json!({"cmd": "snapshot", "dir": snap}), API_TIMEOUT);
    let why = refused["error"].as_str().unwrap_or_default();
    assert!(why.contains("the VM stays paused") && why.contains("FUSE") && why.contains(FS_TAG), "{refused}");
    assert!(!snap.exists(), "nothing was written");
    assert_eq!(api_request(&api, &json!({"cmd": "info"}), API_TIMEOUT)["info"]["state"], "paused");
    assert_eq!(api_request(&api, &json!({"cmd": "shutdown"}), API_TIMEOUT)["ok"], true);
    let run = vmm.wait();
    assert!(run.status.success(), "{:?}\n{}", run.status, run.stderr);
}
