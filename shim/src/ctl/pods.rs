//! The pods of a state directory, as the shims left them: one directory per sandbox id, with
//! the [`PodRecord`] once the sandbox runs. Finding a pod by what an operator types: the full
//! id, a unique prefix of it (crictl shows 13 characters), or the pod's name.

use std::path::Path;

use super::error::{io_err, CtlError};
use crate::sandbox::paths::{PodPaths, PodRecord};

/// One pod directory.
pub struct Pod {
    pub id: String,
    pub paths: PodPaths,
    /// `None` while the sandbox starts (or if the record is unreadable).
    pub record: Option<PodRecord>,
}

impl Pod {
    /// "namespace/name" when known, else the id.
    pub fn label(&self) -> String {
        match &self.record {
            Some(r) if !r.pod_name.is_empty() => format!("{}/{}", r.pod_namespace, r.pod_name),
            _ => self.id.clone(),
        }
    }
}

/// Every pod directory under `state_dir`, oldest first. A missing state dir has no pods.
pub fn list(state_dir: &Path) -> Result<Vec<Pod>, CtlError> {
    let entries = match std::fs::read_dir(state_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(format!("read {}", state_dir.display()))(e)),
    };
    let mut pods: Vec<Pod> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| {
            let id = e.file_name().to_str()?.to_string();
            let paths = PodPaths::new(state_dir, &id)?;
            let record = PodRecord::read(&paths).ok();
            Some(Pod { id, paths, record })
        })
        .collect();
    pods.sort_by(|a, b| {
        let started = |p: &Pod| p.record.as_ref().map_or(u64::MAX, |r| r.started_at_unix);
        started(a).cmp(&started(b)).then_with(|| a.id.cmp(&b.id))
    });
    Ok(pods)
}

/// The one pod `query` names.
pub fn find(state_dir: &Path, query: &str) -> Result<Pod, CtlError> {
    let pods = list(state_dir)?;
    let by_name = |p: &Pod| {
        p.record.as_ref().is_some_and(|r| {
            !r.pod_name.is_empty() && (r.pod_name == query || format!("{}/{}", r.pod_namespace, r.pod_name) == query)
        })
    };
    let choose = |matches: Vec<usize>| -> Option<Result<usize, CtlError>> {
        match matches.len() {
            0 => None,
            1 => Some(Ok(matches[0])),
            _ => Some(Err(CtlError::Ambiguous {
                query: query.into(),
                matches: matches.iter().map(|i| pods[*i].label()).collect::<Vec<_>>().join(", "),
            })),
        }
    };
    let indices = |f: &dyn Fn(&Pod) -> bool| pods.iter().enumerate().filter(|(_, p)| f(p)).map(|(i, _)| i).collect();
    let found = choose(indices(&|p| p.id == query))
        .or_else(|| choose(indices(&|p| !query.is_empty() && p.id.starts_with(query))))
        .or_else(|| choose(indices(&by_name)));
    match found {
        Some(Ok(i)) => Ok(pods.into_iter().nth(i).ok_or_else(|| CtlError::Failed("pod list changed".into()))?),
        Some(Err(e)) => Err(e),
        None => Err(CtlError::NoPod {
            query: query.into(),
            state_dir: state_dir.into(),
            known: if pods.is_empty() {
                "none".into()
            } else {
                pods.iter().map(|p| format!("{} ({})", p.id, p.label())).collect::<Vec<_>>().join(", ")
            },
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::paths::HostPids;

    fn pod(state: &Path, id: &str, name: &str, started: u64) {
        let paths = PodPaths::new(state, id).unwrap();
        std::fs::create_dir_all(&paths.dir).unwrap();
        PodRecord {
            sandbox_id: id.into(),
            pod_name: name.into(),
            pod_namespace: "default".into(),
            containerd_namespace: "k8s.io".into(),
            backend: "namespace".into(),
            shim_pid: 1,
            pids: HostPids::default(),
            started_at_unix: started,
        }
        .write(&paths)
        .unwrap();
    }

    #[test]
    fn pods_are_found_by_id_prefix_or_name() {
        let dir = tempfile::tempdir().unwrap();
        pod(dir.path(), "abc123", "web", 2);
        pod(dir.path(), "abd456", "db", 1);
        std::fs::create_dir(dir.path().join("starting")).unwrap();
        let ids: Vec<String> = list(dir.path()).unwrap().into_iter().map(|p| p.id).collect();
        assert_eq!(ids, ["abd456", "abc123", "starting"], "oldest first, unrecorded last");
        assert_eq!(find(dir.path(), "abc123").unwrap().id, "abc123");
        assert_eq!(find(dir.path(), "abd").unwrap().id, "abd456");
        assert_eq!(find(dir.path(), "web").unwrap().id, "abc123");
        assert_eq!(find(dir.path(), "default/db").unwrap().id, "abd456");
        let ambiguous = find(dir.path(), "ab").err().unwrap().to_string();
        assert!(ambiguous.contains("default/web") && ambiguous.contains("default/db"), "{ambiguous}");
        let missing = find(dir.path(), "nope").err().unwrap().to_string();
        assert!(missing.contains("abc123 (default/web)"), "{missing}");
    }

    #[test]
    fn a_missing_state_dir_has_no_pods() {
        assert!(list(Path::new("/nonexistent/bulkhead")).unwrap().is_empty());
        let err = find(Path::new("/nonexistent/bulkhead"), "x").err().unwrap().to_string();
        assert!(err.contains("known: none"), "{err}");
    }
}
