//! The host side of a jail document, checked before anything changes: who we are, the chroot
//! directory, the files to expose and the device nodes to copy.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use bulkhead_vmm_api::jail::{JailConfig, JailFile};
use nix::fcntl::{open, openat, OFlag};
use nix::sys::stat::{fstat, Mode, SFlag};

use super::error::JailError;

pub const KVM_DEVICE: &str = "/dev/kvm";
pub const TUN_DEVICE: &str = "/dev/net/tun";

/// What the jail takes from the host, resolved while the host is still visible.
#[derive(Debug)]
pub struct HostFacts {
    /// Device numbers of `/dev/kvm` and, when asked for, `/dev/net/tun`.
    pub kvm: u64,
    pub tun: Option<u64>,
}

/// A host file to bind read-only into the jail, opened (`O_PATH`) while the host is visible:
/// the bind takes this file, whatever its host path names by then.
#[derive(Debug)]
pub struct ReadOnlyFile {
    /// Its host path, for messages.
    pub host: PathBuf,
    pub source: OwnedFd,
    /// Its path inside the jail.
    pub jail: PathBuf,
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
    // Checked here for a clear error before anything changes; opened again for the binds in the
    // child's mount namespace (a bind's source must be a mount of the caller's namespace).
    open_read_only(&jail.read_only, |_| {})?;
    if let Some(netns) = &jail.netns {
        std::fs::metadata(netns).map_err(|e| refused(format!("network namespace {}: {e}", netns.display())))?;
    }
    let kvm = char_device(Path::new(KVM_DEVICE))?;
    let tun = if jail.tun { Some(char_device(Path::new(TUN_DEVICE))?) } else { None };
    Ok(HostFacts { kvm, tun })
}

/// Opens every read-only file through one descriptor of its directory per distinct directory:
/// files that sit together (a snapshot's state and memory) are taken from the same directory
/// even if another process renames a new one into its place meanwhile (a template republished
/// while this VMM starts), so a restore never mixes two builds. The host paths come from root's
/// configuration and may hold symlinks (an installer's `current` link); they are followed.
/// `opened_dir` is called after each directory is opened (tests swap directories there).
pub fn open_read_only(files: &[JailFile], mut opened_dir: impl FnMut(&Path)) -> Result<Vec<ReadOnlyFile>, JailError> {
    let mut dirs: HashMap<&Path, OwnedFd> = HashMap::new();
    let mut opened = Vec::with_capacity(files.len());
    for file in files {
        let what = |e: &dyn std::fmt::Display| refused(format!("read-only file {}: {e}", file.host.display()));
        let (Some(parent), Some(name)) = (file.host.parent(), file.host.file_name()) else {
            return Err(what(&"not a file path"));
        };
        let dir = match dirs.entry(parent) {
            std::collections::hash_map::Entry::Occupied(dir) => dir.into_mut(),
            std::collections::hash_map::Entry::Vacant(slot) => {
                let dir = open(parent, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
                    .map_err(|e| what(&e))?;
                opened_dir(parent);
                slot.insert(dir)
            }
        };
        let source = openat(&*dir, name, OFlag::O_PATH | OFlag::O_CLOEXEC, Mode::empty()).map_err(|e| what(&e))?;
        let stat = fstat(&source).map_err(|e| what(&e))?;
        if SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
            return Err(refused(format!("read-only file {} is not a regular file", file.host.display())));
        }
        opened.push(ReadOnlyFile { host: file.host.clone(), source, jail: file.jail.clone() });
    }
    Ok(opened)
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
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::PermissionsExt;

    fn read(file: &ReadOnlyFile) -> String {
        std::fs::read_to_string(format!("/proc/self/fd/{}", file.source.as_raw_fd())).unwrap()
    }

    #[test]
    fn files_of_one_directory_come_from_one_build_even_if_it_is_replaced_meanwhile() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path();
        let build = |n: u32| {
            let staging = store.join(format!(".staging-{n}"));
            std::fs::create_dir(&staging).unwrap();
            std::fs::write(staging.join("state"), format!("state of build {n}")).unwrap();
            std::fs::write(staging.join("memory"), format!("memory of build {n}")).unwrap();
            staging
        };
        std::fs::rename(build(1), store.join("key")).unwrap();
        let second = build(2);
        let files: Vec<JailFile> = ["state", "memory"]
            .map(|name| JailFile { host: store.join("key").join(name), jail: PathBuf::from("/snapshot").join(name) })
            .to_vec();
        // A republish lands right after the directory was opened: quarantine build 1, publish 2.
        let opened = open_read_only(&files, |_| {
            std::fs::rename(store.join("key"), store.join("quarantined")).unwrap();
            std::fs::rename(&second, store.join("key")).unwrap();
        })
        .unwrap();
        assert_eq!((read(&opened[0]).as_str(), read(&opened[1]).as_str()), ("state of build 1", "memory of build 1"));
        assert_eq!(opened[1].jail, Path::new("/snapshot/memory"));
        // Opened after the swap, both come from build 2.
        let opened = open_read_only(&files, |_| {}).unwrap();
        assert_eq!((read(&opened[0]).as_str(), read(&opened[1]).as_str()), ("state of build 2", "memory of build 2"));
    }

    #[test]
    fn read_only_files_must_be_regular_files_that_exist() {
        let dir = tempfile::tempdir().unwrap();
        let file = |host: PathBuf| vec![JailFile { host, jail: PathBuf::from("/f") }];
        let err = open_read_only(&file(dir.path().join("missing")), |_| {}).unwrap_err().to_string();
        assert!(err.contains("missing"), "{err}");
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let err = open_read_only(&file(dir.path().join("sub")), |_| {}).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
        // A link to a regular file is followed (root's configuration may use one).
        std::fs::write(dir.path().join("vmlinux-1"), b"kernel").unwrap();
        std::os::unix::fs::symlink("vmlinux-1", dir.path().join("vmlinux")).unwrap();
        let opened = open_read_only(&file(dir.path().join("vmlinux")), |_| {}).unwrap();
        assert_eq!(read(&opened[0]), "kernel");
    }

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
