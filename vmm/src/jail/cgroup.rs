//! Joining the pod's cgroup in every mounted hierarchy, v1 and v2 alike, so the VMM (and the guest
//! memory it maps) is charged to the pod. The cgroup is created where missing; removing it is the
//! shim's job, since it owns the pod.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

use super::error::{sys, JailError};

/// One mounted cgroup hierarchy.
#[derive(Debug, PartialEq, Eq)]
pub struct Hierarchy {
    pub mount_point: PathBuf,
    /// A v1 cpuset hierarchy: a new cgroup there has no CPUs or memory nodes until given some.
    pub cpuset_v1: bool,
}

/// The hierarchies in `/proc/self/mountinfo` text: each once (bind mounts of the same hierarchy
/// are skipped), only mounts of a hierarchy's root.
pub fn hierarchies(mountinfo: &str) -> Vec<Hierarchy> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else { continue };
        let left: Vec<&str> = left.split(' ').collect();
        let right: Vec<&str> = right.split(' ').collect();
        let (Some(root), Some(mount_point), Some(fstype), Some(super_opts)) =
            (left.get(3), left.get(4), right.first(), right.get(2))
        else {
            continue;
        };
        if *root != "/" || !matches!(*fstype, "cgroup" | "cgroup2") {
            continue;
        }
        // A v1 hierarchy is known by its controllers (or name=); there is one v2 hierarchy.
        let opts: BTreeSet<&str> = super_opts.split(',').filter(|o| !matches!(*o, "rw" | "ro")).collect();
        let key = if *fstype == "cgroup2" {
            "cgroup2".to_string()
        } else {
            opts.iter().copied().collect::<Vec<_>>().join(",")
        };
        if !seen.insert(key) {
            continue;
        }
        out.push(Hierarchy {
            mount_point: PathBuf::from(unescape(mount_point)),
            cpuset_v1: *fstype == "cgroup" && opts.contains("cpuset"),
        });
    }
    out
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal =
            bytes.get(i + 1..i + 4).filter(|d| bytes[i] == b'\\' && d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match octal {
            Some(d) => {
                out.push(d.iter().fold(0u8, |v, b| v.wrapping_mul(8).wrapping_add(b - b'0')));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Moves this process into `cgroup` (a path inside each hierarchy) in every mounted hierarchy.
pub fn join(cgroup: &Path) -> Result<(), JailError> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").map_err(sys("read /proc/self/mountinfo"))?;
    let found = hierarchies(&mountinfo);
    if found.is_empty() {
        return Err(JailError::Refused("no cgroup hierarchy is mounted".into()));
    }
    let pid = std::process::id().to_string();
    for h in &found {
        let dir = create(h, cgroup)?;
        let procs = dir.join("cgroup.procs");
        std::fs::write(&procs, &pid).map_err(sys(format!("join cgroup {}", procs.display())))?;
    }
    tracing::debug!(cgroup = %cgroup.display(), hierarchies = found.len(), "joined the pod cgroup");
    Ok(())
}

/// Creates `cgroup` under the hierarchy, level by level, and returns its directory.
fn create(h: &Hierarchy, cgroup: &Path) -> Result<PathBuf, JailError> {
    let mut dir = h.mount_point.clone();
    for component in cgroup.components() {
        let Component::Normal(name) = component else { continue };
        let parent = dir.clone();
        dir.push(name);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(sys(format!("create cgroup {}", dir.display()))(e)),
        }
        // Every level, not only the ones made here: a level another VMM made a moment ago may
        // not have its CPUs yet, and a child copied from it then would refuse the join (ENOSPC).
        if h.cpuset_v1 {
            inherit_cpuset(&parent, &dir)?;
        }
    }
    Ok(dir)
}

/// A new v1 cpuset cgroup starts with empty `cpuset.cpus`/`cpuset.mems` and accepts no process
/// until it has them: copy the parent's where empty (a value someone set stays; racing copies
/// write the same value).
fn inherit_cpuset(parent: &Path, dir: &Path) -> Result<(), JailError> {
    for file in ["cpuset.cpus", "cpuset.mems"] {
        let own = match std::fs::read_to_string(dir.join(file)) {
            Ok(value) => value,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(sys(format!("read {}", dir.join(file).display()))(e)),
        };
        if !own.trim().is_empty() {
            continue;
        }
        let value =
            std::fs::read_to_string(parent.join(file)).map_err(sys(format!("read {}", parent.join(file).display())))?;
        std::fs::write(dir.join(file), value.trim()).map_err(sys(format!("write {}", dir.join(file).display())))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
25 1 0:23 / /sys rw,nosuid - sysfs sysfs rw
30 25 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
32 30 0:28 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,xattr,name=systemd
33 30 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
34 30 0:30 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset
35 30 0:31 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
36 1 0:31 / /mnt/mem\\040copy rw - cgroup cgroup rw,memory
37 1 0:31 /sub /mnt/sub rw - cgroup cgroup rw,pids
38 1 8:1 / / rw master:1 - ext4 /dev/sda1 rw
";

    #[test]
    fn every_hierarchy_once_with_cpuset_marked() {
        let h = hierarchies(HYBRID);
        let points: Vec<&str> = h.iter().map(|h| h.mount_point.to_str().unwrap()).collect();
        assert_eq!(
            points,
            [
                "/sys/fs/cgroup/unified",
                "/sys/fs/cgroup/systemd",
                "/sys/fs/cgroup/cpu,cpuacct",
                "/sys/fs/cgroup/cpuset",
                "/sys/fs/cgroup/memory"
            ]
        );
        assert_eq!(h.iter().filter(|h| h.cpuset_v1).count(), 1);
        assert!(h[3].cpuset_v1);
    }

    #[test]
    fn pure_v2_and_malformed_lines() {
        let h = hierarchies("29 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\ngarbage\n1 2 3\n");
        assert_eq!(h, vec![Hierarchy { mount_point: "/sys/fs/cgroup".into(), cpuset_v1: false }]);
        assert!(hierarchies("").is_empty());
    }

    /// Two pods' VMMs join cgroups under one new parent at once: the second finds the parent
    /// made by the first, before the first gave it CPUs. Each level gets its parent's where it
    /// has none; one that has its own keeps them.
    #[test]
    fn a_cpuset_level_made_by_another_process_gets_its_cpus_too() {
        let root = tempfile::tempdir().unwrap();
        let (top, parent) = (root.path(), root.path().join("kubepods"));
        std::fs::write(top.join("cpuset.cpus"), "0-3\n").unwrap();
        std::fs::write(top.join("cpuset.mems"), "0\n").unwrap();
        // Made by the other VMM, which has not copied the CPUs yet.
        std::fs::create_dir(&parent).unwrap();
        std::fs::write(parent.join("cpuset.cpus"), "\n").unwrap();
        std::fs::write(parent.join("cpuset.mems"), "").unwrap();
        let h = Hierarchy { mount_point: top.to_path_buf(), cpuset_v1: true };
        let dir = create(&h, Path::new("/kubepods/pod1")).unwrap();
        for level in [&parent, &dir] {
            assert_eq!(std::fs::read_to_string(level.join("cpuset.cpus")).unwrap(), "0-3", "{}", level.display());
            assert_eq!(std::fs::read_to_string(level.join("cpuset.mems")).unwrap(), "0", "{}", level.display());
        }
        // Kubelet's own CPUs for a level stay.
        std::fs::write(dir.join("cpuset.cpus"), "2").unwrap();
        create(&h, Path::new("/kubepods/pod1/sandbox")).unwrap();
        assert_eq!(std::fs::read_to_string(dir.join("cpuset.cpus")).unwrap(), "2");
        assert_eq!(std::fs::read_to_string(dir.join("sandbox/cpuset.cpus")).unwrap(), "2");
    }

    #[test]
    fn mount_points_are_unescaped() {
        assert_eq!(unescape("/mnt/a\\040b\\134c"), "/mnt/a b\\c");
        assert_eq!(unescape("/x\\04"), "/x\\04");
        assert_eq!(unescape("/x\\999"), "/x\\999");
    }
}
