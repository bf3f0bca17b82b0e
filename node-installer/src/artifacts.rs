//! Copy the image's artifacts to `<prefix>/<version>/` and flip `<prefix>/current` to it.
//!
//! Each file is written to a temp name, fsynced and renamed, and the `current` symlink is replaced by rename, so
//! containerd never execs a half-written shim and an upgrade switches all files at once. Older version directories
//! stay: pods started from them still run their files (`versions` removes them once nothing does).

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{io, Error, Result};
use crate::failpoint::FailPoints;
use crate::fsutil;
use crate::node_paths::{NodePaths, SHIM_BINARY, SHIM_CONFIG};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// Without it nothing can work: the install fails.
    Required,
    /// Needed by the `vm` backend: a missing one is reported and blocks the node label.
    VmBackend,
    /// Shipped when the image carries it; otherwise the installer writes a default.
    Optional,
    /// For operators and the `namespace` backend (dev/CI): copied when the image carries it;
    /// nothing in the install depends on it.
    Tool,
}

#[derive(Clone, Copy, Debug)]
pub struct Artifact {
    pub name: &'static str,
    pub mode: u32,
    pub need: Need,
}

/// The artifact directory of the image holds these names, flat; they land flat in `<prefix>/<version>/`.
pub const ARTIFACTS: &[Artifact] = &[
    Artifact { name: SHIM_BINARY, mode: 0o755, need: Need::Required },
    Artifact { name: "bulkhead-vmm", mode: 0o755, need: Need::VmBackend },
    Artifact { name: "virtiofsd", mode: 0o755, need: Need::VmBackend },
    Artifact { name: "vmlinux", mode: 0o644, need: Need::VmBackend },
    Artifact { name: "initramfs.cpio.gz", mode: 0o644, need: Need::VmBackend },
    Artifact { name: SHIM_CONFIG, mode: 0o644, need: Need::Optional },
    Artifact { name: "bulkhead-ctl", mode: 0o755, need: Need::Tool },
    Artifact { name: "bulkhead-agent", mode: 0o755, need: Need::Tool },
];

#[derive(Debug, Default)]
pub struct CopyReport {
    pub changed: bool,
    /// `VmBackend` artifacts the image did not carry.
    pub missing: Vec<&'static str>,
}

pub fn install(layout: &NodePaths, src: &Path, version: &str, fp: &FailPoints) -> Result<CopyReport> {
    let root = layout.install_dir();
    let dir = root.join(version);
    fs::create_dir_all(&dir).map_err(io("create dir", &dir))?;
    fsutil::clean_temps(&dir)?;
    fsutil::clean_temps(&root)?;
    let mut report = CopyReport::default();
    for a in ARTIFACTS {
        let from = src.join(a.name);
        let to = dir.join(a.name);
        if !from.exists() {
            match a.need {
                Need::Required => return Err(Error::MissingArtifact { name: a.name, dir: src.to_path_buf() }),
                Need::VmBackend => {
                    tracing::warn!(artifact = a.name, src = %src.display(), "artifact missing from image; vm backend unavailable");
                    report.missing.push(a.name);
                }
                Need::Tool => tracing::info!(artifact = a.name, src = %src.display(), "tool not in image; skipped"),
                Need::Optional => {
                    let text = default_shim_config(layout, version);
                    if fsutil::read_opt(&to)?.as_deref() != Some(text.as_bytes()) {
                        fsutil::atomic_write(&to, text.as_bytes(), a.mode, fp)?;
                        tracing::info!(artifact = a.name, dest = %to.display(), "wrote default shim config");
                        report.changed = true;
                    }
                }
            }
            continue;
        }
        if fsutil::same_file_content(&from, &to, a.mode)? {
            tracing::info!(artifact = a.name, dest = %to.display(), "artifact up to date");
            continue;
        }
        fsutil::atomic_copy(&from, &to, a.mode, fp)?;
        tracing::info!(artifact = a.name, dest = %to.display(), "artifact installed");
        report.changed = true;
    }
    fp.check("artifacts-copied")?;

    let link = root.join("current");
    let target = PathBuf::from(version);
    if fs::read_link(&link).ok().as_deref() == Some(target.as_path()) {
        tracing::info!(link = %link.display(), version, "current symlink up to date");
    } else {
        fsutil::atomic_symlink(&target, &link)?;
        tracing::info!(link = %link.display(), version, "current symlink flipped");
        report.changed = true;
    }
    fp.check("symlink-flipped")?;
    Ok(report)
}

/// Shim config used when the image ships none, in the shim's own keys (a test parses it with the shim's parser).
///
/// The file is reached through `current` (containerd's `ConfigPath`), but the files it names are in this version's
/// own directory, never `current`: a sandbox reads the config once, at its Create, and so gets the VMM, kernel,
/// initramfs and virtiofsd of one release, even if `current` switches while it starts (the shim resolves each path
/// on its own, so `current/...` could pair a VMM of one release with a kernel of the next). The running VM then
/// holds those files by these paths, which is what keeps the version in use (`usage`) until the pod ends.
/// virtiofsd sits beside the VMM.
pub fn default_shim_config(layout: &NodePaths, version: &str) -> String {
    let d = layout.view(&layout.prefix.join(version));
    format!(
        "# Written by bulkhead-node-installer {version}. Ship config.toml in the image to override.\n\
         backend = \"vm\"\n\n[vm]\nvmm_path = \"{d}/bulkhead-vmm\"\nkernel_path = \"{d}/vmlinux\"\n\
         initramfs_path = \"{d}/initramfs.cpio.gz\"\nvirtiofsd_path = \"{d}/virtiofsd\"\n",
        d = d.display()
    )
}

/// Remove everything under the prefix (artifacts, state). Idempotent.
pub fn remove_all(layout: &NodePaths) -> Result<()> {
    let root = layout.install_dir();
    match fs::remove_dir_all(&root) {
        Ok(()) => {
            tracing::info!(path = %root.display(), "removed install directory");
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io("remove dir", &root)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_shim_config_is_read_by_the_shims_parser() {
        let layout = NodePaths::new("/host", "/");
        let text = default_shim_config(&layout, "1.2.3");
        let config = bulkhead_shim::config::Config::parse(Path::new("config.toml"), &text).unwrap();
        assert_eq!(config.backend, bulkhead_shim::config::Backend::Vm);
        assert_eq!(config.vm.vmm_path, PathBuf::from("/opt/bulkhead/1.2.3/bulkhead-vmm"));
        assert_eq!(config.vm.kernel_path, PathBuf::from("/opt/bulkhead/1.2.3/vmlinux"));
        assert_eq!(config.vm.initramfs_path, PathBuf::from("/opt/bulkhead/1.2.3/initramfs.cpio.gz"));
    }
}
