//! The pod's shared directory on the host: what virtiofsd serves and the guest mounts at
//! `bulkhead_protocol::guest::SHARED_DIR`. Each container gets `<id>/rootfs` (containerd's rootfs
//! mounts) and `<id>/volumes/<n>` (a bind of the source of its OCI spec's n-th bind mount:
//! emptyDir, hostPath, ConfigMap, Secret, the service-account token, /etc/hosts...), and its
//! spec's sources are rewritten to the guest's paths.
//!
//! The guest is hostile and root in its VM, so it must not be able to write anywhere the host
//! later resolves by path (the class of Kata's CVE-2020-2023/2026: a symlink planted where the
//! host is about to mount). Three directories, after Kata's split of private and shared:
//! ```text
//! <pod>/shared.mounts/   host-only (0700): the shim makes mount points and mounts here; a mount
//!                        of its own in a peer group of its own
//! <pod>/shared/          what virtiofsd serves: a read-only bind of shared.mounts, a slave of
//!                        it, so every mount made there appears here (and in virtiofsd's copy,
//!                        a slave too), while the directories around them are read-only
//! <pod>/shared.staging/  host-only and private: every bind of a host path is made here, made
//!                        private (or a slave, as its spec asks: [`bind_propagation`]) and, if
//!                        read-only, read-only, then moved into shared.mounts, because mount
//!                        flags reach a propagated copy only when the mount is created, never by
//!                        a later remount; and a bind made straight into shared.mounts would join
//!                        its source's peer group, so that what the host mounts below a readOnly
//!                        hostPath later (another pod's secret tmpfs) would reach the guest with
//!                        its own, writable, flags
//! ```
//! Containers' writable rootfs and volumes stay writable from the guest, exactly as the spec
//! says; read-only ones are read-only in every copy. Host-side operations in shared.mounts still
//! go by descriptor where they create ([`make_mount_point`]): nothing there is the guest's, but
//! an image's symlinks are. Removal unmounts, then removes only the empty mount points it made.

use std::ffi::OsStr;
use std::os::fd::OwnedFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use bulkhead_protocol::guest::SHARED_DIR;
use containerd_shim::protos::types::mount::Mount;
use nix::errno::Errno;
use nix::fcntl::{openat, openat2, OFlag, OpenHow, ResolveFlag};
use nix::mount::{mount, MsFlags};
use nix::sys::stat::{mkdirat, Mode};
use oci_spec::runtime::{Mount as SpecMount, Spec};
use tracing::warn;

use super::super::container_tree::{Binder, ContainerTree, Volume};
use super::super::idmap::{take_rootfs_maps, IdmapUserns};
use super::super::mounts::{
    attach_clone, bind_propagation, flags_only, io, is_bind, make_point, mount_err, mount_idmapped_rootfs,
    mount_rootfs, mounts_below, remove_mount_points, unmount_all, CloneAttrs, MountError,
};

/// Makes `target` (a bind mount, and every mount below it) read-only, keeping its other flags.
fn remount_read_only(target: &Path) -> Result<(), MountError> {
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
fn make_mount_point(root: &OwnedFd, destination: &str, file: bool) -> Result<(), MountError> {
    let refuse = |reason: String| MountError::MountPoint { destination: destination.to_string(), reason };
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

/// The pod's shared directory and the two host-only directories behind it (module docs).
#[derive(Debug, Clone)]
pub struct SharedDir {
    /// What virtiofsd serves: a read-only view of `<dir>.mounts`, where the shim mounts.
    pub dir: PathBuf,
    tree: ContainerTree,
    /// Where every bind is finished before it moves into the tree: `<dir>.staging`.
    staging: Staging,
}

/// How the vm backend binds: in the private staging directory, where a mount gets its
/// propagation and read-only flag, then moved into the tree (module docs).
#[derive(Debug, Clone)]
struct Staging {
    dir: PathBuf,
    /// A hostUsers: false pod's id maps, which its containers' rootfs and volumes are idmapped
    /// with (crate::sandbox::idmap): virtiofsd then serves the guest the ids the pod's user
    /// namespace expects, and stores what the pod's root writes as the volume's own root's.
    userns: Option<Arc<IdmapUserns>>,
}

/// `dir` with `suffix` appended to its last component.
fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    dir.with_file_name(name)
}

fn bind(source: &Path, target: &Path, flags: MsFlags, what: String) -> Result<(), MountError> {
    mount(Some(source), target, None::<&str>, MsFlags::MS_BIND | flags, None::<&str>).map_err(mount_err(what, target))
}

/// Moves the mount at `from` (below the private staging dir) to `to` (below the tree), where it
/// propagates to the shared view and virtiofsd with the flags it has now.
fn move_mount(from: &Path, to: &Path) -> Result<(), MountError> {
    mount(Some(from), to, None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(mount_err(format!("move {}", from.display()), to))
}

impl Staging {
    /// Where container `id`'s mount `what` is staged.
    fn staged(&self, id: &str, what: &str) -> PathBuf {
        self.dir.join(format!("{id}.{what}"))
    }
}

impl Binder for Staging {
    fn rootfs(
        &self,
        id: &str,
        bundle_rootfs: &Path,
        mounts: &[Mount],
        spec: &Spec,
        rootfs: &Path,
    ) -> Result<(), MountError> {
        // Where it is read-only or a bind of the host's, mounted and finished in staging, then
        // moved (a fresh overlay has no peer group to leave).
        let read_only_root = spec.root().as_ref().and_then(|r| r.readonly()) == Some(true);
        let staged_root = read_only_root || mounts.is_empty();
        let root_at = if staged_root { self.staged(id, "rootfs") } else { rootfs.to_path_buf() };
        if staged_root {
            make_point(&root_at, false)?;
        }
        if mounts.is_empty() {
            bind(bundle_rootfs, &root_at, MsFlags::MS_REC, format!("rootfs {}", bundle_rootfs.display()))?;
            flags_only(&root_at, MsFlags::MS_PRIVATE | MsFlags::MS_REC, "rootfs private")?;
        }
        // No nodev: a device node on the share opens the guest's own device, never the host's.
        for m in mounts {
            match (take_rootfs_maps(self.userns.as_deref(), &m.options)?, self.userns.as_deref()) {
                ((options, true), Some(userns)) => {
                    let scratch = self.staged(id, "layers");
                    mount_idmapped_rootfs(m, options, &root_at, &scratch, userns, MsFlags::empty())?
                }
                _ => mount_rootfs(std::slice::from_ref(m), &root_at, MsFlags::empty())?,
            }
        }
        if read_only_root {
            // Mount points a read-only rootfs needs: every destination, a file where a file is
            // bound (the guest's runtime cannot make them in a read-only tree).
            let root = nix::fcntl::open(&root_at, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
                .map_err(mount_err("open the rootfs", &root_at))?;
            // In an idmapped rootfs, as the pod's root: an idmapped bind refuses ids its maps leave
            // out (root's), and in an overlay the points are then the pod root's, as runc makes them.
            let idmapped = self.userns.as_deref().filter(|_| mounts.iter().any(|m| has_id_maps(&m.options)));
            for (destination, file) in mount_points(spec) {
                match idmapped {
                    Some(userns) => userns.as_pod_root(|| make_mount_point(&root, &destination, file))?,
                    None => make_mount_point(&root, &destination, file)?,
                }
            }
            remount_read_only(&root_at)?;
        }
        if staged_root {
            move_mount(&root_at, rootfs)?;
        }
        Ok(())
    }

    fn volume(&self, id: &str, v: &Volume<'_>) -> Result<(), MountError> {
        let recursive = if v.options.iter().any(|o| o == "rbind") { MsFlags::MS_REC } else { MsFlags::empty() };
        // Bound, cut from (or made a slave of) its source's peer group and finished in staging,
        // then moved (module docs).
        let staged = self.staged(id, &format!("volume-{}", v.index));
        make_point(&staged, !v.is_dir)?;
        match self.userns.as_deref().filter(|_| v.idmap) {
            Some(userns) => {
                let attrs = CloneAttrs {
                    recursive: !recursive.is_empty(),
                    read_only: false,
                    nodev: false,
                    propagation: MsFlags::MS_PRIVATE,
                    idmap: Some(userns.fd()),
                };
                attach_clone(v.source, &staged, attrs)
                    .map_err(mount_err(format!("volume {}, idmapped", v.source.display()), &staged))?
            }
            None => bind(v.source, &staged, recursive, format!("volume {}", v.source.display()))?,
        }
        flags_only(&staged, bind_propagation(v.options), "volume propagation")?;
        if v.options.iter().any(|o| o == "ro") {
            remount_read_only(&staged)?;
        }
        move_mount(&staged, v.target)
    }

    /// The pod's /dev/shm is the guest's own tmpfs, shared by the pod's containers as
    /// containerd's sandbox tmpfs is with runc; a host tmpfs behind virtio-fs would be neither a
    /// tmpfs to the container nor memory of the guest.
    fn idmap_userns(&self) -> Option<&IdmapUserns> {
        self.userns.as_deref()
    }

    fn own_source(&self, m: &SpecMount) -> Option<PathBuf> {
        is_pod_shm(m).then(|| POD_SHM.into())
    }

    /// Removes container `id`'s staging entries (mount points a move emptied, or leftovers of a
    /// failed prepare, unmounted first).
    fn clear(&self, id: &str) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return };
        let prefix = format!("{id}.");
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                let path = entry.path();
                unmount_all(&path);
                if !mounts_below(&path).is_empty() {
                    warn!(path = %path.display(), "a staged mount stayed; left");
                } else if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    remove_mount_points(&path);
                } else if let Err(e) = std::fs::remove_file(&path) {
                    warn!(path = %path.display(), "remove a staged mount point: {e}");
                }
            }
        }
    }
}

impl SharedDir {
    pub fn new(dir: PathBuf) -> Self {
        let tree = ContainerTree::new(sibling(&dir, ".mounts"), dir.clone());
        Self { tree, staging: Staging { dir: sibling(&dir, ".staging"), userns: None }, dir }
    }

    /// The same, its containers' mounts idmapped with a hostUsers: false pod's maps.
    pub fn with_idmap(mut self, userns: Option<Arc<IdmapUserns>>) -> Self {
        self.staging.userns = userns;
        self
    }

    /// The directory the shim mounts in, whose root the guest sees as the share's.
    pub fn mounts_dir(&self) -> PathBuf {
        sibling(&self.dir, ".mounts")
    }

    /// Makes the three directories and their mounts (module docs): the tree a peer group of its
    /// own, staging private, and `dir` a read-only slave view of the tree. Before virtiofsd
    /// starts, so its copy of `dir` receives what is mounted later.
    pub fn create(&self) -> Result<(), MountError> {
        let staging = &self.staging.dir;
        std::fs::DirBuilder::new().mode(0o700).create(staging).map_err(io("create", staging))?;
        bind(staging, staging, MsFlags::empty(), "bind onto itself".into())?;
        flags_only(staging, MsFlags::MS_PRIVATE, "private")?;
        self.tree.create()
    }

    /// Shares container `id` ([`ContainerTree::prepare`]): its spec's sources then name the
    /// guest's paths. Returns the rootfs's path in the guest.
    pub fn prepare(
        &self,
        id: &str,
        bundle_rootfs: &Path,
        mounts: &[Mount],
        spec: &mut Spec,
    ) -> Result<String, MountError> {
        let rootfs = self.tree.prepare(&self.staging, id, bundle_rootfs, mounts, spec, Path::new(SHARED_DIR))?;
        Ok(rootfs.display().to_string())
    }

    /// Unmounts what [`SharedDir::prepare`] mounted for `id` and removes its mount points;
    /// idempotent. Never removes anything below a mount that stayed.
    pub fn release(&self, id: &str) {
        self.tree.release(&self.staging, id)
    }
}

/// Whether a rootfs mount's options carry id maps (containerd's `uidmap=`).
fn has_id_maps(options: &[String]) -> bool {
    options.iter().any(|o| o.starts_with("uidmap="))
}

/// Whether `m` is the mount of the pod's /dev/shm (the destination exactly as containerd names it).
fn is_pod_shm(m: &SpecMount) -> bool {
    m.destination().as_os_str() == OsStr::new(POD_SHM)
}

/// The destinations of `spec`'s mounts, each with whether a file is bound there.
fn mount_points(spec: &Spec) -> Vec<(String, bool)> {
    spec.mounts()
        .iter()
        .flatten()
        .map(|m| {
            let destination = m.destination().to_string_lossy().into_owned();
            let source = m.source().as_deref();
            let file = is_bind(m)
                && !is_pod_shm(m)
                && source.is_some_and(|s| s.is_absolute() && std::fs::metadata(s).is_ok_and(|m| !m.is_dir()));
            (destination, file)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A spec as containerd writes it (JSON), parsed as the shim parses it.
    fn oci(json: impl serde::Serialize) -> Spec {
        serde_json::from_slice(&serde_json::to_vec(&json).unwrap()).unwrap()
    }

    fn sources(spec: &Spec) -> Vec<PathBuf> {
        spec.mounts().iter().flatten().map(|m| m.source().clone().unwrap_or_default()).collect()
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
        let mut spec = oci(json!({
            "root": {"path": "rootfs", "readonly": true},
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/data", "type": "bind", "source": s("rw"), "options": ["rbind", "rw"]},
                {"destination": "/varrun/secrets", "type": "bind", "source": s("ro"), "options": ["rbind", "ro"]},
                {"destination": "/etc/hosts", "type": "bind", "source": s("hosts"), "options": ["rbind", "ro"]},
                {"destination": "/dev/shm", "type": "bind", "source": s("sandbox-shm"), "options": ["rbind", "rw"]},
            ]
        }));
        let rootfs = shared.prepare("c1", &s("image"), &[], &mut spec).unwrap();
        assert_eq!(rootfs, format!("{SHARED_DIR}/c1/rootfs"));
        let volume = |n: usize| Path::new(SHARED_DIR).join(format!("c1/volumes/{n}"));
        // The sandbox's shm is the guest's pod-wide tmpfs, not a host directory.
        let want = ["proc".into(), volume(1), volume(2), volume(3), "/dev/shm".into()];
        assert_eq!(sources(&spec), want);
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

    /// Mounts `shared`'s view at `at` as virtiofsd's sandbox does: a clone that receives
    /// what is mounted later, never sends.
    fn virtiofsd_view(shared: &Path, at: &Path) {
        std::fs::create_dir_all(at).unwrap();
        mount(Some(shared), at, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REC, None::<&str>).unwrap();
        mount(None::<&str>, at, None::<&str>, MsFlags::MS_SLAVE | MsFlags::MS_REC, None::<&str>).unwrap();
    }

    #[test]
    fn read_only_stays_read_only_in_virtiofsds_copy() {
        if !is_root("read_only_stays_read_only_in_virtiofsds_copy") {
            return;
        }
        let scratch = tempfile::tempdir().unwrap();
        let _unmount = Unmount(scratch.path().to_owned());
        let s = |p: &str| scratch.path().join(p);
        std::fs::create_dir_all(s("image/etc")).unwrap();
        for d in ["rw", "ro"] {
            std::fs::create_dir_all(s(d)).unwrap();
            std::fs::write(s(d).join("f"), d).unwrap();
        }
        let shared = SharedDir::new(s("shared"));
        shared.create().unwrap();
        // virtiofsd copies the tree when it starts, before any container exists.
        virtiofsd_view(&s("shared"), &s("virtiofsd"));
        let mut spec = oci(json!({
            "root": {"path": "rootfs", "readonly": true},
            "mounts": [
                {"destination": "/rw", "type": "bind", "source": s("rw"), "options": ["rbind", "rw"]},
                {"destination": "/ro", "type": "bind", "source": s("ro"), "options": ["rbind", "ro"]},
            ]
        }));
        shared.prepare("c1", &s("image"), &[], &mut spec).unwrap();
        let seen = s("virtiofsd/c1");
        assert_eq!(std::fs::read(seen.join("volumes/1/f")).unwrap(), b"ro");
        assert!(read_only(&seen.join("volumes/1/new")), "a read-only volume in virtiofsd's copy");
        assert!(read_only(&seen.join("rootfs/new")), "a read-only rootfs in virtiofsd's copy");
        std::fs::write(seen.join("volumes/0/new"), b"guest").unwrap();
        assert_eq!(std::fs::read(s("rw/new")).unwrap(), b"guest", "a read-write volume stays writable");
        assert!(read_only(&seen.join("planted")), "the directories around the mounts");
        assert!(!s("ro/new").exists());
        shared.release("c1");
        assert!(!seen.exists(), "removal reaches virtiofsd's copy");
    }

    /// A readOnly hostPath whose source is in a shared peer group (as kubelet's directories are
    /// on a systemd host): a tmpfs the host mounts below it after the pod started (another pod's
    /// secret volume) reaches neither the share nor virtiofsd's copy. With `rslave` (CRI's
    /// HostToContainer) it does, as the spec asks.
    #[test]
    fn the_hosts_later_mounts_below_a_volume_do_not_reach_the_share() {
        if !is_root("the_hosts_later_mounts_below_a_volume_do_not_reach_the_share") {
            return;
        }
        let scratch = tempfile::tempdir().unwrap();
        let _unmount = Unmount(scratch.path().to_owned());
        let s = |p: &str| scratch.path().join(p);
        for d in ["image/etc", "pods/other", "slave/other"] {
            std::fs::create_dir_all(s(d)).unwrap();
        }
        // The host's side: each source a mount of its own in a shared peer group.
        for source in [s("pods"), s("slave")] {
            mount(Some(&source), &source, None::<&str>, MsFlags::MS_BIND, None::<&str>).unwrap();
            mount(None::<&str>, &source, None::<&str>, MsFlags::MS_PRIVATE, None::<&str>).unwrap();
            mount(None::<&str>, &source, None::<&str>, MsFlags::MS_SHARED, None::<&str>).unwrap();
        }
        let shared = SharedDir::new(s("shared"));
        shared.create().unwrap();
        virtiofsd_view(&s("shared"), &s("virtiofsd"));
        let mut spec = oci(json!({
            "root": {"path": "rootfs"},
            "mounts": [
                {"destination": "/pods", "type": "bind", "source": s("pods"), "options": ["rbind", "rprivate", "ro"]},
                {"destination": "/slave", "type": "bind", "source": s("slave"), "options": ["rbind", "rslave", "ro"]},
            ]
        }));
        shared.prepare("c1", &s("image"), &[], &mut spec).unwrap();
        // Later, on the host: a tmpfs below each source, with a secret in it.
        for source in [s("pods/other"), s("slave/other")] {
            mount(Some("tmpfs"), &source, Some("tmpfs"), MsFlags::empty(), Some("size=64k")).unwrap();
            std::fs::write(source.join("secret"), b"token").unwrap();
        }
        for view in [s("shared/c1"), s("virtiofsd/c1")] {
            let secret = view.join("volumes/0/other/secret");
            assert!(!secret.exists(), "{}: the host's later mount reached the share", secret.display());
            assert!(read_only(&view.join("volumes/0/other/planted")), "{}", view.display());
            // Asked for: the host's later mounts come through, as runc gives them.
            let followed = view.join("volumes/1/other/secret");
            assert_eq!(std::fs::read(&followed).unwrap(), b"token", "{}", followed.display());
        }
        shared.release("c1");
        assert!(!s("shared/c1").exists());
    }

    #[test]
    fn a_hostile_guest_cannot_plant_links_where_the_host_mounts() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        if !is_root("a_hostile_guest_cannot_plant_links_where_the_host_mounts") {
            return;
        }
        let scratch = tempfile::tempdir().unwrap();
        let _unmount = Unmount(scratch.path().to_owned());
        let s = |p: &str| scratch.path().join(p);
        for d in ["image/etc", "vol", "decoy"] {
            std::fs::create_dir_all(s(d)).unwrap();
        }
        std::fs::write(s("vol/data"), b"keep").unwrap();
        std::fs::write(s("hosts"), b"127.0.0.1 localhost\n").unwrap();
        let shared = SharedDir::new(s("shared"));
        shared.create().unwrap();
        let spec = || {
            oci(json!({
                "root": {"path": "rootfs", "readonly": true},
                "mounts": [
                    {"destination": "/data", "type": "bind", "source": s("vol"), "options": ["rbind", "rw"]},
                    {"destination": "/etc/hosts", "type": "bind", "source": s("hosts"), "options": ["rbind", "ro"]},
                ]
            }))
        };
        // The guest, through virtiofsd, in a tight loop: links at every path the host makes or
        // mounts onto, pointing at a host directory, and directories swapped for links.
        let stop = Arc::new(AtomicBool::new(false));
        let (view, decoy, stop2) = (s("shared"), s("decoy"), stop.clone());
        let guest = std::thread::spawn(move || {
            let mut refused = 0u64;
            let targets = ["c1", "c1/rootfs", "c1/volumes", "c1/volumes/0", "c1/volumes/1", "c1/rootfs/etc"];
            while !stop2.load(Ordering::Relaxed) {
                for t in targets {
                    let at = view.join(t);
                    let _ = std::fs::rename(&at, view.join(format!("{t}.moved").replace('/', "_")));
                    match std::os::unix::fs::symlink(&decoy, &at) {
                        Err(e) if e.raw_os_error() == Some(libc::EROFS) => refused += 1,
                        _ => {}
                    }
                }
            }
            refused
        });
        for _ in 0..20 {
            let mut sp = spec();
            shared.prepare("c1", &s("image"), &[], &mut sp).unwrap();
            assert_eq!(std::fs::read(s("shared/c1/volumes/0/data")).unwrap(), b"keep");
            shared.release("c1");
        }
        stop.store(true, Ordering::Relaxed);
        let refused = guest.join().unwrap();
        assert!(refused > 0, "the guest's writes were tried and refused");
        assert_eq!(std::fs::read_dir(s("decoy")).unwrap().count(), 0, "nothing was made in the host's directory");
        assert!(mounts_below(&s("decoy")).is_empty(), "nothing was mounted on the host's directory");
        assert_eq!(std::fs::read(s("vol/data")).unwrap(), b"keep");
        let outside: Vec<_> = mounts_below(scratch.path())
            .into_iter()
            .filter(|m| ![s("shared"), s("shared.mounts"), s("shared.staging")].contains(m))
            .collect();
        assert!(outside.is_empty(), "mounts outside the share: {outside:?}");
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
        let mut spec = oci(json!({"mounts": [
            {"destination": "/a", "type": "bind", "source": scratch.path().join("vol"), "options": ["rbind"]},
            {"destination": "/b", "type": "bind", "source": "/nonexistent/volume", "options": ["rbind"]},
        ]}));
        let err = shared.prepare("c1", &scratch.path().join("image"), &[], &mut spec).unwrap_err();
        assert!(err.to_string().contains("mounts[1]") && err.to_string().contains("/nonexistent/volume"), "{err}");
        assert!(!scratch.path().join("shared/c1").exists());
        assert_eq!(mounts_below(&scratch.path().join("shared")).len(), 1);
        assert!(matches!(shared.prepare("../x", Path::new("/"), &[], &mut Spec::default()), Err(MountError::Id(_))));
    }
}
