//! Host mounts a pod may leave behind, found from `/proc/self/mountinfo` and lazily unmounted
//! (teardown and `delete` after a crash). Never wider than the directory asked for. Also what
//! counts as a bind mount in an OCI spec, for every module that handles the spec's host paths.

use std::path::{Path, PathBuf};

use nix::mount::{umount2, MntFlags};
use serde_json::Value;
use tracing::debug;

/// Whether an OCI spec mount binds a host path (by its type, or a `bind`/`rbind` option).
pub fn is_bind(m: &Value) -> bool {
    m.get("type").and_then(Value::as_str) == Some("bind")
        || m.get("options")
            .and_then(Value::as_array)
            .is_some_and(|o| o.iter().any(|v| matches!(v.as_str(), Some("bind" | "rbind"))))
}

/// Mount points at or below `dir`, deepest first, from /proc/self/mountinfo.
pub fn mounts_below(dir: &Path) -> Vec<PathBuf> {
    // Never "everything": only a real, absolute directory below the root qualifies.
    if !dir.is_absolute() || dir.parent().is_none() {
        return Vec::new();
    }
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = info
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(unescape_mountinfo)
        .map(PathBuf::from)
        .filter(|p| p.starts_with(dir))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    found
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape_mountinfo(field: &str) -> String {
    field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
}

/// Unmounts (lazily) everything at or below `dir`.
pub fn unmount_all(dir: &Path) {
    for target in mounts_below(dir) {
        if let Err(e) = umount2(&target, MntFlags::MNT_DETACH) {
            debug!("umount {}: {e}", target.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unmount_scope_is_never_the_whole_host() {
        assert!(mounts_below(Path::new("")).is_empty());
        assert!(mounts_below(Path::new("/")).is_empty());
        assert!(mounts_below(Path::new("relative/dir")).is_empty());
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape_mountinfo("/a\\040b"), "/a b");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
    }
}
