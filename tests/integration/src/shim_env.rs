//! The one setup every end-to-end file starts from. [`Setup::new`] makes the checks that say
//! whether a test can run here (root, tools, its containerd, the workspace binaries it needs: one
//! `SKIPPED` line when not), a fresh state dir under /run for the shim and a config dir; the file
//! writes its shim configs there and picks its handlers; [`Setup::start`] then starts a private
//! containerd with them and connects its CRI client. What the pods do is the file's own.

use std::path::{Path, PathBuf};

use anyhow::Result;
use k8s_cri::v1 as cri;
use tempfile::TempDir;

use crate::{pod_config, skip, skip_if_unready_on, workspace_bin};
use crate::{Containerd, ContainerdConfig, ContainerdVersion, Cri};

/// A test that may run here: its directories made, containerd not started yet.
pub struct Setup {
    version: ContainerdVersion,
    state_dir: TempDir,
    config_dir: TempDir,
}

impl Setup {
    /// `None`, after one `SKIPPED` line, when `test` cannot run here on containerd `version` or
    /// one of the workspace binaries in `bins` is not built.
    pub fn new(test: &str, version: ContainerdVersion, bins: &[&str]) -> Result<Option<Self>> {
        Self::new_in(test, version, bins, Path::new("/run"))
    }

    /// [`Setup::new`] with the state dir made in `parent` (a filesystem of the test's own) rather
    /// than in /run.
    pub fn new_in(test: &str, version: ContainerdVersion, bins: &[&str], parent: &Path) -> Result<Option<Self>> {
        if skip_if_unready_on(test, version) {
            return Ok(None);
        }
        for bin in bins {
            let path = workspace_bin(bin);
            if !path.is_file() {
                let why = format!("{} is not built (run `cargo build --workspace`)", path.display());
                skip::missing_prerequisite(test, &why);
                return Ok(None);
            }
        }
        // Short: the agents' and VMs' Unix sockets live below it (108 bytes of sun_path).
        let state_dir = tempfile::Builder::new().prefix("bh").rand_bytes(4).tempdir_in(parent)?;
        Ok(Some(Self { version, state_dir, config_dir: tempfile::tempdir()? }))
    }

    /// The shim's state dir (each handler may take a directory below it).
    pub fn state(&self) -> &Path {
        self.state_dir.path()
    }

    /// The config dir, for what a test writes beside the shim's configs.
    pub fn config_dir(&self) -> &Path {
        self.config_dir.path()
    }

    /// Writes `text` as `name` in the config dir and returns its path.
    pub fn write_config(&self, name: &str, text: &str) -> Result<PathBuf> {
        let path = self.config_dir.path().join(name);
        std::fs::write(&path, text)?;
        Ok(path)
    }

    /// A namespace-backend shim config (the workspace's agent, state in `state`) as `name`.
    pub fn namespace_config(&self, name: &str, state: &Path) -> Result<PathBuf> {
        self.write_config(name, &crate::guests::namespace_config(state, &workspace_bin("bulkhead-agent")))
    }

    /// Starts containerd (the setup's version) with `config`, and connects to its CRI.
    pub async fn start(self, config: ContainerdConfig) -> Result<ShimEnv> {
        let containerd = Containerd::start(ContainerdConfig { version: self.version, ..config }).await?;
        let cri = containerd.cri().await?;
        Ok(ShimEnv { containerd, cri, state_dir: self.state_dir, config_dir: self.config_dir })
    }
}

/// A running test environment. Fields drop in order: containerd (and its shims and pods) goes
/// before the directories they used.
pub struct ShimEnv {
    pub containerd: Containerd,
    pub cri: Cri,
    pub state_dir: TempDir,
    pub config_dir: TempDir,
}

impl ShimEnv {
    /// A pod config named `name`, its logs in a fresh directory.
    pub fn pod(&self, name: &str) -> Result<cri::PodSandboxConfig> {
        Ok(pod_config(name, &self.containerd.new_log_dir(name)?))
    }

    /// containerd's last `lines` log lines (the shims' lines among them), as an error's context.
    pub fn log_context(&self, lines: usize) -> String {
        format!("containerd log tail:\n{}", self.containerd.log_tail(lines))
    }
}
