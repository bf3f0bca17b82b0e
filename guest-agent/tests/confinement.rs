//! Namespace mode's confinement, seen from the host: the agent runs in a minimal root (its
//! binary, /proc, /sys with the cgroup hierarchies, a /dev of six nodes, its state dir and its
//! `--share-dir`), with the capability set the README states and no_new_privs unset; containers
//! asking for more capabilities are refused, naming them; and the containers it runs still work:
//! a non-root init (exec into it), no_new_privs as each spec says.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod common;

use std::path::Path;

use bulkhead_protocol::{agent::*, stream::StreamKind};
use common::*;
use serde_json::json;

/// The agent's capabilities after the drop, as guest-agent/README.md states them: containerd's
/// default set plus CAP_SYS_ADMIN and CAP_SYS_PTRACE.
const KEPT_MASK: &str = "00000000a82c25fb";

/// Regular files below `dir` (symbolic links not followed).
fn files_below(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return found };
    for entry in entries.flatten() {
        let kind = entry.file_type().unwrap();
        if kind.is_dir() {
            found.extend(files_below(&entry.path()));
        } else if kind.is_file() {
            found.push(entry.path());
        }
    }
    found
}

fn status_field(pid: i32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| panic!("{field} not in /proc/{pid}/status"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_runs_in_a_minimal_root_with_the_kept_capabilities() {
    if !can_run("the_agent_runs_in_a_minimal_root_with_the_kept_capabilities") {
        return;
    }
    let agent = Agent::start("confined").await;
    // The serving agent: its first run, which only waits for it, keeps the launcher's privileges.
    let pid = agent.serving_pid().unwrap_or_else(|| panic!("no serving agent\n{}", agent.log()));
    let root = format!("/proc/{pid}/root");

    // The root holds its binary, /dev, /proc, /sys, the read-only sysfs containers get as their
    // /sys, and the top of the kept directories (the test's directory under /tmp), and for a
    // dynamically linked build the loader's and libraries' paths: nothing of the host's /etc,
    // no shadow file.
    let mut top: Vec<String> =
        std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    top.retain(|name| !["lib", "lib64", "usr"].contains(&name.as_str()));
    top.sort();
    assert_eq!(top, ["bulkhead-agent", "container-sysfs", "dev", "proc", "sys", "tmp"], "{}", agent.log());
    for dir in ["lib", "lib64", "usr"] {
        for file in files_below(Path::new(&format!("{root}/{dir}"))) {
            let name = file.file_name().unwrap().to_string_lossy().into_owned();
            assert!(name.contains(".so"), "{} in the root is not a shared library", file.display());
        }
    }
    assert!(Path::new("/etc/shadow").exists(), "the host has a shadow file to hide");
    assert!(!Path::new(&format!("{root}/etc/shadow")).exists());
    let mut dev: Vec<String> = std::fs::read_dir(format!("{root}/dev"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    dev.sort();
    assert_eq!(dev, ["full", "null", "random", "tty", "urandom", "zero"]);
    // Only the test's own directory of /tmp is there.
    let tmp: Vec<_> = std::fs::read_dir(format!("{root}/tmp")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(tmp, [agent.dir.path().file_name().unwrap()]);
    // The root and its /dev are read-only.
    let err = std::fs::write(format!("{root}/planted"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    let err = std::fs::write(format!("{root}/dev/planted"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");

    // Every mount of the agent is one of the root's parts.
    let dir = agent.dir.path().display().to_string();
    let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    for point in mountinfo.lines().filter_map(|l| l.split(' ').nth(4)) {
        let library = (point.starts_with("/usr/") || point.starts_with("/lib")) && point.contains(".so");
        let allowed = ["/", "/bulkhead-agent", "/proc", "/sys", "/container-sysfs", "/dev"].contains(&point)
            || library
            || point.starts_with("/sys/fs/cgroup")
            || point == dir
            || point == format!("{dir}/state");
        assert!(allowed, "unexpected mount {point} in the agent's root:\n{mountinfo}");
    }

    // Capabilities: what the README states, in every set; nothing inheritable or ambient.
    for set in ["CapEff", "CapPrm", "CapBnd"] {
        assert_eq!(status_field(pid, set), KEPT_MASK, "{set}");
    }
    assert_eq!(status_field(pid, "CapInh"), "0000000000000000");
    assert_eq!(status_field(pid, "CapAmb"), "0000000000000000");
    // no_new_privs is left unset on purpose (README): it would reach every container.
    assert_eq!(status_field(pid, "NoNewPrivs"), "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capabilities_outside_the_containers_set_are_refused_by_name() {
    if !can_run("capabilities_outside_the_containers_set_are_refused_by_name") {
        return;
    }
    let agent = Agent::start("capsref").await;
    let rootfs = busybox_rootfs(agent.dir.path(), "rootfs");

    let mut admin = plain_spec(&rootfs, &["true"]);
    admin["process"]["capabilities"]["bounding"].as_array_mut().unwrap().push("CAP_SYS_ADMIN".into());
    let err = agent.create("admin", &admin, false).await.unwrap_err().to_string();
    assert!(err.contains("CAP_SYS_ADMIN") && err.contains("namespace backend"), "{err}");

    let mut module = plain_spec(&rootfs, &["true"]);
    module["process"]["capabilities"]["effective"] = json!(["CAP_SYS_MODULE", "CAP_NET_ADMIN"]);
    let err = agent.create("module", &module, false).await.unwrap_err().to_string();
    assert!(err.contains("CAP_NET_ADMIN, CAP_SYS_MODULE"), "{err}");

    // An exec is held to the same set.
    agent.create_ok("box", &plain_spec(&rootfs, &["sleep", "1000"])).await;
    agent.start_ctr("box").await;
    let process = json!({
        "user": {"uid": 0, "gid": 0}, "args": ["true"], "env": ["PATH=/bin"], "cwd": "/",
        "capabilities": {"bounding": ["CAP_SYS_PTRACE"], "effective": ["CAP_SYS_PTRACE"]}
    });
    let req = ExecProcessRequest {
        container_id: "box".into(),
        exec_id: "ptrace".into(),
        process_json: serde_json::to_vec(&process).unwrap(),
        ..Default::default()
    };
    let err = agent.client.exec_process(ctx(), &req).await.unwrap_err().to_string();
    assert!(err.contains("CAP_SYS_PTRACE"), "{err}");

    // The pod's network is CNI's: a confined agent configures no links.
    let req = SetupSandboxRequest {
        interfaces: vec![Interface { name: "eth0".into(), ..Default::default() }],
        ..Default::default()
    };
    let err = agent.client.setup_sandbox(ctx(), &req).await.unwrap_err().to_string();
    assert!(err.contains("CAP_NET_ADMIN"), "{err}");
    agent.remove("box").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn containers_keep_setuid_unless_they_ask_for_no_new_privs() {
    if !can_run("containers_keep_setuid_unless_they_ask_for_no_new_privs") {
        return;
    }
    let agent = Agent::start("nnp").await;
    let rootfs = busybox_rootfs(agent.dir.path(), "rootfs");
    let probe = "grep -E '^(NoNewPrivs|CapEff)' /proc/self/status";
    for (id, nnp, want) in [("escalating", false, "NoNewPrivs:\t0"), ("nnp", true, "NoNewPrivs:\t1")] {
        let mut spec = plain_spec(&rootfs, &["sh", "-c", probe]);
        spec["process"]["noNewPrivileges"] = nnp.into();
        agent.create_ok(id, &spec).await;
        let mut out = agent.stream(id, None, StreamKind::Stdout).await;
        agent.start_ctr(id).await;
        let text = read_all(&mut out).await;
        assert!(text.contains(want), "{id}: {text}");
        // The container's own capabilities are its spec's, whatever the agent keeps.
        assert!(text.contains("CapEff:\t00000000000405fb"), "{id}: {text}");
        assert_eq!(agent.wait(id, "").await.exit_code, 0);
        agent.remove(id).await;
    }

    // A container whose init is not root: exec into it needs the agent's CAP_SYS_PTRACE.
    let mut spec = plain_spec(&rootfs, &["sleep", "1000"]);
    spec["process"]["user"] = json!({"uid": 1000, "gid": 1000});
    agent.create_ok("user", &spec).await;
    agent.start_ctr("user").await;
    let process = json!({"user": {"uid": 1000, "gid": 1000}, "args": ["id", "-u"], "env": ["PATH=/bin"], "cwd": "/"});
    let req = ExecProcessRequest {
        container_id: "user".into(),
        exec_id: "id".into(),
        process_json: serde_json::to_vec(&process).unwrap(),
        ..Default::default()
    };
    agent.client.exec_process(ctx(), &req).await.unwrap_or_else(|e| panic!("exec: {e}\n{}", agent.log()));
    let mut out = agent.stream("user", Some("id"), StreamKind::Stdout).await;
    assert_eq!(read_all(&mut out).await, "1000\n");
    agent.remove("user").await;
}
