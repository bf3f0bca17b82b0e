//! Reading and steering a container's cgroup, on v2 (the guest) or v1 (a hybrid host in
//! namespace mode). libcgroups picks the hierarchy; this module maps its numbers onto the
//! protocol and reads the OOM-kill counter directly.

use std::path::{Path, PathBuf};

use bulkhead_protocol::agent::{CpuStats, IoStats, MemoryStats, PidsStats, StatsResponse};
use libcgroups::common::{
    create_cgroup_manager, get_cgroup_setup, AnyCgroupManager, CgroupConfig, CgroupManager, CgroupSetup, ControllerOpt,
};
use oci_spec::runtime::LinuxResources;

use crate::error::{AgentError, Result};

pub const ROOT: &str = "/sys/fs/cgroup";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hierarchy {
    V1,
    V2,
}

impl Hierarchy {
    pub fn detect() -> Result<Self> {
        match get_cgroup_setup() {
            Ok(CgroupSetup::Unified) => Ok(Hierarchy::V2),
            Ok(CgroupSetup::Legacy | CgroupSetup::Hybrid) => Ok(Hierarchy::V1),
            Err(e) => Err(AgentError::FailedPrecondition(format!(
                "no usable cgroup hierarchy at {ROOT} (need cgroup v2, or v1 with memory, cpu, \
                 cpuacct, pids, freezer, blkio mounted): {e}"
            ))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Hierarchy::V1 => "v1",
            Hierarchy::V2 => "v2",
        }
    }
}

/// A container's cgroup, by its path relative to the hierarchy root (absolute form).
#[derive(Debug, Clone)]
pub struct Cgroup {
    pub path: PathBuf,
    pub hierarchy: Hierarchy,
}

fn cg_err(what: &str, e: impl std::fmt::Display) -> AgentError {
    AgentError::Internal(format!("cgroup {what}: {e}"))
}

impl Cgroup {
    pub fn new(path: PathBuf, hierarchy: Hierarchy) -> Self {
        Self { path, hierarchy }
    }

    fn manager(&self) -> Result<AnyCgroupManager> {
        create_cgroup_manager(CgroupConfig {
            cgroup_path: self.path.clone(),
            systemd_cgroup: false,
            container_name: String::new(),
        })
        .map_err(|e| cg_err("manager", e))
    }

    pub fn stats(&self) -> Result<StatsResponse> {
        let s = self.manager()?.stats().map_err(|e| cg_err("stats", e))?;
        let (mut read_bytes, mut write_bytes, mut read_ops, mut write_ops) = (0, 0, 0, 0);
        for d in &s.blkio.service_bytes {
            match d.op_type.as_deref().map(str::to_ascii_lowercase).as_deref() {
                Some("read") => read_bytes += d.value,
                Some("write") => write_bytes += d.value,
                _ => {}
            }
        }
        for d in &s.blkio.serviced {
            match d.op_type.as_deref().map(str::to_ascii_lowercase).as_deref() {
                Some("read") => read_ops += d.value,
                Some("write") => write_ops += d.value,
                _ => {}
            }
        }
        let rss = s.memory.stats.get("rss").or_else(|| s.memory.stats.get("anon")).copied().unwrap_or(0);
        Ok(StatsResponse {
            cpu: Some(cpu_stats_in_nanos(self.hierarchy, &s.cpu, clock_ticks_per_sec())).into(),
            memory: Some(MemoryStats {
                usage_bytes: s.memory.memory.usage,
                max_usage_bytes: s.memory.memory.max_usage,
                limit_bytes: s.memory.memory.limit,
                cache_bytes: s.memory.cache,
                rss_bytes: rss,
                oom_kill_count: self.oom_kill_count().unwrap_or(0),
                ..Default::default()
            })
            .into(),
            pids: Some(PidsStats { current: s.pids.current, limit: s.pids.limit, ..Default::default() }).into(),
            io: Some(IoStats { read_bytes, write_bytes, read_ops, write_ops, ..Default::default() }).into(),
            cgroup_version: self.hierarchy.as_str().into(),
            ..Default::default()
        })
    }

    pub fn pids(&self) -> Result<Vec<u32>> {
        let mut pids: Vec<u32> = self
            .manager()?
            .get_all_pids()
            .map_err(|e| cg_err("pids", e))?
            .into_iter()
            .filter_map(|p| u32::try_from(p.as_raw()).ok())
            .collect();
        pids.sort_unstable();
        Ok(pids)
    }

    pub fn update(&self, resources: &LinuxResources) -> Result<()> {
        self.manager()?
            .apply(&ControllerOpt { resources, disable_oom_killer: false, oom_score_adj: None, freezer_state: None })
            .map_err(|e| AgentError::FailedPrecondition(format!("cgroup update: {e}")))
    }

    /// The kernel's count of OOM kills in this cgroup (v2 `memory.events`, v1
    /// `memory.oom_control`). `None` if the file is missing (cgroup gone, old kernel).
    pub fn oom_kill_count(&self) -> Option<u64> {
        let rel = self.path.strip_prefix("/").unwrap_or(&self.path);
        let file = match self.hierarchy {
            Hierarchy::V2 => Path::new(ROOT).join(rel).join("memory.events"),
            Hierarchy::V1 => Path::new(ROOT).join("memory").join(rel).join("memory.oom_control"),
        };
        parse_oom_kill(&std::fs::read_to_string(file).ok()?)
    }
}

/// Finds `oom_kill N` in a flat-keyed cgroup file.
pub fn parse_oom_kill(text: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        match (it.next(), it.next()) {
            (Some("oom_kill"), Some(n)) => n.parse().ok(),
            _ => None,
        }
    })
}

/// USER_HZ, the unit of v1's cpuacct.stat.
fn clock_ticks_per_sec() -> u64 {
    // SAFETY: sysconf has no memory effects; a failure (-1) falls back to Linux's fixed 100.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(hz).ok().filter(|hz| *hz > 0).unwrap_or(100)
}

/// libcgroups passes the kernel's units through: v2's cpu.stat is all microseconds; v1's
/// cpuacct.usage and throttled_time are nanoseconds but cpuacct.stat's user/system are
/// USER_HZ ticks. The protocol speaks nanoseconds.
fn cpu_stats_in_nanos(hierarchy: Hierarchy, cpu: &libcgroups::stats::CpuStats, ticks_per_sec: u64) -> CpuStats {
    let (usage, throttling) = (&cpu.usage, &cpu.throttling);
    let (total, user, kernel, throttled) = match hierarchy {
        Hierarchy::V2 => {
            let us = |v: u64| v.saturating_mul(1_000);
            (us(usage.usage_total), us(usage.usage_user), us(usage.usage_kernel), us(throttling.throttled_time))
        }
        Hierarchy::V1 => {
            let ticks = |v: u64| v.saturating_mul(1_000_000_000 / ticks_per_sec.max(1));
            (usage.usage_total, ticks(usage.usage_user), ticks(usage.usage_kernel), throttling.throttled_time)
        }
    };
    CpuStats {
        usage_total_nanos: total,
        usage_user_nanos: user,
        usage_kernel_nanos: kernel,
        throttled_periods: throttling.throttled_periods,
        throttled_nanos: throttled,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_stats_are_converted_to_nanoseconds_per_hierarchy() {
        let mut raw = libcgroups::stats::CpuStats::default();
        raw.usage.usage_total = 7;
        raw.usage.usage_user = 3;
        raw.usage.usage_kernel = 2;
        raw.throttling.throttled_periods = 4;
        raw.throttling.throttled_time = 5;
        let v2 = cpu_stats_in_nanos(Hierarchy::V2, &raw, 100);
        assert_eq!(
            (v2.usage_total_nanos, v2.usage_user_nanos, v2.usage_kernel_nanos, v2.throttled_nanos),
            (7_000, 3_000, 2_000, 5_000)
        );
        let v1 = cpu_stats_in_nanos(Hierarchy::V1, &raw, 100);
        assert_eq!(
            (v1.usage_total_nanos, v1.usage_user_nanos, v1.usage_kernel_nanos, v1.throttled_nanos),
            (7, 30_000_000, 20_000_000, 5)
        );
        assert_eq!(v1.throttled_periods, 4);
    }

    #[test]
    fn parses_oom_kill_in_v1_and_v2_files() {
        assert_eq!(parse_oom_kill("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"), Some(3));
        assert_eq!(parse_oom_kill("low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n"), Some(1));
        assert_eq!(parse_oom_kill("oom_kill_disable 0\n"), None);
        assert_eq!(parse_oom_kill("oom_kill x\n"), None);
    }
}
