//! Named fail points, so tests can stop an install or uninstall at any step and prove that a rerun converges.
//!
//! Production never sets one. `Error` mode returns `Error::Interrupted` (library tests); `Abort` mode aborts the
//! process on the spot (binary tests: the closest thing to `kill -9` at a known instant).

use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailMode {
    Error,
    Abort,
}

#[derive(Clone, Debug, Default)]
pub struct FailPoints {
    armed: Option<(String, FailMode)>,
}

impl FailPoints {
    pub fn none() -> Self {
        Self::default()
    }

    pub fn arm(name: impl Into<String>, mode: FailMode) -> Self {
        Self { armed: Some((name.into(), mode)) }
    }

    /// Reads `BULKHEAD_INSTALLER_FAILPOINT=<name>` (abort mode) for process-level tests.
    pub fn from_env() -> Self {
        match std::env::var("BULKHEAD_INSTALLER_FAILPOINT") {
            Ok(name) if !name.is_empty() => Self::arm(name, FailMode::Abort),
            _ => Self::none(),
        }
    }

    pub fn check(&self, name: &str) -> Result<()> {
        match &self.armed {
            Some((armed, mode)) if armed == name => {
                tracing::warn!(failpoint = name, "fail point hit");
                match mode {
                    FailMode::Error => Err(Error::Interrupted(name.to_string())),
                    FailMode::Abort => std::process::abort(),
                }
            }
            _ => Ok(()),
        }
    }
}

/// Every fail point the installer checks, in the order an install or uninstall passes them.
pub const ALL: &[&str] = &[
    "artifact-temp-written",
    "artifacts-copied",
    "symlink-flipped",
    "restart-marked",
    "dropin-written",
    "config-backup-written",
    "config-written",
    "restarted",
    "labelled",
    "uninstall-label-removed",
    "uninstall-dropin-removed",
    "uninstall-config-restored",
    "uninstall-restarted",
];
