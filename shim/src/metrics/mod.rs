//! The pod's Prometheus metrics, kept by its shim and served on a Unix socket in the node's
//! metrics directory ([`dir`], open to the metrics group only) while the sandbox runs.
//! `bulkhead-ctl metrics` gathers every pod's into one node-wide `/metrics` and adds the pod and
//! namespace labels; a shim's own series carry none (one socket is one pod).
//!
//! Series:
//! - `bulkhead_task_rpc_duration_seconds{rpc,outcome}`: every Task RPC containerd calls, except
//!   `wait`, whose duration is the workload's lifetime ([`rpc::MeasuredTask`]).
//! - `bulkhead_sandbox_up`, `bulkhead_agent_up`: the sandbox's process runs; the agent answered a
//!   Version call on the shim's own connection during this scrape.
//! - `bulkhead_sandbox_info{backend,agent_version,agent_mode}`.
//! - `bulkhead_output_dropped_bytes_total`: container output dropped on its way: by the agent
//!   because no shim stream was attached while its backlog overflowed (reported in the agent's
//!   Version answer), plus what the shim's own per-stream buffers dropped while containerd's
//!   side did not read (`crate::io`).
//! - `bulkhead_restarts_total{component="agent"|"vmm"}`: restarts by a supervisor
//!   ([`PodMetrics::record_restart`]); neither backend restarts anything yet, so they stay 0.
//! - `bulkhead_sandbox_resident_memory_bytes{process}`, `bulkhead_sandbox_cpu_seconds_total{process}`:
//!   from /proc, per host process tree: `vmm` and `virtiofsd` on the `vm` backend; on the
//!   `namespace` backend `sandbox`, the launcher with the agent and every container process.

pub mod dir;
pub mod http;
pub mod rpc;
pub mod server;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::agent::AgentClient;
use crate::config::Backend;
use crate::procfs;
use crate::sandbox::paths::HostPids;

/// Upper bounds of the RPC latency buckets, in seconds (0.5 ms .. 30 s).
const RPC_BUCKETS: [f64; 15] =
    [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// How long a scrape waits for the agent's answer before reporting it down.
const AGENT_PING_TIMEOUT: Duration = Duration::from_secs(1);

type RpcLabels = [(&'static str, &'static str); 2];
type ComponentLabel = [(&'static str, &'static str); 1];

/// What restarts: counted by [`PodMetrics::record_restart`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Component {
    Agent,
    Vmm,
}

impl Component {
    fn label(self) -> ComponentLabel {
        [("component", if self == Component::Agent { "agent" } else { "vmm" })]
    }
}

/// The running sandbox, as the metrics see it.
struct Attached {
    backend: Backend,
    pids: HostPids,
    agent: Arc<AgentClient>,
}

/// Reads the attached sandbox at every scrape: liveness, identity and /proc usage.
#[derive(Default)]
struct SandboxCollector {
    attached: Mutex<Option<Attached>>,
    /// The agent's count at its last answer.
    dropped_output: AtomicU64,
    /// What the shim itself dropped of the pod's output (containerd's side not reading).
    shim_dropped_output: crate::io::OutputDrops,
}

impl std::fmt::Debug for SandboxCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SandboxCollector")
    }
}

impl SandboxCollector {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Attached>> {
        self.attached.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The host process trees a backend's usage is reported under (see the module docs).
fn process_trees(backend: Backend, pids: HostPids) -> Vec<(&'static str, u32)> {
    match backend {
        Backend::Namespace => vec![("sandbox", pids.sandbox)],
        Backend::Vm => {
            let vmm = pids.vmm.unwrap_or(pids.sandbox);
            std::iter::once(("vmm", vmm)).chain(pids.virtiofsd.map(|p| ("virtiofsd", p))).collect()
        }
    }
}

fn backend_name(backend: Backend) -> &'static str {
    match backend {
        Backend::Vm => "vm",
        Backend::Namespace => "namespace",
    }
}

impl Collector for SandboxCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let attached = self.lock();
        let Some(a) = attached.as_ref() else {
            return Ok(());
        };
        let up = ConstGauge::new(i64::from(procfs::alive(a.pids.sandbox)));
        up.encode(encoder.encode_descriptor(
            "bulkhead_sandbox_up",
            "Whether the sandbox's process (VMM or namespace launcher) runs",
            None,
            up.metric_type(),
        )?)?;

        let info = ConstGauge::new(1i64);
        let labels = [
            ("backend", backend_name(a.backend).to_string()),
            ("agent_version", a.agent.agent_version.clone()),
            ("agent_mode", a.agent.mode.clone()),
        ];
        let mut family = encoder.encode_descriptor(
            "bulkhead_sandbox_info",
            "The sandbox's backend and agent",
            None,
            info.metric_type(),
        )?;
        info.encode(family.encode_family(&labels)?)?;

        let dropped = ConstCounter::new(
            self.dropped_output.load(Ordering::Relaxed) + self.shim_dropped_output.load(Ordering::Relaxed),
        );
        dropped.encode(encoder.encode_descriptor(
            "bulkhead_output_dropped_bytes",
            "Container output dropped on its way to containerd: by the agent (backlog full, no stream \
             attached) or by the shim (containerd's side not reading)",
            None,
            dropped.metric_type(),
        )?)?;

        let usage: Vec<(&str, procfs::Usage)> =
            process_trees(a.backend, a.pids).into_iter().map(|(name, pid)| (name, procfs::usage(&[pid]))).collect();
        let mut rss = encoder.encode_descriptor(
            "bulkhead_sandbox_resident_memory_bytes",
            "Resident memory of the sandbox's host process trees",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (name, u) in &usage {
            ConstGauge::new(u.rss_bytes as i64).encode(rss.encode_family(&[("process", *name)])?)?;
        }
        let mut cpu = encoder.encode_descriptor(
            "bulkhead_sandbox_cpu_seconds",
            "CPU time (user and system) of the sandbox's host process trees",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (name, u) in &usage {
            ConstCounter::new(u.cpu_seconds).encode(cpu.encode_family(&[("process", *name)])?)?;
        }
        Ok(())
    }
}

/// One pod's metrics (one shim serves one pod).
pub struct PodMetrics {
    registry: Registry,
    rpc: Family<RpcLabels, Histogram>,
    restarts: Family<ComponentLabel, Counter>,
    agent_up: Gauge,
    sandbox: Arc<SandboxCollector>,
    server: Mutex<Option<server::MetricsServer>>,
}

impl Default for PodMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl PodMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let rpc = Family::<RpcLabels, Histogram>::new_with_constructor(new_rpc_histogram as fn() -> Histogram);
        registry.register(
            "bulkhead_task_rpc_duration_seconds",
            "Latency of the Task RPCs containerd calls on the shim (wait excluded)",
            rpc.clone(),
        );
        let restarts = Family::<ComponentLabel, Counter>::default();
        registry.register("bulkhead_restarts", "Restarts of the pod's agent or VMM", restarts.clone());
        for c in [Component::Agent, Component::Vmm] {
            let _ = restarts.get_or_create(&c.label());
        }
        let agent_up = Gauge::default();
        registry.register("bulkhead_agent_up", "Whether the agent answered during this scrape", agent_up.clone());
        let sandbox = Arc::new(SandboxCollector::default());
        registry.register_collector(Box::new(sandbox.clone()));
        Self { registry, rpc, restarts, agent_up, sandbox, server: Mutex::new(None) }
    }

    /// The counter the pod's stdio relays add their dropped bytes to.
    pub fn output_drops(&self) -> crate::io::OutputDrops {
        self.sandbox.shim_dropped_output.clone()
    }

    /// Records one Task RPC.
    pub fn observe_rpc(&self, rpc: &'static str, ok: bool, took: Duration) {
        let outcome = if ok { "ok" } else { "error" };
        self.rpc.get_or_create(&[("rpc", rpc), ("outcome", outcome)]).observe(took.as_secs_f64());
    }

    /// For a supervisor that restarts the agent or the VMM of a running pod.
    pub fn record_restart(&self, component: Component) {
        self.restarts.get_or_create(&component.label()).inc();
    }

    /// From the sandbox's start on: its series appear, and the pod's socket serves them.
    pub fn attach(
        self: &Arc<Self>,
        backend: Backend,
        pids: HostPids,
        agent: Arc<AgentClient>,
        endpoint: dir::PodEndpoint,
    ) {
        *self.sandbox.lock() = Some(Attached { backend, pids, agent });
        let mut slot = self.server.lock().unwrap_or_else(|p| p.into_inner());
        let socket = endpoint.socket.clone();
        match server::MetricsServer::start(self.clone(), endpoint) {
            Ok(server) => *slot = Some(server),
            Err(e) => {
                tracing::warn!(socket = %socket.display(), "metrics socket: {e}; this pod's metrics are not served")
            }
        }
    }

    /// The sandbox is gone: stop serving and forget it.
    pub fn detach(&self) {
        self.server.lock().unwrap_or_else(|p| p.into_inner()).take();
        self.sandbox.lock().take();
    }

    /// One scrape: asks the agent, then encodes everything as OpenMetrics text.
    pub async fn scrape(&self) -> String {
        let agent = self.sandbox.lock().as_ref().map(|a| a.agent.clone());
        let answer = match agent {
            Some(agent) => tokio::time::timeout(AGENT_PING_TIMEOUT, agent.ping()).await.ok().and_then(Result::ok),
            None => None,
        };
        if let Some(dropped) = answer {
            self.sandbox.dropped_output.store(dropped, Ordering::Relaxed);
        }
        let up = answer.is_some();
        self.agent_up.set(i64::from(up));
        self.encode()
    }

    fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!("encode metrics: {e}");
        }
        out
    }
}

fn new_rpc_histogram() -> Histogram {
    Histogram::new(RPC_BUCKETS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rpc_histograms_and_restarts_encode() {
        let m = PodMetrics::new();
        m.observe_rpc("create", true, Duration::from_millis(3));
        m.observe_rpc("create", true, Duration::from_millis(40));
        m.observe_rpc("kill", false, Duration::from_micros(10));
        m.record_restart(Component::Vmm);
        let text = m.encode();
        assert!(text.contains("bulkhead_task_rpc_duration_seconds_count{rpc=\"create\",outcome=\"ok\"} 2"), "{text}");
        assert!(
            text.contains("bulkhead_task_rpc_duration_seconds_bucket{le=\"0.005\",rpc=\"create\",outcome=\"ok\"} 1"),
            "{text}"
        );
        assert!(text.contains("{rpc=\"kill\",outcome=\"error\"} 1"), "{text}");
        assert!(text.contains("bulkhead_restarts_total{component=\"vmm\"} 1"), "{text}");
        assert!(text.contains("bulkhead_restarts_total{component=\"agent\"} 0"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(!text.contains("bulkhead_sandbox_up"), "no sandbox, no sandbox series: {text}");
    }

    #[test]
    fn process_trees_follow_the_backend() {
        let pids = HostPids { sandbox: 5, vmm: Some(5), virtiofsd: Some(6) };
        assert_eq!(process_trees(Backend::Vm, pids), vec![("vmm", 5), ("virtiofsd", 6)]);
        assert_eq!(
            process_trees(Backend::Namespace, HostPids { sandbox: 7, ..Default::default() }),
            vec![("sandbox", 7)]
        );
    }
}
