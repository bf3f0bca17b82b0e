//! An emptyDir's image: a sparse file of exactly the volume's limit, formatted ext4 on the
//! host, kept in kubelet's own directory of the volume (`<kubelet root>/pods/<uid>/volumes/
//! kubernetes.io~empty-dir/<name>/.bulkhead-emptydir.ext4`).
//!
//! Why there: the data lives on the node disk where kubelet keeps every emptyDir, kubelet's
//! usage walk of the volume sees the image's allocated blocks (so its pod-level ephemeral-storage
//! accounting and eviction keep working), the image goes when kubelet removes the volume
//! directory with the pod (also when bulkhead is gone or its shim crashed), and a pod whose
//! sandbox is recreated (kubelet does that after a sandbox dies) finds its data again, as with
//! runc. kubelet's directory is mode 0777, so everything here goes by descriptor: the directory
//! is opened without following a link, the image is created with `O_EXCL`/`O_NOFOLLOW`, and
//! mkfs writes through `/proc/<shim>/fd/<n>`, never a path someone else could swap.
//!
//! A new image is made as `.partial`, formatted, marked, then renamed into place, so a shim
//! killed half-way leaves nothing a later sandbox would take for a filesystem. An existing image
//! is taken only if it is what the shim makes (a regular file, root's, one link, the same size)
//! and carries the shim's mark: the host kernel parses it, and no one but the host kernel's ext4
//! driver may have written it (containers see files through virtiofsd or a bind mount, never its
//! blocks). The mark matters because the directory is not always the shim's: while a volume is
//! unlimited (an earlier sandbox of the pod, before a limit was set) the guest writes it through
//! virtiofsd, which runs as root, so a planted `.bulkhead-emptydir.ext4` is root's and of one
//! link. The mark is the `trusted.bulkhead.emptydir` attribute, which only a process with
//! CAP_SYS_ADMIN on the host can set: virtiofsd serves no extended attributes (no `--xattr`),
//! and a namespace-backend container holds no CAP_SYS_ADMIN unless it is privileged (and then is
//! the host's root anyway).

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{open, openat, renameat, OFlag};
use nix::sys::stat::{fchmod, Mode};
use nix::unistd::{fchown, unlinkat, Gid, Uid, UnlinkatFlags};
use tracing::{info, warn};

use super::EmptyDirError;

/// The image's name in the volume's host directory.
pub const IMAGE_NAME: &str = ".bulkhead-emptydir.ext4";
/// What a new image is called until it is formatted.
const PARTIAL_NAME: &str = ".bulkhead-emptydir.ext4.partial";
/// How long mkfs may take (sparse, lazily initialised: well under a second even for terabytes).
const MKFS_TIMEOUT: Duration = Duration::from_secs(60);
/// How much of mkfs's error output goes into an error.
const MKFS_STDERR_MAX: u64 = 4096;
/// The attribute that says the shim made an image (module docs), and its value.
const MARK: &std::ffi::CStr = c"trusted.bulkhead.emptydir";
const MARK_VALUE: &[u8] = b"1";

/// An image opened read-write, and whether it was formatted just now (empty) or found.
#[derive(Debug)]
pub struct Image {
    pub file: File,
    pub path: PathBuf,
    pub fresh: bool,
}

fn sys(what: &'static str, path: &Path) -> impl FnOnce(Errno) -> EmptyDirError {
    let path = path.to_owned();
    move |source| EmptyDirError::Sys { what, path, source }
}

/// Opens the image in `host_dir`, or makes one of `size` bytes with `mkfs` (module docs).
pub fn open_or_create(host_dir: &Path, size: u64, mkfs: &Path) -> Result<Image, EmptyDirError> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let dir = open(host_dir, flags, Mode::empty()).map_err(sys("open the volume directory", host_dir))?;
    let path = host_dir.join(IMAGE_NAME);
    let existing = openat(&dir, IMAGE_NAME, OFlag::O_RDWR | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC, Mode::empty());
    match existing {
        Ok(fd) => reuse(File::from(fd), path, size),
        Err(Errno::ENOENT) => create(&dir, host_dir, path, size, mkfs),
        Err(e) => Err(sys("open the image", &path)(e)),
    }
}

/// Takes an image an earlier sandbox of the pod made, if it is one.
fn reuse(file: File, path: PathBuf, size: u64) -> Result<Image, EmptyDirError> {
    let meta =
        file.metadata().map_err(|e| EmptyDirError::Io { what: "stat the image", path: path.clone(), source: e })?;
    let refuse = |reason: String| EmptyDirError::Image { path: path.clone(), reason };
    if !meta.file_type().is_file() || meta.uid() != 0 || meta.nlink() != 1 {
        return Err(refuse("not an image bulkhead made (a regular file of root's with one link)".into()));
    }
    if !is_marked(&file) {
        return Err(refuse(format!(
            "it does not carry bulkhead's mark (the {} attribute, which only the host's root can set): a file \
             the pod could have written while the volume was unlimited is never mounted; remove it to start \
             the volume afresh",
            MARK.to_string_lossy()
        )));
    }
    if meta.len() != size {
        return Err(refuse(format!(
            "it holds the volume's data at {} bytes, but the pod's limit is now {size} bytes; \
             remove it (the volume's data goes with it) or restore the old limit",
            meta.len()
        )));
    }
    // kubelet's fsGroup handling may have given the volume's files a group: the image is root's.
    fchown(file.as_fd(), Some(Uid::from_raw(0)), Some(Gid::from_raw(0))).map_err(sys("chown the image", &path))?;
    fchmod(file.as_fd(), Mode::from_bits_truncate(0o600)).map_err(sys("chmod the image", &path))?;
    info!(image = %path.display(), size, "an earlier sandbox's emptyDir image is used again");
    Ok(Image { file, path, fresh: false })
}

fn create(dir: &OwnedFd, host_dir: &Path, path: PathBuf, size: u64, mkfs: &Path) -> Result<Image, EmptyDirError> {
    let partial = host_dir.join(PARTIAL_NAME);
    // A leftover of a shim that died while formatting: never a filesystem, never data.
    match unlinkat(dir, PARTIAL_NAME, UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => {}
        Err(e) => return Err(sys("remove a half-made image", &partial)(e)),
    }
    let flags = OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let fd = openat(dir, PARTIAL_NAME, flags, Mode::from_bits_truncate(0o600)).map_err(sys("create", &partial))?;
    let file = File::from(fd);
    let made = file
        .set_len(size)
        .map_err(|e| EmptyDirError::Io { what: "size the image", path: partial.clone(), source: e })
        .and_then(|()| mkfs_ext4(mkfs, &file, &partial))
        .and_then(|()| mark(&file, &partial))
        .and_then(|()| renameat(dir, PARTIAL_NAME, dir, IMAGE_NAME).map_err(sys("rename the image into place", &path)));
    if let Err(e) = made {
        if let Err(undo) = unlinkat(dir, PARTIAL_NAME, UnlinkatFlags::NoRemoveDir) {
            warn!(image = %partial.display(), "remove the half-made image: {undo}");
        }
        return Err(e);
    }
    Ok(Image { file, path, fresh: true })
}

/// Marks `file` as an image the shim made (module docs).
fn mark(file: &File, shown_as: &Path) -> Result<(), EmptyDirError> {
    // SAFETY: the name is a valid C string, the value a live buffer of the given length, the fd ours.
    let done =
        unsafe { libc::fsetxattr(file.as_raw_fd(), MARK.as_ptr(), MARK_VALUE.as_ptr().cast(), MARK_VALUE.len(), 0) };
    if done != 0 {
        // A filesystem without trusted.* attributes cannot hold an image that is safe to use again.
        return Err(sys("mark the image (the filesystem must support trusted.* attributes)", shown_as)(Errno::last()));
    }
    Ok(())
}

/// Whether `file` carries the mark.
fn is_marked(file: &File) -> bool {
    let mut value = [0u8; 8];
    // SAFETY: the name is a valid C string, the buffer live and of the given length, the fd ours.
    let len = unsafe { libc::fgetxattr(file.as_raw_fd(), MARK.as_ptr(), value.as_mut_ptr().cast(), value.len()) };
    usize::try_from(len).is_ok_and(|len| &value[..len] == MARK_VALUE)
}

/// mke2fs's arguments for an image of `size` bytes: no blocks reserved for root (otherwise a
/// writer not running as root would hit ENOSPC 5% earlier than one that does), inode tables and
/// journal left for the kernel to initialise lazily (the image stays sparse), no discard of a
/// file that is all holes anyway. From 16 MiB to below 512 MiB (where mke2fs uses 1 KiB blocks
/// and picks a 4-8 MiB journal) a 1 MiB journal, which leaves more of a small volume for data:
/// measured with e2fsprogs 1.47, 88% of 32 MiB free instead of 79%, 92.5% of 256 MiB instead of
/// 90%. Otherwise mke2fs's defaults for the size (about 95% of 1 GiB free, 97.5% of 10 GiB).
fn mkfs_args(size: u64) -> Vec<&'static str> {
    let mut args = vec!["-q", "-F", "-m", "0", "-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1"];
    if (16 << 20..512 << 20).contains(&size) {
        args.extend(["-J", "size=1"]);
    }
    args
}

/// Formats `file` as ext4 ([`mkfs_args`]), writing through the shim's own descriptor.
fn mkfs_ext4(mkfs: &Path, file: &File, shown_as: &Path) -> Result<(), EmptyDirError> {
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    let fd_path = format!("/proc/{}/fd/{}", std::process::id(), file.as_raw_fd());
    let failed = |reason: String| EmptyDirError::Mkfs { mkfs: mkfs.to_owned(), image: shown_as.to_owned(), reason };
    let mut child = Command::new(mkfs)
        .args(mkfs_args(size))
        .arg(&fd_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| failed(format!("cannot run it: {e} (install e2fsprogs, or set emptydir.mkfs_path)")))?;
    // Its error output, bounded, read aside so a chatty mkfs cannot block on a full pipe.
    let stderr = child.stderr.take().map(|pipe| {
        std::thread::spawn(move || {
            let mut kept = Vec::new();
            let mut pipe = pipe;
            let _ = (&mut pipe).take(MKFS_STDERR_MAX).read_to_end(&mut kept);
            let _ = std::io::copy(&mut pipe, &mut std::io::sink());
            kept
        })
    });
    let deadline = Instant::now() + MKFS_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) if Instant::now() >= deadline => {
                // Our own child, by its handle.
                let _ = child.kill();
                let _ = child.wait();
                break Err(format!("did not finish within {MKFS_TIMEOUT:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => break Err(format!("wait: {e}")),
        }
    };
    let said = stderr.and_then(|t| t.join().ok()).unwrap_or_default();
    let said = String::from_utf8_lossy(&said).trim().replace(|c: char| c.is_control(), " ");
    match status {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => Err(failed(format!("{status}: {said}"))),
        Err(reason) => Err(failed(reason)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mkfs() -> Option<PathBuf> {
        ["/sbin/mkfs.ext4", "/usr/sbin/mkfs.ext4"].into_iter().map(PathBuf::from).find(|p| p.is_file())
    }

    #[test]
    fn an_image_is_made_once_then_found_again() {
        let Some(mkfs) = mkfs() else {
            println!("SKIPPED: an_image_is_made_once_then_found_again: mkfs.ext4 is not installed (e2fsprogs)");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let made = open_or_create(dir.path(), 8 << 20, &mkfs).unwrap();
        assert!(made.fresh && is_marked(&made.file), "a new image carries the mark");
        let meta = std::fs::metadata(dir.path().join(IMAGE_NAME)).unwrap();
        assert_eq!((meta.len(), meta.mode() & 0o777), (8 << 20, 0o600));
        assert!(meta.blocks() * 512 < 1 << 20, "sparse: {} blocks", meta.blocks());
        assert!(!dir.path().join(PARTIAL_NAME).exists());
        // ext4's magic at offset 1080.
        let mut sb = [0u8; 2];
        std::os::unix::fs::FileExt::read_exact_at(&made.file, &mut sb, 1080).unwrap();
        assert_eq!(sb, [0x53, 0xef]);
        drop(made);
        if Uid::effective().is_root() {
            let again = open_or_create(dir.path(), 8 << 20, &mkfs).unwrap();
            assert!(!again.fresh, "the same image is used again");
            // A different limit neither drops the data nor keeps the old size silently.
            let err = open_or_create(dir.path(), 16 << 20, &mkfs).unwrap_err().to_string();
            assert!(err.contains("limit is now 16777216 bytes"), "{err}");
        }
    }

    #[test]
    fn every_size_bulkhead_accepts_formats() {
        let Some(mkfs) = mkfs() else {
            println!("SKIPPED: every_size_bulkhead_accepts_formats: mkfs.ext4 is not installed (e2fsprogs)");
            return;
        };
        // The bounds, either side of the small-journal range, and a large sparse one.
        for size in [1 << 20, 2 << 20, 3 << 20, 15 << 20, 16 << 20, 511 << 20, 512 << 20, 64 << 30] {
            let dir = tempfile::tempdir().unwrap();
            let made = open_or_create(dir.path(), size, &mkfs).unwrap_or_else(|e| panic!("{size}: {e}"));
            assert!(made.fresh && made.file.metadata().unwrap().len() == size);
        }
        assert!(mkfs_args(32 << 20).contains(&"size=1") && !mkfs_args(1 << 30).contains(&"size=1"));
    }

    #[test]
    fn what_bulkhead_did_not_make_is_never_taken() {
        let Some(mkfs) = mkfs() else {
            println!("SKIPPED: what_bulkhead_did_not_make_is_never_taken: mkfs.ext4 is not installed (e2fsprogs)");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = dir.path().join("elsewhere");
        std::fs::write(&elsewhere, b"precious").unwrap();
        let volume = dir.path().join("volume");
        std::fs::create_dir(&volume).unwrap();
        // A link planted where the image goes is not followed.
        std::os::unix::fs::symlink(&elsewhere, volume.join(IMAGE_NAME)).unwrap();
        assert!(open_or_create(&volume, 8 << 20, &mkfs).is_err());
        std::fs::remove_file(volume.join(IMAGE_NAME)).unwrap();
        // A hard link (two names) is not an image of ours.
        std::fs::hard_link(&elsewhere, volume.join(IMAGE_NAME)).unwrap();
        let err = open_or_create(&volume, 8 << 20, &mkfs).unwrap_err().to_string();
        assert!(err.contains("not an image bulkhead made"), "{err}");
        assert_eq!(std::fs::read(&elsewhere).unwrap(), b"precious");
        // A root file of one link and the right size, formatted but not by the shim (what a guest
        // could leave through virtiofsd while the volume was unlimited): never mounted.
        if Uid::effective().is_root() {
            let planted = dir.path().join("planted");
            std::fs::create_dir(&planted).unwrap();
            let file = File::create(planted.join(IMAGE_NAME)).unwrap();
            file.set_len(8 << 20).unwrap();
            mkfs_ext4(&mkfs, &file, &planted.join(IMAGE_NAME)).unwrap();
            drop(file);
            let err = open_or_create(&planted, 8 << 20, &mkfs).unwrap_err().to_string();
            assert!(err.contains("does not carry bulkhead's mark"), "{err}");
            // A mark some other user set (user.*, not trusted.*) does not count either.
            let path = std::ffi::CString::new(planted.join(IMAGE_NAME).as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: valid C strings and a live buffer.
            let set = unsafe {
                libc::setxattr(path.as_ptr(), c"user.bulkhead.emptydir".as_ptr(), c"1".as_ptr().cast(), 1, 0)
            };
            if set == 0 {
                assert!(open_or_create(&planted, 8 << 20, &mkfs).is_err());
            }
        }
        // The volume directory itself must not be a link.
        std::os::unix::fs::symlink(dir.path(), dir.path().join("linked")).unwrap();
        assert!(open_or_create(&dir.path().join("linked"), 8 << 20, &mkfs).is_err());
        // A half-made image of a dead shim is replaced; a failing mkfs leaves nothing behind.
        let fresh = dir.path().join("fresh");
        std::fs::create_dir(&fresh).unwrap();
        std::fs::write(fresh.join(PARTIAL_NAME), b"half").unwrap();
        let err = open_or_create(&fresh, 8 << 20, Path::new("/bin/false")).unwrap_err().to_string();
        assert!(err.contains("/bin/false on") && err.contains("exit status: 1"), "{err}");
        assert_eq!(std::fs::read_dir(&fresh).unwrap().count(), 0, "nothing left after a failed mkfs");
        let err = open_or_create(&fresh, 8 << 20, Path::new("/nonexistent/mkfs.ext4")).unwrap_err().to_string();
        assert!(err.contains("install e2fsprogs"), "{err}");
        assert!(open_or_create(&fresh, 8 << 20, &mkfs).unwrap().fresh);
    }
}
