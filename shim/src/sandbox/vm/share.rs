//! The pod's shared directory on the host, `<state_dir>/<pod>/shared`: what virtiofsd serves and
//! the guest mounts at `bulkhead_protocol::guest::SHARED_DIR`. Each container gets
//! `<id>/rootfs` (containerd's rootfs mounts, made here) and `<id>/volumes/<n>` (a bind of the
//! source of its OCI spec's n-th bind mount: emptyDir, hostPath, ConfigMap, Secret, the
//! service-account token, /etc/hosts...), and its spec's sources are rewritten to the guest's
//! paths. Read-only stays read-only on this side too: a read-only volume is bound read-only, and
//! a read-only rootfs gets its mount points made and is then remounted read-only.
//!
//! The directory is a mount of its own, private then shared, made before virtiofsd starts: its
//! sandbox sees the host's tree as a slave, so mounts made here later reach it. Nothing here
//! ever deletes below a mount point: removal unmounts, then removes only the empty mount points
//! it made.

use std::os::fd::OwnedFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Component, Path, PathBuf};

use bulkhead_protocol::guest::SHARED_DIR;
use containerd_shim::protos::types::mount::Mount;
use nix::errno::Errno;
use nix::fcntl::{openat, openat2, OFlag, OpenHow, ResolveFlag};
use nix::mount::{mount, MsFlags};
use nix::sys::stat::{mkdirat, Mode};
use serde_json::Value;
use tracing::warn;

use super::super::mounts::{mounts_below, unmount_all};

#[derive(Debug, thiserror::Error)]
pub enum ShareError {
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
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> ShareError {
    let path = path.to_owned();
    move |source| ShareError::Io { what, path, source }
}

fn mount_err(what: impl Into<String>, target: &Path) -> impl FnOnce(Errno) -> ShareError {
    let (what, target) = (what.into(), target.to_owned());
    move |source| ShareError::Mount { what, target, source }
}

/// fstab-style options (`ro`, `rbind`, `lowerdir=...`) as mount flags and filesystem data.
fn parse_options(options: &[String]) -> (MsFlags, Option<String>) {
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
            // Propagation is the guest's business; defaults name no change.
            "rprivate" | "private" | "rslave" | "slave" | "rshared" | "shared" | "defaults" | "suid" | "dev"
            | "exec" | "async" => {}
            other => data.push(other.to_string()),
        }
    }
    (flags, (!data.is_empty()).then(|| data.join(",")))
}

/// Makes `target` (a bind mount, and every mount below it) read-only, keeping its other flags.
fn remount_read_only(target: &Path) -> Result<(), ShareError> {
    use nix::sys::statvfs::{statvfs, FsFlags};
    let mut points = mounts_below(target);
    points.reverse(); // shallowest first
    for point in points {
        let have = statvfs(&point).map_err(mount_err("read-only (statvfs)", &point))?.flags();
        let mut flags = MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY;
        for (st, ms) in [
            (FsFlags::ST_NOSUID, MsFlags::MS_NOSUID),
            (FsFlags::ST_NODEV, MsFlags::MS_NODEV),
            (FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
            (FsFlags::ST_NOATIME, MsFlags::MS_NOATIME),
            (FsFlags::ST_NODIRATIME, MsFlags::MS_NODIRATIME),
            (FsFlags::ST_RELATIME, MsFlags::MS_RELATIME),
        ] {
            if have.contains(st) {
                flags.insert(ms);
            }
        }
        mount(None::<&str>, &point, None::<&str>, flags, None::<&str>).map_err(mount_err("read-only", &point))?;
    }
    Ok(())
}

/// Whether an OCI mount is a bind of a host path (the ones the guest reaches through the share).
fn is_bind(m: &Value) -> bool {
    m.get("type").and_then(Value::as_str) == Some("bind")
        || m.get("options")
            .and_then(Value::as_array)
            .is_some_and(|o| o.iter().any(|v| matches!(v.as_str(), Some("bind" | "rbind"))))
}

fn options_of(m: &Value) -> Vec<String> {
    m.get("options")
        .and_then(Value::as_array)
        .map(|o| o.iter().filter_map(Value::as_str).map(str::to_string).collect())
        .unwrap_or_default()
}

/// Opens `relative` below `root`, resolving symlinks as if `root` were `/` (never outside it).
fn open_in_root(root: &OwnedFd, relative: &Path, flags: OFlag) -> Result<OwnedFd, Errno> {
    let how = OpenHow::new()
        .flags(flags | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let path = if relative.as_os_str().is_empty() { Path::new(".") } else { relative };
    openat2(root, path, how)
}

/// Creates `destination` (a directory, or an empty file if `file`) inside the rootfs whose
/// directory is `root`, resolving the image's symlinks inside the rootfs, as runc's securejoin
/// does, so an image cannot aim a root-owned mkdir at the host.
fn make_mount_point(root: &OwnedFd, destination: &str, file: bool) -> Result<(), ShareError> {
    let refuse = |reason: String| ShareError::MountPoint { destination: destination.to_string(), reason };
    let mut names = Vec::new();
    for component in Path::new(destination).components() {
        match component {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(name) => names.push(name),
            _ => return Err(refuse("`..` is not allowed".into())),
        }
    }
    let dir_flags = OFlag::O_PATH | OFlag::O_DIRECTORY;
    for (i, name) in names.iter().enumerate() {
        let prefix: PathBuf = names[..=i].iter().collect();
        let leaf_file = file && i + 1 == names.len();
        let probe = if leaf_file { OFlag::O_PATH } else { dir_flags };
        match open_in_root(root, &prefix, probe) {
            Ok(_) => continue,
            Err(Errno::ENOENT) => {}
            Err(e) => return Err(refuse(format!("{}: {e}", prefix.display()))),
        }
        let parent: PathBuf = names[..i].iter().collect();
        let parent = open_in_root(root, &parent, dir_flags).map_err(|e| refuse(format!("open parent: {e}")))?;
        let made = if leaf_file {
            let flags = OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
            openat(&parent, *name, flags, Mode::from_bits_truncate(0o644)).map(drop)
        } else {
            mkdirat(&parent, *name, Mode::from_bits_truncate(0o755))
        };
        made.map_err(|e| refuse(format!("create {}: {e}", prefix.display())))?;
    }
    Ok(())
}

/// Where containerd binds the pod sandbox's shm into each container, and where the guest agent
/// mounts the pod's own tmpfs.
const POD_SHM: &str = "/dev/shm";

/// `<pod>/shared`: the directory virtiofsd serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedDir {
    pub dir: PathBuf,
}

impl SharedDir {
    pub fn new(dir: PathBuf) -> Self {
        Self { dir }
    }

    /// Makes the directory a mount of its own in a new peer group, so later mounts below it
    /// propagate into virtiofsd's sandbox (a slave of the host's tree).
    pub fn create(&self) -> Result<(), ShareError> {
        std::fs::DirBuilder::new().mode(0o755).create(&self.dir).map_err(io("create", &self.dir))?;
        let d = self.dir.as_path();
        mount(Some(d), d, None::<&str>, MsFlags::MS_BIND, None::<&str>).map_err(mount_err("bind onto itself", d))?;
        mount(None::<&str>, d, None::<&str>, MsFlags::MS_PRIVATE, None::<&str>).map_err(mount_err("private", d))?;
        mount(None::<&str>, d, None::<&str>, MsFlags::MS_SHARED, None::<&str>).map_err(mount_err("shared", d))?;
        Ok(())
    }

    fn container_dir(&self, id: &str) -> Result<PathBuf, ShareError> {
        bulkhead_protocol::stream::validate_id(id).map_err(|_| ShareError::Id(id.to_string()))?;
        Ok(self.dir.join(id))
    }

    /// Shares container `id`: its rootfs from containerd's `mounts` (or a bind of
    /// `bundle_rootfs` when there are none) and the sources of its spec's bind mounts, whose
    /// sources `spec` then names in the guest. Returns the rootfs's path in the guest. On
    /// failure, whatever was done is undone.
    pub fn prepare(
        &self,
        id: &str,
        bundle_rootfs: &Path,
        mounts: &[Mount],
        spec: &mut Value,
    ) -> Result<String, ShareError> {
        let dir = self.container_dir(id)?;
        let result = self.prepare_in(&dir, id, bundle_rootfs, mounts, spec);
        if result.is_err() {
            self.release(id);
        }
        result
    }

    fn prepare_in(
        &self,
        dir: &Path,
        id: &str,
        bundle_rootfs: &Path,
        mounts: &[Mount],
        spec: &mut Value,
    ) -> Result<String, ShareError> {
        let guest = Path::new(SHARED_DIR).join(id);
        let rootfs = dir.join("rootfs");
        let volumes = dir.join("volumes");
        for d in [dir, &rootfs, &volumes] {
            std::fs::DirBuilder::new().mode(0o755).create(d).map_err(io("create", d))?;
        }
        if mounts.is_empty() {
            let flags = MsFlags::MS_BIND | MsFlags::MS_REC;
            mount(Some(bundle_rootfs), &rootfs, None::<&str>, flags, None::<&str>)
                .map_err(mount_err(format!("rootfs {}", bundle_rootfs.display()), &rootfs))?;
        }
        for m in mounts {
            let (flags, data) = parse_options(&m.options);
            let fstype = Some(m.type_.as_str()).filter(|t| !t.is_empty() && *t != "bind");
            mount(Some(m.source.as_str()), &rootfs, fstype, flags, data.as_deref())
                .map_err(mount_err(format!("rootfs {} ({})", m.source, m.type_), &rootfs))?;
        }

        // Mount points a read-only rootfs needs: every destination, a file where a file is bound.
        let mut points = Vec::new();
        let list = spec.pointer_mut("/mounts").and_then(Value::as_array_mut);
        for (index, m) in list.into_iter().flatten().enumerate() {
            let destination = m.get("destination").and_then(Value::as_str).unwrap_or_default().to_string();
            if !is_bind(m) {
                points.push((destination, false));
                continue;
            }
            if destination == POD_SHM {
                // The pod's /dev/shm is the guest's own tmpfs, shared by the pod's containers as
                // containerd's sandbox tmpfs is with runc; a host tmpfs behind virtio-fs would
                // be neither a tmpfs to the container nor memory of the guest.
                m["source"] = Value::String(POD_SHM.into());
                points.push((destination, false));
                continue;
            }
            let bad = |reason: String| ShareError::Spec { index, reason };
            let source = PathBuf::from(m.get("source").and_then(Value::as_str).unwrap_or_default());
            if !source.is_absolute() {
                return Err(bad(format!("bind source {:?} is not an absolute host path", source.display())));
            }
            let meta = std::fs::metadata(&source).map_err(|e| bad(format!("bind source {}: {e}", source.display())))?;
            let target = volumes.join(index.to_string());
            if meta.is_dir() {
                std::fs::DirBuilder::new().mode(0o755).create(&target).map_err(io("create", &target))?;
            } else {
                std::fs::File::create(&target).map_err(io("create", &target))?;
            }
            let options = options_of(m);
            let mut flags = MsFlags::MS_BIND;
            if options.iter().any(|o| o == "rbind") {
                flags.insert(MsFlags::MS_REC);
            }
            mount(Some(&source), &target, None::<&str>, flags, None::<&str>)
                .map_err(mount_err(format!("volume {}", source.display()), &target))?;
            if options.iter().any(|o| o == "ro") {
                remount_read_only(&target)?;
            }
            m["source"] = Value::String(guest.join("volumes").join(index.to_string()).display().to_string());
            points.push((destination, !meta.is_dir()));
        }

        if spec.pointer("/root/readonly").and_then(Value::as_bool) == Some(true) {
            let root = nix::fcntl::open(&rootfs, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
                .map_err(mount_err("open the rootfs", &rootfs))?;
            for (destination, file) in &points {
                make_mount_point(&root, destination, *file)?;
            }
            remount_read_only(&rootfs)?;
        }
        Ok(guest.join("rootfs").display().to_string())
    }

    /// Unmounts what [`SharedDir::prepare`] mounted for `id` and removes its mount points;
    /// idempotent. Never removes anything below a mount that stayed.
    pub fn release(&self, id: &str) {
        let Ok(dir) = self.container_dir(id) else { return };
        unmount_all(&dir);
        let left = mounts_below(&dir);
        if !left.is_empty() {
            warn!(container = id, mounts = ?left, "shared mounts stayed; leaving the container's shared dir");
            return;
        }
        remove_mount_points(&dir);
    }
}

/// Removes `dir` bottom-up, only empty directories and empty files: what [`SharedDir::prepare`]
/// made as mount points. Anything else (a mount that came back, data) stays and is reported.
fn remove_mount_points(dir: &Path) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
        assert!(is_bind(&json!({"type": "bind", "source": "/a", "destination": "/b"})));
        assert!(is_bind(&json!({"source": "/a", "destination": "/b", "options": ["rbind", "ro"]})));
        assert!(!is_bind(&json!({"type": "tmpfs", "source": "tmpfs", "destination": "/tmp"})));
    }

    fn root_of(dir: &Path) -> OwnedFd {
        nix::fcntl::open(dir, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty()).unwrap()
    }

    #[test]
    fn mount_points_stay_inside_the_rootfs_whatever_its_symlinks_say() {
        let scratch = tempfile::tempdir().unwrap();
        let rootfs = scratch.path().join("rootfs");
        let host = scratch.path().join("host");
        std::fs::create_dir_all(rootfs.join("run")).unwrap();
        std::fs::create_dir_all(&host).unwrap();
        // An image's absolute and escaping symlinks resolve inside the rootfs.
        std::os::unix::fs::symlink("/run", rootfs.join("varrun")).unwrap();
        std::os::unix::fs::symlink(&host, rootfs.join("evil")).unwrap();
        std::os::unix::fs::symlink("../../../../host", rootfs.join("up")).unwrap();
        let root = root_of(&rootfs);
        make_mount_point(&root, "/varrun/secrets/token", false).unwrap();
        assert!(rootfs.join("run/secrets/token").is_dir());
        make_mount_point(&root, "/etc/hosts", true).unwrap();
        assert!(rootfs.join("etc/hosts").is_file());
        make_mount_point(&root, "/etc/hosts", true).unwrap(); // already there: fine
        for escape in ["/evil/x", "/up/y"] {
            let _ = make_mount_point(&root, escape, false);
        }
        assert_eq!(std::fs::read_dir(&host).unwrap().count(), 0, "nothing was made outside the rootfs");
        assert!(make_mount_point(&root, "/a/../b", false).is_err());
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

    /// Unmounts everything below the test's scratch dir, also when the test fails.
    struct Unmount(PathBuf);

    impl Drop for Unmount {
        fn drop(&mut self) {
            unmount_all(&self.0);
        }
    }

    fn is_root(test: &str) -> bool {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        if !root {
            println!("SKIPPED: {test}: mounting needs root");
        }
        root
    }

    fn read_only(path: &Path) -> bool {
        std::fs::write(path, b"x").err().and_then(|e| e.raw_os_error()) == Some(libc::EROFS)
    }

    #[test]
    fn a_container_is_shared_and_read_only_stays_read_only() {
        if !is_root("a_container_is_shared_and_read_only_stays_read_only") {
            return;
        }
        let scratch = tempfile::tempdir().unwrap();
        let _unmount = Unmount(scratch.path().to_owned());
        let s = |p: &str| scratch.path().join(p);
        std::fs::create_dir_all(s("image/run")).unwrap();
        std::os::unix::fs::symlink("/run", s("image/varrun")).unwrap();
        std::fs::create_dir_all(s("rw")).unwrap();
        std::fs::write(s("rw/old"), b"old").unwrap();
        std::fs::create_dir_all(s("ro")).unwrap();
        std::fs::write(s("ro/token"), b"secret").unwrap();
        std::fs::write(s("hosts"), b"127.0.0.1 localhost\n").unwrap();
        let shared = SharedDir::new(s("shared"));
        shared.create().unwrap();
        let mut spec = json!({
            "root": {"path": "rootfs", "readonly": true},
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/data", "type": "bind", "source": s("rw"), "options": ["rbind", "rw"]},
                {"destination": "/varrun/secrets", "type": "bind", "source": s("ro"), "options": ["rbind", "ro"]},
                {"destination": "/etc/hosts", "type": "bind", "source": s("hosts"), "options": ["rbind", "ro"]},
                {"destination": "/dev/shm", "type": "bind", "source": s("sandbox-shm"), "options": ["rbind", "rw"]},
            ]
        });
        let rootfs = shared.prepare("c1", &s("image"), &[], &mut spec).unwrap();
        assert_eq!(rootfs, format!("{SHARED_DIR}/c1/rootfs"));
        assert_eq!(spec["mounts"][0]["source"], "proc");
        for n in 1..=3 {
            assert_eq!(spec["mounts"][n]["source"], format!("{SHARED_DIR}/c1/volumes/{n}"));
        }
        // The sandbox's shm is the guest's pod-wide tmpfs, not a host directory.
        assert_eq!(spec["mounts"][4]["source"], "/dev/shm");
        assert!(!s("shared/c1/volumes/4").exists());
        let c1 = s("shared/c1");
        // A read-write volume is the host directory itself.
        assert_eq!(std::fs::read(c1.join("volumes/1/old")).unwrap(), b"old");
        std::fs::write(c1.join("volumes/1/new"), b"new").unwrap();
        assert_eq!(std::fs::read(s("rw/new")).unwrap(), b"new");
        // Read-only volumes, a file among them, and the rootfs are read-only on the host side.
        assert_eq!(std::fs::read(c1.join("volumes/2/token")).unwrap(), b"secret");
        assert!(read_only(&c1.join("volumes/2/token")));
        assert!(read_only(&c1.join("volumes/3")));
        assert!(read_only(&c1.join("rootfs/new-file")));
        // ... after the mount points the guest needs were made, through the image's symlink.
        assert!(c1.join("rootfs/proc").is_dir() && c1.join("rootfs/data").is_dir());
        assert!(c1.join("rootfs/run/secrets").is_dir());
        assert!(c1.join("rootfs/etc/hosts").is_file());
        assert!(c1.join("rootfs/dev/shm").is_dir());

        shared.release("c1");
        assert!(!c1.exists());
        assert!(mounts_below(&s("shared")).len() == 1, "only the shared dir itself stays mounted");
        assert_eq!(std::fs::read(s("rw/old")).unwrap(), b"old", "volumes keep their data");
        assert_eq!(std::fs::read(s("ro/token")).unwrap(), b"secret");
    }

    #[test]
    fn a_failed_share_undoes_itself() {
        if !is_root("a_failed_share_undoes_itself") {
            return;
        }
        let scratch = tempfile::tempdir().unwrap();
        let _unmount = Unmount(scratch.path().to_owned());
        std::fs::create_dir_all(scratch.path().join("image")).unwrap();
        std::fs::create_dir_all(scratch.path().join("vol")).unwrap();
        let shared = SharedDir::new(scratch.path().join("shared"));
        shared.create().unwrap();
        let mut spec = json!({"mounts": [
            {"destination": "/a", "type": "bind", "source": scratch.path().join("vol"), "options": ["rbind"]},
            {"destination": "/b", "type": "bind", "source": "/nonexistent/volume", "options": ["rbind"]},
        ]});
        let err = shared.prepare("c1", &scratch.path().join("image"), &[], &mut spec).unwrap_err();
        assert!(err.to_string().contains("mounts[1]") && err.to_string().contains("/nonexistent/volume"), "{err}");
        assert!(!scratch.path().join("shared/c1").exists());
        assert_eq!(mounts_below(&scratch.path().join("shared")).len(), 1);
        assert!(matches!(shared.prepare("../x", Path::new("/"), &[], &mut json!({})), Err(ShareError::Id(_))));
    }
}
