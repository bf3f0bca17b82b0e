//! Resource usage of a host cgroup (the sandbox's own: the VMM, or the namespace launcher and
//! agent), read from the cgroup files of every mounted hierarchy, v1 or v2. The numbers use the
//! agent protocol's `StatsResponse`, the shim's one stats vocabulary (see `trans::metrics`).
//!
//! Boundaries: reads only; every file read is bounded.

use std::path::{Path, PathBuf};

use bulkhead_protocol::agent::{CpuStats, MemoryStats, PidsStats, StatsResponse};

/// Largest cgroup file read (memory.stat is a few KiB).
const MAX_FILE: u64 = 64 * 1024;
/// cgroup v1's "no limit" (`PAGE_COUNTER_MAX` pages in bytes, rounded to the page size).
const V1_UNLIMITED: u64 = 0x7FFF_FFFF_FFFF_F000;

fn read(dir: &Path, file: &str) -> Option<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(dir.join(file)).ok()?.take(MAX_FILE).read_to_string(&mut text).ok()?;
    Some(text)
}

fn number(dir: &Path, file: &str) -> Option<u64> {
    read(dir, file)?.trim().parse().ok()
}

/// A limit file: a number, or `max` (v2) / the v1 sentinel for "none", both reported as 0.
fn limit(dir: &Path, file: &str) -> Option<u64> {
    let text = read(dir, file)?;
    match text.trim() {
        "max" => Some(0),
        n => n.parse().ok().map(|v| if v >= V1_UNLIMITED { 0 } else { v }),
    }
}

/// `key value` lines (memory.stat, cpu.stat, cpuacct.stat).
fn keyed(dir: &Path, file: &str) -> Option<Vec<(String, u64)>> {
    Some(
        read(dir, file)?
            .lines()
            .filter_map(|l| {
                let (k, v) = l.split_once(' ')?;
                Some((k.to_string(), v.trim().parse().ok()?))
            })
            .collect(),
    )
}

fn get(pairs: &[(String, u64)], key: &str) -> Option<u64> {
    pairs.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
}

/// Stats of `cgroup` (a path inside each hierarchy) across `mounts`; `None` when no hierarchy
/// has it.
pub fn read_stats(mounts: &[PathBuf], cgroup: &Path) -> Option<StatsResponse> {
    let relative = cgroup.strip_prefix("/").unwrap_or(cgroup);
    let dirs: Vec<PathBuf> = mounts.iter().map(|m| m.join(relative)).filter(|d| d.is_dir()).collect();
    if dirs.is_empty() {
        return None;
    }
    let mut stats = StatsResponse::default();
    let mut memory = MemoryStats::default();
    let mut cpu = CpuStats::default();
    let mut pids = PidsStats::default();
    let (mut has_memory, mut has_cpu, mut has_pids, mut v2) = (false, false, false, false);
    for dir in &dirs {
        if let Some(usage) = number(dir, "memory.usage_in_bytes") {
            // v1 memory controller.
            has_memory = true;
            memory.usage_bytes = usage;
            memory.max_usage_bytes = number(dir, "memory.max_usage_in_bytes").unwrap_or_default();
            memory.limit_bytes = limit(dir, "memory.limit_in_bytes").unwrap_or_default();
            let stat = keyed(dir, "memory.stat").unwrap_or_default();
            memory.cache_bytes = get(&stat, "total_cache").or_else(|| get(&stat, "cache")).unwrap_or_default();
            memory.rss_bytes = get(&stat, "total_rss").or_else(|| get(&stat, "rss")).unwrap_or_default();
        } else if let Some(usage) = number(dir, "memory.current") {
            has_memory = true;
            v2 = true;
            memory.usage_bytes = usage;
            memory.max_usage_bytes = number(dir, "memory.peak").unwrap_or_default();
            memory.limit_bytes = limit(dir, "memory.max").unwrap_or_default();
            let stat = keyed(dir, "memory.stat").unwrap_or_default();
            memory.cache_bytes = get(&stat, "file").unwrap_or_default();
            memory.rss_bytes = get(&stat, "anon").unwrap_or_default();
        }
        if let Some(total) = number(dir, "cpuacct.usage") {
            // v1 cpuacct, in nanoseconds.
            has_cpu = true;
            cpu.usage_total_nanos = total;
            cpu.usage_user_nanos = number(dir, "cpuacct.usage_user").unwrap_or_default();
            cpu.usage_kernel_nanos = number(dir, "cpuacct.usage_sys").unwrap_or_default();
        }
        if let Some(stat) = keyed(dir, "cpu.stat") {
            if let Some(usec) = get(&stat, "usage_usec") {
                // v2: usage and throttling in microseconds.
                has_cpu = true;
                v2 = true;
                cpu.usage_total_nanos = usec.saturating_mul(1000);
                cpu.usage_user_nanos = get(&stat, "user_usec").unwrap_or_default().saturating_mul(1000);
                cpu.usage_kernel_nanos = get(&stat, "system_usec").unwrap_or_default().saturating_mul(1000);
                cpu.throttled_nanos = get(&stat, "throttled_usec").unwrap_or_default().saturating_mul(1000);
            } else if let Some(ns) = get(&stat, "throttled_time") {
                cpu.throttled_nanos = ns;
            }
            cpu.throttled_periods = get(&stat, "nr_throttled").unwrap_or(cpu.throttled_periods);
        }
        if let Some(current) = number(dir, "pids.current") {
            has_pids = true;
            pids.current = current;
            pids.limit = limit(dir, "pids.max").unwrap_or_default();
        }
    }
    if has_memory {
        stats.memory = Some(memory).into();
    }
    if has_cpu {
        stats.cpu = Some(cpu).into();
    }
    if has_pids {
        stats.pids = Some(pids).into();
    }
    stats.cgroup_version = if v2 { "v2" } else { "v1" }.into();
    Some(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, files: &[(&str, &str)]) {
        std::fs::create_dir_all(dir).unwrap();
        for (name, text) in files {
            std::fs::write(dir.join(name), text).unwrap();
        }
    }

    #[test]
    fn v1_hierarchies_are_combined() {
        let root = tempfile::tempdir().unwrap();
        let mounts: Vec<PathBuf> = ["memory", "cpu,cpuacct", "pids"].iter().map(|h| root.path().join(h)).collect();
        write(
            &mounts[0].join("bulkhead/sb1/sb1"),
            &[
                ("memory.usage_in_bytes", "4096\n"),
                ("memory.max_usage_in_bytes", "8192\n"),
                ("memory.limit_in_bytes", "9223372036854771712\n"),
                ("memory.stat", "cache 1\nrss 2\ntotal_cache 10\ntotal_rss 20\n"),
            ],
        );
        write(
            &mounts[1].join("bulkhead/sb1/sb1"),
            &[
                ("cpuacct.usage", "500\n"),
                ("cpuacct.usage_user", "300\n"),
                ("cpuacct.usage_sys", "200\n"),
                ("cpu.stat", "nr_periods 4\nnr_throttled 2\nthrottled_time 77\n"),
            ],
        );
        write(&mounts[2].join("bulkhead/sb1/sb1"), &[("pids.current", "3\n"), ("pids.max", "max\n")]);
        let s = read_stats(&mounts, Path::new("/bulkhead/sb1/sb1")).unwrap();
        assert_eq!(s.memory.usage_bytes, 4096);
        assert_eq!(s.memory.max_usage_bytes, 8192);
        assert_eq!(s.memory.limit_bytes, 0, "v1's sentinel means no limit");
        assert_eq!((s.memory.cache_bytes, s.memory.rss_bytes), (10, 20));
        assert_eq!((s.cpu.usage_total_nanos, s.cpu.usage_user_nanos, s.cpu.usage_kernel_nanos), (500, 300, 200));
        assert_eq!((s.cpu.throttled_periods, s.cpu.throttled_nanos), (2, 77));
        assert_eq!((s.pids.current, s.pids.limit), (3, 0));
        assert_eq!(s.cgroup_version, "v1");
    }

    #[test]
    fn v2_units_are_converted() {
        let root = tempfile::tempdir().unwrap();
        let mounts = vec![root.path().join("unified")];
        write(
            &mounts[0].join("pod"),
            &[
                ("memory.current", "1000\n"),
                ("memory.max", "2000\n"),
                ("memory.stat", "anon 600\nfile 300\n"),
                ("cpu.stat", "usage_usec 5\nuser_usec 3\nsystem_usec 2\nnr_throttled 1\nthrottled_usec 4\n"),
                ("pids.current", "2\n"),
                ("pids.max", "64\n"),
            ],
        );
        let s = read_stats(&mounts, Path::new("/pod")).unwrap();
        assert_eq!((s.memory.usage_bytes, s.memory.limit_bytes, s.memory.rss_bytes), (1000, 2000, 600));
        assert_eq!((s.cpu.usage_total_nanos, s.cpu.throttled_nanos), (5000, 4000));
        assert_eq!((s.pids.current, s.pids.limit), (2, 64));
        assert_eq!(s.cgroup_version, "v2");
    }

    #[test]
    fn a_missing_cgroup_or_junk_is_no_number() {
        let root = tempfile::tempdir().unwrap();
        let mounts = vec![root.path().join("memory")];
        assert!(read_stats(&mounts, Path::new("/nope")).is_none());
        write(&mounts[0].join("junk"), &[("memory.usage_in_bytes", "lots\n"), ("pids.current", "\u{0}\u{1}")]);
        let s = read_stats(&mounts, Path::new("/junk")).unwrap();
        assert!(s.memory.is_none() && s.pids.is_none(), "{s:?}");
    }
}
