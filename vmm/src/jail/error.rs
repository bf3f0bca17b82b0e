//! The jail's one error type, and the `map_err` its steps share.

use std::path::PathBuf;

use crate::seccomp;

#[derive(Debug, thiserror::Error)]
pub enum JailError {
    /// The host does not offer what the document asks for; nothing was changed.
    #[error("jail refused: {0}")]
    Refused(String),
    #[error("jail path {path}: {reason}")]
    Path { path: PathBuf, reason: String },
    #[error("jail step failed: {what}: {source}")]
    Sys { what: String, source: std::io::Error },
    #[error("the waiter (jailed VMM's parent) is gone")]
    ParentGone,
    /// A privilege survived the drop; the VMM does not go on.
    #[error("privileges not dropped: {0}")]
    NotDropped(String),
    #[error(transparent)]
    Seccomp(#[from] seccomp::SeccompError),
}

/// `map_err` for a failed system call of step `what`.
pub(super) fn sys<E: Into<std::io::Error>>(what: impl Into<String>) -> impl FnOnce(E) -> JailError {
    let what = what.into();
    move |e| JailError::Sys { what, source: e.into() }
}
