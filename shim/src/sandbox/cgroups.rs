//! The pod's cgroup parent on the host. The agent puts every container at
//! `<parent>/<container id>` in each hierarchy. The parent is the kubelet's pod cgroup when the
//! sandbox spec names one (`linux.cgroupsPath` = `<pod cgroup>/<sandbox id>`, cgroupfs style),
//! else `/bulkhead/<sandbox id>`, which the shim owns.
//!
//! When the agent dies abruptly (pod killed, shim crashed) nobody removes the containers'
//! cgroups, so the sandbox's teardown does: it removes every empty cgroup below the parent, and
//! the parent itself when the shim owns it. rmdir only ever removes empty cgroups.

use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use tracing::{debug, warn};

/// Where the shim puts pods whose spec names no cgroup.
const OWN_ROOT: &str = "/bulkhead";

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PodCgroup {
    /// Absolute path inside each hierarchy.
    pub parent: PathBuf,
    /// Whether the shim created `parent` (and so removes it).
    pub owned: bool,
}

/// A cgroupfs path the shim may use: absolute, plain components, not the root.
fn plain_absolute(path: &Path) -> bool {
    path.is_absolute()
        && path.components().count() > 1
        && path.components().all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
}

impl PodCgroup {
    /// The parent for a pod, from the sandbox spec's `linux.cgroupsPath` if it is cgroupfs style.
    pub fn for_pod(sandbox_id: &str, spec_cgroups_path: Option<&str>) -> Self {
        if let Some(path) = spec_cgroups_path.map(Path::new) {
            if let Some(parent) = path.parent().filter(|p| plain_absolute(p) && plain_absolute(path)) {
                return Self { parent: parent.to_path_buf(), owned: false };
            }
            if !path.as_os_str().is_empty() {
                warn!(cgroups_path = %path.display(), "sandbox cgroupsPath is not cgroupfs style; using the shim's own");
            }
        }
        Self { parent: Path::new(OWN_ROOT).join(sandbox_id), owned: true }
    }

    /// Removes the containers' cgroups (and the parent when owned), retrying briefly while the
    /// last processes of a killed pod exit.
    pub async fn remove(&self) {
        if !plain_absolute(&self.parent) {
            return;
        }
        for mount in cgroup_mounts() {
            let dir = mount.join(self.parent.strip_prefix("/").unwrap_or(&self.parent));
            if !dir.is_dir() {
                continue;
            }
            for attempt in 0..50 {
                let left = remove_below(&dir) + usize::from(self.owned && rmdir(&dir).is_err());
                if left == 0 {
                    break;
                }
                if attempt == 49 {
                    warn!(cgroup = %dir.display(), "cgroups still busy after teardown");
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

impl PodCgroup {
    /// The sandbox's own cgroup, where the launcher and agent live: `<parent>/<sandbox id>`
    /// (for kubelet pods exactly the sandbox spec's `linux.cgroupsPath`).
    pub fn sandbox(&self, sandbox_id: &str) -> PathBuf {
        self.parent.join(sandbox_id)
    }
}

/// Moves `pid` into the cgroup `path` of every hierarchy that accepts it, creating it as
/// needed; returns what failed. cpuset is skipped: a new cpuset cgroup has no CPUs until
/// configured, and the launcher needs none of its own.
pub fn join(path: &Path, pid: u32) -> Vec<String> {
    if !plain_absolute(path) {
        return vec![format!("cgroup {} is not a plain absolute path", path.display())];
    }
    let relative = path.strip_prefix("/").unwrap_or(path);
    let mut problems = Vec::new();
    for mount in cgroup_mounts() {
        if mount.file_name().is_some_and(|n| n.to_string_lossy().contains("cpuset")) {
            continue;
        }
        let dir = mount.join(relative);
        let joined =
            std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(dir.join("cgroup.procs"), pid.to_string()));
        if let Err(e) = joined {
            problems.push(format!("join cgroup {}: {e}", dir.display()));
        }
    }
    problems
}

fn rmdir(dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// Removes every cgroup below `dir`, deepest first; returns how many could not be removed.
fn remove_below(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut left = 0;
    for entry in entries.flatten() {
        // Only directories are cgroups; control files are never touched.
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            let child = entry.path();
            left += remove_below(&child);
            if let Err(e) = rmdir(&child) {
                debug!("rmdir {}: {e}", child.display());
                left += 1;
            }
        }
    }
    left
}

/// Mount points of every cgroup hierarchy (v1 controllers, named, and v2), from mountinfo.
fn cgroup_mounts() -> Vec<PathBuf> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else { return Vec::new() };
    info.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fstype = right.split(' ').next()?;
            (fstype == "cgroup" || fstype == "cgroup2").then(|| left.split(' ').nth(4).map(PathBuf::from))?
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubelet_pod_cgroup_is_the_parent() {
        let cg = PodCgroup::for_pod("sb1", Some("/kubepods/burstable/pod-uid/sb1"));
        assert_eq!(cg, PodCgroup { parent: "/kubepods/burstable/pod-uid".into(), owned: false });
    }

    #[test]
    fn otherwise_the_shim_owns_one() {
        for spec in [None, Some(""), Some("system.slice:cri:sb1"), Some("/sb1"), Some("/a/../b/sb1")] {
            let cg = PodCgroup::for_pod("sb1", spec);
            assert_eq!(cg, PodCgroup { parent: "/bulkhead/sb1".into(), owned: true }, "{spec:?}");
        }
    }

    #[test]
    fn only_plain_absolute_paths_qualify() {
        assert!(plain_absolute(Path::new("/a/b")));
        assert!(!plain_absolute(Path::new("/")));
        assert!(!plain_absolute(Path::new("a/b")));
        assert!(!plain_absolute(Path::new("/a/../b")));
    }

    #[test]
    fn removal_takes_empty_directories_only() {
        let dir = tempfile::tempdir().unwrap();
        let nested = dir.path().join("c1/sub");
        std::fs::create_dir_all(&nested).unwrap();
        std::fs::write(dir.path().join("c2-file"), b"x").unwrap();
        assert_eq!(remove_below(dir.path()), 0);
        assert!(!dir.path().join("c1").exists());
        assert!(dir.path().join("c2-file").exists());
    }
}
