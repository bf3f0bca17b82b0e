//! The jailed VMM's filesystem: a private mount namespace whose root is the chroot directory,
//! holding only what the document lists (writable dirs, read-only bind mounts of host files)
//! and its device nodes. Runs in the child, as root, before the uid changes.
//!
//! Paths inside the chroot are walked one component at a time from a directory fd with
//! O_NOFOLLOW, so a symlink left in a writable dir (by an earlier VMM of the pod, say) cannot
//! send a root-owned mkdir, mknod, chown or mount outside the chroot.

use std::ffi::OsStr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Component, Path};

use bulkhead_vmm_api::jail::JailConfig;
use nix::errno::Errno;
use nix::fcntl::{openat, OFlag};
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::stat::{fchmod, mkdirat, mknodat, umask, Mode, SFlag};
use nix::unistd::{chdir, fchdir, fchown, fchownat, pivot_root, unlinkat, Gid, Uid, UnlinkatFlags};

use super::checks::{open_read_only, HostFacts, ReadOnlyFile};
use super::error::{sys, JailError};

const NONE: Option<&str> = None;

pub fn build(jail: &JailConfig, host: &HostFacts) -> Result<(), JailError> {
    // Modes below are meant exactly; the VMM's own files get a private umask at the end.
    umask(Mode::empty());
    // Nothing we mount may reach the host's mount namespace.
    mount(NONE, "/", NONE, MsFlags::MS_REC | MsFlags::MS_PRIVATE, NONE).map_err(sys("make / rprivate"))?;
    // pivot_root needs the new root to be a mount point.
    mount(Some(&jail.chroot), &jail.chroot, NONE, MsFlags::MS_BIND | MsFlags::MS_REC, NONE)
        .map_err(sys(format!("bind-mount the chroot {}", jail.chroot.display())))?;
    // The chroot may live on a nodev mount (the pod state dir on /run): allow device nodes in
    // this bind mount only, and nothing setuid or executable.
    let flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC;
    mount(NONE, &jail.chroot, NONE, flags, NONE)
        .map_err(sys(format!("remount the chroot {}", jail.chroot.display())))?;
    let root = nix::fcntl::open(
        &jail.chroot,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(sys(format!("open the chroot {}", jail.chroot.display())))?;
    let (uid, gid) = (Uid::from_raw(jail.uid), Gid::from_raw(jail.gid));

    for dir in &jail.writable_dirs {
        let fd = ensure_dir(&root, dir)?;
        fchown(&fd, Some(uid), Some(gid)).map_err(sys(format!("chown {}", dir.display())))?;
        fchmod(&fd, Mode::from_bits_truncate(0o700)).map_err(sys(format!("chmod {}", dir.display())))?;
    }
    for file in &open_read_only(&jail.read_only, |_| {})? {
        bind_read_only(&root, file)?;
    }
    device_node(&root, Path::new("/dev/kvm"), host.kvm, uid, gid)?;
    if let Some(tun) = host.tun {
        device_node(&root, Path::new("/dev/net/tun"), tun, uid, gid)?;
    }

    fchdir(&root).map_err(sys("enter the chroot"))?;
    // Stack the old root on top of the new one, then detach it: no old_root directory needed.
    pivot_root(".", ".").map_err(sys("pivot_root into the chroot"))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(sys("detach the host's root"))?;
    chdir("/").map_err(sys("chdir /"))?;
    // Sockets, logs and memory files the VMM creates are its uid's alone.
    umask(Mode::from_bits_truncate(0o077));
    tracing::debug!(chroot = %jail.chroot.display(), "pivoted into the chroot");
    Ok(())
}

fn path_err(path: &Path, reason: impl std::fmt::Display) -> JailError {
    JailError::Path { path: path.to_owned(), reason: reason.to_string() }
}

/// `/proc/self/fd/N`: lets mount(2) act on exactly the file an fd holds.
fn fd_path(fd: &OwnedFd) -> String {
    format!("/proc/self/fd/{}", fd.as_raw_fd())
}

fn open_dir_at(dir: &OwnedFd, name: &OsStr) -> nix::Result<OwnedFd> {
    openat(dir, name, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC, Mode::empty())
}

/// Opens (creating root-owned 0755 levels as needed) the directory `path` inside the chroot.
fn ensure_dir(root: &OwnedFd, path: &Path) -> Result<OwnedFd, JailError> {
    let mut cur = open_dir_at(root, OsStr::new(".")).map_err(|e| path_err(path, e))?;
    for component in path.components() {
        let name = match component {
            Component::RootDir => continue,
            Component::Normal(name) => name,
            _ => return Err(path_err(path, "only plain components are allowed")),
        };
        match mkdirat(&cur, name, Mode::from_bits_truncate(0o755)) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(e) => return Err(path_err(path, format!("mkdir: {e}"))),
        }
        cur = open_dir_at(&cur, name).map_err(|e| match e {
            Errno::ELOOP | Errno::ENOTDIR => path_err(path, "a component is a symlink or not a directory"),
            e => path_err(path, e),
        })?;
    }
    Ok(cur)
}

/// Splits a jail file path into its (created) parent directory and its name.
fn parent_and_name<'a>(root: &OwnedFd, path: &'a Path) -> Result<(OwnedFd, &'a OsStr), JailError> {
    let name = path.file_name().ok_or_else(|| path_err(path, "no file name"))?;
    let parent = ensure_dir(root, path.parent().unwrap_or(Path::new("/")))?;
    Ok((parent, name))
}

/// Bind-mounts the host file (the one opened on the host side, not whatever its path names now)
/// read-only (and nosuid, nodev, noexec) at its jail path.
fn bind_read_only(root: &OwnedFd, file: &ReadOnlyFile) -> Result<(), JailError> {
    let (host_path, jail_path, source) = (&file.host, &file.jail, &file.source);
    let (parent, name) = parent_and_name(root, jail_path)?;
    let flags = OFlag::O_RDONLY | OFlag::O_CREAT | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
    let target = openat(&parent, name, flags, Mode::from_bits_truncate(0o444))
        .map_err(|e| path_err(jail_path, format!("mount point: {e}")))?;
    mount(Some(fd_path(source).as_str()), fd_path(&target).as_str(), NONE, MsFlags::MS_BIND, NONE)
        .map_err(sys(format!("bind-mount {} at {}", host_path.display(), jail_path.display())))?;
    // Reopen through the new mount: a remount acts on the mount's root, not the file under it.
    let mounted = openat(&parent, name, OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC, Mode::empty())
        .map_err(|e| path_err(jail_path, e))?;
    let ro = MsFlags::MS_BIND
        | MsFlags::MS_REMOUNT
        | MsFlags::MS_RDONLY
        | MsFlags::MS_NOSUID
        | MsFlags::MS_NODEV
        | MsFlags::MS_NOEXEC;
    mount(NONE, fd_path(&mounted).as_str(), NONE, ro, NONE)
        .map_err(sys(format!("make {} read-only", jail_path.display())))?;
    Ok(())
}

/// A character device `rdev` at `path`, owned by the VMM's uid/gid, mode 0600. A node left by an
/// earlier run is replaced.
fn device_node(root: &OwnedFd, path: &Path, rdev: u64, uid: Uid, gid: Gid) -> Result<(), JailError> {
    let (dir, name) = parent_and_name(root, path)?;
    match unlinkat(&dir, name, UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => {}
        Err(e) => return Err(path_err(path, format!("remove the old node: {e}"))),
    }
    mknodat(&dir, name, SFlag::S_IFCHR, Mode::from_bits_truncate(0o600), rdev)
        .map_err(sys(format!("mknod {}", path.display())))?;
    fchownat(&dir, name, Some(uid), Some(gid), nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
        .map_err(sys(format!("chown {}", path.display())))?;
    Ok(())
}
