//! How `bulkhead-vmm --jail <file>` confines itself before it builds the VM (Firecracker's jailer
//! is the model). The shim writes this document; the VMM applies it as root, then drops to
//! `uid`/`gid` for good. Paths in the VM config are then paths inside the chroot.

use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::bounded::{read_bounded, BoundedReadError};

/// Largest jail document accepted (bytes).
pub const MAX_JAIL_BYTES: u64 = 64 * 1024;
/// Most read-only files a jail exposes (kernel, initramfs, snapshot files...).
pub const MAX_JAIL_FILES: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum JailConfigError {
    #[error("cannot read jail config {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("jail config is larger than {MAX_JAIL_BYTES} bytes")]
    TooLarge,
    #[error("jail config is not valid JSON: {0}")]
    Parse(#[from] serde_json::Error),
    #[error("jail {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct JailConfig {
    /// The pod this VMM serves (logs, names); a plain id.
    pub id: String,
    /// Host directory that becomes the VMM's root. It must exist, be owned by root and hold
    /// nothing but what this VM needs; the VMM adds its device nodes and mounts.
    pub chroot: PathBuf,
    /// Unprivileged user and group the VMM runs as; never 0.
    pub uid: u32,
    pub gid: u32,
    /// Host files bind-mounted read-only into the chroot (kernel, initramfs, snapshot files).
    #[serde(default)]
    pub read_only: Vec<JailFile>,
    /// Directories inside the chroot the VMM may write (sockets, logs, memory files), created
    /// and owned by `uid`/`gid`.
    #[serde(default)]
    pub writable_dirs: Vec<PathBuf>,
    /// The pod's cgroup (a path inside each hierarchy) the VMM joins, so guest memory and CPU
    /// are charged to the pod.
    #[serde(default)]
    pub cgroup: Option<PathBuf>,
    /// The pod's network namespace to join; `None` keeps the current one.
    #[serde(default)]
    pub netns: Option<PathBuf>,
    /// Create `/dev/net/tun` in the chroot (the VM has virtio-net devices).
    #[serde(default)]
    pub tun: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct JailFile {
    /// Absolute path on the host.
    pub host: PathBuf,
    /// Absolute path inside the chroot.
    pub jail: PathBuf,
}

/// Absolute, with only plain components (no `..`, no `.`), and not the root itself.
pub fn plain_absolute(path: &Path) -> bool {
    path.is_absolute()
        && path.components().count() > 1
        && path.components().all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
}

impl JailConfig {
    pub fn from_json(text: &str) -> Result<Self, JailConfigError> {
        if text.len() as u64 > MAX_JAIL_BYTES {
            return Err(JailConfigError::TooLarge);
        }
        let config: Self = serde_json::from_str(text)?;
        config.validate()?;
        Ok(config)
    }

    pub fn from_file(path: &Path) -> Result<Self, JailConfigError> {
        let text = read_bounded(path, MAX_JAIL_BYTES).map_err(|e| match e {
            BoundedReadError::Io(source) => JailConfigError::Read { path: path.to_owned(), source },
            BoundedReadError::TooLarge { .. } => JailConfigError::TooLarge,
        })?;
        Self::from_json(&text)
    }

    /// Checks the document alone; the VMM checks the host side (owners, existence) when applying it.
    pub fn validate(&self) -> Result<(), JailConfigError> {
        let invalid = |field, reason: &str| JailConfigError::Invalid { field, reason: reason.to_string() };
        let id_ok = !self.id.is_empty()
            && self.id.len() <= 128
            && self.id.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            && self.id.as_bytes()[0].is_ascii_alphanumeric();
        if !id_ok {
            return Err(invalid("id", "must be 1-128 characters of [A-Za-z0-9_.-], starting alphanumeric"));
        }
        if !plain_absolute(&self.chroot) {
            return Err(invalid("chroot", "must be an absolute path without `.` or `..`, not /"));
        }
        if self.uid == 0 || self.gid == 0 {
            return Err(invalid("uid/gid", "the VMM must not run as root (uid or gid 0)"));
        }
        if self.read_only.len() > MAX_JAIL_FILES {
            return Err(invalid("read_only", "too many files"));
        }
        for file in &self.read_only {
            if !plain_absolute(&file.host) || !plain_absolute(&file.jail) {
                return Err(invalid("read_only", "paths must be absolute without `.` or `..`"));
            }
        }
        if self.writable_dirs.len() > MAX_JAIL_FILES || !self.writable_dirs.iter().all(|d| plain_absolute(d)) {
            return Err(invalid("writable_dirs", "paths must be absolute without `.` or `..` (at most 16)"));
        }
        if self.cgroup.as_ref().is_some_and(|c| !plain_absolute(c)) {
            return Err(invalid("cgroup", "must be an absolute path without `.` or `..`"));
        }
        if self.netns.as_ref().is_some_and(|n| !n.is_absolute()) {
            return Err(invalid("netns", "must be an absolute path"));
        }
        Ok(())
    }

    /// Where a path inside the jail lives on the host.
    pub fn host_path(&self, jail_path: &Path) -> PathBuf {
        self.chroot.join(jail_path.strip_prefix("/").unwrap_or(jail_path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid() -> JailConfig {
        JailConfig {
            id: "pod-1".into(),
            chroot: "/run/bulkhead/pod-1/vm/root".into(),
            uid: 65534,
            gid: 65534,
            read_only: vec![JailFile { host: "/usr/share/bulkhead/vmlinux".into(), jail: "/vmlinux".into() }],
            writable_dirs: vec!["/run".into()],
            cgroup: Some("/kubepods/pod-uid/pod-1".into()),
            netns: Some("/var/run/netns/cni-1".into()),
            tun: true,
        }
    }

    #[test]
    fn a_valid_jail_round_trips() {
        let jail = valid();
        let json = serde_json::to_string(&jail).unwrap();
        assert_eq!(JailConfig::from_json(&json).unwrap(), jail);
        assert_eq!(jail.host_path(Path::new("/run/v.sock")), PathBuf::from("/run/bulkhead/pod-1/vm/root/run/v.sock"));
    }

    #[test]
    fn root_and_escapes_are_refused() {
        let cases: Vec<(JailConfig, &str)> = vec![
            (JailConfig { uid: 0, ..valid() }, "root"),
            (JailConfig { chroot: "/".into(), ..valid() }, "chroot"),
            (JailConfig { chroot: "/run/../etc".into(), ..valid() }, "chroot"),
            (JailConfig { id: "../x".into(), ..valid() }, "id"),
            (
                JailConfig {
                    read_only: vec![JailFile { host: "/a".into(), jail: "/../etc/passwd".into() }],
                    ..valid()
                },
                "read_only",
            ),
            (JailConfig { cgroup: Some("/a/../../b".into()), ..valid() }, "cgroup"),
        ];
        for (jail, needle) in cases {
            let err = jail.validate().unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
        assert!(JailConfig::from_json(r#"{"id":"a","chroot":"/r","uid":1,"gid":1,"extra":1}"#).is_err());
    }
}
