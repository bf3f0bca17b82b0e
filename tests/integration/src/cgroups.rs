//! Where a test looks for cgroups, on cgroup v1, hybrid or v2 hosts alike: every mounted
//! hierarchy (from mountinfo), and a process's own cgroup path (v1's memory controller when
//! it is mounted, else the unified v2 line).

use std::path::{Path, PathBuf};

/// Mount points of every cgroup hierarchy (v1 controllers, named ones, and v2) in `mountinfo`.
pub fn mounts_in(mountinfo: &str) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fstype = right.split(' ').next()?;
            (fstype == "cgroup" || fstype == "cgroup2").then(|| left.split(' ').nth(4).map(PathBuf::from))?
        })
        .collect()
}

/// Mount points of this host's cgroup hierarchies.
pub fn mounts() -> Vec<PathBuf> {
    mounts_in(&std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default())
}

/// `cgroup` (a path inside each hierarchy) in every hierarchy of `mounts`.
pub fn dirs_in(mounts: &[PathBuf], cgroup: &str) -> Vec<PathBuf> {
    let relative = Path::new(cgroup.trim_start_matches('/'));
    mounts.iter().map(|m| m.join(relative)).collect()
}

/// `cgroup` in every hierarchy of this host.
pub fn dirs(cgroup: &str) -> Vec<PathBuf> {
    dirs_in(&mounts(), cgroup)
}

/// Those of `dirs(cgroup)` that exist, as strings (for "nothing left" checks).
pub fn existing(cgroup: &str) -> Vec<String> {
    dirs(cgroup).into_iter().filter(|d| d.exists()).map(|d| d.display().to_string()).collect()
}

/// A process's cgroup from the text of `/proc/<pid>/cgroup`: the memory controller's path
/// on v1 and hybrid hosts, the unified (`0::`) path on v2-only hosts.
pub fn path_in(proc_cgroup: &str) -> Option<String> {
    let memory = proc_cgroup.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers.split(',').any(|c| c == "memory").then(|| path.to_string())
    });
    memory.or_else(|| proc_cgroup.lines().find_map(|l| l.strip_prefix("0::").map(str::to_string)))
}

/// The cgroup of process `pid` (see [`path_in`]).
pub fn of_pid(pid: u32) -> Option<String> {
    path_in(&std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?)
}

/// kubelet's cgroup for one pod, made as kubelet makes it: in every hierarchy, level by level, a
/// new v1 cpuset cgroup given its parent's CPUs and memory nodes (else nothing could join it).
/// Dropping it removes what it made, deepest first, where nothing else lives (the shim must
/// never remove it: tests check that it is still there first).
pub struct KubeletPodCgroup {
    /// The cgroup's path inside each hierarchy.
    pub path: String,
    /// What the pod's `linux.cgroup_parent` says: the path (cgroupfs driver) or the slice's name.
    pub cri_parent: String,
}

impl KubeletPodCgroup {
    /// The cgroupfs driver's pod cgroup at `path`.
    pub fn cgroupfs(path: &str) -> std::io::Result<Self> {
        make_levels(path)?;
        Ok(Self { path: path.into(), cri_parent: path.into() })
    }

    /// The systemd driver's slice for a besteffort pod `uid`; containerd then names the sandbox's
    /// cgroup `<slice>:cri-containerd:<id>`.
    pub fn systemd_slice(uid: &str) -> std::io::Result<Self> {
        let slice = format!("kubepods-besteffort-pod{uid}.slice");
        let path = format!("/kubepods.slice/kubepods-besteffort.slice/{slice}");
        make_levels(&path)?;
        Ok(Self { path, cri_parent: slice })
    }

    /// Writes `value` to `file` in every hierarchy that has it (a limit kubelet sets); returns how
    /// many did.
    pub fn set(&self, file: &str, value: &str) -> std::io::Result<usize> {
        let mut n = 0;
        for dir in dirs(&self.path) {
            if dir.join(file).exists() {
                std::fs::write(dir.join(file), value)?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// Every hierarchy's directory of it.
    pub fn dirs(&self) -> Vec<PathBuf> {
        dirs(&self.path)
    }

    /// The memory charged to it (v1 `memory.usage_in_bytes` or v2 `memory.current`).
    pub fn memory_charged(&self) -> Option<u64> {
        self.dirs().iter().find_map(|dir| {
            ["memory.usage_in_bytes", "memory.current"]
                .iter()
                .find_map(|f| std::fs::read_to_string(dir.join(f)).ok())
                .and_then(|t| t.trim().parse::<u64>().ok())
        })
    }

    /// Where systemd is PID 1: checks that the sandbox `pod_id`'s scope is systemd's active
    /// transient unit in this slice, as runc's systemd driver leaves it, and returns its name.
    /// `None` elsewhere (the cgroupfs expansion is all there is).
    pub fn systemd_scope_of(&self, pod_id: &str) -> anyhow::Result<Option<String>> {
        if !std::path::Path::new("/run/systemd/system").is_dir() {
            return Ok(None);
        }
        let unit = format!("cri-containerd-{pod_id}.scope");
        let show = |prop: &str| -> anyhow::Result<String> {
            let out = std::process::Command::new("systemctl").args(["show", "-p", prop, "--value", &unit]).output()?;
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        };
        anyhow::ensure!(show("ActiveState")? == "active", "systemd does not know the pod's scope {unit}");
        let slice = show("Slice")?;
        anyhow::ensure!(
            slice == self.cri_parent,
            "the scope {unit} is in {slice}, not in kubelet's {}",
            self.cri_parent
        );
        Ok(Some(unit))
    }
}

impl Drop for KubeletPodCgroup {
    fn drop(&mut self) {
        for mount in mounts() {
            let mut dir = mount.join(self.path.trim_start_matches('/'));
            while dir != mount {
                let _ = std::fs::remove_dir(&dir);
                dir.pop();
            }
        }
    }
}

fn make_levels(path: &str) -> std::io::Result<()> {
    for mount in mounts() {
        // v2 (the unified hierarchy): a level's limits exist only where its parent hands the
        // controllers down, as kubelet (and systemd for its slices) enable them; cpusets are
        // inherited, so there is nothing to copy.
        let unified = mount.join("cgroup.controllers").exists();
        let mut dir = mount.clone();
        for part in path.trim_start_matches('/').split('/').filter(|p| !p.is_empty()) {
            let parent = dir.clone();
            dir.push(part);
            if unified {
                for controller in ["cpu", "memory", "pids"] {
                    // Best effort: a controller the parent lacks stays off below it too.
                    let _ = std::fs::write(parent.join("cgroup.subtree_control"), format!("+{controller}"));
                }
                let _ = std::fs::create_dir(&dir);
            } else if std::fs::create_dir(&dir).is_ok() && dir.join("cpuset.cpus").exists() {
                for file in ["cpuset.cpus", "cpuset.mems"] {
                    std::fs::write(dir.join(file), std::fs::read_to_string(parent.join(file))?.trim())?;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_and_hybrid_use_the_memory_controller() {
        let text = "12:pids:/a\n4:memory:/kubepods/pod1/c1\n0::/\n";
        assert_eq!(path_in(text).as_deref(), Some("/kubepods/pod1/c1"));
        assert_eq!(path_in("5:cpu,memory:/x\n").as_deref(), Some("/x"));
    }

    #[test]
    fn v2_uses_the_unified_line() {
        assert_eq!(path_in("0::/bulkhead/sb1/c1\n").as_deref(), Some("/bulkhead/sb1/c1"));
        assert_eq!(path_in(""), None);
    }

    #[test]
    fn a_v2_only_tree_is_found_and_checked() {
        let root = tempfile::tempdir().unwrap();
        let unified = root.path().join("cgroup");
        std::fs::create_dir_all(unified.join("bulkhead/sb1/c1")).unwrap();
        let mountinfo = format!(
            "25 1 0:22 / / rw - ext4 /dev/vda rw\n\
             30 25 0:26 / {} rw,nosuid - cgroup2 cgroup2 rw\n",
            unified.display()
        );
        let mounts = mounts_in(&mountinfo);
        assert_eq!(mounts, vec![unified.clone()]);
        let dirs = dirs_in(&mounts, "/bulkhead/sb1");
        assert_eq!(dirs, vec![unified.join("bulkhead/sb1")]);
        assert!(dirs[0].exists());
        std::fs::remove_dir_all(unified.join("bulkhead")).unwrap();
        assert!(!dirs_in(&mounts, "/bulkhead/sb1")[0].exists());
    }

    #[test]
    fn v1_mounts_are_all_found() {
        let mountinfo = "35 30 0:30 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n\
                         36 30 0:31 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n\
                         37 30 0:32 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n";
        assert_eq!(mounts_in(mountinfo).len(), 3);
    }
}
