//! Restoring a VM from a snapshot: the snapshot directory's layout and the per-run settings a
//! restore takes. A snapshot fixes the VM's shape and guest state; what differs per pod (its
//! sockets, its console log, its disks, its taps, its virtiofsd) comes from the
//! [`RestoreConfig`] of each run; [`restored_config`] puts them in place of the snapshot's.
//!
//! Used two ways: `bulkhead-vmm --restore DIR --restore-config FILE` restores at once (and waits
//! paused for the API's `resume`); `bulkhead-vmm --prepare DIR --api-socket SOCK` does the
//! expensive host work ahead of time and restores on the API's `restore` request, which carries
//! a `RestoreConfig`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::{
    BlockConfig, FsConfig, LinkState, ValidConfig, VmConfigError, VsockConfig, MAX_BLOCK_DEVICES, MAX_CONFIG_BYTES,
    MAX_FS_DEVICES, MAX_NET_DEVICES,
};

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
    /// each pod has its own tap (MAC, MTU and rate limits stay the snapshot's). Their links are
    /// up: a template's NIC that was down comes up, and its guest is told.
    #[serde(default)]
    pub net_taps: Vec<String>,
    /// This run's vhost-user sockets, one per virtio-fs device of the snapshot, in order.
    /// Required when it has any: each pod has its own virtiofsd (tag and queue size stay the
    /// snapshot's).
    #[serde(default)]
    pub fs_sockets: Vec<PathBuf>,
    /// Run the guest as soon as it is restored, instead of waiting paused for the API's
    /// `resume`: for a caller with nothing to do in between (the shim), it saves the round trip.
    #[serde(default)]
    pub resume: bool,
}

impl RestoreConfig {
    pub fn from_json(text: &str) -> Result<Self, VmConfigError> {
        if text.len() as u64 > MAX_CONFIG_BYTES {
            return Err(VmConfigError::TooLarge);
        }
        Ok(serde_json::from_str(text)?)
    }

    pub fn from_file(path: &Path) -> Result<Self, VmConfigError> {
        Self::from_json(&crate::config::read_document(path)?)
    }

    /// Checks what can be checked without the snapshot: paths and counts.
    pub fn validate(&self) -> Result<(), VmConfigError> {
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
            return Err(VmConfigError::TooManyBlock(self.block.len()));
        }
        for b in &self.block {
            crate::config::readable_file("block device", &b.path)?;
        }
        if self.net_taps.len() > MAX_NET_DEVICES {
            return Err(VmConfigError::Net(format!("at most {MAX_NET_DEVICES} taps, got {}", self.net_taps.len())));
        }
        for tap in &self.net_taps {
            crate::config::check_tap_name(tap)?;
        }
        if self.fs_sockets.len() > MAX_FS_DEVICES {
            return Err(VmConfigError::Fs(format!("at most {MAX_FS_DEVICES} sockets, got {}", self.fs_sockets.len())));
        }
        for socket in &self.fs_sockets {
            crate::config::parent_dir_exists("fs socket", socket)?;
        }
        Ok(())
    }
}

/// Why a run's settings do not fit the snapshot: `what` names the device kind.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[error("restoring {what}: {reason}")]
pub struct RestoreMismatch {
    pub what: &'static str,
    pub reason: String,
}

/// The snapshot's config with this run's settings in place of the snapshot's: its API socket and
/// serial log, its vsock socket (the snapshot's CID), its disks (or the snapshot's, if it names
/// none), its taps with their links up and its virtiofsd sockets (the snapshot's MAC, MTU,
/// limits, tags and queue sizes). Plain data: the devices check the rest (disk sizes, features)
/// when they restore.
pub fn restored_config(saved: &ValidConfig, run: &RestoreConfig) -> Result<ValidConfig, RestoreMismatch> {
    let mismatch = |what, reason: String| RestoreMismatch { what, reason };
    let mut cfg = saved.clone();
    cfg.api_socket = run.api_socket.clone();
    cfg.serial_log = run.serial_log.clone();
    cfg.vsock = match (&saved.vsock, &run.vsock_uds_path) {
        (Some(v), Some(uds_path)) => Some(VsockConfig { uds_path: uds_path.clone(), guest_cid: v.guest_cid }),
        (Some(_), None) => {
            return Err(mismatch(
                "vsock",
                "the snapshot has a vsock device: the run must name its own vsock_uds_path".into(),
            ))
        }
        (None, Some(_)) => return Err(mismatch("vsock", "the snapshot has no vsock device".into())),
        (None, None) => None,
    };
    if !run.block.is_empty() {
        if run.block.len() != saved.block.len() {
            let reason = format!("the run names {} disks, the snapshot has {}", run.block.len(), saved.block.len());
            return Err(mismatch("block", reason));
        }
        cfg.block = run.block.clone();
    }
    // Each pod has its own taps and its own virtiofsd: the run names every one.
    if run.net_taps.len() != saved.net.len() {
        let reason =
            format!("the run names {} taps, the snapshot has {} net devices", run.net_taps.len(), saved.net.len());
        return Err(mismatch("net", reason));
    }
    for (net, tap) in cfg.net.iter_mut().zip(&run.net_taps) {
        net.tap = tap.clone();
        net.link = LinkState::Up;
    }
    if run.fs_sockets.len() != saved.fs.len() {
        let reason = format!(
            "the run names {} fs sockets, the snapshot has {} fs devices",
            run.fs_sockets.len(),
            saved.fs.len()
        );
        return Err(mismatch("fs", reason));
    }
    cfg.fs = saved
        .fs
        .iter()
        .zip(&run.fs_sockets)
        .map(|(f, socket)| FsConfig { socket: socket.clone(), ..f.clone() })
        .collect();
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{BootSource, NetConfig, RawFormat, RawGuestConfig};

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

    fn saved(vsock: bool, disks: usize) -> ValidConfig {
        saved_with(vsock, disks, vec![], vec![])
    }

    fn saved_with(vsock: bool, disks: usize, fs: Vec<FsConfig>, net: Vec<NetConfig>) -> ValidConfig {
        ValidConfig {
            boot: BootSource::Raw(RawGuestConfig { image: "/g".into(), format: RawFormat::Elf, load_addr: 0x10_0000 }),
            vcpus: 1,
            mem_bytes: 32 << 20,
            serial_log: Some("/old/serial".into()),
            vsock: vsock.then(|| VsockConfig { uds_path: "/old/v.sock".into(), guest_cid: 7 }),
            block: (0..disks).map(|i| BlockConfig { path: format!("/old/disk{i}").into(), read_only: false }).collect(),
            fs,
            net,
            api_socket: Some("/old/api".into()),
            balloon: None,
        }
    }

    #[test]
    fn run_settings_replace_the_snapshots() {
        let run = RestoreConfig {
            api_socket: Some("/new/api".into()),
            serial_log: None,
            vsock_uds_path: Some("/new/v.sock".into()),
            block: vec![BlockConfig { path: "/new/disk".into(), read_only: false }],
            ..Default::default()
        };
        let cfg = restored_config(&saved(true, 1), &run).unwrap();
        assert_eq!(cfg.api_socket, run.api_socket);
        assert_eq!(cfg.serial_log, None, "no log unless the run names one");
        assert_eq!(cfg.vsock, Some(VsockConfig { uds_path: "/new/v.sock".into(), guest_cid: 7 }));
        assert_eq!(cfg.block, run.block);
        let keep = RestoreConfig { vsock_uds_path: Some("/x".into()), ..Default::default() };
        assert_eq!(restored_config(&saved(true, 1), &keep).unwrap().block, saved(true, 1).block);
    }

    #[test]
    fn run_settings_that_do_not_fit_the_snapshot_are_refused() {
        let e = |cfg: ValidConfig, run: RestoreConfig| restored_config(&cfg, &run).unwrap_err().to_string();
        assert!(e(saved(true, 0), RestoreConfig::default()).contains("vsock_uds_path"));
        let stray = RestoreConfig { vsock_uds_path: Some("/x".into()), ..Default::default() };
        assert!(e(saved(false, 0), stray).contains("no vsock"));
        let two =
            RestoreConfig { block: vec![BlockConfig { path: "/a".into(), read_only: false }; 2], ..Default::default() };
        assert!(e(saved(false, 1), two).contains("2 disks"));
    }

    fn fs_and_net() -> (Vec<FsConfig>, Vec<NetConfig>) {
        let fs = FsConfig { tag: "rootfs".into(), socket: "/old/fs.sock".into(), queue_size: 512 };
        let net = NetConfig {
            tap: "tap-old".into(),
            mac: "02:00:00:00:00:01".into(),
            mtu: Some(1500),
            rate_limiter: None,
            link: LinkState::Down,
        };
        (vec![fs], vec![net])
    }

    #[test]
    fn each_run_names_its_own_taps_and_virtiofsd_sockets() {
        let (fs, net) = fs_and_net();
        let snapshot = saved_with(false, 0, fs.clone(), net.clone());
        let run = RestoreConfig {
            net_taps: vec!["tap-new".into()],
            fs_sockets: vec!["/new/fs.sock".into()],
            ..Default::default()
        };
        let cfg = restored_config(&snapshot, &run).unwrap();
        let raised = NetConfig { tap: "tap-new".into(), link: LinkState::Up, ..net[0].clone() };
        assert_eq!(cfg.net, vec![raised], "MAC, MTU, limits kept; the template's link comes up on the run's tap");
        assert_eq!(cfg.fs, vec![FsConfig { socket: "/new/fs.sock".into(), ..fs[0].clone() }], "tag, queue size kept");

        let e = |run: RestoreConfig| restored_config(&snapshot, &run).unwrap_err().to_string();
        assert!(e(RestoreConfig { fs_sockets: run.fs_sockets.clone(), ..Default::default() }).contains("0 taps"));
        assert!(e(RestoreConfig { net_taps: run.net_taps.clone(), ..Default::default() }).contains("0 fs sockets"));
        let stray = RestoreConfig { net_taps: vec!["tap-x".into()], ..Default::default() };
        assert!(restored_config(&saved(false, 0), &stray).unwrap_err().to_string().contains("1 taps"));
    }
}
