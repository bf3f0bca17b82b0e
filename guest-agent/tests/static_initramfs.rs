//! `make -C guest-kernel initramfs` yields a static musl agent packed as /init, and that
//! binary really serves (Version handshake as PID 1 of fresh namespaces).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod common;

use std::{path::Path, process::Command, time::Duration};

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initramfs_target_builds_a_static_musl_agent() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    if Command::new("make").arg("--version").output().is_err() {
        bulkhead_integration::skip::missing_prerequisite(
            "initramfs_target_builds_a_static_musl_agent",
            "make not installed (make setup)",
        );
        return;
    }
    let out =
        Command::new("make").arg("-C").arg(root.join("guest-kernel")).arg("initramfs").output().expect("run make");
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() && log.contains("target may not be installed") {
        bulkhead_integration::skip::missing_prerequisite(
            "initramfs_target_builds_a_static_musl_agent",
            "rust target x86_64-unknown-linux-musl missing (make setup)",
        );
        return;
    }
    assert!(out.status.success(), "make initramfs failed:\n{log}");

    let agent = root.join("guest-kernel/build/bulkhead-agent");
    let file = Command::new("file").arg("-L").arg(&agent).output().expect("file(1)");
    let desc = String::from_utf8_lossy(&file.stdout).into_owned();
    println!("{desc}");
    assert!(desc.contains("statically linked") || desc.contains("static-pie linked"), "not static: {desc}");
    let ldd = Command::new("ldd").arg(&agent).output();
    if let Ok(l) = ldd {
        let text = format!("{}{}", String::from_utf8_lossy(&l.stdout), String::from_utf8_lossy(&l.stderr));
        assert!(!text.contains("libseccomp") && !text.contains("libc.so"), "dynamic deps: {text}");
    }

    // The archive is newc and holds /init.
    let cpio = Command::new("gzip")
        .arg("-dc")
        .arg(root.join("guest-kernel/build/initramfs.cpio.gz"))
        .output()
        .expect("gzip -dc");
    assert!(cpio.status.success());
    assert!(cpio.stdout.starts_with(b"070701"), "not a newc archive");
    assert!(cpio.stdout.windows(5).any(|w| w == b"init\0"), "no /init in the initramfs");

    // The static binary serves the protocol.
    if !can_run("initramfs_target_builds_a_static_musl_agent (serving part)") {
        return;
    }
    let a = Agent::start_with("static", &agent).await;
    bulkhead_protocol::client::connect_agent(&a.sock, "static-check", Duration::from_secs(5))
        .await
        .unwrap_or_else(|e| panic!("static agent does not serve: {e}\n{}", a.log()));
}
