//! Keeps cgroup migrations fast while a pod's helpers join their cgroups.
//!
//! Every cgroup migration on the node takes one kernel lock (`cgroup_threadgroup_rwsem`), whose
//! writer waits for an RCU grace period unless another writer came within about one grace period
//! before it. Measured on this project's hosts (cgroup v1, kernel 6.18): moving a process after a
//! quiet second takes 4.8–6.4 ms, right after another move 0.2 ms. A VM start moves the VMM and
//! virtiofsd into the pod's cgroups, and that first wait was the largest single cost of the VMM's
//! start (`jail: join cgroup`, 14–15 ms in `vm_pod`).
//!
//! So while a pod starts, a thread moves the shim into the cgroup it is already in (which changes
//! nothing) every [`PERIOD`], from the start of the pod's start, a grace period ahead of the
//! helpers' joins, until it is dropped or [`LONGEST`] has passed. Best effort: where the shim's
//! own cgroup cannot be written, there is no primer and the joins take their usual time.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Well under a grace period, so the lock never goes back to its slow path between writes.
const PERIOD: Duration = Duration::from_millis(2);
/// A bound whatever the caller does: a VM start's joins are done long before.
const LONGEST: Duration = Duration::from_secs(1);

/// Stops its thread when dropped.
pub struct CgroupPrimer {
    stop: Arc<AtomicBool>,
    writes: Arc<AtomicU64>,
}

impl CgroupPrimer {
    /// Starts priming through the shim's own cgroup; `None` (logged) where it cannot.
    pub fn start() -> Option<Self> {
        let procs = match own_procs_file() {
            Ok(procs) => procs,
            Err(why) => {
                tracing::debug!(%why, "no cgroup primer: helpers join their cgroups unprimed");
                return None;
            }
        };
        Self::start_with(procs)
    }

    fn start_with(procs: PathBuf) -> Option<Self> {
        let (stop, writes) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let (thread_stop, thread_writes) = (stop.clone(), writes.clone());
        let spawned = std::thread::Builder::new().name("cgroup-primer".into()).spawn(move || {
            let until = Instant::now() + LONGEST;
            while !thread_stop.load(Ordering::Relaxed) && Instant::now() < until {
                // "0" is the writing process: the shim, into the cgroup it is in.
                if let Err(e) = std::fs::write(&procs, "0") {
                    tracing::debug!(file = %procs.display(), error = %e, "cgroup primer stopped");
                    return;
                }
                thread_writes.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(PERIOD);
            }
        });
        match spawned {
            Ok(_) => Some(Self { stop, writes }),
            Err(e) => {
                tracing::debug!(error = %e, "no cgroup primer thread");
                None
            }
        }
    }

    /// Primes until process `pid` is in `cgroup` (as `/proc/<pid>/cgroup` names it), has gone,
    /// or [`LONGEST`] has passed; then stops. For a spawned helper that joins by itself.
    pub async fn until_joined(self, pid: u32, cgroup: PathBuf) {
        let (file, deadline) = (format!("/proc/{pid}/cgroup"), Instant::now() + LONGEST);
        let cgroup = cgroup.to_string_lossy().into_owned();
        loop {
            match std::fs::read_to_string(&file) {
                Ok(text) if text.lines().any(|l| l.splitn(3, ':').nth(2) == Some(cgroup.as_str())) => break,
                Err(_) => break,
                Ok(_) if Instant::now() >= deadline => break,
                Ok(_) => tokio::time::sleep(PERIOD).await,
            }
        }
        tracing::debug!(pid, writes = self.writes(), "cgroup primer done");
    }

    /// How many moves the primer has made so far.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }
}

impl Drop for CgroupPrimer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The `cgroup.procs` file of this process's own cgroup in one hierarchy: the v2 one where there
/// is one (v2 and hybrid hosts), else the first v1 hierarchy mounted here.
fn own_procs_file() -> Result<PathBuf, String> {
    let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| format!("/proc/self/cgroup: {e}"))?;
    let info = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
    procs_file_in(&own, &info).ok_or_else(|| "no writable cgroup hierarchy of this process is mounted".into())
}

/// [`own_procs_file`] from the texts of `/proc/self/cgroup` and `/proc/self/mountinfo`.
fn procs_file_in(own: &str, mountinfo: &str) -> Option<PathBuf> {
    // (mount point, root within the hierarchy, v1 controllers or None for v2)
    let mounts: Vec<(PathBuf, &str, Option<Vec<&str>>)> = mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mut fields = left.split(' ');
            let (root, point) = (fields.nth(3)?, fields.next()?);
            let mut right = right.split(' ');
            let (fstype, options) = (right.next()?, right.nth(1).unwrap_or(""));
            match fstype {
                "cgroup2" => Some((PathBuf::from(point), root, None)),
                "cgroup" => Some((PathBuf::from(point), root, Some(options.split(',').collect()))),
                _ => None,
            }
        })
        .collect();
    let mut v1 = None;
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let found = mounts.iter().find(|(_, _, opts)| match opts {
            None => controllers.is_empty(),
            Some(opts) => !controllers.is_empty() && controllers.split(',').all(|c| opts.contains(&c)),
        });
        let Some((point, root, opts)) = found else { continue };
        // A mount of a subtree (a container's view) names paths relative to its root.
        let Some(relative) = Path::new(path).strip_prefix(root).ok() else { continue };
        let file = point.join(relative).join("cgroup.procs");
        if opts.is_none() {
            return Some(file);
        }
        v1.get_or_insert(file);
    }
    v1
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
30 23 0:26 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw,nsdelegate
34 30 0:30 / /sys/fs/cgroup/memory rw,nosuid shared:14 - cgroup cgroup rw,memory
35 30 0:31 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:15 - cgroup cgroup rw,cpu,cpuacct
";

    #[test]
    fn the_v2_hierarchy_is_preferred_and_v1_is_found_without_it() {
        let own = "5:cpu,cpuacct:/system.slice/containerd.service\n4:memory:/system.slice/containerd.service\n\
                   0::/system.slice/containerd.service\n";
        assert_eq!(
            procs_file_in(own, MOUNTINFO),
            Some(PathBuf::from("/sys/fs/cgroup/unified/system.slice/containerd.service/cgroup.procs"))
        );
        let v1_only: String = MOUNTINFO.lines().filter(|l| !l.contains("cgroup2")).map(|l| format!("{l}\n")).collect();
        assert_eq!(
            procs_file_in(own, &v1_only),
            Some(PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/system.slice/containerd.service/cgroup.procs"))
        );
        // A hierarchy mounted from a subtree names paths below its root; one not mounted is skipped.
        let sub = "40 30 0:32 /kubepods /mnt/cg rw - cgroup2 cgroup2 rw\n";
        assert_eq!(procs_file_in("0::/kubepods/pod1\n", sub), Some(PathBuf::from("/mnt/cg/pod1/cgroup.procs")));
        assert_eq!(procs_file_in("0::/elsewhere\n", sub), None);
        assert_eq!(procs_file_in("garbage", MOUNTINFO), None);
    }

    /// It ends once the process is in the cgroup, or is gone, not at its bound.
    #[tokio::test]
    async fn until_joined_ends_when_the_process_is_there_or_gone() {
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let Some(path) = own.lines().next().and_then(|l| l.splitn(3, ':').nth(2)) else {
            println!("SKIPPED: until_joined_ends_when_the_process_is_there_or_gone: this process has no cgroup");
            return;
        };
        let primer = || CgroupPrimer { stop: Arc::default(), writes: Arc::default() };
        let me = std::process::id();
        for (pid, cgroup) in [(me, path), (u32::MAX, "/anywhere")] {
            let done = tokio::time::timeout(LONGEST / 2, primer().until_joined(pid, cgroup.into())).await;
            assert!(done.is_ok(), "pid {pid}, {cgroup}: still waiting");
        }
        let waited = tokio::time::timeout(LONGEST / 2, primer().until_joined(me, "/not/this/one".into())).await;
        assert!(waited.is_err(), "a process elsewhere ended the wait");
    }

    #[test]
    fn the_primer_moves_the_process_where_it_is_until_dropped() {
        let test = "the_primer_moves_the_process_where_it_is_until_dropped";
        if !nix::unistd::geteuid().is_root() {
            println!("SKIPPED: {test}: moving a process between cgroups needs root");
            return;
        }
        let Ok(procs) = own_procs_file() else {
            println!("SKIPPED: {test}: no cgroup hierarchy is mounted here");
            return;
        };
        let before = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let primer = CgroupPrimer::start_with(procs).expect("primer thread");
        let deadline = Instant::now() + Duration::from_secs(10);
        while primer.writes() < 3 {
            assert!(Instant::now() < deadline, "the primer made {} moves in 10 s", primer.writes());
            std::thread::sleep(PERIOD);
        }
        let writes = primer.writes.clone();
        drop(primer);
        std::thread::sleep(PERIOD * 10);
        let stopped = writes.load(Ordering::Relaxed);
        std::thread::sleep(PERIOD * 10);
        assert_eq!(writes.load(Ordering::Relaxed), stopped, "the primer went on after it was dropped");
        assert_eq!(std::fs::read_to_string("/proc/self/cgroup").unwrap(), before, "the process moved");
    }
}
