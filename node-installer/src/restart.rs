//! Restarting containerd. Behind a trait so tests restart their own containerd process instead of systemd's.

use crate::error::{Error, Result};

pub trait Restarter: Send + Sync {
    fn restart(&self) -> Result<()>;
}

/// Runs a command (default `systemctl restart containerd`, reached through `nsenter` into the host's namespaces
/// by the DaemonSet's configured command).
pub struct CommandRestarter {
    pub argv: Vec<String>,
}

impl CommandRestarter {
    pub fn parse(cmd: &str) -> Result<Self> {
        let argv: Vec<String> = cmd.split_whitespace().map(str::to_string).collect();
        if argv.is_empty() {
            return Err(Error::Setting("restart command is empty".into()));
        }
        Ok(Self { argv })
    }
}

impl Restarter for CommandRestarter {
    fn restart(&self) -> Result<()> {
        tracing::info!(command = ?self.argv, "restarting containerd");
        let status = std::process::Command::new(&self.argv[0])
            .args(&self.argv[1..])
            .status()
            .map_err(|e| Error::Restart(format!("{:?}: {e}", self.argv)))?;
        if status.success() {
            Ok(())
        } else {
            Err(Error::Restart(format!("{:?} exited with {status}", self.argv)))
        }
    }
}
