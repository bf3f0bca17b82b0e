//! KVM integration: boot, serial, i8042 reset, errors, signals and the API, with the real binary.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use common::*;

#[test]
fn serial_line_lands_in_log_and_i8042_reset_exits_zero() {
    let Some(guest) = guest_or_skip("hello") else { return };
    let dir = tempfile::tempdir().unwrap();
    let run = VmmProcess::spawn(dir.path(), &raw_config(dir.path(), &guest), GUEST_TIMEOUT).wait();
    assert!(run.status.success(), "exit {:?}\nstderr:\n{}", run.status, run.stderr);
    assert!(run.serial.contains("hello from the bulkhead test guest\n"), "serial: {:?}", run.serial);
    assert!(run.stderr.contains("guest reset through i8042"), "{}", run.stderr);
}

#[test]
fn two_vcpus_boot_and_reset() {
    let Some(guest) = guest_or_skip("hello") else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = raw_config(dir.path(), &guest);
    cfg["vcpus"] = serde_json::json!(2);
    let run = VmmProcess::spawn(dir.path(), &cfg, GUEST_TIMEOUT).wait();
    assert!(run.status.success(), "exit {:?}\nstderr:\n{}", run.status, run.stderr);
    assert!(run.serial.contains("hello from the bulkhead test guest\n"), "serial: {:?}", run.serial);
}

#[test]
fn bzimage_boot_protocol_passes_cmdline_through_boot_params() {
    if skip_without_kvm() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("bzImage");
    std::fs::write(&kernel, fake_bzimage()).unwrap();
    let disk = zero_disk(dir.path(), 4096);
    let cfg = serde_json::json!({
        "kernel": kernel,
        "cmdline": "console=ttyS0 bzimage-test",
        "mem_mib": 32,
        "serial_log": dir.path().join("serial.log"),
        "block": [{ "path": disk }],
    });
    let run = VmmProcess::spawn(dir.path(), &cfg, GUEST_TIMEOUT).wait();
    assert!(run.status.success(), "exit {:?}\nstderr:\n{}", run.status, run.stderr);
    assert_eq!(run.serial, "console=ttyS0 bzimage-test virtio_mmio.device=4K@0xd0000000:5\n", "{}", run.stderr);
}

#[test]
fn bad_config_fails_with_a_clear_message() {
    if skip_without_kvm() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = serde_json::json!({ "kernel": "/nonexistent/vmlinux", "vcpus": 1 });
    let stderr = startup_failure(dir.path(), &cfg);
    assert!(stderr.contains("invalid VM config") && stderr.contains("/nonexistent/vmlinux"), "{stderr}");

    let cfg = serde_json::json!({ "kernel": "/bin/true", "vcpus": 1, "typo": true });
    let stderr = startup_failure(dir.path(), &cfg);
    assert!(stderr.contains("unknown field `typo`"), "{stderr}");
}

#[test]
fn unloadable_kernel_fails_with_a_clear_message() {
    if skip_without_kvm() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("not-a-kernel");
    std::fs::write(&kernel, vec![0x5au8; 16384]).unwrap();
    let cfg = serde_json::json!({ "kernel": kernel, "mem_mib": 32 });
    let stderr = startup_failure(dir.path(), &cfg);
    assert!(stderr.contains("neither a loadable ELF vmlinux nor a bzImage"), "{stderr}");
}

#[test]
fn vcpu_failure_exits_nonzero() {
    if skip_without_kvm() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // int3 with no IDT: an emulation failure under PVM, a triple fault elsewhere.
    let image = dir.path().join("int3.bin");
    std::fs::write(&image, [0xcc, 0xf4]).unwrap();
    let cfg = serde_json::json!({
        "raw_guest": { "image": image, "format": "flat", "load_addr": 0x100000 },
        "mem_mib": 32,
    });
    let run = VmmProcess::spawn(dir.path(), &cfg, GUEST_TIMEOUT).wait();
    assert_eq!(run.status.code(), Some(1), "{}", run.stderr);
    assert!(run.stderr.contains("VM failed"), "{}", run.stderr);
}

/// Runs a VMM that must refuse to start (exit code 1); returns its stderr.
fn startup_failure(dir: &Path, cfg: &serde_json::Value) -> String {
    let run = VmmProcess::spawn(dir, cfg, Duration::from_secs(10)).wait();
    assert_eq!(run.status.code(), Some(1));
    run.stderr
}

#[test]
fn sigterm_stops_the_vm_cleanly() {
    let Some(guest) = guest_or_skip("idle") else { return };
    let dir = tempfile::tempdir().unwrap();
    let vmm = VmmProcess::spawn(dir.path(), &raw_config(dir.path(), &guest), GUEST_TIMEOUT);
    wait_for_serial(dir.path(), "idle guest up", GUEST_TIMEOUT);
    // SAFETY: the pid is our own child.
    assert_eq!(unsafe { libc::kill(vmm.pid(), libc::SIGTERM) }, 0);
    let run = vmm.wait();
    assert!(run.status.success(), "{:?} {}", run.status, run.stderr);
    assert!(run.stderr.contains("termination signal"), "{}", run.stderr);
}

#[test]
fn api_pause_resume_info_and_shutdown() {
    let Some(guest) = guest_or_skip("idle") else { return };
    let dir = tempfile::tempdir().unwrap();
    let api = dir.path().join("api.sock");
    let mut cfg = raw_config(dir.path(), &guest);
    cfg["api_socket"] = serde_json::json!(api);
    // The second vCPU sits in KVM_RUN waiting for a SIPI: pause must still park it.
    cfg["vcpus"] = serde_json::json!(2);
    let vmm = VmmProcess::spawn(dir.path(), &cfg, GUEST_TIMEOUT);
    wait_for_socket(&api, Duration::from_secs(10));
    wait_for_serial(dir.path(), "idle guest up", GUEST_TIMEOUT);
    let mut s = UnixStream::connect(&api).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());

    let info = api_call(&mut s, &mut r, "info");
    assert_eq!(info["ok"], true);
    assert_eq!(info["info"]["state"], "running");
    assert_eq!(info["info"]["pid"], vmm.pid());
    let first = info["info"]["first_kvm_run_unix_ns"].as_u64().expect("first KVM_RUN recorded");
    assert!(first >= info["info"]["start_unix_ns"].as_u64().unwrap());

    assert_eq!(api_call(&mut s, &mut r, "pause")["ok"], true);
    assert_eq!(api_call(&mut s, &mut r, "info")["info"]["state"], "paused");
    assert_eq!(api_call(&mut s, &mut r, "resume")["ok"], true);
    assert_eq!(api_call(&mut s, &mut r, "info")["info"]["state"], "running");
    s.write_all(b"{\"cmd\":\"explode\"}\n").unwrap();
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert!(line.contains("\"ok\":false"), "{line}");
    assert_eq!(api_call(&mut s, &mut r, "shutdown")["ok"], true);
    let run = vmm.wait();
    assert!(run.status.success(), "{:?} {}", run.status, run.stderr);
    assert!(!api.exists(), "API socket removed on exit");
}
