//! `--mode guest` for real, inside a private mount/pid/uts namespace: the boot plan's mounts
//! exist, SetupSandbox applies the hostname, and DestroySandbox powers "the VM" off (in a pid
//! namespace, reboot(2) ends its init).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod common;

use std::{process::Command, time::Duration};

use bulkhead_protocol::agent::*;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_mode_boot_mounts_setup_and_power_off() {
    if !can_run("guest_mode_boot_mounts_setup_and_power_off") {
        return;
    }
    let mut agent = Agent::start_guest_mode("guest").await;
    let v = agent
        .client
        .version(ctx(), &VersionRequest { protocol_version: bulkhead_protocol::PROTOCOL_VERSION, ..Default::default() })
        .await
        .unwrap();
    assert_eq!(v.mode, "guest");

    let pid = agent.agent_pid().expect("agent pid");
    let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    for (target, fstype) in [
        ("/proc", "proc"),
        ("/sys", "sysfs"),
        ("/dev", "devtmpfs"),
        ("/dev/pts", "devpts"),
        ("/dev/shm", "tmpfs"),
        ("/tmp", "tmpfs"),
        ("/run", "tmpfs"),
        ("/sys/fs/cgroup", "cgroup2"),
    ] {
        let found = mountinfo.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let sep = f.iter().position(|x| *x == "-");
            f.get(4) == Some(&target) && sep.and_then(|i| f.get(i + 1)) == Some(&fstype)
        });
        assert!(found, "{fstype} not mounted on {target}:\n{mountinfo}");
    }

    // Only namespaced settings here: the clock, entropy pool and /etc are the host's.
    let setup = SetupSandboxRequest {
        hostname: "guest-pod".into(),
        sysctls: [("kernel.domainname".to_string(), "bulkhead.test".to_string())].into_iter().collect(),
        ..Default::default()
    };
    agent.client.setup_sandbox(ctx(), &setup).await.unwrap_or_else(|e| panic!("setup: {e}\n{}", agent.log()));
    let uts = |what: &str| {
        let out = Command::new("nsenter").args(["--target", &pid.to_string(), "--uts", what]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    assert_eq!(uts("hostname"), "guest-pod");
    assert_eq!(uts("domainname"), "bulkhead.test");
    let bad = SetupSandboxRequest {
        sysctls: [("../../etc/passwd".to_string(), "x".to_string())].into_iter().collect(),
        ..Default::default()
    };
    let e = agent.client.setup_sandbox(ctx(), &bad).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::INVALID_ARGUMENT, "{e}");

    agent.client.destroy_sandbox(ctx(), &DestroySandboxRequest::default()).await.unwrap();
    assert!(agent.wait_exit(Duration::from_secs(10)).is_some(), "guest-mode agent did not power off\n{}", agent.log());
}
