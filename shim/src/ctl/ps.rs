//! `bulkhead-ctl ps`: the node's sandboxes, from the pod records and /proc.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use super::error::{CtlError, Outcome};
use super::pods::{self, Pod};
use crate::procfs;

/// The shim's executable name, to tell a live shim from a reused pid.
const SHIM_EXE: &str = "containerd-shim-bulkhead-v2";

/// Where a pod stands, from the host's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PodState {
    /// Shim and sandbox run.
    Running,
    /// The shim runs, the sandbox process has ended (containerd has not removed the pod yet).
    SandboxExited,
    /// The sandbox runs without its shim (containerd's cleanup will remove it).
    ShimGone,
    /// Neither runs: a directory a crash left behind.
    Stale,
    /// No record yet: the sandbox is starting.
    Starting,
}

impl PodState {
    fn of(shim: bool, sandbox: bool) -> Self {
        match (shim, sandbox) {
            (true, true) => Self::Running,
            (true, false) => Self::SandboxExited,
            (false, true) => Self::ShimGone,
            (false, false) => Self::Stale,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::SandboxExited => "sandbox-exited",
            Self::ShimGone => "shim-gone",
            Self::Stale => "stale",
            Self::Starting => "starting",
        }
    }
}

#[derive(Debug, Serialize)]
pub struct PodRow {
    pub id: String,
    pub name: String,
    pub namespace: String,
    pub backend: String,
    pub state: PodState,
    pub shim_pid: Option<u32>,
    pub sandbox_pid: Option<u32>,
    pub vmm_pid: Option<u32>,
    pub virtiofsd_pid: Option<u32>,
    pub uptime_seconds: Option<u64>,
    /// Resident memory of the sandbox's host processes (and their children).
    pub memory_bytes: Option<u64>,
}

pub fn row(pod: &Pod) -> PodRow {
    let Some(r) = &pod.record else {
        return PodRow {
            id: pod.id.clone(),
            name: String::new(),
            namespace: String::new(),
            backend: String::new(),
            state: PodState::Starting,
            shim_pid: None,
            sandbox_pid: None,
            vmm_pid: None,
            virtiofsd_pid: None,
            uptime_seconds: None,
            memory_bytes: None,
        };
    };
    let state = PodState::of(procfs::runs(r.shim_pid, SHIM_EXE), procfs::alive(r.pids.sandbox));
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or_default();
    let roots: Vec<u32> = [Some(r.pids.sandbox), r.pids.vmm, r.pids.virtiofsd].into_iter().flatten().collect();
    PodRow {
        id: pod.id.clone(),
        name: r.pod_name.clone(),
        namespace: r.pod_namespace.clone(),
        backend: r.backend.clone(),
        state,
        shim_pid: Some(r.shim_pid),
        sandbox_pid: Some(r.pids.sandbox),
        vmm_pid: r.pids.vmm,
        virtiofsd_pid: r.pids.virtiofsd,
        uptime_seconds: Some(now.saturating_sub(r.started_at_unix)),
        memory_bytes: Some(procfs::usage(&roots).rss_bytes),
    }
}

pub fn run(state_dir: &Path) -> Result<Outcome, CtlError> {
    let rows: Vec<PodRow> = pods::list(state_dir)?.iter().map(row).collect();
    let json = serde_json::json!({ "state_dir": state_dir, "pods": rows });
    Ok(Outcome { json, text: table(&rows), ok: true })
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

fn table(rows: &[PodRow]) -> String {
    let mut out = format!(
        "{:<13}  {:<24} {:<10} {:<9} {:<14} {:>7} {:>7} {:>7} {:>9} {:>8} {:>9}\n",
        "POD ID", "NAME", "NAMESPACE", "BACKEND", "STATE", "SHIM", "SANDBOX", "VMM", "VIRTIOFSD", "UPTIME", "MEMORY"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{:<13}  {:<24} {:<10} {:<9} {:<14} {:>7} {:>7} {:>7} {:>9} {:>8} {:>9}",
            r.id.chars().take(13).collect::<String>(),
            r.name,
            r.namespace,
            r.backend,
            r.state.name(),
            opt(r.shim_pid),
            opt(r.sandbox_pid),
            opt(r.vmm_pid),
            opt(r.virtiofsd_pid),
            r.uptime_seconds.map_or_else(|| "-".into(), |s| format!("{s}s")),
            r.memory_bytes.map_or_else(|| "-".into(), |b| format!("{}MiB", b >> 20)),
        );
    }
    if rows.is_empty() {
        out.push_str("(no bulkhead pods on this node)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_follow_what_runs() {
        assert_eq!(PodState::of(true, true), PodState::Running);
        assert_eq!(PodState::of(true, false), PodState::SandboxExited);
        assert_eq!(PodState::of(false, true), PodState::ShimGone);
        assert_eq!(PodState::of(false, false), PodState::Stale);
        assert_eq!(serde_json::to_value(PodState::SandboxExited).unwrap(), "sandbox-exited");
    }

    #[test]
    fn an_empty_node_says_so() {
        assert!(table(&[]).contains("no bulkhead pods"));
    }
}
