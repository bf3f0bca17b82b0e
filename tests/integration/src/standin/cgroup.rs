//! Joining the pod's cgroup in every mounted hierarchy (v1 and v2), as `bulkhead-vmm`'s jail
//! does, so QEMU's guest memory and CPU are charged to the pod. A missing cgroup is created; a v1
//! cpuset cgroup gets its parent's CPUs and memory nodes, without which nothing can join it.

use std::path::{Path, PathBuf};

/// Mount points of the hierarchies in `mountinfo` (only mounts of a hierarchy's root).
pub fn hierarchies(mountinfo: &str) -> Vec<(PathBuf, bool)> {
    let mut out: Vec<(PathBuf, bool)> = Vec::new();
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else { continue };
        let left: Vec<&str> = left.split(' ').collect();
        let right: Vec<&str> = right.split(' ').collect();
        let (Some(root), Some(mount_point), Some(fstype), Some(opts)) =
            (left.get(3), left.get(4), right.first(), right.get(2))
        else {
            continue;
        };
        if *root != "/" || !matches!(*fstype, "cgroup" | "cgroup2") {
            continue;
        }
        let cpuset = *fstype == "cgroup" && opts.split(',').any(|o| o == "cpuset");
        let point = PathBuf::from(mount_point);
        if !out.iter().any(|(p, _)| *p == point) {
            out.push((point, cpuset));
        }
    }
    out
}

/// Moves this process into `cgroup` (a path inside each hierarchy).
pub fn join(cgroup: &Path) -> std::io::Result<()> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    for (mount_point, cpuset) in hierarchies(&mountinfo) {
        // Level by level: a v1 cpuset cgroup made here copies its parent's CPUs and nodes.
        let mut dir = mount_point.clone();
        for component in cgroup.components() {
            let std::path::Component::Normal(name) = component else { continue };
            let parent = dir.clone();
            dir.push(name);
            match std::fs::create_dir(&dir) {
                Ok(()) if cpuset => {
                    for file in ["cpuset.cpus", "cpuset.mems"] {
                        std::fs::write(dir.join(file), std::fs::read_to_string(parent.join(file))?.trim())?;
                    }
                }
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
                _ => {}
            }
        }
        std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string())
            .map_err(|e| std::io::Error::new(e.kind(), format!("join {}: {e}", dir.display())))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hierarchies_are_found_once_each() {
        let mountinfo = "\
30 25 0:26 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
31 25 0:27 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
32 25 0:28 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
33 25 0:27 /sub /mnt/memory rw - cgroup cgroup rw,memory
34 25 0:29 / /proc rw - proc proc rw";
        assert_eq!(
            hierarchies(mountinfo),
            [
                (PathBuf::from("/sys/fs/cgroup/cpuset"), true),
                (PathBuf::from("/sys/fs/cgroup/memory"), false),
                (PathBuf::from("/sys/fs/cgroup/unified"), false),
            ]
        );
    }
}
