//! Every conversion between protobuf messages (containerd's and the agent's) and the shim's
//! domain types, in one place: errors to ttrpc statuses, stdio requests to the agent's
//! `StdioConfig`, agent stats to containerd's metrics.

use bulkhead_protocol::agent as pb;
use containerd_shim::protos::cgroups::metrics::{
    CPUStat, CPUUsage, MemoryEntry, MemoryStat, Metrics, PidsStat, Throttle,
};

use crate::error::TaskError;
use crate::io::{Stdio, Target};
use crate::sandbox::SandboxError;

impl From<TaskError> for ttrpc::Error {
    fn from(e: TaskError) -> Self {
        use ttrpc::Code;
        let code = match &e {
            TaskError::NotFound(_) => Code::NOT_FOUND,
            TaskError::AlreadyExists(_) => Code::ALREADY_EXISTS,
            TaskError::FailedPrecondition(_) | TaskError::Sandbox(SandboxError::Resize(_)) => Code::FAILED_PRECONDITION,
            TaskError::InvalidArgument(_) | TaskError::Config(_) | TaskError::Spec(_) => Code::INVALID_ARGUMENT,
            TaskError::Agent(a) => a.code().unwrap_or(Code::UNKNOWN),
            TaskError::Sandbox(SandboxError::Unsupported { .. }) | TaskError::Unimplemented(_) => Code::UNIMPLEMENTED,
            _ => Code::UNKNOWN,
        };
        let message = match &e {
            TaskError::Agent(a) => a.message(),
            other => other.to_string(),
        };
        ttrpc::Error::RpcStatus(ttrpc::get_status(code, message))
    }
}

/// The agent's stdio request for a process.
pub fn stdio_config(stdio: &Stdio) -> pb::StdioConfig {
    pb::StdioConfig { terminal: stdio.terminal, stdin: stdio.stdin != Target::None, ..Default::default() }
}

/// The agent's cgroup stats as containerd's cgroup v1 `Metrics` (what CRI decodes).
pub fn metrics(s: &pb::StatsResponse) -> Metrics {
    let mut m = Metrics::default();
    if let Some(cpu) = s.cpu.as_ref() {
        m.cpu = Some(CPUStat {
            usage: Some(CPUUsage {
                total: cpu.usage_total_nanos,
                user: cpu.usage_user_nanos,
                kernel: cpu.usage_kernel_nanos,
                ..Default::default()
            })
            .into(),
            throttling: Some(Throttle {
                throttled_periods: cpu.throttled_periods,
                throttled_time: cpu.throttled_nanos,
                ..Default::default()
            })
            .into(),
            ..Default::default()
        })
        .into();
    }
    if let Some(mem) = s.memory.as_ref() {
        m.memory = Some(MemoryStat {
            cache: mem.cache_bytes,
            rss: mem.rss_bytes,
            total_cache: mem.cache_bytes,
            total_rss: mem.rss_bytes,
            usage: Some(MemoryEntry {
                usage: mem.usage_bytes,
                max: mem.max_usage_bytes,
                limit: mem.limit_bytes,
                ..Default::default()
            })
            .into(),
            ..Default::default()
        })
        .into();
    }
    if let Some(pids) = s.pids.as_ref() {
        m.pids = Some(PidsStat { current: pids.current, limit: pids.limit, ..Default::default() }).into();
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::StdioPaths;

    #[test]
    fn errors_map_to_ttrpc_codes() {
        let e: ttrpc::Error = TaskError::NotFound("process already finished".into()).into();
        match e {
            ttrpc::Error::RpcStatus(s) => assert_eq!(s.code(), ttrpc::Code::NOT_FOUND),
            other => panic!("{other:?}"),
        }
        let e: ttrpc::Error =
            TaskError::Sandbox(SandboxError::Unsupported { backend: "namespace", what: "pausing".into() }).into();
        match e {
            ttrpc::Error::RpcStatus(s) => assert_eq!(s.code(), ttrpc::Code::UNIMPLEMENTED),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn stdio_config_reflects_stdin_and_tty() {
        let stdio = Stdio::parse(StdioPaths {
            stdin: "/f/in".into(),
            stdout: "/f/out".into(),
            stderr: String::new(),
            terminal: true,
        })
        .unwrap();
        let cfg = stdio_config(&stdio);
        assert!(cfg.terminal && cfg.stdin);
        let cfg = stdio_config(&Stdio::default());
        assert!(!cfg.terminal && !cfg.stdin);
    }

    #[test]
    fn stats_become_cgroup_metrics() {
        let stats = pb::StatsResponse {
            memory: Some(pb::MemoryStats { usage_bytes: 10, limit_bytes: 20, ..Default::default() }).into(),
            pids: Some(pb::PidsStats { current: 3, limit: 9, ..Default::default() }).into(),
            ..Default::default()
        };
        let m = metrics(&stats);
        assert_eq!(m.memory.usage.usage, 10);
        assert_eq!(m.memory.usage.limit, 20);
        assert_eq!((m.pids.current, m.pids.limit), (3, 9));
        assert!(m.cpu.is_none());
    }
}
