//! `bulkhead-ctl` and the pods' metrics against real pods on the `namespace` backend, through a
//! private containerd (issue 15, "Done when"): every command's JSON, `doctor`'s failing line for
//! a broken config, and the node's `/metrics` during a pod's life, read with a Prometheus
//! text-format parser.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bulkhead_integration::{
    container_config, workspace_bin, ContainerdConfig, ContainerdVersion, RuntimeHandler, Setup, ShimEnv,
};
use prometheus_parse::{LineInfo, Scrape, Value};
use serde_json::Value as Json;

/// The containerd these tests run on: this run's (`BULKHEAD_CONTAINERD`, default 1.6), or the one a
/// `*_on_containerd_<x>_<y>` twin binary, which compiles this same file, is named after.
fn containerd_version() -> ContainerdVersion {
    ContainerdVersion::for_test_binary(env!("CARGO_CRATE_NAME"))
}

/// `runc` and `bulkhead` (the namespace backend, its config at `config`) on a private containerd.
struct Env {
    shim: ShimEnv,
    config: PathBuf,
}

impl std::ops::Deref for Env {
    type Target = ShimEnv;

    fn deref(&self) -> &ShimEnv {
        &self.shim
    }
}

async fn setup(test: &str) -> Result<Option<Env>> {
    let bins = ["bulkhead-agent", "containerd-shim-bulkhead-v2", "bulkhead-ctl"];
    let Some(setup) = Setup::new(test, containerd_version(), &bins)? else { return Ok(None) };
    let config = setup.namespace_config("bulkhead.toml", setup.state())?;
    let handlers = vec![RuntimeHandler::runc(), RuntimeHandler::bulkhead(Some(&config))];
    let shim = setup.start(ContainerdConfig { handlers, ..Default::default() }).await?;
    Ok(Some(Env { shim, config }))
}

/// What one `bulkhead-ctl` run printed.
struct Run {
    ok: bool,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Json {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}\n{}", self.stdout, self.stderr))
    }
}

fn ctl(config: &Path, args: &[&str]) -> Run {
    let out = Command::new(workspace_bin("bulkhead-ctl"))
        .arg("--config")
        .arg(config)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run bulkhead-ctl");
    Run {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A child process of this test, stopped by its PID when dropped.
struct Spawned(Child);

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn sleeper(name: &str) -> k8s_cri::v1::ContainerConfig {
    container_config(name, &["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.2; done"])
}

async fn remove_pod(env: &Env, pod_id: &str, ctr: &str) -> Result<()> {
    env.cri.stop_container(ctr, 5).await?;
    env.cri.remove_container(ctr).await?;
    env.cri.stop_pod_sandbox(pod_id).await?;
    env.cri.remove_pod_sandbox(pod_id).await
}

#[tokio::test]
async fn ctl_commands_report_a_namespace_pod() -> Result<()> {
    let Some(env) = setup("ctl_commands_report_a_namespace_pod").await? else { return Ok(()) };
    let pod = env.pod("ctlpod")?;
    let pod_id = env.cri.run_pod_sandbox(&pod, "bulkhead").await?;
    let ctr = env.cri.create_container(&pod_id, &sleeper("c"), &pod).await?;
    env.cri.start_container(&ctr).await?;

    // ps: the pod, its backend and processes.
    let ps = ctl(&env.config, &["ps", "--json"]);
    assert!(ps.ok, "{}", ps.stderr);
    let pods = ps.json()["pods"].as_array().unwrap().clone();
    assert_eq!(pods.len(), 1, "{pods:?}");
    let p = &pods[0];
    assert_eq!(p["id"], pod_id.as_str());
    assert_eq!((p["name"].as_str(), p["namespace"].as_str()), (Some("ctlpod"), Some("default")));
    assert_eq!((p["backend"].as_str(), p["state"].as_str()), (Some("namespace"), Some("running")));
    for pid in ["shim_pid", "sandbox_pid"] {
        let pid = p[pid].as_u64().unwrap();
        assert!(Path::new(&format!("/proc/{pid}")).exists(), "{p}");
    }
    assert!(p["vmm_pid"].is_null() && p["virtiofsd_pid"].is_null(), "{p}");
    assert!(p["uptime_seconds"].as_u64().is_some() && p["memory_bytes"].as_u64().unwrap() > 0, "{p}");
    assert!(ctl(&env.config, &["ps"]).stdout.contains("ctlpod"));

    // console: the agent's own output is the namespace backend's console.
    let console = ctl(&env.config, &["console", "ctlpod", "--json"]);
    assert!(console.ok, "{}", console.stderr);
    let text = console.json()["text"].as_str().unwrap().to_string();
    assert!(text.contains("listening"), "agent start-up line missing from the console: {text}");
    let mut follow = Spawned(
        Command::new(workspace_bin("bulkhead-ctl"))
            .arg("--config")
            .arg(&env.config)
            .args(["console", &pod_id[..13], "-f", "--json"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?,
    );
    let mut lines = BufReader::new(follow.0.stdout.take().unwrap()).lines();
    let first: Json = serde_json::from_str(&lines.next().unwrap()?)?;
    assert_eq!(first["pod"], pod_id.as_str());
    assert!(first["line"].is_string());

    // agent: the shim's handshake, answered.
    let agent = ctl(&env.config, &["agent", &pod_id, "--json"]);
    assert!(agent.ok, "{}", agent.stderr);
    let a = agent.json();
    assert_eq!((a["ok"].as_bool(), a["mode"].as_str()), (Some(true), Some("namespace")), "{a}");
    assert_eq!(a["agent_version"], env!("CARGO_PKG_VERSION"));

    // doctor: every line passes for this node; the probe line says why the namespace backend is fine.
    let socket = env.containerd.address().display().to_string();
    let doctor = ctl(&env.config, &["doctor", "--json", "--containerd-socket", &socket]);
    let d = doctor.json();
    let checks = d["checks"].as_array().unwrap().clone();
    let names: Vec<&str> = checks.iter().filter_map(|c| c["name"].as_str()).collect();
    for want in ["containerd", "containerd handler", "shim binary", "shim config", "host probe", "agent"] {
        assert!(names.contains(&want), "doctor has no {want:?} line: {d}");
    }
    assert!(doctor.ok && d["ok"] == true, "{d}");
    let handler = checks.iter().find(|c| c["name"] == "containerd handler").unwrap();
    assert!(handler["detail"].as_str().unwrap().contains(&env.config.display().to_string()), "{handler}");
    // The containerd line names the containerd that answers, as its CRI reports itself.
    let line = checks.iter().find(|c| c["name"] == "containerd").unwrap();
    let version = format!("containerd {}", env.containerd.runtime_version());
    assert!(line["detail"].as_str().unwrap().starts_with(&version), "{line}");

    // doctor on a broken shim config: a failing line naming the bad key, and exit code 1.
    let broken = env.config_dir.path().join("broken.toml");
    std::fs::write(&broken, "backend = \"namespace\"\nvcpus = 2\n")?;
    let doctor = ctl(&broken, &["doctor", "--json", "--containerd-socket", &socket]);
    assert!(!doctor.ok);
    let d = doctor.json();
    let line = d["checks"].as_array().unwrap().iter().find(|c| c["name"] == "shim config").unwrap().clone();
    assert_eq!(line["ok"], false, "{d}");
    assert!(line["detail"].as_str().unwrap().contains("vcpus"), "{line}");
    let text = ctl(&broken, &["doctor", "--containerd-socket", &socket]).stdout;
    assert!(text.contains("[FAIL] shim config"), "{text}");

    // metrics, once: this pod's series under its labels.
    let metrics = ctl(&env.config, &["metrics", "--json"]);
    assert!(metrics.ok, "{}", metrics.stderr);
    let exposition = metrics.json()["exposition"].as_str().unwrap().to_string();
    assert!(exposition.contains(&format!("pod_id=\"{pod_id}\"")), "{exposition}");

    // Clear errors.
    let missing = ctl(&env.config, &["console", "no-such-pod", "--json"]);
    assert!(!missing.ok);
    assert!(missing.json()["error"].as_str().unwrap().contains("no pod matches \"no-such-pod\""), "{}", missing.stdout);
    let bad_config = ctl(Path::new("/nonexistent/bulkhead.toml"), &["ps"]);
    assert!(!bad_config.ok && bad_config.stderr.contains("/nonexistent/bulkhead.toml"), "{}", bad_config.stderr);

    // The agent's output reached the shim's log stream (containerd's log), naming the pod.
    let log = std::fs::read_to_string(env.containerd.log_path())?;
    assert!(
        log.lines().any(|l| l.contains(&format!("pod={pod_id} component=")) && l.contains("agent")),
        "no relayed agent line with pod={pod_id} in containerd's log"
    );

    remove_pod(&env, &pod_id, &ctr).await?;
    // `console -f` ends by itself once the pod is gone.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(status) = follow.0.try_wait()? {
            assert!(status.success(), "console -f: {status}");
            break;
        }
        if Instant::now() > deadline {
            bail!("console -f still running after the pod was removed");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let ps = ctl(&env.config, &["ps", "--json"]);
    assert_eq!(ps.json()["pods"], serde_json::json!([]));
    assert!(!env.state_dir.path().join(&pod_id).exists());
    Ok(())
}

/// The node exporter as the DaemonSet runs it: `bulkhead-ctl metrics --listen 127.0.0.1:0
/// --state-dir DIR`, no config, as nobody with `groups` (the metrics group, or none).
struct Exporter {
    _child: Spawned,
    addr: String,
}

/// The config's `[metrics] gid` (the default).
const METRICS_GID: u32 = 9464;
const NOBODY: u32 = 65534;

impl Exporter {
    fn start(state_dir: &Path, groups: &'static [u32]) -> Result<Self> {
        use std::os::unix::process::CommandExt;
        let mut command = Command::new(workspace_bin("bulkhead-ctl"));
        command
            .args(["metrics", "--listen", "127.0.0.1:0", "--state-dir"])
            .arg(state_dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        // SAFETY: between fork and exec, only async-signal-safe credential calls on a static list.
        unsafe {
            command.pre_exec(move || {
                if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setgid(NOBODY) != 0
                    || libc::setuid(NOBODY) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = Spawned(command.spawn()?);
        let mut first = String::new();
        BufReader::new(child.0.stdout.take().unwrap()).read_line(&mut first)?;
        let addr = first.trim().strip_prefix("listening on ").context("no listening line")?.to_string();
        Ok(Self { _child: child, addr })
    }

    /// GET /metrics over loopback; returns the body.
    fn scrape(&self) -> Result<String> {
        let mut stream = std::net::TcpStream::connect(&self.addr)?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")?;
        let mut raw = String::new();
        stream.read_to_string(&mut raw)?;
        let (head, body) = raw.split_once("\r\n\r\n").context("no HTTP header end")?;
        if !head.starts_with("HTTP/1.0 200") {
            bail!("scrape answered {head}");
        }
        Ok(body.to_string())
    }

    /// Scrapes until `ready` holds of the parsed result: the exporter answers from a scrape of
    /// the pods that may be up to its cache interval old.
    async fn scrape_until(&self, what: &str, ready: impl Fn(&Scrape) -> bool) -> Result<Scrape> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let scrape = parse(&self.scrape()?);
            if ready(&scrape) {
                return Ok(scrape);
            }
            if Instant::now() > deadline {
                bail!("the exporter never showed {what}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Parses an exposition as Prometheus would; every line must be a help, type or sample line
/// (OpenMetrics' `# EOF` aside).
fn parse(text: &str) -> Scrape {
    for line in text.lines() {
        if line != "# EOF" {
            assert!(!matches!(LineInfo::parse(line), LineInfo::Ignored), "unparsable line {line:?} in:\n{text}");
        }
    }
    Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).expect("exposition parses")
}

fn for_pod<'a>(scrape: &'a Scrape, pod_id: &str) -> Vec<&'a prometheus_parse::Sample> {
    scrape.samples.iter().filter(|s| s.labels.get("pod_id") == Some(pod_id)).collect()
}

/// The RPC histogram's total count for `rpc`, from its buckets (`+Inf` is the total).
fn rpc_count(scrape: &Scrape, pod_id: &str, rpc: &str) -> f64 {
    for_pod(scrape, pod_id)
        .into_iter()
        .filter(|s| s.metric == "bulkhead_task_rpc_duration_seconds" && s.labels.get("rpc") == Some(rpc))
        .map(|s| match &s.value {
            Value::Histogram(buckets) => buckets.iter().map(|b| b.count).fold(0.0, f64::max),
            other => panic!("not a histogram: {other:?}"),
        })
        .sum()
}

fn gauge(scrape: &Scrape, pod_id: &str, metric: &str) -> Option<f64> {
    for_pod(scrape, pod_id).into_iter().find(|s| s.metric == metric).map(|s| match s.value {
        Value::Gauge(v) | Value::Untyped(v) | Value::Counter(v) => v,
        _ => f64::NAN,
    })
}

#[tokio::test]
async fn metrics_endpoint_follows_a_pods_life() -> Result<()> {
    let Some(env) = setup("metrics_endpoint_follows_a_pods_life").await? else { return Ok(()) };
    // Searchable, as the shim makes a state dir (0711) and kubelet /run/bulkhead (0755).
    std::fs::set_permissions(env.state_dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o711))?;
    let exporter = Exporter::start(env.state_dir.path(), &[METRICS_GID])?;
    let outsider = Exporter::start(env.state_dir.path(), &[])?;
    let before = parse(&exporter.scrape()?);
    assert!(before.samples.is_empty(), "no pods, no samples: {:?}", before.samples);

    let pod = env.pod("metricspod")?;
    let pod_id = env.cri.run_pod_sandbox(&pod, "bulkhead").await?;
    let ctr = env.cri.create_container(&pod_id, &sleeper("m"), &pod).await?;
    env.cri.start_container(&ctr).await?;

    let first = exporter.scrape_until("the pod's series", |s| !for_pod(s, &pod_id).is_empty()).await?;
    let samples = for_pod(&first, &pod_id);
    assert!(!samples.is_empty(), "no series for the pod");
    for s in &samples {
        assert_eq!(s.labels.get("pod"), Some("metricspod"), "{s:?}");
        assert_eq!(s.labels.get("namespace"), Some("default"), "{s:?}");
    }
    assert_eq!(gauge(&first, &pod_id, "bulkhead_pod_scrape_up"), Some(1.0));
    assert_eq!(gauge(&first, &pod_id, "bulkhead_sandbox_up"), Some(1.0));
    assert_eq!(gauge(&first, &pod_id, "bulkhead_agent_up"), Some(1.0));
    assert!(gauge(&first, &pod_id, "bulkhead_sandbox_resident_memory_bytes").unwrap() > 0.0);
    assert!(gauge(&first, &pod_id, "bulkhead_sandbox_cpu_seconds_total").is_some());
    assert_eq!(gauge(&first, &pod_id, "bulkhead_restarts_total"), Some(0.0));
    assert_eq!(gauge(&first, &pod_id, "bulkhead_output_dropped_bytes_total"), Some(0.0));
    let creates = rpc_count(&first, &pod_id, "create");
    assert_eq!(creates, 2.0, "sandbox and container creates");
    let starts = rpc_count(&first, &pod_id, "start");

    // An exec is Exec, Start, (Wait), Delete on the shim: the counts grow.
    let out = env.cri.exec_sync(&ctr, &["echo", "hi"], 10).await?;
    assert_eq!(out.exit_code, 0);
    let second = exporter.scrape_until("the exec's RPCs", |s| rpc_count(s, &pod_id, "start") > starts).await?;
    assert!(rpc_count(&second, &pod_id, "exec") >= 1.0, "exec not counted");
    assert_eq!(rpc_count(&second, &pod_id, "create"), creates);
    // An exporter outside the metrics group reads nothing of the pods.
    let outside = parse(&outsider.scrape()?);
    assert!(outside.samples.is_empty(), "an exporter without the group saw {:?}", outside.samples);

    remove_pod(&env, &pod_id, &ctr).await?;
    exporter.scrape_until("the removed pod's series gone", |s| for_pod(s, &pod_id).is_empty()).await?;
    Ok(())
}
