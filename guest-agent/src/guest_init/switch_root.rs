//! Guest mode: leaving the initramfs. The kernel starts /init on its initial rootfs, which
//! pivot_root(2) refuses, so libcontainer could not pivot a container into its root (it would
//! need runc's `--no-pivot`, a chroot that a process with CAP_SYS_CHROOT can climb out of). As
//! util-linux's `switch_root` does, the agent copies the initramfs into a fresh tmpfs, deletes
//! the old files (their memory is freed), moves the tmpfs onto `/`, chroots into it and executes
//! itself again from there. The second run finds a tmpfs at `/` and goes on booting.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;

use anyhow::Context;
use nix::mount::{mount, umount2, MntFlags, MsFlags};

/// Where the new root is built before it is moved onto `/`.
const NEW_ROOT: &str = "/.bulkhead-root";

/// Whether `/` in `mountinfo` (this process's view) is the kernel's initial rootfs.
pub fn on_initial_rootfs(mountinfo: &str) -> bool {
    mountinfo.lines().any(|line| {
        let Some((left, right)) = line.split_once(" - ") else { return false };
        left.split(' ').nth(4) == Some("/") && right.split(' ').next() == Some("rootfs")
    })
}

/// Copies the tree at `from` into `to` (an existing directory): directories, regular files,
/// symlinks and device nodes, with their modes and owners. `skip` (a direct child of `from`) is
/// left out, as is anything on another filesystem (a mount point below `from`).
pub fn copy_tree(from: &Path, to: &Path, skip: &Path) -> io::Result<()> {
    let dev = fs::symlink_metadata(from)?.dev();
    for entry in fs::read_dir(from)? {
        let entry = entry?;
        let src = entry.path();
        if src == skip {
            continue;
        }
        let meta = fs::symlink_metadata(&src)?;
        let dst = to.join(entry.file_name());
        let ft = meta.file_type();
        if ft.is_dir() {
            fs::create_dir(&dst)?;
            if meta.dev() == dev {
                copy_tree(&src, &dst, skip)?;
            }
        } else if ft.is_symlink() {
            std::os::unix::fs::symlink(fs::read_link(&src)?, &dst)?;
        } else if ft.is_file() {
            fs::copy(&src, &dst)?;
        } else if ft.is_char_device() || ft.is_block_device() {
            let kind =
                if ft.is_char_device() { nix::sys::stat::SFlag::S_IFCHR } else { nix::sys::stat::SFlag::S_IFBLK };
            let perm = nix::sys::stat::Mode::from_bits_truncate(meta.mode() & 0o7777);
            nix::sys::stat::mknod(&dst, kind, perm, meta.rdev()).map_err(io::Error::from)?;
        } else {
            // Sockets and FIFOs mean nothing in a fresh root.
            continue;
        }
        if !ft.is_symlink() {
            fs::set_permissions(&dst, fs::Permissions::from_mode(meta.mode() & 0o7777))?;
        }
        std::os::unix::fs::lchown(&dst, Some(meta.uid()), Some(meta.gid()))?;
    }
    Ok(())
}

/// Deletes what [`copy_tree`] copied from `dir`, staying on `dir`'s filesystem and leaving
/// `skip` alone. Errors are ignored: a file left behind only costs memory.
fn remove_tree(dir: &Path, skip: &Path, dev: u64) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(meta) = fs::symlink_metadata(&path) else { continue };
        if path == skip || meta.dev() != dev {
            continue;
        }
        if meta.is_dir() {
            remove_tree(&path, skip, dev);
            let _ = fs::remove_dir(&path);
        } else {
            let _ = fs::remove_file(&path);
        }
    }
}

/// Reads this process's mountinfo, mounting a /proc for the read if none is there (and
/// unmounting it again: the boot plan mounts its own).
fn read_mountinfo() -> anyhow::Result<String> {
    if let Ok(text) = fs::read_to_string("/proc/self/mountinfo") {
        return Ok(text);
    }
    fs::create_dir_all("/proc").context("create /proc")?;
    mount(
        Some("proc"),
        "/proc",
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .context("mount /proc")?;
    let text = fs::read_to_string("/proc/self/mountinfo").context("read /proc/self/mountinfo");
    umount2("/proc", MntFlags::MNT_DETACH).context("unmount /proc")?;
    text
}

/// Moves the agent off the initial rootfs, if it is on it: on success this does not return (the
/// agent runs again from the new root); where `/` is already a real mount, it returns at once.
pub fn leave_initramfs() -> anyhow::Result<()> {
    if !on_initial_rootfs(&read_mountinfo()?) {
        return Ok(());
    }
    let new_root = Path::new(NEW_ROOT);
    fs::create_dir_all(new_root).with_context(|| format!("create {NEW_ROOT}"))?;
    mount(Some("rootfs"), new_root, Some("tmpfs"), MsFlags::empty(), Some("mode=0755"))
        .with_context(|| format!("mount a tmpfs at {NEW_ROOT}"))?;
    copy_tree(Path::new("/"), new_root, new_root).context("copy the initramfs into the new root")?;
    let dev = fs::symlink_metadata("/").context("stat /")?.dev();
    remove_tree(Path::new("/"), new_root, dev);
    std::env::set_current_dir(new_root).with_context(|| format!("chdir {NEW_ROOT}"))?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>).context("move the new root onto /")?;
    nix::unistd::chroot(".").context("chroot into the new root")?;
    std::env::set_current_dir("/").context("chdir /")?;
    let init = CString::new("/init")?;
    let args = std::env::args_os()
        .map(|a| CString::new(a.into_encoded_bytes()))
        .collect::<Result<Vec<_>, _>>()
        .context("arguments with a NUL byte")?;
    tracing::info!("left the initramfs for a tmpfs root; executing /init again");
    let err = nix::unistd::execv(&init, &args).unwrap_err();
    anyhow::bail!("execute /init in the new root: {err}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_initial_rootfs_is_recognised() {
        let initramfs = "1 1 0:2 / / rw - rootfs rootfs rw\n20 1 0:5 / /proc rw - proc proc rw";
        assert!(on_initial_rootfs(initramfs));
        let switched = "22 21 0:20 / / rw - tmpfs rootfs rw,mode=755\n23 22 0:5 / /proc rw - proc proc rw";
        assert!(!on_initial_rootfs(switched));
        let host = "25 1 8:1 / / rw,relatime - ext4 /dev/vda rw\n26 25 0:21 / /mnt rw - rootfs rootfs rw";
        assert!(!on_initial_rootfs(host), "a rootfs mounted elsewhere is not /");
        assert!(!on_initial_rootfs(""));
    }

    #[test]
    fn the_tree_is_copied_with_modes_and_links_and_the_skipped_dir_left_out() {
        let from = tempfile::tempdir().unwrap();
        let to = tempfile::tempdir().unwrap();
        fs::create_dir_all(from.path().join("etc/deep")).unwrap();
        fs::write(from.path().join("init"), b"agent").unwrap();
        fs::set_permissions(from.path().join("init"), fs::Permissions::from_mode(0o755)).unwrap();
        fs::write(from.path().join("etc/deep/f"), b"x").unwrap();
        std::os::unix::fs::symlink("init", from.path().join("sbin-init")).unwrap();
        fs::create_dir(from.path().join("newroot")).unwrap();
        fs::write(from.path().join("newroot/leftover"), b"no").unwrap();

        copy_tree(from.path(), to.path(), &from.path().join("newroot")).unwrap();
        assert_eq!(fs::read(to.path().join("init")).unwrap(), b"agent");
        assert_eq!(fs::metadata(to.path().join("init")).unwrap().mode() & 0o777, 0o755);
        assert_eq!(fs::read(to.path().join("etc/deep/f")).unwrap(), b"x");
        assert_eq!(fs::read_link(to.path().join("sbin-init")).unwrap(), Path::new("init"));
        assert!(!to.path().join("newroot").exists());

        let dev = fs::metadata(from.path()).unwrap().dev();
        remove_tree(from.path(), &from.path().join("newroot"), dev);
        let left: Vec<_> = fs::read_dir(from.path()).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(left, ["newroot"], "everything but the new root is freed");
    }
}
