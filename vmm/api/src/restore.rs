//! Restoring a VM from a snapshot: the snapshot directory's layout and the per-run settings a
//! restore takes. A snapshot fixes the VM's shape and guest state; what differs per pod (its
//! sockets, its console log, its disks, its taps, its virtiofsd) comes from the
//! [`RestoreConfig`] of each run.
//!
//! Used two ways: `bulkhead-vmm --restore DIR --restore-config FILE` restores at once (and waits
//! paused for the API's `resume`); `bulkhead-vmm --prepare DIR --api-socket SOCK` does the
//! expensive host work ahead of time and restores on the API's `restore` request, which carries
//! a `RestoreConfig`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::{BlockConfig, ConfigError, MAX_BLOCK_DEVICES, MAX_CONFIG_BYTES, MAX_FS_DEVICES, MAX_NET_DEVICES};

/// The state file (versioned, checksummed) inside a snapshot directory.
pub const STATE_FILE: &str = "state";
/// The guest memory file inside a snapshot directory; restores map it private and never write it.
pub const MEMORY_FILE: &str = "memory";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct RestoreConfig {
    /// The API socket of this run (`--prepare` takes it on the command line instead).
    #[serde(default)]
    pub api_socket: Option<PathBuf>,
    /// Where this run's 8250 output goes; without it, serial output is dropped.
    #[serde(default)]
    pub serial_log: Option<PathBuf>,
    /// This run's hybrid-vsock socket. Required when the snapshot has a vsock device: two VMs
    /// cannot listen on one path.
    #[serde(default)]
    pub vsock_uds_path: Option<PathBuf>,
    /// This run's disks, one per disk of the snapshot, same sizes and read-only flags. Empty
    /// means the snapshot's own paths.
    #[serde(default)]
    pub block: Vec<BlockConfig>,
    /// This run's taps, one per net device of the snapshot, in order. Required when it has any:
    /// each pod has its own tap (MAC, MTU and rate limits stay the snapshot's).
    #[serde(default)]
    pub net_taps: Vec<String>,
    /// This run's vhost-user sockets, one per virtio-fs device of the snapshot, in order.
    /// Required when it has any: each pod has its own virtiofsd (tag and queue size stay the
    /// snapshot's).
    #[serde(default)]
    pub fs_sockets: Vec<PathBuf>,
}

impl RestoreConfig {
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        if text.len() as u64 > MAX_CONFIG_BYTES {
            return Err(ConfigError::TooLarge);
        }
        Ok(serde_json::from_str(text)?)
    }

    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        Self::from_json(&crate::config::read_document(path)?)
    }

    /// Checks what can be checked without the snapshot: paths and counts.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (what, p) in [
            ("api_socket", &self.api_socket),
            ("serial_log", &self.serial_log),
            ("vsock uds_path", &self.vsock_uds_path),
        ] {
            if let Some(p) = p {
                crate::config::parent_dir_exists(what, p)?;
            }
        }
        if self.block.len() > MAX_BLOCK_DEVICES {
            return Err(ConfigError::TooManyBlock(self.block.len()));
        }
        for b in &self.block {
            crate::config::readable_file("block device", &b.path)?;
        }
        if self.net_taps.len() > MAX_NET_DEVICES {
            return Err(ConfigError::Net(format!("at most {MAX_NET_DEVICES} taps, got {}", self.net_taps.len())));
        }
        for tap in &self.net_taps {
            crate::config::check_tap_name(tap)?;
        }
        if self.fs_sockets.len() > MAX_FS_DEVICES {
            return Err(ConfigError::Fs(format!("at most {MAX_FS_DEVICES} sockets, got {}", self.fs_sockets.len())));
        }
        for socket in &self.fs_sockets {
            crate::config::parent_dir_exists("fs socket", socket)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_validates() {
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("disk");
        std::fs::write(&disk, [0u8; 512]).unwrap();
        let json = format!(
            r#"{{"api_socket":"{d}/api","serial_log":"{d}/serial","vsock_uds_path":"{d}/v.sock","block":[{{"path":"{p}"}}],"net_taps":["tap7"],"fs_sockets":["{d}/fs.sock"]}}"#,
            d = dir.path().display(),
            p = disk.display()
        );
        let c = RestoreConfig::from_json(&json).unwrap();
        c.validate().unwrap();
        assert_eq!(c.block[0].path, disk);
        assert_eq!((c.net_taps[0].as_str(), c.fs_sockets[0].clone()), ("tap7", dir.path().join("fs.sock")));
        assert_eq!(RestoreConfig::from_json("{}").unwrap(), RestoreConfig::default());
    }

    #[test]
    fn bad_run_settings_are_refused() {
        assert!(RestoreConfig::from_json(r#"{"vcpus":2}"#).is_err(), "the shape comes from the snapshot");
        let c = RestoreConfig { serial_log: Some("/nonexistent/dir/log".into()), ..Default::default() };
        assert!(c.validate().unwrap_err().to_string().contains("serial_log"));
        let c = RestoreConfig {
            block: vec![BlockConfig { path: "/nonexistent".into(), read_only: false }],
            ..Default::default()
        };
        assert!(c.validate().is_err());
        let c = RestoreConfig { net_taps: vec!["a/b".into()], ..Default::default() };
        assert!(c.validate().unwrap_err().to_string().contains("tap name"));
        let c = RestoreConfig { fs_sockets: vec!["/nonexistent/dir/fs.sock".into()], ..Default::default() };
        assert!(c.validate().unwrap_err().to_string().contains("fs socket"));
        let c = RestoreConfig { fs_sockets: vec!["/tmp/fs.sock".into(); MAX_FS_DEVICES + 1], ..Default::default() };
        assert!(c.validate().is_err());
    }
}
