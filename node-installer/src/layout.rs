//! Where things live. Two roots, because the installer and containerd see the host through different paths:
//! `host_root` is where the installer reaches the host's `/` (the DaemonSet mounts it at /host), `view_root` is
//! the same tree as containerd sees it (`/` on a real node). Paths written into containerd's config use the view.

use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

/// Handler name in the CRI config and the RuntimeClass.
pub const HANDLER: &str = "bulkhead";
pub const SHIM_BINARY: &str = "containerd-shim-bulkhead-v2";
pub const SHIM_CONFIG: &str = "config.toml";

#[derive(Clone, Debug)]
pub struct Layout {
    pub host_root: PathBuf,
    pub view_root: PathBuf,
    /// containerd's main config, as a host path (e.g. /etc/containerd/config.toml).
    pub containerd_config: PathBuf,
    /// Install prefix, as a host path (e.g. /opt/bulkhead).
    pub prefix: PathBuf,
}

impl Layout {
    pub fn new(host_root: impl Into<PathBuf>, view_root: impl Into<PathBuf>) -> Self {
        Self {
            host_root: host_root.into(),
            view_root: view_root.into(),
            containerd_config: PathBuf::from("/etc/containerd/config.toml"),
            prefix: PathBuf::from("/opt/bulkhead"),
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
        self.install_dir().join("state")
    }

    /// Where the installer's lock lives: the host's /run (tmpfs), so a refused node keeps no
    /// trace of it and a reboot starts unlocked.
    pub fn lock_dir(&self) -> PathBuf {
        self.host(Path::new("/run/bulkhead"))
    }

    pub fn config_file(&self) -> PathBuf {
        self.host(&self.containerd_config)
    }

    /// The shim as containerd will exec it: through the `current` symlink, so upgrades need no config change.
    pub fn view_shim(&self) -> PathBuf {
        self.view(&self.prefix.join("current").join(SHIM_BINARY))
    }

    pub fn view_shim_config(&self) -> PathBuf {
        self.view(&self.prefix.join("current").join(SHIM_CONFIG))
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
        && v != "current"
        && v != "state"
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
        let l = Layout::new("/host", "/");
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
