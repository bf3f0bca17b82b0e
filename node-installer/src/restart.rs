//! Restarting containerd. Behind a trait so tests restart their own containerd process instead of systemd's.

use std::time::Duration;

use crate::error::{Error, Result};

pub trait Restarter: Send + Sync {
    fn restart(&self) -> Result<()>;
}

/// Runs a command (default `systemctl restart containerd`, reached through `nsenter` into the host's namespaces
/// by the DaemonSet's configured command).
pub struct CommandRestarter {
    pub argv: Vec<String>,
    /// A restart command still running after this is killed and counts as failed ([`crate::bounded`]).
    pub timeout: Duration,
}

/// How long `systemctl restart containerd` may take.
pub const RESTART_TIMEOUT: Duration = Duration::from_secs(120);

impl CommandRestarter {
    pub fn parse(cmd: &str) -> Result<Self> {
        let argv: Vec<String> = cmd.split_whitespace().map(str::to_string).collect();
        if argv.is_empty() {
            return Err(Error::Setting("restart command is empty".into()));
        }
        Ok(Self { argv, timeout: RESTART_TIMEOUT })
    }
}

impl Restarter for CommandRestarter {
    fn restart(&self) -> Result<()> {
        tracing::info!(command = ?self.argv, "restarting containerd");
        let done = crate::bounded::run(&self.argv, self.timeout, false).map_err(Error::Restart)?;
        if done.status.success() {
            Ok(())
        } else {
            Err(Error::Restart(format!("{:?} exited with {}", self.argv, done.status)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_hung_restart_command_is_killed_at_its_timeout() {
        let mut r = CommandRestarter::parse("sleep 30").unwrap();
        r.timeout = Duration::from_millis(300);
        let started = Instant::now();
        let err = r.restart().unwrap_err();
        assert!(err.to_string().contains("did not finish within"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(CommandRestarter::parse("true").unwrap().restart().is_ok());
        assert!(CommandRestarter::parse("false").unwrap().restart().is_err());
    }
}
