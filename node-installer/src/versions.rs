//! The version directories under the prefix: which are installed, which one `current` names, and their collection.
//!
//! An update installs version N+1 beside N and points `current` at it; N stays for as long as anything still runs
//! from it (`usage`). A version is removed only when all of these hold: `current` does not name it, it is not the
//! version being installed, no process executes one of its files, every live pod's version is known, and `current`
//! has named another version for the grace period (a `start` that resolved the old link just before the switch
//! re-executes itself by that resolved path a moment later). Anything unclear keeps every version: a version too
//! many costs disk, one too few breaks a pod.
//!
//! Removal first renames the directory to `.<version>.bulkhead-gc`, then deletes it, so a version is either whole
//! or absent from the listing, and the next run finishes a removal that a crash interrupted.

use std::fmt;
use std::fs;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use crate::error::{io, Result};
use crate::fsutil;
use crate::node_paths::{self, NodePaths};
use crate::usage::{self, Usage};

/// Suffix of a version directory being removed.
pub const GC_SUFFIX: &str = ".bulkhead-gc";

/// Why a version stays.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Keep {
    /// `current` names it: new pods get it.
    Current,
    /// This install puts it in place.
    Installing,
    /// These processes execute its files (a pod's shim, its VMM, a `delete` in progress...).
    InUse { pids: Vec<u32> },
    /// Something runs whose version cannot be told, so no version is known to be unused.
    Unknown { why: String },
    /// `current` switched less than the grace period ago (or when is unknown).
    JustSwitched { ago: Option<Duration> },
}

impl fmt::Display for Keep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Keep::Current => write!(f, "current"),
            Keep::Installing => write!(f, "being installed"),
            Keep::InUse { pids } => write!(f, "in use by pids {pids:?}"),
            Keep::Unknown { why } => write!(f, "kept while {why}"),
            Keep::JustSwitched { ago: Some(ago) } => write!(f, "current switched away from it only {ago:?} ago"),
            Keep::JustSwitched { ago: None } => write!(f, "the time current switched is unknown"),
        }
    }
}

/// One installed version and its fate: `keep: None` removes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub version: String,
    pub keep: Option<Keep>,
}

/// What the collection decides from.
#[derive(Clone, Copy, Debug)]
pub struct Inputs<'a> {
    pub installed: &'a [String],
    pub current: Option<&'a str>,
    pub installing: &'a str,
    pub usage: &'a Usage,
    /// How long ago `current` was switched; `None` when that cannot be told.
    pub since_switch: Option<Duration>,
    pub grace: Duration,
}

/// The collection rule, for every installed version (pure: unit-tested without a node).
pub fn decide(i: Inputs<'_>) -> Vec<Decision> {
    let in_use = i.usage.by_version();
    let unknown_pods: Vec<&str> =
        i.usage.pods.iter().filter(|p| p.version.is_none()).map(|p| p.label.as_str()).collect();
    let unknown = if !unknown_pods.is_empty() {
        Some(format!("pods run a shim outside every version directory: {}", unknown_pods.join(", ")))
    } else if !i.usage.unreadable.is_empty() {
        Some(format!("the executables of pids {:?} cannot be read", i.usage.unreadable))
    } else {
        None
    };
    i.installed
        .iter()
        .map(|v| {
            let keep = if i.current == Some(v.as_str()) {
                Some(Keep::Current)
            } else if i.installing == v {
                Some(Keep::Installing)
            } else if let Some(pids) = in_use.get(v.as_str()) {
                Some(Keep::InUse { pids: pids.clone() })
            } else if let Some(why) = &unknown {
                Some(Keep::Unknown { why: why.clone() })
            } else {
                match i.since_switch {
                    Some(ago) if ago >= i.grace => None,
                    ago => Some(Keep::JustSwitched { ago }),
                }
            };
            Decision { version: v.clone(), keep }
        })
        .collect()
}

/// Installed versions: the directories under `root` with a plain version name, sorted.
pub fn installed(root: &Path) -> Result<Vec<String>> {
    let entries = match fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(io("read dir", root)(e)),
    };
    let mut out = vec![];
    for entry in entries {
        let entry = entry.map_err(io("read dir", root))?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else { continue };
        if entry.file_type().is_ok_and(|t| t.is_dir()) && node_paths::check_version(&name).is_ok() {
            out.push(name);
        }
    }
    out.sort();
    Ok(out)
}

/// The version `current` names, if it names one.
pub fn current(layout: &NodePaths) -> Option<String> {
    let target = fs::read_link(layout.current_link()).ok()?;
    let mut parts = target.components();
    match (parts.next(), parts.next()) {
        (Some(Component::Normal(v)), None) => {
            v.to_str().filter(|v| node_paths::check_version(v).is_ok()).map(str::to_string)
        }
        _ => None,
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    pub removed: Vec<String>,
    pub kept: Vec<(String, Keep)>,
}

/// Removes every old version nothing uses any more (see the module doc). Called with the install lock held.
pub fn collect(layout: &NodePaths, installing: &str, grace: Duration) -> Result<GcReport> {
    let root = layout.install_dir();
    finish_interrupted_removals(&root)?;
    let installed = installed(&root)?;
    let current = current(layout);
    let mut report = GcReport::default();
    if installed.iter().all(|v| Some(v) == current.as_ref() || v == installing) {
        return Ok(report);
    }
    let usage = usage::scan(layout)?;
    let since_switch =
        fs::symlink_metadata(layout.current_link()).and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok());
    let inputs =
        Inputs { installed: &installed, current: current.as_deref(), installing, usage: &usage, since_switch, grace };
    for d in decide(inputs) {
        match d.keep {
            None => {
                remove(&root, &d.version)?;
                report.removed.push(d.version);
            }
            Some(keep) => {
                if !matches!(keep, Keep::Current | Keep::Installing) {
                    tracing::info!(version = %d.version, reason = %keep, "old version kept");
                }
                report.kept.push((d.version, keep));
            }
        }
    }
    Ok(report)
}

fn gc_path(root: &Path, version: &str) -> PathBuf {
    root.join(format!(".{version}{GC_SUFFIX}"))
}

fn remove(root: &Path, version: &str) -> Result<()> {
    let (dir, doomed) = (root.join(version), gc_path(root, version));
    remove_dir_if_exists(&doomed)?;
    fs::rename(&dir, &doomed).map_err(io("rename", &dir))?;
    fsutil::sync_parent(&dir)?;
    remove_dir_if_exists(&doomed)?;
    tracing::info!(version, path = %dir.display(), "removed old version: nothing runs from it");
    Ok(())
}

fn finish_interrupted_removals(root: &Path) -> Result<()> {
    let Ok(entries) = fs::read_dir(root) else { return Ok(()) };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') && name.ends_with(GC_SUFFIX) && entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_dir_if_exists(&entry.path())?;
            tracing::info!(path = %entry.path().display(), "finished removing a version an interrupted run left");
        }
    }
    Ok(())
}

fn remove_dir_if_exists(dir: &Path) -> Result<()> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io("remove dir", dir)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::usage::{Pod, Process};

    const MIN: Duration = Duration::from_secs(60);

    fn versions(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn pod(label: &str, version: Option<&str>) -> Pod {
        Pod { id: label.into(), label: label.into(), shim_pid: 7, version: version.map(str::to_string) }
    }

    fn process(pid: u32, version: &str) -> Process {
        Process { pid, version: version.into(), exe: PathBuf::from(format!("/opt/bulkhead/{version}/x")) }
    }

    /// The versions `decide` removes.
    fn removed(
        installed: &[&str],
        current: Option<&str>,
        installing: &str,
        usage: &Usage,
        ago: Option<Duration>,
    ) -> Vec<String> {
        let installed = versions(installed);
        let inputs = Inputs { installed: &installed, current, installing, usage, since_switch: ago, grace: MIN };
        decide(inputs).into_iter().filter(|d| d.keep.is_none()).map(|d| d.version).collect()
    }

    #[test]
    fn an_unused_old_version_goes_and_current_never_does() {
        let idle = Usage::default();
        assert_eq!(removed(&["1.0", "2.0"], Some("2.0"), "2.0", &idle, Some(2 * MIN)), ["1.0"]);
        assert_eq!(removed(&["1.0", "1.1", "2.0"], Some("2.0"), "2.0", &idle, Some(MIN)), ["1.0", "1.1"]);
        // current is kept even when nothing runs from it, and so is the version being installed.
        assert!(removed(&["2.0"], Some("2.0"), "2.0", &idle, Some(2 * MIN)).is_empty());
        assert_eq!(removed(&["1.0", "2.0"], Some("1.0"), "2.0", &idle, Some(2 * MIN)), Vec::<String>::new());
    }

    #[test]
    fn a_version_a_process_runs_from_stays_until_the_process_is_gone() {
        let busy = Usage {
            processes: vec![process(10, "1.0"), process(11, "1.0")],
            pods: vec![pod("default/web", Some("1.0"))],
            ..Usage::default()
        };
        let installed = versions(&["0.9", "1.0", "2.0"]);
        let inputs = Inputs {
            installed: &installed,
            current: Some("2.0"),
            installing: "2.0",
            usage: &busy,
            since_switch: Some(2 * MIN),
            grace: MIN,
        };
        let d = decide(inputs);
        assert_eq!(d[0], Decision { version: "0.9".into(), keep: None });
        assert_eq!(d[1], Decision { version: "1.0".into(), keep: Some(Keep::InUse { pids: vec![10, 11] }) });
        assert_eq!(d[2], Decision { version: "2.0".into(), keep: Some(Keep::Current) });
        assert_eq!(removed(&["1.0", "2.0"], Some("2.0"), "2.0", &Usage::default(), Some(2 * MIN)), ["1.0"]);
    }

    #[test]
    fn a_pod_of_unknown_version_or_an_unreadable_process_keeps_everything() {
        let unknown = Usage { pods: vec![pod("default/db", None)], ..Usage::default() };
        assert!(removed(&["1.0", "2.0"], Some("2.0"), "2.0", &unknown, Some(2 * MIN)).is_empty());
        let installed = versions(&["1.0", "2.0"]);
        let inputs = Inputs {
            installed: &installed,
            current: Some("2.0"),
            installing: "2.0",
            usage: &unknown,
            since_switch: Some(2 * MIN),
            grace: MIN,
        };
        let why = decide(inputs)[0].keep.clone().map(|k| k.to_string()).unwrap_or_default();
        assert!(why.contains("default/db"), "{why}");
        let unreadable = Usage { unreadable: vec![42], ..Usage::default() };
        assert!(removed(&["1.0", "2.0"], Some("2.0"), "2.0", &unreadable, Some(2 * MIN)).is_empty());
        // A pod of a known version holds only that one.
        let known = Usage {
            pods: vec![pod("default/db", Some("1.1"))],
            processes: vec![process(7, "1.1")],
            ..Usage::default()
        };
        assert_eq!(removed(&["1.0", "1.1", "2.0"], Some("2.0"), "2.0", &known, Some(2 * MIN)), ["1.0"]);
    }

    #[test]
    fn nothing_goes_within_the_grace_period_after_a_switch() {
        let idle = Usage::default();
        assert!(removed(&["1.0", "2.0"], Some("2.0"), "2.0", &idle, Some(MIN / 2)).is_empty());
        assert!(removed(&["1.0", "2.0"], Some("2.0"), "2.0", &idle, None).is_empty(), "unknown switch time");
    }

    #[test]
    fn collection_renames_then_deletes_and_finishes_an_interrupted_removal() {
        let d = tempfile::tempdir().unwrap();
        let mut l = NodePaths::new(d.path(), d.path());
        l.proc_dir = d.path().join("proc");
        fs::create_dir_all(&l.proc_dir).unwrap();
        for v in ["1.0", "2.0"] {
            fs::create_dir_all(l.version_dir(v).join("sub")).unwrap();
            fs::write(l.version_dir(v).join("sub/f"), v).unwrap();
        }
        fs::create_dir_all(l.state_dir()).unwrap();
        std::os::unix::fs::symlink("2.0", l.current_link()).unwrap();
        let left = gc_path(&l.install_dir(), "0.9");
        fs::create_dir_all(left.join("x")).unwrap();
        assert_eq!(installed(&l.install_dir()).unwrap(), ["1.0", "2.0"], "a removal in progress is no version");
        assert_eq!(current(&l).as_deref(), Some("2.0"));

        // Just switched: 1.0 stays for now; the leftover is finished regardless.
        let r = collect(&l, "2.0", Duration::from_secs(3600)).unwrap();
        assert!(r.removed.is_empty() && !left.exists(), "{r:?}");
        let r = collect(&l, "2.0", Duration::ZERO).unwrap();
        assert_eq!(r.removed, ["1.0"]);
        assert_eq!(installed(&l.install_dir()).unwrap(), ["2.0"]);
        assert!(l.state_dir().is_dir(), "the installer's state is no version");
        assert_eq!(collect(&l, "2.0", Duration::ZERO).unwrap(), GcReport { removed: vec![], kept: vec![] });
    }
}
