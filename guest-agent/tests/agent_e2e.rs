//! End-to-end: the real agent as PID 1 of fresh namespaces, spoken to only over its Unix
//! socket with the CONNECT preamble. Each test proves one "Done when" item of issue 3.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod common;

use std::time::{Duration, Instant};

use bulkhead_protocol::{agent::*, stream::StreamKind};
use common::*;
use serde_json::json;
use tokio::io::AsyncWriteExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_echo_exit_codes_and_destroy() {
    if !can_run("lifecycle_echo_exit_codes_and_destroy") {
        return;
    }
    let mut agent = Agent::start("life").await;
    let rootfs = busybox_rootfs(agent.dir.path(), "rootfs");

    agent.create_ok("echo", &plain_spec(&rootfs, &["echo", "hello from bulkhead"])).await;
    let mut out = agent.stream("echo", None, StreamKind::Stdout).await;
    let mut err = agent.stream("echo", None, StreamKind::Stderr).await;
    agent.start_ctr("echo").await;
    assert_eq!(read_all(&mut out).await, "hello from bulkhead\n");
    assert_eq!(read_all(&mut err).await, "");
    let w = agent.wait("echo", "").await;
    assert_eq!((w.exit_code, w.signal, w.oom_killed), (0, 0, false));
    assert!(w.exited_at_unix_nanos > 0);

    // A figure for the report (not asserted): create -> start -> exit of a trivial container.
    let t0 = Instant::now();
    agent.create("timed", &plain_spec(&rootfs, &["true"]), false).await.unwrap();
    let created = t0.elapsed();
    agent.start_ctr("timed").await;
    agent.wait("timed", "").await;
    println!("create {created:?}, create+start+exit {:?}", t0.elapsed());
    agent.remove("timed").await;

    agent.create("seven", &plain_spec(&rootfs, &["sh", "-c", "exit 7"]), false).await.unwrap();
    agent.start_ctr("seven").await;
    assert_eq!(agent.wait("seven", "").await.exit_code, 7);

    agent.remove("echo").await;
    agent.remove("seven").await;

    let t0 = Instant::now();
    agent
        .client
        .destroy_sandbox(ctx(), &DestroySandboxRequest { timeout_ms: 1000, ..Default::default() })
        .await
        .unwrap();
    let status = agent.wait_exit(Duration::from_secs(10));
    assert!(status.is_some(), "agent did not exit after DestroySandbox");
    println!("destroy -> agent exit: {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_with_tty_sees_a_terminal_and_resize_changes_stty_size() {
    if !can_run("exec_with_tty_sees_a_terminal_and_resize_changes_stty_size") {
        return;
    }
    let agent = Agent::start("tty").await;
    let rootfs = busybox_rootfs(agent.dir.path(), "rootfs");
    agent.create_ok("box", &plain_spec(&rootfs, &["sleep", "1000"])).await;
    agent.start_ctr("box").await;

    agent
        .exec("box", "term", &["sh", "-c", "tty; stty size; echo READY; read x; stty size; echo DONE"], true)
        .await
        .unwrap_or_else(|e| panic!("exec: {e}\n{}", agent.log()));
    let mut tty = agent.stream("box", Some("term"), StreamKind::Tty).await;
    let mut seen = String::new();
    read_until(&mut tty, &mut seen, "READY").await;
    assert!(seen.contains("/dev/pts/"), "tty output: {seen:?}");

    let resize = ResizePtyRequest {
        container_id: "box".into(),
        exec_id: "term".into(),
        rows: 40,
        cols: 123,
        ..Default::default()
    };
    agent.client.resize_pty(ctx(), &resize).await.unwrap();
    tty.write_all(b"go\n").await.unwrap();
    read_until(&mut tty, &mut seen, "DONE").await;
    assert!(seen.contains("40 123"), "stty size after resize: {seen:?}");
    assert_eq!(agent.wait("box", "term").await.exit_code, 0);

    // ResizePty on a process without a terminal is a precise error.
    let bad = ResizePtyRequest { container_id: "box".into(), rows: 1, cols: 1, ..Default::default() };
    let e = agent.client.resize_pty(ctx(), &bad).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::FAILED_PRECONDITION, "{e}");
    agent.remove("box").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_reports_15_and_sigkill_stops_a_term_trapper() {
    if !can_run("sigterm_reports_15_and_sigkill_stops_a_term_trapper") {
        return;
    }
    let agent = Agent::start("sig").await;
    let rootfs = busybox_rootfs(agent.dir.path(), "rootfs");
    // The init traps TERM itself (prints, keeps running).
    let trapper = "trap 'echo got-term' TERM; echo armed; while :; do sleep 0.2; done";
    agent.create_ok("sig", &plain_spec(&rootfs, &["sh", "-c", trapper])).await;
    let mut out = agent.stream("sig", None, StreamKind::Stdout).await;
    agent.start_ctr("sig").await;
    let mut seen = String::new();
    read_until(&mut out, &mut seen, "armed").await;

    // A plain sleep (not PID 1 of its namespace) dies of TERM.
    agent.exec("sig", "sleeper", &["sleep", "100"], false).await.unwrap();
    agent.signal("sig", "sleeper", libc::SIGTERM).await.unwrap();
    let w = agent.wait("sig", "sleeper").await;
    assert_eq!((w.signal, w.exit_code), (15, 143));

    // The trapper survives TERM...
    agent.signal("sig", "", libc::SIGTERM).await.unwrap();
    read_until(&mut out, &mut seen, "got-term").await;
    let still = agent.wait_ms("sig", "", 500).await;
    assert!(still.is_err(), "trapper exited on TERM: {still:?}");
    // ...but not KILL.
    agent.signal("sig", "", libc::SIGKILL).await.unwrap();
    let w = agent.wait("sig", "").await;
    assert_eq!((w.signal, w.exit_code), (9, 137));

    // Signalling an exited process is a precise error.
    let e = agent.signal("sig", "sleeper", libc::SIGTERM).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::NOT_FOUND, "{e}");
    agent.remove("sig").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oom_kill_is_reported_in_wait_and_on_the_oom_stream() {
    if !can_run("oom_kill_is_reported_in_wait_and_on_the_oom_stream") {
        return;
    }
    let agent = Agent::start("oom").await;
    let rootfs = busybox_rootfs(agent.dir.path(), "rootfs");
    // Double a shell string until the 32 MiB limit is hit.
    let hog = "a=xxxxxxxxxxxxxxxx; while :; do a=\"$a$a\"; done";
    let limit = 32 << 20;
    let res = json!({"memory": {"limit": limit, "swap": limit}});
    agent.create_ok("hog", &spec(&rootfs, &["sh", "-c", hog], vec![], res)).await;
    agent.start_ctr("hog").await;
    let w = agent.wait("hog", "").await;
    assert!(w.oom_killed, "not reported as OOM-killed: {w:?}\n{}", agent.log());
    assert_eq!(w.signal, 9);

    let ev = agent
        .client
        .get_oom_event(ctx(), &GetOomEventRequest { after_seq: 0, wait_ms: 10_000, ..Default::default() })
        .await
        .unwrap();
    let ev = ev.event.into_option().expect("no OOM event within 10 s");
    assert_eq!(ev.container_id, "hog");
    // Nothing newer: the long poll times out empty.
    let none = agent
        .client
        .get_oom_event(ctx(), &GetOomEventRequest { after_seq: ev.seq, wait_ms: 300, ..Default::default() })
        .await
        .unwrap();
    assert!(none.event.is_none());
    agent.remove("hog").await;
}

fn read_counter(path: &std::path::Path) -> u64 {
    std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_pause_resume_and_list_pids() {
    if !can_run("stats_pause_resume_and_list_pids") {
        return;
    }
    let agent = Agent::start("stats").await;
    let rootfs = busybox_rootfs(agent.dir.path(), "rootfs");
    let vol = agent.dir.path().join("vol");
    std::fs::create_dir_all(&vol).unwrap();
    let counter = vol.join("counter");
    let busy =
        "i=0; while :; do i=$((i+1)); echo $i > /shared/counter.tmp; mv /shared/counter.tmp /shared/counter; done";
    let mounts = vec![json!({"destination": "/shared", "type": "bind", "source": vol, "options": ["rbind", "rw"]})];
    let pid = agent.create_ok("busy", &spec(&rootfs, &["sh", "-c", busy], mounts, json!({}))).await;
    agent.start_ctr("busy").await;

    let deadline = Instant::now() + T;
    while read_counter(&counter) < 100 {
        assert!(Instant::now() < deadline, "counter never moved\n{}", agent.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let stats =
        agent.client.stats(ctx(), &StatsRequest { container_id: "busy".into(), ..Default::default() }).await.unwrap();
    let cpu = stats.cpu.usage_total_nanos;
    let mem = stats.memory.usage_bytes;
    println!("stats ({}): cpu {cpu} ns, memory {mem} B, pids {}", stats.cgroup_version, stats.pids.current);
    assert!(cpu > 0 && mem > 0, "{stats:?}");

    let pids = agent
        .client
        .list_pids(ctx(), &ContainerRequest { container_id: "busy".into(), ..Default::default() })
        .await
        .unwrap()
        .pids;
    assert!(pids.contains(&pid), "init {pid} not in {pids:?}");

    let creq = ContainerRequest { container_id: "busy".into(), ..Default::default() };
    agent.client.pause_container(ctx(), &creq).await.unwrap();
    // Frozen: the counter stays put (allow one in-flight write to land first).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let a = read_counter(&counter);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let b = read_counter(&counter);
    assert_eq!(a, b, "counter moved while paused");
    // Pausing twice is a precise error.
    let e = agent.client.pause_container(ctx(), &creq).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::FAILED_PRECONDITION, "{e}");

    agent.client.resume_container(ctx(), &creq).await.unwrap();
    let deadline = Instant::now() + T;
    while read_counter(&counter) <= b {
        assert!(Instant::now() < deadline, "counter did not move after resume");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("paused at {b}, moving again after resume");

    // UpdateContainer changes the cgroup limit that Stats reports.
    let upd = UpdateContainerRequest {
        container_id: "busy".into(),
        resources_json: serde_json::to_vec(&json!({"memory": {"limit": 96 << 20}})).unwrap(),
        ..Default::default()
    };
    agent.client.update_container(ctx(), &upd).await.unwrap_or_else(|e| panic!("update: {e}\n{}", agent.log()));
    let sreq = StatsRequest { container_id: "busy".into(), ..Default::default() };
    let stats = agent.client.stats(ctx(), &sreq).await.unwrap();
    assert_eq!(stats.memory.limit_bytes, 96 << 20);
    let bad =
        UpdateContainerRequest { container_id: "busy".into(), resources_json: b"{".to_vec(), ..Default::default() };
    let e = agent.client.update_container(ctx(), &bad).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::INVALID_ARGUMENT, "{e}");
    agent.remove("busy").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_containers_share_a_volume() {
    if !can_run("two_containers_share_a_volume") {
        return;
    }
    let agent = Agent::start("vol").await;
    let rootfs_a = busybox_rootfs(agent.dir.path(), "rootfs-a");
    let rootfs_b = busybox_rootfs(agent.dir.path(), "rootfs-b");
    let vol = agent.dir.path().join("vol");
    std::fs::create_dir_all(&vol).unwrap();
    let mount = || vec![json!({"destination": "/shared", "type": "bind", "source": vol, "options": ["rbind", "rw"]})];

    let writer = "echo written-by-a > /shared/msg; while [ ! -f /shared/ack ]; do sleep 0.1; done; cat /shared/ack";
    agent.create("a", &spec(&rootfs_a, &["sh", "-c", writer], mount(), json!({})), false).await.unwrap();
    let reader = "while [ ! -f /shared/msg ]; do sleep 0.1; done; cat /shared/msg; echo ack-from-b > /shared/ack";
    agent.create("b", &spec(&rootfs_b, &["sh", "-c", reader], mount(), json!({})), false).await.unwrap();
    let mut out_a = agent.stream("a", None, StreamKind::Stdout).await;
    let mut out_b = agent.stream("b", None, StreamKind::Stdout).await;
    agent.start_ctr("a").await;
    agent.start_ctr("b").await;
    assert_eq!(read_all(&mut out_b).await, "written-by-a\n");
    assert_eq!(read_all(&mut out_a).await, "ack-from-b\n");
    assert_eq!(agent.wait("a", "").await.exit_code, 0);
    assert_eq!(agent.wait("b", "").await.exit_code, 0);
    agent.remove("a").await;
    agent.remove("b").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_precise_errors_and_the_agent_keeps_serving() {
    if !can_run("bad_input_gets_precise_errors_and_the_agent_keeps_serving") {
        return;
    }
    let agent = Agent::start("bad").await;
    let rootfs = busybox_rootfs(agent.dir.path(), "rootfs");
    let good = plain_spec(&rootfs, &["sleep", "1000"]);
    agent.create("ok", &good, false).await.unwrap();
    agent.start_ctr("ok").await;

    // Duplicate id.
    let e = agent.create("ok", &good, false).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::ALREADY_EXISTS, "{e}");
    // Malformed spec.
    let req = CreateContainerRequest {
        container_id: "bad1".into(),
        oci_spec_json: b"{\"ociVersion\": 12".to_vec(),
        ..Default::default()
    };
    let e = agent.client.create_container(ctx(), &req).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::INVALID_ARGUMENT, "{e}");
    assert!(format!("{e}").contains("malformed OCI spec"), "{e}");
    // Path-like id.
    let e = agent.create("../etc", &good, false).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::INVALID_ARGUMENT, "{e}");
    // Seccomp without no_new_privs cannot be enforced here: refused, not silently ignored.
    let mut sec = good.clone();
    sec["process"]["noNewPrivileges"] = json!(false);
    sec["linux"]["seccomp"] = json!({"defaultAction": "SCMP_ACT_ERRNO"});
    let e = agent.create("sec", &sec, false).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::UNIMPLEMENTED, "{e}");
    assert!(format!("{e}").contains("noNewPrivileges"), "{e}");
    // SCMP_ACT_NOTIFY likewise.
    let mut sec = good.clone();
    sec["linux"]["seccomp"] = json!({"defaultAction": "SCMP_ACT_NOTIFY"});
    let e = agent.create("sec2", &sec, false).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::UNIMPLEMENTED, "{e}");
    // A missing executable fails at create with a message naming it.
    let e = agent.create("nobin", &plain_spec(&rootfs, &["/no/such/binary"]), false).await.unwrap_err();
    println!("missing executable -> {e}");
    assert!(format!("{e}").contains("/no/such/binary"), "{e}");
    // ...and leaves nothing behind: the id is usable again.
    agent
        .create("nobin", &plain_spec(&rootfs, &["true"]), false)
        .await
        .unwrap_or_else(|e| panic!("re-create after failure: {e}\n{}", agent.log()));
    agent.remove("nobin").await;
    // Unknown container.
    let e = agent.wait_ms("ghost", "", 2000).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::NOT_FOUND, "{e}");
    let e = agent.signal("ghost", "", 15).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::NOT_FOUND, "{e}");
    // Duplicate exec id.
    agent.exec("ok", "e1", &["sleep", "1000"], false).await.unwrap();
    let e = agent.exec("ok", "e1", &["true"], false).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::ALREADY_EXISTS, "{e}");
    // Exec with a malformed process.
    let req = ExecProcessRequest {
        container_id: "ok".into(),
        exec_id: "e2".into(),
        process_json: b"[]".to_vec(),
        ..Default::default()
    };
    let e = agent.client.exec_process(ctx(), &req).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::INVALID_ARGUMENT, "{e}");
    // Over-long message (5 MiB > ttrpc's 4 MiB).
    let req = CreateContainerRequest {
        container_id: "huge".into(),
        oci_spec_json: vec![b' '; 5 << 20],
        ..Default::default()
    };
    let e = agent.client.create_container(ctx(), &req).await.unwrap_err();
    println!("over-long message -> {e}");
    // A stopped container refuses exec.
    agent.create("done", &plain_spec(&rootfs, &["true"]), false).await.unwrap();
    agent.start_ctr("done").await;
    assert_eq!(agent.wait("done", "").await.exit_code, 0);
    let e = agent.exec("done", "late", &["true"], false).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::FAILED_PRECONDITION, "{e}");
    assert!(format!("{e}").contains("stopped"), "{e}");
    // Stream for an unknown process is rejected in the ack.
    let mut s = bulkhead_protocol::handshake::dial_unix(
        &agent.sock,
        bulkhead_protocol::ports::AGENT_STREAMS,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let e = bulkhead_protocol::stream::StreamHeader::new("ghost", None, StreamKind::Stdout)
        .open(&mut s, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("ghost"), "{e}");

    // Still serving the good container.
    agent.exec("ok", "e3", &["true"], false).await.unwrap();
    assert_eq!(agent.wait("ok", "e3").await.exit_code, 0);
    agent.remove("ok").await;
    agent.remove("done").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_close_and_streams_never_block_each_other() {
    if !can_run("stdin_close_and_streams_never_block_each_other") {
        return;
    }
    let agent = Agent::start("stdio").await;
    let rootfs = busybox_rootfs(agent.dir.path(), "rootfs");
    // 8 MiB on stdout that nobody reads, then a line on stderr: the process must not stall
    // on the absent stdout reader, and stderr must arrive regardless.
    let flood = "head -c 8388608 /dev/zero; echo flood-done >&2";
    agent.create_ok("flood", &plain_spec(&rootfs, &["sh", "-c", flood])).await;
    let mut err = agent.stream("flood", None, StreamKind::Stderr).await;
    agent.start_ctr("flood").await;
    assert_eq!(read_all(&mut err).await, "flood-done\n");
    assert_eq!(agent.wait("flood", "").await.exit_code, 0);

    // stdin: bytes flow in, CloseStdin gives EOF.
    agent.create("box", &plain_spec(&rootfs, &["sleep", "1000"]), false).await.unwrap();
    agent.start_ctr("box").await;
    agent.exec_io("box", "cat", &["sh", "-c", "cat; echo eof-seen"], false, true).await.unwrap();
    let mut input = agent.stream("box", Some("cat"), StreamKind::Stdin).await;
    let mut out = agent.stream("box", Some("cat"), StreamKind::Stdout).await;
    input.write_all(b"piped through\n").await.unwrap();
    let mut seen = String::new();
    read_until(&mut out, &mut seen, "piped through\n").await;
    let close = CloseStdinRequest { container_id: "box".into(), exec_id: "cat".into(), ..Default::default() };
    agent.client.close_stdin(ctx(), &close).await.unwrap();
    read_until(&mut out, &mut seen, "eof-seen").await;
    assert_eq!(agent.wait("box", "cat").await.exit_code, 0);
    agent.remove("flood").await;
    agent.remove("box").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seccomp_profile_from_the_spec_is_enforced_for_init_and_exec() {
    if !can_run("seccomp_profile_from_the_spec_is_enforced_for_init_and_exec") {
        return;
    }
    let agent = Agent::start("seccomp").await;
    let rootfs = busybox_rootfs(agent.dir.path(), "rootfs");
    let script = "mkdir /denied 2>&1; echo mkdir-exit=$?; sleep 1000";
    let mut s = plain_spec(&rootfs, &["sh", "-c", script]);
    s["linux"]["seccomp"] = json!({
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64"],
        "syscalls": [
            {"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO"},
            {"names": ["sethostname"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38}
        ]
    });
    agent.create_ok("sc", &s).await;
    let mut out = agent.stream("sc", None, StreamKind::Stdout).await;
    agent.start_ctr("sc").await;
    let mut seen = String::new();
    read_until(&mut out, &mut seen, "mkdir-exit=").await;
    read_until(&mut out, &mut seen, "\n").await;
    assert!(seen.contains("Operation not permitted"), "init not filtered: {seen:?}");
    assert!(seen.contains("mkdir-exit=1"), "{seen:?}");

    // Execs inherit the profile, including the custom errno.
    agent
        .exec_io(
            "sc",
            "host",
            &["sh", "-c", "hostname x 2>&1; mkdir /d2 2>&1; touch /ok && echo touch-ok"],
            false,
            false,
        )
        .await
        .unwrap();
    let mut eo = agent.stream("sc", Some("host"), StreamKind::Stdout).await;
    let text = read_all(&mut eo).await;
    assert!(text.contains("Function not implemented"), "errnoRet 38 not applied: {text:?}");
    assert!(text.contains("Operation not permitted"), "{text:?}");
    assert!(text.contains("touch-ok"), "allowed syscalls must work: {text:?}");
    agent.remove("sc").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_to_the_agent_destroys_the_sandbox() {
    if !can_run("sigterm_to_the_agent_destroys_the_sandbox") {
        return;
    }
    let mut agent = Agent::start("term").await;
    let rootfs = busybox_rootfs(agent.dir.path(), "rootfs");
    agent.create("s", &plain_spec(&rootfs, &["sleep", "1000"]), false).await.unwrap();
    agent.start_ctr("s").await;
    let agent_pid = agent.agent_pid().expect("agent pid");
    // SAFETY: kill(2) on the agent this test started, by pid.
    assert_eq!(unsafe { libc::kill(agent_pid, libc::SIGTERM) }, 0);
    assert!(agent.wait_exit(Duration::from_secs(15)).is_some(), "agent ignored SIGTERM\n{}", agent.log());
    assert!(agent.log().contains("SIGTERM: destroying the sandbox"), "{}", agent.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spec_security_settings_are_applied() {
    if !can_run("spec_security_settings_are_applied") {
        return;
    }
    let agent = Agent::start("secure").await;
    let rootfs = busybox_rootfs(agent.dir.path(), "rootfs");
    let probe = "grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; echo nofile=$(ulimit -n); \
                 echo keys=$(ls -l /proc/keys | cut -c1) fw=$(ls /sys/firmware | wc -l); \
                 (echo 1 > /proc/sys/kernel/domainname) 2>/dev/null && echo sys=rw || echo sys=ro; \
                 hostname; echo pid=$$";
    agent.create_ok("sec", &plain_spec(&rootfs, &["sh", "-c", probe])).await;
    let mut out = agent.stream("sec", None, StreamKind::Stdout).await;
    agent.start_ctr("sec").await;
    let text = read_all(&mut out).await;
    println!("{text}");
    // CAP_CHOWN|DAC_OVERRIDE|FOWNER|FSETID|KILL|SETGID|SETUID|SETPCAP|NET_BIND_SERVICE|SYS_CHROOT
    assert!(text.contains("CapEff:\t00000000000405fb"), "{text}");
    assert!(text.contains("NoNewPrivs:\t1"), "{text}");
    assert!(text.contains("nofile=1024"), "{text}");
    // Masked: /dev/null (a char device) over a file, an empty read-only tmpfs over a dir.
    assert!(text.contains("keys=c"), "masked file not masked: {text}");
    assert!(text.contains("fw=0"), "masked dir not masked: {text}");
    assert!(text.contains("sys=ro"), "readonly path writable: {text}");
    assert!(text.contains("ctr"), "hostname from spec: {text}");
    assert!(text.contains("pid=1"), "not PID 1 of its own pid namespace: {text}");
    assert_eq!(agent.wait("sec", "").await.exit_code, 0);

    // user/group (and supplementary groups) from the spec, on an exec.
    agent.create("box", &plain_spec(&rootfs, &["sleep", "1000"]), false).await.unwrap();
    agent.start_ctr("box").await;
    let process = json!({
        "user": {"uid": 1000, "gid": 1000, "additionalGids": [5]},
        "args": ["id"], "env": ["PATH=/bin"], "cwd": "/", "noNewPrivileges": true
    });
    let req = ExecProcessRequest {
        container_id: "box".into(),
        exec_id: "who".into(),
        process_json: serde_json::to_vec(&process).unwrap(),
        ..Default::default()
    };
    agent.client.exec_process(ctx(), &req).await.unwrap_or_else(|e| panic!("exec: {e}\n{}", agent.log()));
    let mut out = agent.stream("box", Some("who"), StreamKind::Stdout).await;
    let id = read_all(&mut out).await;
    assert!(id.starts_with("uid=1000 gid=1000"), "{id}");
    assert!(id.contains("groups=") && id.contains('5'), "{id}");
    agent.remove("sec").await;
    agent.remove("box").await;
}

#[tokio::test]
async fn no_container_starts_before_the_sandbox_has_its_identity() {
    if !can_run("no_container_starts_before_the_sandbox_has_its_identity") {
        return;
    }
    // As a VM restored from a template is: serving, but never given SetupSandbox.
    let agent = Agent::start("identity").await;
    let rootfs = busybox_rootfs(agent.dir.path(), "rootfs");
    let req = CreateContainerRequest {
        container_id: "early".into(),
        oci_spec_json: serde_json::to_vec(&plain_spec(&rootfs, &["true"])).unwrap(),
        ..Default::default()
    };
    let e = agent.client.create_container(ctx(), &req).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::FAILED_PRECONDITION, "{e}");
    assert!(format!("{e}").contains("before SetupSandbox"), "{e}");
    // SetupSandbox gives it (what it applies is guest_mode's and setup.rs's to test); then
    // containers start.
    let setup = SetupSandboxRequest { hostname: "given-pod".into(), ..Default::default() };
    agent.client.setup_sandbox(ctx(), &setup).await.unwrap_or_else(|e| panic!("setup: {e}\n{}", agent.log()));
    agent.create_ok("later", &plain_spec(&rootfs, &["echo", "started"])).await;
    let mut out = agent.stream("later", None, StreamKind::Stdout).await;
    agent.start_ctr("later").await;
    assert_eq!(read_all(&mut out).await, "started\n");
    assert_eq!(agent.wait("later", "").await.exit_code, 0);
}
