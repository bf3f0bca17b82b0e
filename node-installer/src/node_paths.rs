//! Where things live. Two roots, because the installer and containerd see the host through different paths:
//! `host_root` is where the installer reaches the host's `/` (the DaemonSet mounts it at /host), `view_root` is
//! the same tree as containerd sees it (`/` on a real node). Paths written into containerd's config use the view.

use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

/// Handler name in the CRI config and the RuntimeClass.
pub const HANDLER: &str = "bulkhead";
pub const SHIM_BINARY: &str = "containerd-shim-bulkhead-v2";
pub const SHIM_CONFIG: &str = "config.toml";
pub const CTL_BINARY: &str = "bulkhead-ctl";
/// The link under the prefix that names the version new pods get.
pub const CURRENT: &str = "current";
/// Under the prefix, beside the version directories: the installer's own state.
pub const STATE: &str = "state";
/// The shims' default `state_dir` (one directory per pod), as the node sees it.
pub const SHIM_STATE_DIR: &str = "/run/bulkhead";
/// The config the shim reads when containerd names none (the shim's `INSTALLED_CONFIG_PATH`: a test holds
/// them equal).
pub const SHIM_DEFAULT_CONFIG: &str = "/opt/bulkhead/current/config.toml";

#[derive(Clone, Debug)]
pub struct NodePaths {
    pub host_root: PathBuf,
    pub view_root: PathBuf,
    /// containerd's main config, as a host path (e.g. /etc/containerd/config.toml).
    pub containerd_config: PathBuf,
    /// Install prefix, as a host path (e.g. /opt/bulkhead).
    pub prefix: PathBuf,
    /// procfs of the host's PID namespace, where the installer sees which processes execute installed files. The
    /// installer's own `/proc`, not one under `host_root`: the DaemonSet runs with `hostPID`, and a scratch node in
    /// the tests has only a fake `proc/cpuinfo`.
    pub proc_dir: PathBuf,
}

impl NodePaths {
    pub fn new(host_root: impl Into<PathBuf>, view_root: impl Into<PathBuf>) -> Self {
        Self {
            host_root: host_root.into(),
            view_root: view_root.into(),
            containerd_config: PathBuf::from("/etc/containerd/config.toml"),
            prefix: PathBuf::from("/opt/bulkhead"),
            proc_dir: PathBuf::from("/proc"),
        }
    }

    /// A host path (absolute, as on the node) seen from the installer.
    pub fn host(&self, p: &Path) -> PathBuf {
        self.host_root.join(strip_root(p))
    }

    /// A host path as containerd sees it.
    pub fn view(&self, p: &Path) -> PathBuf {
        self.view_root.join(strip_root(p))
    }

    /// Map a path containerd knows (from its config) back to where the installer sees it.
    pub fn host_from_view(&self, p: &Path) -> Option<PathBuf> {
        p.strip_prefix(&self.view_root).ok().map(|rel| self.host_root.join(rel))
    }

    pub fn install_dir(&self) -> PathBuf {
        self.host(&self.prefix)
    }

    pub fn state_dir(&self) -> PathBuf {
        self.install_dir().join(STATE)
    }

    /// `<prefix>/<version>`, as the installer sees it.
    pub fn version_dir(&self, version: &str) -> PathBuf {
        self.install_dir().join(version)
    }

    pub fn current_link(&self) -> PathBuf {
        self.install_dir().join(CURRENT)
    }

    /// Where the installer's lock lives: the host's /run (tmpfs), so a refused node keeps no
    /// trace of it and a reboot starts unlocked.
    pub fn lock_dir(&self) -> PathBuf {
        self.host(Path::new("/run/bulkhead"))
    }

    pub fn config_file(&self) -> PathBuf {
        self.host(&self.containerd_config)
    }

    /// The shim as containerd execs it: through `current`, never a version directory. containerd keeps this path
    /// for the life of every task (the bundle's `shim-binary-path`) and runs it again long after the pod started:
    /// `start` for each later container of the pod (which answers with the running shim's address), `delete` to
    /// clean up after the shim exits or dies, and a check that it still exists when containerd restarts (a
    /// missing binary makes containerd drop the task). `current` exists for as long as bulkhead is installed,
    /// whichever versions have been collected, so those calls keep working for pods of every version; and an
    /// update leaves the drop-in unchanged, so it needs no containerd restart. The price: `start` and `delete` of
    /// an older pod run the newer release's binary (as with any shim a package manager replaces in place).
    pub fn view_shim(&self) -> PathBuf {
        self.view(&self.prefix.join(CURRENT).join(SHIM_BINARY))
    }

    /// `bulkhead-ctl` of the current release, as the host runs it.
    pub fn view_ctl(&self) -> PathBuf {
        self.view(&self.prefix.join(CURRENT).join(CTL_BINARY))
    }

    /// The shim config as containerd passes it (`ConfigPath`), through `current` for the same reasons: the CRI
    /// plugin passes it on every container create, from the config it has now, so new pods read the newest
    /// release's config. The file itself names its files by version directory ([`crate::artifacts`]).
    pub fn view_shim_config(&self) -> PathBuf {
        self.view(&self.prefix.join(CURRENT).join(SHIM_CONFIG))
    }
}

fn strip_root(p: &Path) -> PathBuf {
    p.components().filter(|c| matches!(c, Component::Normal(_))).collect()
}

/// A version names a directory under the prefix; keep it a plain name.
pub fn check_version(v: &str) -> Result<()> {
    let ok = !v.is_empty()
        && v.len() <= 64
        && !v.starts_with('.')
        && v != CURRENT
        && v != STATE
        && v.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | '+'));
    if ok {
        Ok(())
    } else {
        Err(Error::Setting(format!("version {v:?} must be a plain name ([A-Za-z0-9.+_-], not current/state)")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_and_view_paths() {
        let l = NodePaths::new("/host", "/");
        assert_eq!(l.config_file(), PathBuf::from("/host/etc/containerd/config.toml"));
        assert_eq!(l.view_shim(), PathBuf::from("/opt/bulkhead/current/containerd-shim-bulkhead-v2"));
        assert_eq!(
            l.host_from_view(Path::new("/etc/containerd/conf.d")),
            Some(PathBuf::from("/host/etc/containerd/conf.d"))
        );
    }

    #[test]
    fn versions_are_plain_names() {
        assert!(check_version("0.1.0+abc").is_ok());
        for bad in ["", "../x", "a/b", "current", "state", ".hidden"] {
            assert!(check_version(bad).is_err(), "{bad}");
        }
    }
}
