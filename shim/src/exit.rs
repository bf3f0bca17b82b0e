//! How a process (or the sandbox) ended: the one exit vocabulary of the shim, below everything
//! that reports exits.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitInfo {
    /// runc's convention: the exit status, or 128+signal when signalled.
    pub status: u32,
    pub at: SystemTime,
    pub oom_killed: bool,
}

impl ExitInfo {
    pub fn from_agent(code: u32, at_unix_nanos: i64, oom_killed: bool) -> Self {
        let at =
            if at_unix_nanos > 0 { UNIX_EPOCH + Duration::from_nanos(at_unix_nanos as u64) } else { SystemTime::now() };
        Self { status: code, at, oom_killed }
    }
}
