//! The host side of a jail document, checked before anything changes: who we are, the chroot
//! directory, the files to expose and the device nodes to copy.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use bulkhead_vmm_api::jail::JailConfig;

use super::JailError;

pub const KVM_DEVICE: &str = "/dev/kvm";
pub const TUN_DEVICE: &str = "/dev/net/tun";

/// What the jail takes from the host, resolved while the host is still visible.
#[derive(Debug)]
pub struct HostFacts {
    /// Device numbers of `/dev/kvm` and, when asked for, `/dev/net/tun`.
    pub kvm: u64,
    pub tun: Option<u64>,
    /// Each read-only file: its canonical host path and its path inside the jail.
    pub read_only: Vec<(PathBuf, PathBuf)>,
}

fn refused(reason: String) -> JailError {
    JailError::Refused(reason)
}

pub fn check_host(jail: &JailConfig) -> Result<HostFacts, JailError> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(refused("the VMM must start as root to jail itself".into()));
    }
    let threads = std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0);
    if threads != 1 {
        return Err(refused(format!("the process must be single-threaded before it forks, it has {threads} threads")));
    }
    check_chroot(&jail.chroot)?;
    let mut read_only = Vec::new();
    for file in &jail.read_only {
        let host = std::fs::canonicalize(&file.host)
            .map_err(|e| refused(format!("read-only file {}: {e}", file.host.display())))?;
        let meta = std::fs::metadata(&host).map_err(|e| refused(format!("read-only file {}: {e}", host.display())))?;
        if !meta.is_file() {
            return Err(refused(format!("read-only file {} is not a regular file", host.display())));
        }
        read_only.push((host, file.jail.clone()));
    }
    if let Some(netns) = &jail.netns {
        std::fs::metadata(netns).map_err(|e| refused(format!("network namespace {}: {e}", netns.display())))?;
    }
    let kvm = char_device(Path::new(KVM_DEVICE))?;
    let tun = if jail.tun { Some(char_device(Path::new(TUN_DEVICE))?) } else { None };
    Ok(HostFacts { kvm, tun, read_only })
}

/// The chroot must be a real directory (not a symlink) that only root can change.
fn check_chroot(chroot: &Path) -> Result<(), JailError> {
    let meta = std::fs::symlink_metadata(chroot).map_err(|e| refused(format!("chroot {}: {e}", chroot.display())))?;
    if !meta.is_dir() {
        return Err(refused(format!("chroot {} is not a directory (symlinks are refused)", chroot.display())));
    }
    if meta.uid() != 0 {
        return Err(refused(format!("chroot {} is owned by uid {}, not root", chroot.display(), meta.uid())));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(refused(format!(
            "chroot {} is writable by group or others (mode {:o})",
            chroot.display(),
            meta.mode() & 0o7777
        )));
    }
    Ok(())
}

fn char_device(path: &Path) -> Result<u64, JailError> {
    let meta = std::fs::metadata(path).map_err(|e| refused(format!("{}: {e}", path.display())))?;
    if !meta.file_type().is_char_device() {
        return Err(refused(format!("{} is not a character device", path.display())));
    }
    Ok(meta.rdev())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn chroot_must_be_a_root_owned_directory_only_root_can_write() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
        let owner_is_root = std::fs::metadata(&root).unwrap().uid() == 0;
        assert_eq!(check_chroot(&root).is_ok(), owner_is_root);

        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = check_chroot(&root).unwrap_err().to_string();
        assert!(err.contains("writable by group or others") || err.contains("not root"), "{err}");

        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&root, &link).unwrap();
        assert!(check_chroot(&link).unwrap_err().to_string().contains("symlinks are refused"));
        assert!(check_chroot(&dir.path().join("missing")).is_err());
    }
}
