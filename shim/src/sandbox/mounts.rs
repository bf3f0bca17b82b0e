//! Host mounts a pod may leave behind, found from `/proc/self/mountinfo` and lazily unmounted
//! (teardown and `delete` after a crash). Never wider than the directory asked for.
//!
//! Also the rules both backends follow when they mount a container's rootfs and volumes on the
//! host (the one skeleton, [`super::container_tree`], with their ways of binding in
//! [`super::namespace_mounts`] and [`super::vm::share`]): what counts as a bind mount in an OCI
//! spec and which host path it names, fstab-style options as mount flags, containerd's rootfs
//! mounts, mount points made without following links, their removal, and the errors.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use containerd_shim::protos::types::mount::Mount as RootfsMount;
use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::NixPath;
use oci_spec::runtime::Mount;
use tracing::{debug, warn};

use super::idmap::{IdmapError, IdmapUserns, RootfsIdmap};

/// What mounting a container's rootfs and volumes on the host fails with.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("container id {0:?} is not a plain id")]
    Id(String),
    #[error("{what} {path}: {source}")]
    Io { what: &'static str, path: PathBuf, source: std::io::Error },
    #[error("mount {what} at {target}: {source}")]
    Mount { what: String, target: PathBuf, source: Errno },
    #[error("OCI spec mounts[{index}]: {reason}")]
    Spec { index: usize, reason: String },
    #[error("mount point {destination} in the read-only rootfs: {reason}")]
    MountPoint { destination: String, reason: String },
    #[error(transparent)]
    Idmap(#[from] IdmapError),
}

pub fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> MountError {
    let path = path.to_owned();
    move |source| MountError::Io { what, path, source }
}

pub fn mount_err(what: impl Into<String>, target: &Path) -> impl FnOnce(Errno) -> MountError {
    let (what, target) = (what.into(), target.to_owned());
    move |source| MountError::Mount { what, target, source }
}

/// Whether an OCI spec mount binds a host path (by its type, or a `bind`/`rbind` option).
pub fn is_bind(m: &Mount) -> bool {
    m.typ().as_deref() == Some("bind") || options_of(m).iter().any(|o| o == "bind" || o == "rbind")
}

/// An OCI spec mount's options (none: empty).
pub fn options_of(m: &Mount) -> &[String] {
    m.options().as_deref().unwrap_or_default()
}

/// The host path the spec's `index`-th mount, a bind, names, and whether it is a directory.
/// Refused unless it is absolute and exists.
pub fn bind_source(index: usize, m: &Mount) -> Result<(PathBuf, bool), MountError> {
    let bad = |reason: String| MountError::Spec { index, reason };
    let source = m.source().clone().unwrap_or_default();
    if !source.is_absolute() {
        return Err(bad(format!("bind source {:?} is not an absolute host path", source.display())));
    }
    let meta = std::fs::metadata(&source).map_err(|e| bad(format!("bind source {}: {e}", source.display())))?;
    Ok((source, meta.is_dir()))
}

/// fstab-style options (`ro`, `rbind`, `lowerdir=...`) as mount flags and filesystem data.
pub fn parse_options(options: &[String]) -> (MsFlags, Option<String>) {
    let mut flags = MsFlags::empty();
    let mut data = Vec::new();
    for option in options {
        match option.as_str() {
            "ro" => flags.insert(MsFlags::MS_RDONLY),
            "rw" => flags.remove(MsFlags::MS_RDONLY),
            "bind" => flags.insert(MsFlags::MS_BIND),
            "rbind" => flags.insert(MsFlags::MS_BIND | MsFlags::MS_REC),
            "nosuid" => flags.insert(MsFlags::MS_NOSUID),
            "nodev" => flags.insert(MsFlags::MS_NODEV),
            "noexec" => flags.insert(MsFlags::MS_NOEXEC),
            "noatime" => flags.insert(MsFlags::MS_NOATIME),
            "relatime" => flags.insert(MsFlags::MS_RELATIME),
            // Propagation is the container's business (the agent's libcontainer applies it);
            // defaults name no change.
            "rprivate" | "private" | "rslave" | "slave" | "rshared" | "shared" | "defaults" | "suid" | "dev"
            | "exec" | "async" => {}
            other => data.push(other.to_string()),
        }
    }
    (flags, (!data.is_empty()).then(|| data.join(",")))
}

/// The propagation a bind of the host's gets where the shim binds it for a pod (the share, a
/// namespace pod's root), as runc gives it: `rslave` (or `slave`; CRI's HostToContainer) makes it
/// a slave of its source, so what the host mounts below the source later appears in the pod;
/// anything else, `rprivate` (CRI's default) or no option, makes it private, so nothing mounted
/// later below the source reaches the pod, with its own flags, past a read-only bind.
/// `rshared` (Bidirectional) is taken as `rslave`: no mount the pod makes can reach the host
/// through the share or the agent's namespace. Recursive for an rbind.
pub fn bind_propagation(options: &[String]) -> MsFlags {
    let slave = options.iter().any(|o| matches!(o.as_str(), "rslave" | "slave" | "rshared" | "shared"));
    let recursive = options.iter().any(|o| o == "rbind");
    let kind = if slave { MsFlags::MS_SLAVE } else { MsFlags::MS_PRIVATE };
    if recursive {
        kind | MsFlags::MS_REC
    } else {
        kind
    }
}

/// A path as the C string the mount system calls take.
fn with_cpath<T>(path: &Path, f: impl FnOnce(&std::ffi::CStr) -> T) -> Result<T, Errno> {
    path.with_nix_path(f)
}

/// How [`attach_clone`] clones a mount.
#[derive(Debug, Clone, Copy)]
pub struct CloneAttrs<'a> {
    /// With every mount below it.
    pub recursive: bool,
    pub read_only: bool,
    pub nodev: bool,
    /// `MS_PRIVATE` or `MS_SLAVE`: a clone joins its source's peer group otherwise.
    pub propagation: MsFlags,
    /// Idmapped with the maps of this user namespace (crate::sandbox::idmap).
    pub idmap: Option<BorrowedFd<'a>>,
}

/// Clones the mount at `source` as a detached tree, gives it `attrs`, and attaches it at
/// `target`, so that it is born with its flags and every propagated copy has them (the
/// namespace backend's binds, and idmapped ones on both backends).
pub fn attach_clone(source: &Path, target: &Path, attrs: CloneAttrs<'_>) -> Result<(), Errno> {
    let CloneAttrs { recursive, read_only, nodev, propagation, idmap } = attrs;
    let rec = if recursive { libc::AT_RECURSIVE as libc::c_uint } else { 0 };
    let flags = libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC | rec;
    let fd = with_cpath(source, |src| {
        // SAFETY: open_tree(2) with a valid NUL-terminated path and plain flags; it returns a new
        // descriptor or -1, nothing else is touched.
        unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, src.as_ptr(), flags) }
    })?;
    let fd = i32::try_from(Errno::result(fd)?).map_err(|_| Errno::EBADF)?;
    // SAFETY: open_tree just returned this descriptor; nothing else owns it.
    let tree = unsafe { OwnedFd::from_raw_fd(fd) };
    {
        let mut attr_set = if nodev { libc::MOUNT_ATTR_NODEV } else { 0 };
        if read_only {
            attr_set |= libc::MOUNT_ATTR_RDONLY;
        }
        let mut userns_fd = 0;
        if let Some(fd) = idmap {
            attr_set |= libc::MOUNT_ATTR_IDMAP;
            userns_fd = u64::try_from(fd.as_raw_fd()).map_err(|_| Errno::EBADF)?;
        }
        let propagation = (propagation & (MsFlags::MS_PRIVATE | MsFlags::MS_SLAVE)).bits();
        let attr = libc::mount_attr { attr_set, attr_clr: 0, propagation, userns_fd };
        let at = libc::AT_EMPTY_PATH as libc::c_uint | rec;
        // SAFETY: mount_setattr(2) on our detached tree's descriptor, an empty path (a static
        // C string), and a mount_attr of the size passed, which outlives the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                tree.as_raw_fd(),
                c"".as_ptr(),
                at,
                &attr as *const libc::mount_attr,
                std::mem::size_of::<libc::mount_attr>(),
            )
        };
        Errno::result(rc)?;
    }
    let rc = with_cpath(target, |to| {
        // SAFETY: move_mount(2) from our detached tree's descriptor (empty path, a static C
        // string) to a valid NUL-terminated target path.
        unsafe {
            libc::syscall(
                libc::SYS_move_mount,
                tree.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_FDCWD,
                to.as_ptr(),
                libc::MOVE_MOUNT_F_EMPTY_PATH,
            )
        }
    })?;
    Errno::result(rc).map(drop)
}

/// Mounts one of containerd's rootfs mounts that carries the pod's id maps (`uidmap=`, `gidmap=`,
/// already taken off into `options`) at `target`, with `extra` flags: a bind idmapped, or an
/// overlay on lower layers seen through an idmapped bind of their directory at `scratch` (a
/// private place of the shim's), dropped once the overlay holds them (crate::sandbox::idmap).
pub fn mount_idmapped_rootfs(
    m: &RootfsMount,
    options: Vec<String>,
    target: &Path,
    scratch: &Path,
    userns: &IdmapUserns,
    extra: MsFlags,
) -> Result<(), MountError> {
    let what = format!("rootfs {} ({}), idmapped", m.source, m.type_);
    let nodev = extra.contains(MsFlags::MS_NODEV);
    let attrs = |recursive, read_only| CloneAttrs {
        recursive,
        read_only,
        nodev,
        propagation: MsFlags::MS_PRIVATE,
        idmap: Some(userns.fd()),
    };
    match m.type_.as_str() {
        "bind" => {
            let (recursive, read_only) = (options.iter().any(|o| o == "rbind"), options.iter().any(|o| o == "ro"));
            attach_clone(Path::new(&m.source), target, attrs(recursive, read_only)).map_err(mount_err(what, target))
        }
        "overlay" => {
            let plan = RootfsIdmap::plan(&options, scratch)?;
            std::fs::create_dir_all(scratch).map_err(io("create", scratch))?;
            let result = attach_clone(&plan.source, scratch, attrs(false, true))
                .map_err(mount_err(format!("{what}: its layers"), scratch))
                .and_then(|()| {
                    let overlay = RootfsMount { options: plan.options.clone(), ..m.clone() };
                    mount_rootfs(&[overlay], target, extra)
                });
            // The overlay holds the layers it uses; the bind of their directory may go.
            let _ = umount2(scratch, MntFlags::MNT_DETACH);
            let _ = std::fs::remove_dir(scratch);
            result
        }
        other => Err(MountError::Idmap(IdmapError::Malformed(format!(
            "an idmapped rootfs of type {other:?}: only bind and overlay are"
        )))),
    }
}

/// Mounts containerd's rootfs `mounts` (an overlay of the snapshot's layers, usually one) at
/// `target`, each with `extra` flags on top of its own options.
pub fn mount_rootfs(mounts: &[RootfsMount], target: &Path, extra: MsFlags) -> Result<(), MountError> {
    for m in mounts {
        let (flags, data) = parse_options(&m.options);
        let flags = flags | extra;
        let fstype = Some(m.type_.as_str()).filter(|t| !t.is_empty() && *t != "bind");
        mount(Some(m.source.as_str()), target, fstype, flags, data.as_deref())
            .map_err(mount_err(format!("rootfs {} ({})", m.source, m.type_), target))?;
    }
    Ok(())
}

/// Changes only the flags (propagation, a remount) of the mount at `target`.
pub fn flags_only(target: &Path, flags: MsFlags, what: &str) -> Result<(), MountError> {
    mount(None::<&str>, target, None::<&str>, flags, None::<&str>).map_err(mount_err(what, target))
}

/// Creates `path` as an empty directory, or an empty file if `file`, with no symlink followed.
pub fn make_point(path: &Path, file: bool) -> Result<(), MountError> {
    if file {
        use nix::fcntl::OFlag;
        let flags = OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        nix::fcntl::open(path, flags, nix::sys::stat::Mode::from_bits_truncate(0o644))
            .map(drop)
            .map_err(|e| MountError::Io { what: "create", path: path.to_owned(), source: e.into() })
    } else {
        std::fs::DirBuilder::new().mode(0o755).create(path).map_err(io("create", path))
    }
}

/// Removes `dir` bottom-up, only empty directories and empty files: the mount points a backend
/// made for a container. Anything else (a mount that came back, data) stays and is reported.
pub fn remove_mount_points(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            match entry.file_type() {
                Ok(t) if t.is_dir() => remove_mount_points(&path),
                Ok(t) if t.is_file() && entry.metadata().is_ok_and(|m| m.len() == 0) => {
                    if let Err(e) = std::fs::remove_file(&path) {
                        warn!(path = %path.display(), "remove mount point: {e}");
                    }
                }
                _ => warn!(path = %path.display(), "not a mount point of ours; left"),
            }
        }
    }
    if let Err(e) = std::fs::remove_dir(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            warn!(path = %dir.display(), "remove: {e}");
        }
    }
}

/// Mount points at or below `dir`, deepest first, from /proc/self/mountinfo.
pub fn mounts_below(dir: &Path) -> Vec<PathBuf> {
    // Never "everything": only a real, absolute directory below the root qualifies.
    if !dir.is_absolute() || dir.parent().is_none() {
        return Vec::new();
    }
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = info
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(unescape_mountinfo)
        .map(PathBuf::from)
        .filter(|p| p.starts_with(dir))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    found
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape_mountinfo(field: &str) -> String {
    field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
}

/// Unmounts (lazily) everything at or below `dir`.
pub fn unmount_all(dir: &Path) {
    for target in mounts_below(dir) {
        if let Err(e) = umount2(&target, MntFlags::MNT_DETACH) {
            debug!("umount {}: {e}", target.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oci_spec::runtime::MountBuilder;

    fn oci_mount(typ: Option<&str>, source: &str, options: &[&str]) -> Mount {
        let mut m = MountBuilder::default()
            .destination("/d")
            .source(source)
            .options(options.iter().map(|o| o.to_string()).collect::<Vec<_>>())
            .build()
            .unwrap();
        m.set_typ(typ.map(str::to_string));
        m
    }

    #[test]
    fn unmount_scope_is_never_the_whole_host() {
        assert!(mounts_below(Path::new("")).is_empty());
        assert!(mounts_below(Path::new("/")).is_empty());
        assert!(mounts_below(Path::new("relative/dir")).is_empty());
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape_mountinfo("/a\\040b"), "/a b");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
    }

    #[test]
    fn binds_are_private_unless_the_spec_asks_for_the_hosts_later_mounts() {
        let of = |options: &[&str]| bind_propagation(&options.iter().map(|o| o.to_string()).collect::<Vec<_>>());
        assert_eq!(of(&["rbind", "rprivate", "ro"]), MsFlags::MS_PRIVATE | MsFlags::MS_REC);
        assert_eq!(of(&["bind", "ro"]), MsFlags::MS_PRIVATE);
        assert_eq!(of(&[]), MsFlags::MS_PRIVATE);
        assert_eq!(of(&["rbind", "rslave"]), MsFlags::MS_SLAVE | MsFlags::MS_REC);
        assert_eq!(of(&["rbind", "rshared"]), MsFlags::MS_SLAVE | MsFlags::MS_REC);
    }

    #[test]
    fn options_split_into_flags_and_data() {
        let (flags, data) = parse_options(&["ro".into(), "lowerdir=/a:/b".into(), "index=off".into()]);
        assert_eq!(flags, MsFlags::MS_RDONLY);
        assert_eq!(data.as_deref(), Some("lowerdir=/a:/b,index=off"));
        let (flags, data) = parse_options(&["rbind".into(), "rprivate".into(), "rw".into()]);
        assert_eq!(flags, MsFlags::MS_BIND | MsFlags::MS_REC);
        assert_eq!(data, None);
    }

    #[test]
    fn binds_are_found_by_type_or_option() {
        assert!(is_bind(&oci_mount(Some("bind"), "/a", &[])));
        assert!(is_bind(&oci_mount(None, "/a", &["rbind", "ro"])));
        assert!(is_bind(&oci_mount(Some("none"), "/a", &["bind"])));
        assert!(!is_bind(&oci_mount(Some("tmpfs"), "tmpfs", &["nosuid"])));
        let mut no_options = oci_mount(Some("proc"), "proc", &[]);
        no_options.set_options(None);
        assert!(!is_bind(&no_options));
        assert!(options_of(&no_options).is_empty());
    }

    #[test]
    fn bind_sources_are_absolute_host_paths_that_exist() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("hosts");
        std::fs::write(&file, b"").unwrap();
        let source = |s: &Path| oci_mount(Some("bind"), &s.display().to_string(), &["rbind"]);
        assert_eq!(bind_source(0, &source(dir.path())).unwrap(), (dir.path().to_owned(), true));
        assert_eq!(bind_source(0, &source(&file)).unwrap(), (file.clone(), false));
        let err = bind_source(3, &source(Path::new("relative"))).unwrap_err().to_string();
        assert!(err.starts_with("OCI spec mounts[3]: ") && err.contains("not an absolute host path"), "{err}");
        let err = bind_source(1, &source(&dir.path().join("gone"))).unwrap_err().to_string();
        assert!(err.contains("mounts[1]") && err.contains("gone"), "{err}");
        let mut none = source(dir.path());
        none.set_source(None);
        assert!(bind_source(0, &none).is_err());
    }

    #[test]
    fn removal_takes_only_empty_mount_points() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join("c1");
        std::fs::create_dir_all(dir.join("rootfs")).unwrap();
        std::fs::create_dir_all(dir.join("volumes/0")).unwrap();
        std::fs::write(dir.join("volumes/1"), b"").unwrap();
        remove_mount_points(&dir);
        assert!(!dir.exists());
        // Data where a mount point should be empty is never removed.
        std::fs::create_dir_all(dir.join("volumes/0")).unwrap();
        std::fs::write(dir.join("volumes/0/precious"), b"data").unwrap();
        remove_mount_points(&dir);
        assert_eq!(std::fs::read(dir.join("volumes/0/precious")).unwrap(), b"data");
    }

    #[test]
    fn mount_points_are_made_without_following_links() {
        let scratch = tempfile::tempdir().unwrap();
        let target = scratch.path().join("target");
        std::fs::create_dir(&target).unwrap();
        std::os::unix::fs::symlink(&target, scratch.path().join("link")).unwrap();
        assert!(make_point(&scratch.path().join("link"), true).is_err());
        assert!(make_point(&scratch.path().join("link"), false).is_err());
        make_point(&scratch.path().join("f"), true).unwrap();
        make_point(&scratch.path().join("d"), false).unwrap();
        assert!(scratch.path().join("f").is_file() && scratch.path().join("d").is_dir());
        assert_eq!(std::fs::read_dir(&target).unwrap().count(), 0);
    }
}
