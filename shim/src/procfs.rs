//! What /proc says about the host processes behind a pod: liveness, and the memory and CPU of
//! a process tree. Shared by the metrics (scraped per pod) and `bulkhead-ctl ps`.
//!
//! A tree is the given roots and all their descendants, found by one scan of /proc. Its CPU
//! time counts each process's own time plus that of the children it reaped, so work done by
//! short-lived processes inside the tree (an exec, a container that exited) is kept.

use std::collections::{HashMap, HashSet};

/// The fields of `/proc/<pid>/stat` the shim uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub state: char,
    pub ppid: u32,
    /// utime + stime + cutime + cstime, in clock ticks.
    pub cpu_ticks: u64,
    /// Resident pages.
    pub rss_pages: u64,
}

/// Parses a `/proc/<pid>/stat` line. The command name sits in parentheses and may itself hold
/// spaces and parentheses, so fields are counted from the last `)`.
pub fn parse_stat(line: &str) -> Option<Stat> {
    let rest = &line[line.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state is field 3 of proc(5), so field n is f[n - 3].
    let num = |n: usize| f.get(n - 3)?.parse::<u64>().ok();
    let cpu = num(14)? + num(15)? + num(16)? + num(17)?;
    Some(Stat {
        state: f.first()?.chars().next()?,
        ppid: u32::try_from(num(4)?).ok()?,
        cpu_ticks: cpu,
        rss_pages: num(24)?,
    })
}

pub fn stat(pid: u32) -> Option<Stat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Whether `pid` runs (exists and is not a zombie).
pub fn alive(pid: u32) -> bool {
    pid > 0 && stat(pid).is_some_and(|s| s.state != 'Z')
}

/// Memory and CPU of a process tree.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    pub rss_bytes: u64,
    pub cpu_seconds: f64,
    pub processes: usize,
}

/// `roots` and every descendant of them that runs now.
pub fn tree(roots: &[u32]) -> Vec<(u32, Stat)> {
    let mut all: HashMap<u32, Stat> = HashMap::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            if let Some(s) = stat(pid) {
                all.insert(pid, s);
            }
        }
    }
    collect_tree(&all, roots)
}

fn collect_tree(all: &HashMap<u32, Stat>, roots: &[u32]) -> Vec<(u32, Stat)> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for (pid, s) in all {
        children.entry(s.ppid).or_default().push(*pid);
    }
    let mut seen = HashSet::new();
    let mut stack: Vec<u32> = roots.iter().copied().filter(|p| all.contains_key(p)).collect();
    let mut out = Vec::new();
    while let Some(pid) = stack.pop() {
        if !seen.insert(pid) {
            continue;
        }
        if let Some(s) = all.get(&pid) {
            out.push((pid, *s));
        }
        stack.extend(children.get(&pid).into_iter().flatten().copied());
    }
    out
}

/// The usage of a process tree (see the module docs for what counts).
pub fn usage(roots: &[u32]) -> Usage {
    sum(&tree(roots))
}

fn sum(procs: &[(u32, Stat)]) -> Usage {
    let (ticks, pages) = procs.iter().fold((0u64, 0u64), |(t, p), (_, s)| (t + s.cpu_ticks, p + s.rss_pages));
    Usage {
        rss_bytes: pages.saturating_mul(page_size()),
        cpu_seconds: ticks as f64 / clock_ticks() as f64,
        processes: procs.len(),
    }
}

fn clock_ticks() -> u64 {
    // SAFETY: sysconf only reads a system constant.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as u64
    } else {
        100
    }
}

fn page_size() -> u64 {
    // SAFETY: sysconf only reads a system constant.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// Whether `pid` runs the executable named `exe_name` (guards against pid reuse when all we
/// have is a recorded pid).
pub fn runs(pid: u32, exe_name: &str) -> bool {
    alive(pid)
        && std::fs::read_link(format!("/proc/{pid}/exe"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().trim_end_matches(" (deleted)").to_string()))
            .is_some_and(|n| n == exe_name)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINE: &str = "4242 (my (odd) cmd) S 1 4242 4242 0 -1 4194560 500 0 0 0 \
                        30 20 5 5 20 0 1 0 12345 10000000 256 18446744073709551615";

    #[test]
    fn stat_fields_are_counted_from_the_last_paren() {
        let s = parse_stat(LINE).unwrap();
        assert_eq!(s, Stat { state: 'S', ppid: 1, cpu_ticks: 60, rss_pages: 256 });
        assert!(parse_stat("").is_none());
        assert!(parse_stat("1 (x) S").is_none());
        assert!(parse_stat("1 (x) S notanumber").is_none());
    }

    #[test]
    fn trees_follow_parents_and_ignore_others() {
        let st = |ppid, ticks| Stat { state: 'S', ppid, cpu_ticks: ticks, rss_pages: 1 };
        let all: HashMap<u32, Stat> =
            [(10, st(1, 1)), (11, st(10, 2)), (12, st(11, 4)), (20, st(1, 8)), (21, st(20, 16))].into();
        let mut pids: Vec<u32> = collect_tree(&all, &[10]).into_iter().map(|(p, _)| p).collect();
        pids.sort();
        assert_eq!(pids, vec![10, 11, 12]);
        let usage = sum(&collect_tree(&all, &[10, 11, 99]));
        assert_eq!(usage.processes, 3, "overlapping and missing roots count once or not at all");
        assert_eq!(usage.rss_bytes, 3 * page_size());
    }

    #[test]
    fn own_process_is_alive_and_measured() {
        let me = std::process::id();
        assert!(alive(me));
        assert!(!alive(0));
        let usage = usage(&[me]);
        assert!(usage.rss_bytes > 0 && usage.processes >= 1, "{usage:?}");
        let exe = std::env::current_exe().unwrap();
        assert!(runs(me, &exe.file_name().unwrap().to_string_lossy()));
        assert!(!runs(me, "containerd-shim-bulkhead-v2"));
    }
}
