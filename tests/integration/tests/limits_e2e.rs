//! A pod's limits hold as runc's do, on every backend this host runs (the namespace backend; the
//! vm backend on the QEMU stand-in, and on `bulkhead-vmm` where the probe allows), with runc
//! alongside as the measure:
//! - a fork bomb stops at the container's pids limit, kubelet's pod pids limit reaches the guest,
//!   and a second pod still answers exec;
//! - a log reader (containerd itself) stopped for 60 s costs the container nothing: it writes on,
//!   and the log resumes with its newest output after a gap the shim counted;
//! - a container that floods stdout for 30 s runs to its end, its log keeps the newest lines, and
//!   a second pod answers exec throughout. Its exec p95, idle and under the flood, is printed for
//!   each backend beside runc's: a figure to compare, not a pass mark (timings are not asserted).
//!
//! The tests of this file load the host on purpose, so they take turns.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use bulkhead_integration::guests::GuestVmm;
use bulkhead_integration::host::{dropped_output, eventually_nothing, mounts_with, processes_with};
use bulkhead_integration::images::FORKBOMB_BIN;
use bulkhead_integration::{
    cgroups, container_config, ContainerdConfig, ContainerdVersion, Cri, RuntimeHandler, Setup, ShimEnv,
};
use k8s_cri::v1 as cri;

const RUNNING: i32 = cri::ContainerState::ContainerRunning as i32;
/// The container pids limit the fork bomb meets (the figure).
const CONTAINER_PIDS: i64 = 64;
/// kubelet's podPidsLimit for the bomb's pod, set on its pod cgroup as kubelet would.
const POD_PIDS: u64 = 1000;
/// ExecSync's own deadline: a probe exec must answer within it, loaded host or not.
const EXEC_BOUND_SECS: i64 = 30;

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// One backend's handler in the private containerd.
struct Backend {
    handler: String,
    label: String,
    kind: Kind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// runc, what bulkhead is measured against.
    Runc,
    Namespace,
    Vm,
}

/// A private containerd with a handler per backend this host runs, each starting containers from
/// containerd's default spec with a pids limit of [`CONTAINER_PIDS`].
struct Stand {
    shim: ShimEnv,
    backends: Vec<Backend>,
}

impl std::ops::Deref for Stand {
    type Target = ShimEnv;

    fn deref(&self) -> &ShimEnv {
        &self.shim
    }
}

impl Stand {
    async fn start(test: &str) -> Result<Option<Self>> {
        let version = ContainerdVersion::for_test_binary(env!("CARGO_CRATE_NAME"));
        let Some(setup) = Setup::new(test, version, &["bulkhead-agent", "containerd-shim-bulkhead-v2"])? else {
            return Ok(None);
        };
        let base_spec =
            setup.write_config("base-spec.json", &serde_json::to_string_pretty(&base_spec_with_pids_limit()?)?)?;
        let handler = |name: &str, config: &Path| RuntimeHandler {
            name: name.into(),
            base_runtime_spec: Some(base_spec.clone()),
            ..RuntimeHandler::bulkhead(Some(config))
        };

        let ns_config = setup.namespace_config("namespace.toml", &setup.state().join("ns"))?;
        let runc = RuntimeHandler { base_runtime_spec: Some(base_spec.clone()), ..RuntimeHandler::runc() };
        let mut handlers = vec![runc, handler("bulkhead", &ns_config)];
        let mut backends = vec![
            Backend { handler: "runc".into(), label: "runc".into(), kind: Kind::Runc },
            Backend { handler: "bulkhead".into(), label: "namespace".into(), kind: Kind::Namespace },
        ];
        for (i, vmm) in [GuestVmm::QemuStandIn, GuestVmm::Bulkhead].into_iter().enumerate() {
            if let Some(why) = vmm.unavailable() {
                println!("{test}: not on {}: {why:?}", vmm.name());
                continue;
            }
            let vm_state = setup.state().join(format!("vm{i}"));
            let text = bulkhead_integration::guests::real_vm_config(&vm_state, 45_000, vmm)?;
            let path = setup.write_config(&format!("vm{i}.toml"), &text)?;
            let name = format!("bulkhead-vm{i}");
            handlers.push(handler(&name, &path));
            backends.push(Backend { handler: name, label: format!("vm on {}", vmm.name()), kind: Kind::Vm });
        }
        let shim = setup.start(ContainerdConfig { handlers, ..Default::default() }).await?;
        Ok(Some(Self { shim, backends }))
    }

    /// Runs a pod named `name` on `backend`, under `cgroup_parent` when given.
    async fn pod(
        &self,
        backend: &Backend,
        name: &str,
        cgroup_parent: Option<&str>,
    ) -> Result<(String, cri::PodSandboxConfig)> {
        let mut config = self.shim.pod(name)?;
        if let (Some(parent), Some(linux)) = (cgroup_parent, config.linux.as_mut()) {
            linux.cgroup_parent = parent.into();
        }
        let id =
            self.cri.run_pod_sandbox(&config, &backend.handler).await.with_context(|| self.containerd.log_tail(60))?;
        Ok((id, config))
    }

    async fn container(&self, pod: &(String, cri::PodSandboxConfig), config: &cri::ContainerConfig) -> Result<String> {
        let id =
            self.cri.create_container(&pod.0, config, &pod.1).await.with_context(|| self.containerd.log_tail(40))?;
        self.cri.start_container(&id).await?;
        self.cri.wait_container(&id, Duration::from_secs(60), |s| s.state == RUNNING).await?;
        Ok(id)
    }

    /// The serial console of vm pod `pod_id`, in whichever vm backend's state dir runs it.
    fn console_of(&self, pod_id: &str) -> Option<PathBuf> {
        std::fs::read_dir(self.state_dir.path())
            .ok()?
            .flatten()
            .map(|backend| bulkhead_integration::vm_env::console_log(&backend.path(), pod_id))
            .find(|c| c.is_file())
    }

    async fn remove_pods(&self, pods: &[&str]) -> Result<()> {
        for pod in pods {
            self.cri.stop_pod_sandbox(pod).await?;
            self.cri.remove_pod_sandbox(pod).await?;
        }
        Ok(())
    }

    /// No process or mount of any pod is left.
    async fn nothing_left(&self) -> Result<()> {
        let state = self.state_dir.path().display().to_string();
        let within = Duration::from_secs(30);
        eventually_nothing("the pods' processes", within, || {
            processes_with(&state).into_iter().map(|(p, c)| format!("{p} {c}")).collect()
        })
        .await?;
        eventually_nothing("mounts", within, || mounts_with(&state)).await
    }
}

/// containerd's default spec (`ctr oci spec`) with `linux.resources.pids.limit` set, as a node
/// whose operator caps every container's processes hands it to containerd.
fn base_spec_with_pids_limit() -> Result<serde_json::Value> {
    let out = std::process::Command::new("ctr").args(["oci", "spec"]).output().context("ctr oci spec")?;
    if !out.status.success() {
        bail!("ctr oci spec: {}", String::from_utf8_lossy(&out.stderr));
    }
    let mut spec: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    spec["linux"]["resources"]["pids"] = serde_json::json!({ "limit": CONTAINER_PIDS });
    Ok(spec)
}

/// A container that runs until SIGTERM.
fn sleeper(name: &str) -> cri::ContainerConfig {
    container_config(name, &["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.2; done"])
}

/// How long `exec` into `id` takes, each of `n` times; any failure is an error.
async fn exec_times(cri: &Cri, id: &str, n: usize) -> Result<Vec<Duration>> {
    exec_times_within(cri, id, n, Duration::MAX).await
}

/// As [`exec_times`], but no exec starts once `window` has passed: fewer samples when each is
/// slow, all of them inside what they measure.
async fn exec_times_within(cri: &Cri, id: &str, n: usize, window: Duration) -> Result<Vec<Duration>> {
    let begun = Instant::now();
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        if begun.elapsed() >= window {
            break;
        }
        let started = Instant::now();
        let out = cri.exec_sync(id, &["echo", "ok"], EXEC_BOUND_SECS).await?;
        if (out.exit_code, out.stdout.as_slice()) != (0, b"ok\n") {
            bail!("exec into {id}: {out:?}");
        }
        times.push(started.elapsed());
    }
    Ok(times)
}

/// The fork bomb's last score line in its log: (forked, eagain, other).
fn bomb_score(log: &str) -> Option<(u64, u64, u64)> {
    let line = log.lines().rev().find_map(|l| l.split_once("forked=").map(|(_, rest)| rest))?;
    let mut fields = line.split_whitespace();
    let forked = fields.next()?.parse().ok()?;
    let eagain = fields.next()?.strip_prefix("eagain=")?.parse().ok()?;
    let other = fields.next()?.strip_prefix("other=")?.parse().ok()?;
    Some((forked, eagain, other))
}

/// The first score in the bomb's log at `log_path` that `wanted` accepts (a line a second; 60 s at
/// most). The error quotes the log.
async fn wait_for_score(log_path: &str, wanted: impl Fn((u64, u64, u64)) -> bool) -> Result<(u64, u64, u64)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let log = std::fs::read_to_string(log_path).unwrap_or_default();
        match bomb_score(&log) {
            Some(score) if wanted(score) => return Ok(score),
            _ if Instant::now() > deadline => {
                let tail: Vec<&str> = log.lines().rev().take(10).collect();
                bail!("no such score within 60 s; the log ends {tail:?}")
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

#[test]
fn bomb_scores_parse() {
    let log = "2026-12-01T00:00:00Z stdout F forked=3 eagain=0 other=0\n\
               2026-12-01T00:00:01Z stdout F forked=63 eagain=4242 other=1\n";
    assert_eq!(bomb_score(log), Some((63, 4242, 1)));
    assert_eq!(bomb_score("nothing yet\n"), None);
    assert_eq!(bomb_score("x stdout F forked=1 eagain=zz other=0\n"), None);
}

#[tokio::test]
async fn a_fork_bomb_stops_at_the_pids_limit() -> Result<()> {
    let test = "a_fork_bomb_stops_at_the_pids_limit";
    let _turn = ONE_AT_A_TIME.lock().await;
    let Some(stand) = Stand::start(test).await? else { return Ok(()) };
    for (i, backend) in stand.backends.iter().enumerate() {
        fork_bomb_on(test, &stand, backend, i).await.with_context(|| format!("on the {} backend", backend.label))?;
    }
    stand.nothing_left().await
}

async fn fork_bomb_on(test: &str, stand: &Stand, backend: &Backend, i: usize) -> Result<()> {
    let label = &backend.label;
    let cri = &stand.cri;
    let kubelet_cgroup = cgroups::KubeletPodCgroup::cgroupfs(&format!("/bhlimits-{}-bomb{i}", std::process::id()))?;
    kubelet_cgroup.set("pids.max", &POD_PIDS.to_string())?;
    let bomb_pod = stand.pod(backend, &format!("bomb{i}"), Some(&kubelet_cgroup.cri_parent)).await?;
    let probe_pod = stand.pod(backend, &format!("probe{i}"), None).await?;
    let probe = stand.container(&probe_pod, &sleeper("probe")).await?;
    let idle = exec_times(cri, &probe, 5).await?;

    if backend.kind == Kind::Vm {
        // kubelet's pod limit binds only the pod's host processes; the guest carries it over the
        // parent of its containers. Each container has a cgroup namespace of its own and cannot see
        // that parent, so the agent's console line says what it set.
        let want = format!("the pod's pids limit is set limit={POD_PIDS}");
        let console = stand.console_of(&bomb_pod.0).with_context(|| format!("{label}: the bomb pod's console"))?;
        let until = Instant::now() + Duration::from_secs(10);
        while !std::fs::read_to_string(&console).unwrap_or_default().contains(&want) {
            if Instant::now() >= until {
                bail!("{label}: the guest never said {want:?}: {}", std::fs::read_to_string(&console)?);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    let bomb = stand.container(&bomb_pod, &container_config("bomb", &[FORKBOMB_BIN])).await?;
    let log_path = cri.container_status(&bomb).await?.log_path;
    // The bomb reaches the limit: the kernel refuses forks.
    let refused = wait_for_score(&log_path, |(_, eagain, _)| eagain > 0).await.context("no fork was refused")?;
    // The second pod answers while the bomb goes on.
    let loaded = exec_times(cri, &probe, 5).await?;
    let (forked, eagain, other) =
        wait_for_score(&log_path, |(_, eagain, _)| eagain > refused.1).await.context("the bomb stopped bombing")?;
    println!(
        "{test}: {label}: first refusal at {refused:?}; later forked={forked} eagain={eagain} other={other}; \
         probe exec idle {idle:?}, under the bomb {loaded:?}"
    );
    // Nothing the bomb made exits: the reporter and its forks stay within the limit.
    assert!(forked < CONTAINER_PIDS as u64, "{label}: {forked} forks succeeded under a limit of {CONTAINER_PIDS}");
    assert_eq!(cri.container_status(&bomb).await?.state, RUNNING, "{label}: the bomb is held, not killed");

    // The bomb's pod stops as any pod does.
    let started = Instant::now();
    stand.remove_pods(&[&bomb_pod.0]).await?;
    println!("{test}: {label}: the bomb's pod stopped and went in {:?}", started.elapsed());
    assert_eq!(exec_times(cri, &probe, 1).await?.len(), 1);
    stand.remove_pods(&[&probe_pod.0]).await?;
    eventually_nothing("the bomb pod's cgroups", Duration::from_secs(20), || {
        kubelet_cgroup
            .dirs()
            .iter()
            .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten())
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.path().display().to_string())
            .collect()
    })
    .await?;
    Ok(())
}

/// How long the flood runs (the figure).
const FLOOD: Duration = Duration::from_secs(30);
/// The probe's execs under the flood start within its first three quarters (so that they all
/// fall inside it even when each takes seconds, as on TCG beside a CPU hog), and at least this
/// many must fit for a p95 to mean anything.
const FLOOD_SAMPLING: Duration = Duration::from_millis(22_500);
const MIN_LOADED_SAMPLES: usize = 5;

/// The `p`th percentile (0..=100) of `times`, nearest rank.
fn percentile(times: &[Duration], p: usize) -> Duration {
    let mut sorted = times.to_vec();
    sorted.sort();
    let rank = (p * sorted.len()).div_ceil(100).clamp(1, sorted.len());
    sorted[rank - 1]
}

#[test]
fn percentiles_are_nearest_rank() {
    let ms = |v: &[u64]| v.iter().map(|&m| Duration::from_millis(m)).collect::<Vec<_>>();
    assert_eq!(percentile(&ms(&[5, 1, 4, 2, 3]), 50), Duration::from_millis(3));
    assert_eq!(percentile(&ms(&(1..=20).collect::<Vec<_>>()), 95), Duration::from_millis(19));
    assert_eq!(percentile(&ms(&[7]), 95), Duration::from_millis(7));
}

/// `secs` since the epoch as the first 19 characters of a CRI log timestamp (UTC).
fn utc_second(secs: i64) -> Result<String> {
    let out =
        std::process::Command::new("date").args(["-u", "-d", &format!("@{secs}"), "+%Y-%m-%dT%H:%M:%S"]).output()?;
    Ok(String::from_utf8(out.stdout)?.trim().to_string())
}

/// What one backend's flood showed.
struct FloodFigures {
    idle_p95: Duration,
    loaded_p95: Duration,
    /// The log's last lines, when they were not the container's last ones.
    tail_problem: Option<String>,
}

#[tokio::test]
async fn a_log_flood_keeps_its_newest_lines_and_slows_no_other_pod() -> Result<()> {
    let test = "a_log_flood_keeps_its_newest_lines_and_slows_no_other_pod";
    let _turn = ONE_AT_A_TIME.lock().await;
    let Some(stand) = Stand::start(test).await? else { return Ok(()) };
    let mut figures = Vec::new();
    for (i, backend) in stand.backends.iter().enumerate() {
        let f = log_flood_on(test, &stand, backend, i)
            .await
            .with_context(|| format!("on the {} backend", backend.label))?;
        figures.push((backend, f));
    }
    stand.nothing_left().await?;
    for (backend, f) in &figures {
        println!(
            "{test}: {}: probe exec p95 idle {:?}, under the flood {:?}; tail {}",
            backend.label,
            f.idle_p95,
            f.loaded_p95,
            f.tail_problem.as_deref().unwrap_or("whole")
        );
    }
    Ok(())
}

async fn log_flood_on(test: &str, stand: &Stand, backend: &Backend, i: usize) -> Result<FloodFigures> {
    let label = &backend.label;
    let cri = &stand.cri;
    let probe_pod = stand.pod(backend, &format!("quiet{i}"), None).await?;
    let probe = stand.container(&probe_pod, &sleeper("probe")).await?;
    let samples = if backend.kind == Kind::Vm { 20 } else { 40 };
    let idle = exec_times(cri, &probe, samples).await?;

    // Numbered lines as fast as the container can write them, then one last line. seq writes in
    // blocks, so the one `timeout` stops may end mid-line: the lone `echo` ends that line.
    let flood_pod = stand.pod(backend, &format!("flood{i}"), None).await?;
    let script = format!("timeout {} seq 1 2000000000; echo; echo flood-over", FLOOD.as_secs());
    let flood = stand.container(&flood_pod, &container_config("flood", &["sh", "-c", &script])).await?;
    let started = Instant::now();
    let loaded = exec_times_within(cri, &probe, samples, FLOOD_SAMPLING).await?;
    let sampled_for = started.elapsed();
    ensure!(
        loaded.len() >= MIN_LOADED_SAMPLES,
        "{label}: only {} probe execs started in the flood's first {FLOOD_SAMPLING:?} (each took {loaded:?})",
        loaded.len()
    );
    let status = cri
        .wait_container(&flood, FLOOD + Duration::from_secs(60), |s| s.state != RUNNING)
        .await
        .context("the flood ends")?;
    assert_eq!(status.exit_code, 0, "{label}: {status:?}");
    assert!(sampled_for < FLOOD, "{label}: the probe's execs all fell inside the flood ({sampled_for:?})");

    // The log keeps the newest lines: it runs on to the flood's last second (a stream cut off
    // mid-flood would end early), and its newest lines are an unbroken run of numbers (drops,
    // when containerd stalls, take the oldest bytes). containerd itself may lose the last few
    // lines at exit (it does with runc too: `tail_problem`, reported not asserted).
    let log = std::fs::read_to_string(&status.log_path)?;
    let stdout: Vec<(&str, &str)> = log
        .lines()
        .filter_map(|l| {
            let mut parts = l.splitn(4, ' ');
            let (time, stream, _tag, text) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
            (stream == "stdout").then_some((time, text))
        })
        .collect();
    let numbers: Vec<(&str, u64)> =
        stdout.iter().filter_map(|(time, text)| Some((*time, text.parse().ok()?))).collect();
    // The last number may be cut short: `timeout` stops seq mid-write.
    let whole_numbers = &numbers[..numbers.len().saturating_sub(1)];
    let newest = &whole_numbers[whole_numbers.len().saturating_sub(1000)..];
    let breaks: Vec<_> = newest.windows(2).filter(|w| w[1].1 != w[0].1 + 1).map(|w| (w[0], w[1])).collect();
    assert!(
        newest.len() == 1000 && breaks.is_empty(),
        "{label}: the newest lines run unbroken; {} of them, breaks {breaks:?}, the last {:?}",
        newest.len(),
        newest.last()
    );
    let last_second = utc_second(status.finished_at / 1_000_000_000 - 3)?;
    let last_time = newest.last().map(|(time, _)| time.get(..19).unwrap_or(time)).unwrap_or_default();
    assert!(
        last_time >= last_second.as_str(),
        "{label}: the log's newest numbers date from {last_time}, the container ended at {last_second} + 3 s"
    );
    let whole = stdout.last().map(|(_, text)| *text) == Some("flood-over");
    let tail_problem = (!whole).then(|| format!("{:?}", &stdout[stdout.len().saturating_sub(3)..]));
    let figures = FloodFigures { idle_p95: percentile(&idle, 95), loaded_p95: percentile(&loaded, 95), tail_problem };
    println!(
        "{test}: {label}: {} MiB of log, {} stdout lines; {} probe execs over {sampled_for:?}",
        log.len() >> 20,
        stdout.len(),
        loaded.len(),
    );
    stand.remove_pods(&[&flood_pod.0, &probe_pod.0]).await?;
    Ok(figures)
}

/// How long the log reader (containerd itself) stays stopped (the figure).
const READER_STALL: Duration = Duration::from_secs(60);
/// Bytes of each line the stalled-reader test's container writes (its counter, then padding).
const LINE_BYTES: u64 = 512;

/// Writes numbered lines of [`LINE_BYTES`] to stdout as fast as it can, and every 16th line's
/// number to `/progress/n`, which the host reads whatever happens to stdout.
fn chatter(name: &str, progress: &Path) -> cri::ContainerConfig {
    let pad = "x".repeat(LINE_BYTES as usize - 16);
    let script = format!("i=0; while true; do printf 'n=%012d {pad}\\n' $i; [ $((i % 16)) = 0 ] && echo $i > /progress/n; i=$((i+1)); done");
    let mut config = container_config(name, &["sh", "-c", &script]);
    config.mounts = vec![cri::Mount {
        container_path: "/progress".into(),
        host_path: progress.display().to_string(),
        ..Default::default()
    }];
    config
}

/// The counters of a chatter's CRI log, in order.
fn chatter_numbers(log: &str) -> Vec<u64> {
    log.lines().filter_map(|l| l.split_once(" stdout F n=")?.1.split_whitespace().next()?.parse().ok()).collect()
}

/// The counter the chatter last reported through its progress file. The file is rewritten for
/// every line, so a read can catch it empty: read again, a bounded number of times.
fn progress(dir: &Path) -> u64 {
    for _ in 0..100 {
        if let Some(n) = std::fs::read_to_string(dir.join("n")).ok().and_then(|t| t.trim().parse().ok()) {
            return n;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    0
}

#[tokio::test]
async fn a_stalled_log_reader_costs_a_counted_gap_never_the_container() -> Result<()> {
    let test = "a_stalled_log_reader_costs_a_counted_gap_never_the_container";
    let _turn = ONE_AT_A_TIME.lock().await;
    let Some(stand) = Stand::start(test).await? else { return Ok(()) };
    let cri = &stand.cri;
    // runc's container would block on the full pipe: the measure here is bulkhead's own promise.
    struct Chatter<'a> {
        backend: &'a Backend,
        pod: String,
        id: String,
        progress: tempfile::TempDir,
    }
    // Every pod first: a guest boots slowly on a host busy with a chatter.
    let mut pods = Vec::new();
    for (i, backend) in stand.backends.iter().enumerate().filter(|(_, b)| b.kind != Kind::Runc) {
        pods.push((backend, stand.pod(backend, &format!("chatter{i}"), None).await?));
    }
    let mut chatters = Vec::new();
    for (backend, pod) in pods {
        let progress = tempfile::tempdir()?;
        let id = stand.container(&pod, &chatter("chatter", progress.path())).await?;
        chatters.push(Chatter { backend, pod: pod.0, id, progress });
    }
    // Each has written past its first lines.
    for c in &chatters {
        let deadline = Instant::now() + Duration::from_secs(60);
        while progress(c.progress.path()) < 100 {
            if Instant::now() > deadline {
                bail!("{}: the chatter never got going", c.backend.label);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    // containerd, which reads every container's output, stops reading for a minute.
    let pid = nix::unistd::Pid::from_raw(stand.containerd.pid().context("containerd's pid")? as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP)?;
    let at_stop: Vec<u64> = chatters.iter().map(|c| progress(c.progress.path())).collect();
    tokio::time::sleep(READER_STALL).await;
    let at_resume: Vec<u64> = chatters.iter().map(|c| progress(c.progress.path())).collect();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT)?;

    for ((c, before), after) in chatters.iter().zip(at_stop).zip(at_resume) {
        let label = &c.backend.label;
        // Every buffer on the path together holds little more than the shim's 1 MiB (the measured
        // gaps leave ~1.1 MiB delivered); the container wrote well past that while nobody read, so
        // it was never held up.
        let written = after.saturating_sub(before) * LINE_BYTES;
        println!("{test}: {label}: {written} bytes written in the {READER_STALL:?} nobody read");
        assert!(written > 3 << 20, "{label}: the container wrote only {written} bytes while its reader stalled");
        // The log resumes with the newest output, after a gap the shim counted.
        let log_path = cri.container_status(&c.id).await?.log_path;
        let deadline = Instant::now() + Duration::from_secs(60);
        let numbers = loop {
            let numbers = chatter_numbers(&std::fs::read_to_string(&log_path)?);
            if numbers.last().is_some_and(|&n| n > after) {
                break numbers;
            }
            if Instant::now() > deadline {
                bail!("{label}: the log never caught up past {after}: it ends at {:?}", numbers.last());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let gaps: Vec<(u64, u64)> = numbers.windows(2).filter(|w| w[1] != w[0] + 1).map(|w| (w[0], w[1])).collect();
        let dropped = dropped_output(stand.state_dir.path(), &c.pod)?;
        println!("{test}: {label}: gaps {gaps:?}, {dropped} bytes dropped and counted");
        assert!(!gaps.is_empty() && dropped > 0, "{label}: a stalled reader costs a counted gap");
        let missing: u64 = gaps.iter().map(|(a, b)| b - a - 1).sum();
        assert!(missing * LINE_BYTES <= dropped, "{label}: {missing} lines missing, only {dropped} bytes counted");
        assert_eq!(cri.container_status(&c.id).await?.state, RUNNING, "{label}");
    }
    let pods: Vec<&str> = chatters.iter().map(|c| c.pod.as_str()).collect();
    stand.remove_pods(&pods).await?;
    stand.nothing_left().await
}
