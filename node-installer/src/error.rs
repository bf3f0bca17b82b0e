//! The installer's one error type. Every variant names what was being done, so a single log line is enough to act on.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A fail point fired (tests only): the run stopped as if the process had been killed there.
    #[error("interrupted at fail point {0}")]
    Interrupted(String),
    #[error("containerd config {path}: {msg}")]
    Config { path: PathBuf, msg: String },
    #[error("required artifact {name} missing from {dir}")]
    MissingArtifact { name: &'static str, dir: PathBuf },
    #[error("invalid setting: {0}")]
    Setting(String),
    #[error("another installer holds {path} (waited {waited:?}); it will be retried")]
    Locked { path: PathBuf, waited: std::time::Duration },
    #[error("restarting containerd: {0}")]
    Restart(String),
    #[error("CRI check: {0}")]
    Cri(String),
    #[error("kubernetes API: {0}")]
    Kube(String),
    /// Uninstall found bulkhead still running. Nothing was changed.
    #[error(
        "refusing to uninstall: {summary}. containerd runs the shim from {shown}/current for their later containers \
         and to clean up after them. Drain them first (delete the pods, or `kubectl drain` the node), or force it \
         with BULKHEAD_FORCE_UNINSTALL=1 (`uninstall --force`): they then keep running, but can start no new \
         container and nothing cleans up after them",
        shown = .prefix.display()
    )]
    InUse { pods: usize, summary: String, prefix: PathBuf },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Shorthand for mapping an io::Error with the operation and path it concerned.
pub fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { op, path, source }
}
