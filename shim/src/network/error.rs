//! The network module's one error type, which its children and callers share.

use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("network namespace {path}: {source}")]
    Netns { path: PathBuf, source: std::io::Error },
    #[error("netlink: {what}: {message}")]
    Netlink { what: String, errno: Option<i32>, message: String },
    #[error("tap {name}: {what}: {source}")]
    Tap { name: String, what: &'static str, source: std::io::Error },
    #[error("pod network: {0}")]
    Unsupported(String),
    #[error("network record {path}: {message}")]
    Record { path: PathBuf, message: String },
    #[error("pod network: {what}: not done within {limit:?}")]
    Timeout { what: &'static str, limit: Duration },
    #[error("pod network: {0}")]
    Thread(String),
}

impl NetworkError {
    pub(super) fn netlink(what: String, e: rtnetlink::Error) -> Self {
        let errno = match &e {
            rtnetlink::Error::NetlinkError(m) => Some(-m.raw_code()),
            _ => None,
        };
        Self::Netlink { what, errno, message: e.to_string() }
    }
}
