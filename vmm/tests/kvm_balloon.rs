//! KVM integration: virtio-balloon free page reporting, driven by the `balloon` test guest inside
//! the real `bulkhead-vmm`. The guest dirties 8 MiB, reports it, and the host checks that the
//! memory really left: on a booted VM the guest memfd's allocated size and the VMM's RSS go down;
//! on a VM restored from a snapshot (memory file mapped private) the VMM's private copies of
//! those pages go. Both check that a hostile report comes back without breaking the device.
//!
//! The host steers the guest through a mailbox disk (sector 0), so each measurement is taken
//! while the guest waits.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod common;

use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use serde_json::json;

const MIB: u64 = 1 << 20;
/// What the guest dirties and then reports.
const REPORTED: u64 = 8 * MIB;
/// The guest reads 8 of the reported pages back (a punched page is allocated again when read),
/// plus a little for whatever else runs meanwhile.
const SLACK: u64 = 256 << 10;
const API_TIMEOUT: Duration = Duration::from_secs(30);

/// A 4 KiB disk whose sector 0 is the guest's mailbox.
fn mailbox(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, vec![0u8; 4096]).unwrap();
    path
}

/// Puts `word` (NUL-terminated) in the mailbox; the guest reads it on its next poll.
fn post(disk: &Path, word: &str) {
    let mut sector = [0u8; 512];
    sector[..word.len()].copy_from_slice(word.as_bytes());
    std::fs::OpenOptions::new().write(true).open(disk).unwrap().write_all_at(&sector, 0).unwrap();
}

/// Bytes the VMM's guest memfd has allocated (its `/proc/<pid>/fd` entry, followed).
fn memfd_allocated(pid: i32) -> u64 {
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
        let entry = entry.unwrap();
        let target = std::fs::read_link(entry.path()).unwrap_or_default();
        if target.to_string_lossy().starts_with("/memfd:bulkhead-guest-mem") {
            return std::fs::metadata(entry.path()).unwrap().blocks() * 512;
        }
    }
    panic!("no guest memfd among the VMM's fds");
}

/// `field` (kB) of `/proc/<pid>/smaps_rollup`, in bytes.
fn rollup(pid: i32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap();
    smaps_field(text.lines(), field)
}

fn smaps_field<'a>(lines: impl Iterator<Item = &'a str>, field: &str) -> u64 {
    lines
        .filter_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .filter_map(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        .sum::<u64>()
        * 1024
}

/// Anonymous (private, copied-on-write) bytes of the VMM's mappings of `file`.
fn private_copies_of(pid: i32, file: &Path) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let name = file.to_string_lossy();
    let mut total = 0;
    let mut inside = false;
    for line in text.lines() {
        // A mapping's header: "start-end perms offset dev inode [path]"; its fields follow.
        let header = line.split_whitespace().next().is_some_and(|f| f.contains('-') && !f.ends_with(':'));
        if header {
            inside = line.ends_with(name.as_ref());
        } else if inside {
            total += smaps_field(std::iter::once(line), "Anonymous");
        }
    }
    total
}

/// Waits for the guest's complete `pages ...` line and returns it.
fn pages_line(dir: &Path) -> String {
    let text = wait_for_serial_text(dir, GUEST_TIMEOUT, "the pages line", |t| {
        t.find("pages zero").is_some_and(|at| t[at..].contains('\n'))
    });
    let at = text.find("pages zero").unwrap();
    text[at..].lines().next().unwrap().to_string()
}

/// Polls until the API socket accepts a connection (it exists from bind on, accepts after listen).
fn wait_for_api(p: &Path) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::os::unix::net::UnixStream::connect(p).is_err() {
        assert!(std::time::Instant::now() < deadline, "{} does not accept connections", p.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Debug lines (one per report, with the device's running totals) as JSON, for exact matching.
fn debug_log(c: &mut std::process::Command) {
    c.env("BULKHEAD_VMM_LOG", "debug").arg("--log-json");
}

#[test]
fn reported_pages_leave_the_guest_memfd_and_the_vmm_rss() {
    let Some(guest) = guest_or_skip("balloon") else { return };
    let dir = tempfile::tempdir().unwrap();
    let disk = mailbox(dir.path(), "mailbox.img");
    let mut cfg = raw_config(dir.path(), &guest);
    cfg["block"] = json!([{ "path": disk }]);
    cfg["balloon"] = json!({ "free_page_reporting": true });
    let vmm = VmmProcess::spawn_with(dir.path(), &cfg, GUEST_TIMEOUT, debug_log);
    let pid = vmm.pid();
    wait_for_serial(dir.path(), "touched\n", GUEST_TIMEOUT);
    post(&disk, "GO");
    wait_for_serial(dir.path(), "retouched\n", GUEST_TIMEOUT);
    let (memfd_before, rss_before) = (memfd_allocated(pid), rollup(pid, "Rss"));
    post(&disk, "REPORT");
    let pages = pages_line(dir.path());
    let (memfd_after, rss_after) = (memfd_allocated(pid), rollup(pid, "Rss"));
    post(&disk, "EXIT");
    let run = vmm.wait();
    println!(
        "guest memfd allocated {} KiB -> {} KiB, VMM RSS {} KiB -> {} KiB",
        memfd_before >> 10,
        memfd_after >> 10,
        rss_before >> 10,
        rss_after >> 10
    );
    assert!(run.status.success(), "{:?}\nserial:\n{}\nstderr:\n{}", run.status, run.serial, run.stderr);
    for line in ["balloon reporting on queue 2\n", "hostile report returned, nothing dropped\n", "reported\n"] {
        assert!(run.serial.contains(line), "{line:?} missing; serial:\n{}", run.serial);
    }
    assert_eq!(pages, "pages zero 8 first 0 second 0 other 0", "a punched page reads as zeros");
    assert!(run.serial.ends_with("balloon done\n"), "serial:\n{}", run.serial);

    assert!(memfd_before >= REPORTED, "the guest's pages were in the memfd: {memfd_before}");
    assert!(memfd_after + REPORTED <= memfd_before + SLACK, "memfd {memfd_before} -> {memfd_after}");
    assert!(rss_after + REPORTED <= rss_before + SLACK, "VMM RSS {rss_before} -> {rss_after}");
    // The device's own account: the hostile report's four ranges skipped, 8 MiB freed.
    assert!(run.stderr.contains("guest named pages that cannot be given back"), "{}", run.stderr);
    assert!(run.stderr.contains(r#""rejected_ranges":4"#), "{}", run.stderr);
    assert!(run.stderr.contains(&format!(r#""freed_bytes":{REPORTED}"#)), "{}", run.stderr);
}

#[test]
fn a_restored_vm_drops_its_private_copies_of_reported_pages() {
    let Some(guest) = guest_or_skip("balloon") else { return };
    let dir = tempfile::tempdir().unwrap();
    let api = dir.path().join("api.sock");
    let mut cfg = raw_config(dir.path(), &guest);
    cfg["block"] = json!([{ "path": mailbox(dir.path(), "mailbox.img") }]);
    cfg["balloon"] = json!({ "free_page_reporting": true });
    cfg["api_socket"] = json!(api);
    let vmm = VmmProcess::spawn(dir.path(), &cfg, GUEST_TIMEOUT);
    wait_for_api(&api);
    // The template: the balloon negotiated, 8 MiB dirtied, the guest polling its mailbox.
    wait_for_serial(dir.path(), "touched\n", GUEST_TIMEOUT);
    let snap = dir.path().join("snap");
    let resp = api_request(&api, &json!({"cmd": "snapshot", "dir": snap}), API_TIMEOUT);
    assert_eq!(resp["ok"], true, "{resp}");
    assert_eq!(api_request(&api, &json!({"cmd": "shutdown"}), API_TIMEOUT)["ok"], true);
    let run = vmm.wait();
    assert!(run.status.success(), "{:?}\n{}", run.status, run.stderr);

    // A pod: its own mailbox, already saying GO.
    let run_dir = dir.path().join("restored");
    std::fs::create_dir_all(&run_dir).unwrap();
    let disk = mailbox(&run_dir, "mailbox.img");
    post(&disk, "GO");
    let run_api = run_dir.join("api.sock");
    let run_cfg = run_dir.join("restore.json");
    let restore = json!({
        "api_socket": run_api,
        "serial_log": run_dir.join("serial.log"),
        "block": [{ "path": disk }],
    });
    std::fs::write(&run_cfg, restore.to_string()).unwrap();
    let vmm = VmmProcess::spawn_args_with(
        &run_dir,
        &["--restore".as_ref(), snap.as_os_str(), "--restore-config".as_ref(), run_cfg.as_os_str()],
        GUEST_TIMEOUT,
        debug_log,
    );
    let pid = vmm.pid();
    wait_for_api(&run_api);
    assert_eq!(api_request(&run_api, &json!({"cmd": "resume"}), API_TIMEOUT)["ok"], true);
    // Dirtied again after the restore: now the VMM's private copies of the file's pages.
    wait_for_serial(&run_dir, "retouched\n", GUEST_TIMEOUT);
    let memory = snap.join("memory");
    let before = private_copies_of(pid, &memory);
    post(&disk, "REPORT");
    let pages = pages_line(&run_dir);
    let after = private_copies_of(pid, &memory);
    post(&disk, "EXIT");
    let run = vmm.wait();
    println!("restored VM: private copies of the memory file {} KiB -> {} KiB", before >> 10, after >> 10);
    assert!(run.status.success(), "{:?}\nserial:\n{}\nstderr:\n{}", run.status, run.serial, run.stderr);
    assert!(run.serial.contains("hostile report returned, nothing dropped\n"), "serial:\n{}", run.serial);
    assert_eq!(pages, "pages zero 0 first 8 second 0 other 0", "a dropped private page reads the snapshot's again");
    assert!(before >= REPORTED, "the guest's writes made private copies: {before}");
    assert!(after + REPORTED <= before + SLACK, "private copies {before} -> {after}");
    assert!(run.stderr.contains(&format!(r#""freed_bytes":{REPORTED}"#)), "{}", run.stderr);
}
