//! The installer binary as the DaemonSet runs it: killed midway (abort at a fail point, like `kill -9`), rerun to
//! convergence, then `run` mode keeping the node wired on SIGTERM (the default) or uninstalling (when asked to), and
//! `uninstall` refusing while a pod runs unless forced. containerd is restarted through the injectable
//! `--restart-command`, here a script that restarts the test's own containerd by PID file (`support::Script`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod support;

use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_bulkhead-node-installer");

fn installer(node: &support::Node, script: &support::Script, cmd: &str) -> Command {
    let mut c = Command::new(BIN);
    c.arg(cmd)
        .arg("--no-kube")
        .arg("--host-root")
        .arg(node.root())
        .arg("--view-root")
        .arg(node.root())
        .arg("--artifacts")
        .arg(node.artifacts.path().join("image"))
        .args(["--artifact-version", "0.1.0-test", "--cri-timeout-secs", "30"])
        .arg("--restart-command")
        .arg(format!("{} restart", script.path.display()))
        .env_remove("BULKHEAD_INSTALLER_FAILPOINT")
        .stdin(Stdio::null());
    c
}

fn temp_files(dir: &Path) -> Vec<String> {
    let mut out = vec![];
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() && !p.is_symlink() {
                stack.push(p);
            } else if p.to_string_lossy().ends_with(".bulkhead-tmp") {
                out.push(p.display().to_string());
            }
        }
    }
    out
}

#[test]
fn killed_midway_rerun_converges_then_sigterm_keeps_or_uninstalls() {
    if !support::can_run_containerd() {
        return;
    }
    let node = support::node(true);
    let original = fs::read(node.config()).unwrap();
    let before = node.snapshot();
    let script = support::Script::new(&node);
    script.run("start");

    // Killed while writing the first artifact: a temp file is left, nothing is on the final path.
    let out = installer(&node, &script, "install")
        .env("BULKHEAD_INSTALLER_FAILPOINT", "artifact-temp-written")
        .output()
        .unwrap();
    assert_eq!(out.status.signal(), Some(libc::SIGABRT), "{}", String::from_utf8_lossy(&out.stderr));
    let version_dir = node.root().join("opt/bulkhead/0.1.0-test");
    assert_eq!(temp_files(&version_dir).len(), 1);
    assert!(!version_dir.join("containerd-shim-bulkhead-v2").exists());

    // Killed after the config backup, before the config edit.
    let out = installer(&node, &script, "install")
        .env("BULKHEAD_INSTALLER_FAILPOINT", "config-backup-written")
        .output()
        .unwrap();
    let log2 = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), Some(libc::SIGABRT), "{log2}");
    assert!(log2.contains("removed temp file left by an interrupted run"), "{log2}");
    assert!(log2.contains("artifact installed") && log2.contains("drop-in written"), "{log2}");
    assert_eq!(fs::read(node.config()).unwrap(), original);
    assert_eq!(script.restarts(), 0);

    // Rerun: converges, restarts containerd once, and logs every action as one JSON line.
    let out = installer(&node, &script, "install").output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(temp_files(node.root()).is_empty());
    assert_eq!(script.restarts(), 1);
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not one JSON line ({e}): {line}"));
        assert!(v.get("message").is_some(), "{line}");
    }
    for action in [
        "artifact up to date",
        "current symlink up to date",
        "drop-in up to date",
        "imports entry added",
        "original containerd config saved",
        "restarting containerd",
        "CRI reports handler registered",
        "install complete",
    ] {
        assert!(log.contains(action), "missing log line {action:?}:\n{log}");
    }

    // DaemonSet mode: converge (nothing to do); SIGTERM leaves the node wired by default (a rolling update
    // terminates the old pod: it must not unwire the node under its pods).
    let wired = node.snapshot();
    let log = run_until_sigterm(installer(&node, &script, "run"), &node.artifacts.path().join("run-keep.log"));
    assert!(log.contains("leaving the node wired"), "{log}");
    assert_eq!(node.snapshot(), wired, "SIGTERM with the default keeps everything");
    assert_eq!(script.restarts(), 1, "already installed: run mode must not restart containerd");

    // With BULKHEAD_ON_SIGTERM=uninstall (how an operator removes bulkhead), SIGTERM uninstalls.
    let mut run = installer(&node, &script, "run");
    run.env("BULKHEAD_ON_SIGTERM", "uninstall");
    run_until_sigterm(run, &node.artifacts.path().join("run-uninstall.log"));
    assert_eq!(fs::read(node.config()).unwrap(), original, "config restored byte for byte");
    assert_eq!(node.snapshot(), before, "no files left");
    assert_eq!(script.restarts(), 2);
}

/// Starts `cmd` (`run` mode), waits until it has converged, sends SIGTERM, expects a clean exit; returns its log.
fn run_until_sigterm(mut cmd: Command, log: &Path) -> String {
    let read = || fs::read_to_string(log).unwrap_or_default();
    let mut child = cmd.stderr(fs::File::create(log).unwrap()).stdout(Stdio::null()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !read().contains("converged") {
        assert!(Instant::now() < deadline, "run mode never converged: {}", read());
        std::thread::sleep(Duration::from_millis(100));
    }
    // SAFETY: kill(2) on the child we spawned (not yet reaped: try_wait has not seen it exit).
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("installer ignored SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "{}", read());
    read()
}

#[test]
fn uninstall_refuses_while_a_pod_runs_unless_forced() {
    if !support::can_run_containerd() {
        return;
    }
    let node = support::node(true);
    support::elf_shim(&node);
    let before = node.snapshot();
    let script = support::Script::new(&node);
    script.run("start");
    let out = installer(&node, &script, "install").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let wired = node.snapshot();
    let mut pod = support::FakePod::start(&node, "abc123", "web");

    let out = installer(&node, &script, "uninstall").output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{log}");
    assert!(log.contains("refusing to uninstall: 1 bulkhead pod runs on this node (default/web)"), "{log}");
    assert!(log.contains("BULKHEAD_FORCE_UNINSTALL=1") && log.contains("--force"), "{log}");
    assert_eq!(node.snapshot(), wired, "a refused uninstall changes nothing");

    // The same refusal at SIGTERM in run mode: the pod exits with the error, the node stays wired.
    let mut run = installer(&node, &script, "run");
    run.env("BULKHEAD_ON_SIGTERM", "uninstall");
    let log_path = node.artifacts.path().join("run-refused.log");
    let mut child = run.stderr(fs::File::create(&log_path).unwrap()).stdout(Stdio::null()).spawn().unwrap();
    let read = || fs::read_to_string(&log_path).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !read().contains("converged") {
        assert!(Instant::now() < deadline, "run mode never converged: {}", read());
        std::thread::sleep(Duration::from_millis(100));
    }
    // SAFETY: kill(2) on the child we spawned and have not reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert!(!status.success() && read().contains("refusing to uninstall"), "{}", read());
    assert_eq!(node.snapshot(), wired);

    // Forced (the flag, then the environment variable on an idempotent rerun), it proceeds; the pod keeps running.
    let out = installer(&node, &script, "uninstall").arg("--force").output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("uninstall forced while bulkhead runs on this node"), "{log}");
    assert!(pod.is_running());
    assert_eq!(node.snapshot(), before, "no files left");
    let out = installer(&node, &script, "uninstall").env("BULKHEAD_FORCE_UNINSTALL", "1").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    pod.stop();
}
