//! emptyDir `sizeLimit`, enforced where the data lives: a limited emptyDir of a pod is an ext4
//! filesystem of exactly its limit, which the host kernel mounts for the pod, so a writer that
//! fills it gets ENOSPC and the node's disk never gives the volume more than the limit. Without
//! this, only kubelet's eviction bounds an emptyDir, after the fact; and on the vm backend
//! virtiofsd writes as root, so no quota of the writer's applies.
//!
//! **Which mounts, which limits** ([`EmptyDirPolicy`]). CRI carries no sizeLimit, and an
//! emptyDir reaches the shim as a bind mount of kubelet's directory
//! `<kubelet root>/pods/<pod uid>/volumes/kubernetes.io~empty-dir/<volume name>`. The limits come
//! from the pod annotation [`crate::annotations::EMPTYDIR_SIZE_LIMITS`] (`scratch=1Gi, cache=500Mi`:
//! an operator or a mutating webhook copies the volumes' `sizeLimit` there; containerd passes it
//! because the installer's handler allows `bulkhead.io/*`), else from the shim config's
//! `emptydir.default_size_limit`; `emptydir.max_size_limit` caps both. A bind source is that
//! pod's emptyDir when its last five components are `pods/<the pod's UID>/volumes/
//! kubernetes.io~empty-dir/<name>` (the UID is containerd's `io.kubernetes.cri.sandbox-uid`;
//! kubelet's root is configurable, so only the tail is matched). Annotations are read once, from
//! the sandbox's spec, so every container of the pod sees the same limits.
//!
//! **The disk** ([`PodEmptyDirs`]). The first container that mounts a limited emptyDir makes its
//! disk; later ones (init containers, restarts, sidecars) get the same one:
//! ```text
//! <kubelet's volume dir>/.bulkhead-emptydir.ext4   sparse file of the limit, ext4 (image.rs)
//! /dev/loopN                                       over it, autoclear (loopdev.rs)
//! <pod>/emptydir/                                  host-only (0700), a private mount of its own
//! <pod>/emptydir/<name>                            the ext4, nosuid, nodev, discard
//! ```
//! and the container's spec names `<pod>/emptydir/<name>` as the bind source instead of
//! kubelet's directory; the backends then share it like any volume (the vm backend binds it into
//! the directory virtiofsd serves, the namespace backend into the agent's view). The volume's
//! root takes the owner and mode kubelet gave its directory (0777, or fsGroup's group and
//! setgid), and loses mke2fs's `lost+found`, so the container sees the empty directory it
//! would see with runc. ext4's metadata takes its share of the limit (about 12% of 32 MiB, 5%
//! of 1 GiB, 2.5% of 10 GiB): the node gives at most the limit, the volume holds a little less.
//! `discard` punches deleted files' blocks out of the image, so the node gets them back, as it
//! would from a plain directory.
//!
//! **Lifetime.** The mount belongs to the pod, not to a container, so data survives container
//! restarts. Teardown unmounts everything below the pod's state dir (also `delete` after a shim
//! crash); the loop device detaches itself when the filesystem goes. The image stays with
//! kubelet's volume directory, which kubelet removes with the pod: a sandbox kubelet recreates
//! for the same pod mounts the same image again, as runc would show it the same directory.
//! kubelet's own usage walk of the directory counts the image's allocated blocks, so its
//! ephemeral-storage accounting and eviction go on working; a full volume is at most its limit
//! (plus the host filesystem's extent blocks for the file), so kubelet's per-volume eviction,
//! which evicts above the limit, is not triggered by a volume this keeps at it.
//!
//! **Not limited:** emptyDirs kubelet already backs with memory (`medium: Memory` is a tmpfs
//! kubelet mounts with `size=` the sizeLimit; hugepages), left as they are; and a `subPath` of a
//! limited emptyDir is refused (kubelet binds a directory inside its own volume directory, which
//! the pod's disk does not hold). A pod whose containerd passes no pod UID cannot name its
//! emptyDirs: a limits annotation is then refused.
//!
//! **A hostile guest** gains nothing: it reaches the volume's files through virtiofsd (or a
//! container, through a bind mount), never the image's blocks, so the host's ext4 driver parses
//! only metadata it wrote itself; the names and sizes come from the spec containerd wrote, never
//! from the guest; filling the volume only fills the volume.

pub mod image;
pub mod loopdev;
pub mod size_limits;

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

use nix::errno::Errno;
use nix::fcntl::{open, OFlag};
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::stat::{fchmod, Mode};
use nix::unistd::{fchown, unlinkat, Gid, Uid, UnlinkatFlags};
use oci_spec::runtime::Spec;
use tracing::{info, warn};

use self::size_limits::is_volume_name;
use super::mounts::is_bind;
use super::paths::PodPaths;
use crate::annotations::EMPTYDIR_SIZE_LIMITS;
use crate::config::{EmptyDirConfig, MAX_EMPTYDIR_BYTES};
use crate::spec::{BundleSpec, SpecError};

/// kubelet's directory of a pod's emptyDir volumes, below `<root>/pods/<uid>/volumes/`.
const EMPTY_DIR_PLUGIN: &str = "kubernetes.io~empty-dir";
/// ext4 mount options: give deleted blocks back to the node (module docs); a filesystem error
/// stops writes instead of letting them go on.
const MOUNT_DATA: &str = "discard,errors=remount-ro";

#[derive(Debug, thiserror::Error)]
pub enum EmptyDirError {
    #[error("{what} {path}: {source}")]
    Sys { what: &'static str, path: PathBuf, source: Errno },
    #[error("{what} {path}: {source}")]
    Io { what: &'static str, path: PathBuf, source: std::io::Error },
    #[error("emptyDir image {path}: {reason}")]
    Image { path: PathBuf, reason: String },
    #[error("{mkfs} on {image}: {reason}")]
    Mkfs { mkfs: PathBuf, image: PathBuf, reason: String },
    #[error("emptyDir {name}: a loop device for {image}: {source}")]
    Loop { name: String, image: PathBuf, source: Errno },
    #[error(
        "emptyDir {name} has a size limit, and a subPath of it cannot be limited (kubelet binds a directory \
         of its own volume directory, which the limited volume does not hold); mount the whole volume, or \
         leave this volume out of {EMPTYDIR_SIZE_LIMITS}"
    )]
    SubPath { name: String },
}

fn sys(what: &'static str, path: &Path) -> impl FnOnce(Errno) -> EmptyDirError {
    let path = path.to_owned();
    move |source| EmptyDirError::Sys { what, path, source }
}

/// Whether `s` can be one path component: kubelet names the pod's directory by its UID.
fn is_component(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains(['/', '\0']) && s.len() <= 255
}

/// A bind mount's source, as far as emptyDir limits care.
#[derive(Debug, PartialEq, Eq)]
pub enum Volume<'a> {
    /// kubelet's directory of this pod's emptyDir `name`.
    EmptyDir {
        name: &'a str,
    },
    /// kubelet's bind of a subPath of this pod's volume `name`; `volume_dir` is where that
    /// volume's directory is if it is an emptyDir.
    SubPath {
        name: &'a str,
        volume_dir: PathBuf,
    },
    Other,
}

/// The limits of one pod's emptyDirs (module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EmptyDirPolicy {
    pod_uid: Option<String>,
    limits: BTreeMap<String, u64>,
    default: Option<u64>,
}

impl EmptyDirPolicy {
    /// The policy for the pod of sandbox spec `spec`: its annotation, the node's default and
    /// ceiling. A malformed annotation, one above the ceiling, or one the shim could not apply
    /// (no pod UID) is an error naming the annotation, so RunPodSandbox fails saying why.
    pub fn for_pod(config: &EmptyDirConfig, spec: &BundleSpec) -> Result<Self, SpecError> {
        let max = config.max_size_limit.map_or(MAX_EMPTYDIR_BYTES, |b| b.0);
        let limits = spec.emptydir_size_limits(max)?;
        let pod_uid = spec.pod_uid().filter(|uid| is_component(uid)).map(str::to_string);
        if !limits.is_empty() && pod_uid.is_none() {
            return Err(SpecError::Annotation {
                key: EMPTYDIR_SIZE_LIMITS,
                message: "containerd passed no usable pod UID (io.kubernetes.cri.sandbox-uid), so the pod's \
                          emptyDir directories cannot be told from other bind mounts"
                    .into(),
            });
        }
        Ok(Self { pod_uid, limits, default: config.default_size_limit.map(|b| b.0) })
    }

    /// Whether no emptyDir of the pod can have a limit (the usual case: nothing to do).
    pub fn is_unlimited(&self) -> bool {
        self.pod_uid.is_none() || (self.limits.is_empty() && self.default.is_none())
    }

    /// The limit of emptyDir `name`: the pod's own, else the node's default.
    pub fn limit_of(&self, name: &str) -> Option<u64> {
        self.limits.get(name).copied().or(self.default)
    }

    /// What the bind source `source` is (module docs); only plain absolute paths match.
    pub fn classify<'a>(&self, source: &'a Path) -> Volume<'a> {
        let Some(uid) = self.pod_uid.as_deref() else { return Volume::Other };
        let mut parts = Vec::new();
        for component in source.components() {
            match component {
                Component::RootDir => {}
                Component::Normal(part) => match part.to_str() {
                    Some(part) => parts.push(part),
                    None => return Volume::Other,
                },
                _ => return Volume::Other,
            }
        }
        if !source.is_absolute() {
            return Volume::Other;
        }
        match parts.as_slice() {
            [.., "pods", pod, "volumes", plugin, name]
                if *pod == uid && *plugin == EMPTY_DIR_PLUGIN && is_volume_name(name) =>
            {
                Volume::EmptyDir { name }
            }
            [.., "pods", pod, "volume-subpaths", name, _container, _index] if *pod == uid && is_volume_name(name) => {
                let pod_dir = source.ancestors().nth(4).unwrap_or(source);
                Volume::SubPath { name, volume_dir: pod_dir.join("volumes").join(EMPTY_DIR_PLUGIN).join(name) }
            }
            _ => Volume::Other,
        }
    }
}

/// Whether `dir` is on memory (kubelet's `medium: Memory` tmpfs, hugepages): kubelet sizes
/// those itself, and a disk image there would hold disk data in memory.
fn on_memory(dir: &Path) -> Result<bool, EmptyDirError> {
    use nix::sys::statfs::{statfs, FsType, HUGETLBFS_MAGIC, TMPFS_MAGIC};
    // linux/magic.h; nix names no constant for it.
    const RAMFS_MAGIC: FsType = FsType(0x8584_58f6);
    let kind = statfs(dir).map_err(sys("statfs", dir))?.filesystem_type();
    Ok(kind == TMPFS_MAGIC || kind == HUGETLBFS_MAGIC || kind == RAMFS_MAGIC)
}

/// What a pod's emptyDir became.
#[derive(Debug, Clone)]
enum Disk {
    /// Its ext4, mounted here.
    Mounted(PathBuf),
    /// On memory, left to kubelet.
    Memory,
}

#[derive(Debug, Default)]
struct Disks {
    /// `<pod>/emptydir` is made and private.
    base: bool,
    by_name: BTreeMap<String, Disk>,
}

/// A pod's limited emptyDirs on the host (module docs). Its methods block (mounts, mkfs): call
/// them off the async runtime's workers.
#[derive(Debug)]
pub struct PodEmptyDirs {
    policy: EmptyDirPolicy,
    /// `<pod>/emptydir`
    dir: PathBuf,
    mkfs: PathBuf,
    disks: Mutex<Disks>,
}

impl PodEmptyDirs {
    pub fn new(paths: &PodPaths, policy: EmptyDirPolicy, config: &EmptyDirConfig) -> Self {
        Self { policy, dir: paths.emptydir_dir(), mkfs: config.mkfs_path.clone(), disks: Mutex::default() }
    }

    /// Points every bind mount of `spec` that is a limited emptyDir of the pod at the pod's
    /// disk for it, made the first time it is asked for; refuses a subPath of one.
    pub fn redirect(&self, spec: &mut Spec) -> Result<(), EmptyDirError> {
        if self.policy.is_unlimited() {
            return Ok(());
        }
        for m in spec.mounts_mut().iter_mut().flatten().filter(|m| is_bind(m)) {
            let Some(source) = m.source().clone() else { continue };
            match self.policy.classify(&source) {
                Volume::Other => {}
                Volume::EmptyDir { name } => {
                    let Some(limit) = self.policy.limit_of(name) else { continue };
                    if let Some(point) = self.disk(name, &source, limit)? {
                        m.set_source(Some(point));
                    }
                }
                Volume::SubPath { name, volume_dir } => {
                    if self.policy.limit_of(name).is_some() && volume_dir.is_dir() && !on_memory(&volume_dir)? {
                        return Err(EmptyDirError::SubPath { name: name.to_string() });
                    }
                }
            }
        }
        Ok(())
    }

    /// The mount point of emptyDir `name`'s disk, made from kubelet's `host_dir` the first time;
    /// `None` for an emptyDir kubelet keeps in memory.
    fn disk(&self, name: &str, host_dir: &Path, limit: u64) -> Result<Option<PathBuf>, EmptyDirError> {
        let mut disks = self.disks.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(disk) = disks.by_name.get(name) {
            return Ok(match disk {
                Disk::Mounted(point) => Some(point.clone()),
                Disk::Memory => None,
            });
        }
        if on_memory(host_dir)? {
            info!(volume = name, dir = %host_dir.display(), "emptyDir on memory: kubelet's tmpfs size applies, no disk is made");
            disks.by_name.insert(name.to_string(), Disk::Memory);
            return Ok(None);
        }
        if !disks.base {
            self.make_base()?;
            disks.base = true;
        }
        let point = self.dir.join(name);
        self.make_disk(name, host_dir, limit, &point)?;
        disks.by_name.insert(name.to_string(), Disk::Mounted(point.clone()));
        Ok(Some(point))
    }

    /// `<pod>/emptydir`: host-only, and a private mount, so the disks mounted below it appear in
    /// no other mount namespace (nothing else can hold them busy at teardown).
    fn make_base(&self) -> Result<(), EmptyDirError> {
        use std::os::unix::fs::DirBuilderExt;
        match std::fs::DirBuilder::new().mode(0o700).create(&self.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(source) => return Err(EmptyDirError::Io { what: "create", path: self.dir.clone(), source }),
        }
        mount(Some(&self.dir), &self.dir, None::<&str>, MsFlags::MS_BIND, None::<&str>)
            .map_err(sys("bind onto itself", &self.dir))?;
        mount(None::<&str>, &self.dir, None::<&str>, MsFlags::MS_PRIVATE, None::<&str>)
            .map_err(sys("make private", &self.dir))
    }

    fn make_disk(&self, name: &str, host_dir: &Path, limit: u64, point: &Path) -> Result<(), EmptyDirError> {
        let image = image::open_or_create(host_dir, limit, &self.mkfs)?;
        if image.fresh {
            let others = std::fs::read_dir(host_dir)
                .map(|d| d.flatten().filter(|e| e.file_name() != image::IMAGE_NAME).count())
                .unwrap_or(0);
            if others > 0 {
                warn!(volume = name, dir = %host_dir.display(), others, "kubelet's volume directory holds other files; the pod sees its new, empty disk instead");
            }
        }
        match std::fs::create_dir(point) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(source) => return Err(EmptyDirError::Io { what: "create", path: point.to_owned(), source }),
        }
        let label = image.path.display().to_string();
        let device = loopdev::attach(&image.file, &label).map_err(|source| EmptyDirError::Loop {
            name: name.to_string(),
            image: image.path.clone(),
            source,
        })?;
        let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        mount(Some(&device.path), point, Some("ext4"), flags, Some(MOUNT_DATA))
            .map_err(sys("mount the emptyDir image at", point))?;
        // The mount holds the device now; it detaches itself once the mount goes.
        let device_path = device.path.clone();
        drop(device);
        if image.fresh {
            if let Err(e) = like_kubelets_dir(point, host_dir) {
                if let Err(undo) = umount2(point, MntFlags::MNT_DETACH) {
                    warn!(point = %point.display(), "unmount after a failed setup: {undo}");
                }
                return Err(e);
            }
        }
        info!(
            volume = name, limit, image = %image.path.display(), device = %device_path.display(),
            mount = %point.display(), fresh = image.fresh, "emptyDir size limit enforced: the volume is its own filesystem"
        );
        Ok(())
    }
}

/// Gives a new volume's root what kubelet gave its directory (owner, group, mode: 0777, or
/// fsGroup's group with setgid) and removes mke2fs's `lost+found`, so the container finds the
/// empty directory it would find with runc.
fn like_kubelets_dir(point: &Path, host_dir: &Path) -> Result<(), EmptyDirError> {
    use std::os::unix::fs::MetadataExt;
    let want = std::fs::metadata(host_dir).map_err(|source| EmptyDirError::Io {
        what: "stat",
        path: host_dir.to_owned(),
        source,
    })?;
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let root = open(point, flags, Mode::empty()).map_err(sys("open", point))?;
    fchown(root.as_fd(), Some(Uid::from_raw(want.uid())), Some(Gid::from_raw(want.gid())))
        .map_err(sys("chown", point))?;
    fchmod(root.as_fd(), Mode::from_bits_truncate(want.mode() & 0o7777)).map_err(sys("chmod", point))?;
    match unlinkat(&root, "lost+found", UnlinkatFlags::RemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => Ok(()),
        Err(e) => Err(sys("remove lost+found in", point)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ByteSize;
    use serde_json::json;

    const UID: &str = "5b1e7c2a-0000-4000-8000-000000000001";

    /// A spec as containerd writes it (JSON), parsed as the shim parses it.
    fn oci(json: impl serde::Serialize) -> Spec {
        serde_json::from_slice(&serde_json::to_vec(&json).unwrap()).unwrap()
    }

    fn bundle(json: impl serde::Serialize) -> BundleSpec {
        BundleSpec::from(oci(json))
    }

    fn source(spec: &Spec, index: usize) -> PathBuf {
        spec.mounts().as_ref().unwrap()[index].source().clone().unwrap()
    }

    fn policy(annotation: Option<&str>, default: Option<u64>) -> EmptyDirPolicy {
        let mut annotations = json!({crate::annotations::SANDBOX_UID: UID});
        if let Some(value) = annotation {
            annotations[EMPTYDIR_SIZE_LIMITS] = json!(value);
        }
        let spec = bundle(json!({ "annotations": annotations }));
        let config = EmptyDirConfig { default_size_limit: default.map(ByteSize), ..Default::default() };
        EmptyDirPolicy::for_pod(&config, &spec).unwrap()
    }

    fn emptydir(root: &str, uid: &str, name: &str) -> PathBuf {
        PathBuf::from(format!("{root}/pods/{uid}/volumes/{EMPTY_DIR_PLUGIN}/{name}"))
    }

    #[test]
    fn only_this_pods_emptydirs_match() {
        let p = policy(Some("scratch=32Mi"), None);
        let kubelet = emptydir("/var/lib/kubelet", UID, "scratch");
        assert_eq!(p.classify(&kubelet), Volume::EmptyDir { name: "scratch" });
        // kubelet's root is configurable: only the tail counts.
        assert_eq!(p.classify(&emptydir("/data/k", UID, "cache")), Volume::EmptyDir { name: "cache" });
        for other in [
            emptydir("/var/lib/kubelet", "another-pod", "scratch"),
            PathBuf::from(format!("/var/lib/kubelet/pods/{UID}/volumes/kubernetes.io~configmap/scratch")),
            PathBuf::from(format!("/var/lib/kubelet/pods/{UID}/volumes/{EMPTY_DIR_PLUGIN}/scratch/sub")),
            PathBuf::from(format!("/var/lib/kubelet/pods/{UID}/volumes/{EMPTY_DIR_PLUGIN}/../x")),
            PathBuf::from(format!("/var/lib/kubelet/pods/{UID}/volumes/{EMPTY_DIR_PLUGIN}/Bad_Name")),
            PathBuf::from(format!("pods/{UID}/volumes/{EMPTY_DIR_PLUGIN}/scratch")),
            PathBuf::from(format!("/var/lib/kubelet/pods/{UID}/etc-hosts")),
            PathBuf::from("/"),
        ] {
            assert_eq!(p.classify(&other), Volume::Other, "{}", other.display());
        }
        let sub = PathBuf::from(format!("/var/lib/kubelet/pods/{UID}/volume-subpaths/scratch/app/0"));
        assert_eq!(
            p.classify(&sub),
            Volume::SubPath { name: "scratch", volume_dir: emptydir("/var/lib/kubelet", UID, "scratch") }
        );
    }

    #[test]
    fn limits_come_from_the_pod_then_the_node() {
        let p = policy(Some("scratch=32Mi"), Some(1 << 30));
        assert_eq!(p.limit_of("scratch"), Some(32 << 20));
        assert_eq!(p.limit_of("cache"), Some(1 << 30), "the node's default");
        let p = policy(Some("scratch=32Mi"), None);
        assert_eq!(p.limit_of("cache"), None, "unlimited, as with runc");
        assert!(!p.is_unlimited());
        assert!(policy(None, None).is_unlimited());
        assert!(!policy(None, Some(1 << 30)).is_unlimited());
    }

    #[test]
    fn a_pod_that_cannot_be_matched_or_asks_too_much_is_refused() {
        let config = EmptyDirConfig::default();
        let no_uid = bundle(json!({"annotations": {EMPTYDIR_SIZE_LIMITS: "scratch=32Mi"}}));
        let err = EmptyDirPolicy::for_pod(&config, &no_uid).unwrap_err().to_string();
        assert!(err.contains(EMPTYDIR_SIZE_LIMITS) && err.contains("pod UID"), "{err}");
        let bad_uid = bundle(
            json!({"annotations": {EMPTYDIR_SIZE_LIMITS: "scratch=32Mi", crate::annotations::SANDBOX_UID: "../x"}}),
        );
        assert!(EmptyDirPolicy::for_pod(&config, &bad_uid).is_err());
        // No annotation, no uid: nothing to enforce, nothing refused.
        let plain = bundle(json!({}));
        assert!(EmptyDirPolicy::for_pod(&config, &plain).unwrap().is_unlimited());
        let capped = EmptyDirConfig { max_size_limit: Some(ByteSize(16 << 20)), ..Default::default() };
        let big = bundle(
            json!({"annotations": {EMPTYDIR_SIZE_LIMITS: "scratch=32Mi", crate::annotations::SANDBOX_UID: UID}}),
        );
        let err = EmptyDirPolicy::for_pod(&capped, &big).unwrap_err().to_string();
        assert!(err.contains("outside 1Mi..=16Mi"), "{err}");
    }

    #[test]
    fn unlimited_pods_are_left_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let paths = PodPaths::new(dir.path(), "sb1").unwrap();
        let disks = PodEmptyDirs::new(&paths, policy(None, None), &EmptyDirConfig::default());
        let source = emptydir("/var/lib/kubelet", UID, "scratch");
        let mut spec =
            oci(json!({"mounts": [{"destination": "/d", "type": "bind", "source": source, "options": ["rbind"]}]}));
        let before = spec.clone();
        disks.redirect(&mut spec).unwrap();
        assert_eq!(spec, before);
        assert!(!paths.emptydir_dir().exists());
    }

    fn mkfs_and_root(test: &str) -> Option<PathBuf> {
        let mkfs = ["/sbin/mkfs.ext4", "/usr/sbin/mkfs.ext4"].into_iter().map(PathBuf::from).find(|p| p.is_file());
        let ready = Uid::effective().is_root() && Path::new("/dev/loop-control").exists();
        match mkfs {
            Some(mkfs) if ready => Some(mkfs),
            _ => {
                println!("SKIPPED: {test}: needs root, /dev/loop-control and mkfs.ext4 (e2fsprogs)");
                None
            }
        }
    }

    /// Unmounts everything below the test's scratch dir, also when the test fails.
    struct Unmount(PathBuf);

    impl Drop for Unmount {
        fn drop(&mut self) {
            super::super::mounts::unmount_all(&self.0);
        }
    }

    /// Writes 1 MiB chunks to `path` until the filesystem refuses; returns (bytes written, error).
    fn fill(path: &Path) -> (u64, std::io::Error) {
        use std::io::Write;
        let mut file = std::fs::File::create(path).unwrap();
        let chunk = vec![0xa5u8; 1 << 20];
        let mut written = 0u64;
        loop {
            match file.write(&chunk).and_then(|n| file.sync_data().map(|()| n)) {
                Ok(n) => written += n as u64,
                Err(e) => return (written, e),
            }
            assert!(written < 1 << 30, "no limit: wrote 1 GiB");
        }
    }

    fn spec_with(source: &Path) -> Spec {
        oci(json!({"mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/data", "type": "bind", "source": source, "options": ["rbind", "rw"]},
        ]}))
    }

    #[test]
    fn a_limited_emptydir_is_one_disk_for_the_pod_and_goes_with_it() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let test = "a_limited_emptydir_is_one_disk_for_the_pod_and_goes_with_it";
        let Some(mkfs) = mkfs_and_root(test) else { return };
        let scratch = tempfile::tempdir().unwrap();
        let _unmount = Unmount(scratch.path().to_owned());
        let host_dir = emptydir(&scratch.path().join("kubelet").display().to_string(), UID, "scratch");
        std::fs::create_dir_all(&host_dir).unwrap();
        // As kubelet leaves it with an fsGroup: group 2000, setgid, 0777.
        std::os::unix::fs::chown(&host_dir, Some(0), Some(2000)).unwrap();
        std::fs::set_permissions(&host_dir, std::fs::Permissions::from_mode(0o2777)).unwrap();
        let paths = PodPaths::new(&scratch.path().join("state"), "sb1").unwrap();
        std::fs::create_dir_all(&paths.dir).unwrap();
        let config = EmptyDirConfig { mkfs_path: mkfs, ..Default::default() };
        let disks = PodEmptyDirs::new(&paths, policy(Some("scratch=8Mi"), None), &config);

        let mut first = spec_with(&host_dir);
        disks.redirect(&mut first).unwrap();
        let point = paths.emptydir_dir().join("scratch");
        assert_eq!(source(&first, 1), point);
        assert_eq!(source(&first, 0), Path::new("proc"), "other mounts are left alone");
        let root = std::fs::metadata(&point).unwrap();
        assert_eq!((root.uid(), root.gid(), root.mode() & 0o7777), (0, 2000, 0o2777), "kubelet's owner and mode");
        assert_eq!(std::fs::read_dir(&point).unwrap().count(), 0, "empty: no lost+found");

        // The writer gets ENOSPC at the limit, and the node gives no more than the limit.
        let (written, err) = fill(&point.join("fill"));
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
        assert!((4 << 20..=8 << 20).contains(&written), "wrote {written} bytes");
        let image = std::fs::metadata(host_dir.join(image::IMAGE_NAME)).unwrap();
        assert!(image.blocks() * 512 <= (8 << 20) + (64 << 10), "the image holds {} bytes", image.blocks() * 512);
        assert_eq!(std::fs::read_dir(&host_dir).unwrap().count(), 1, "only the image in kubelet's directory");

        // A second container gets the same disk, full as the first left it.
        let mut second = spec_with(&host_dir);
        disks.redirect(&mut second).unwrap();
        assert_eq!(source(&second, 1), point);
        assert_eq!(std::fs::metadata(point.join("fill")).unwrap().len(), written);

        // Teardown unmounts below the pod's state; the loop device goes by itself.
        let backing = host_dir.join(image::IMAGE_NAME).display().to_string();
        assert!(loopdev::bound_devices().iter().any(|(_, b)| *b == backing));
        super::super::mounts::unmount_all(&paths.dir);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while loopdev::bound_devices().iter().any(|(_, b)| *b == backing) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(!loopdev::bound_devices().iter().any(|(_, b)| *b == backing), "the loop device detached itself");

        // A new sandbox of the same pod finds the data again.
        let again = PodEmptyDirs::new(&paths, policy(Some("scratch=8Mi"), None), &config);
        again.redirect(&mut spec_with(&host_dir)).unwrap();
        assert_eq!(std::fs::metadata(point.join("fill")).unwrap().len(), written);
    }

    #[test]
    fn memory_emptydirs_are_kubelets_and_subpaths_of_limited_ones_are_refused() {
        let test = "memory_emptydirs_are_kubelets_and_subpaths_of_limited_ones_are_refused";
        let Some(mkfs) = mkfs_and_root(test) else { return };
        let scratch = tempfile::tempdir().unwrap();
        let _unmount = Unmount(scratch.path().to_owned());
        let kubelet = scratch.path().join("kubelet").display().to_string();
        let memory = emptydir(&kubelet, UID, "mem");
        std::fs::create_dir_all(&memory).unwrap();
        mount(Some("tmpfs"), &memory, Some("tmpfs"), MsFlags::empty(), Some("size=4m")).unwrap();
        let paths = PodPaths::new(&scratch.path().join("state"), "sb1").unwrap();
        std::fs::create_dir_all(&paths.dir).unwrap();
        let config = EmptyDirConfig { mkfs_path: mkfs, ..Default::default() };
        let disks = PodEmptyDirs::new(&paths, policy(Some("mem=8Mi,scratch=8Mi"), None), &config);
        let mut spec = spec_with(&memory);
        disks.redirect(&mut spec).unwrap();
        assert_eq!(source(&spec, 1), memory, "kubelet's tmpfs, as it is");
        assert_eq!(std::fs::read_dir(&memory).unwrap().count(), 0, "no image in memory");

        std::fs::create_dir_all(emptydir(&kubelet, UID, "scratch")).unwrap();
        let sub = PathBuf::from(format!("{kubelet}/pods/{UID}/volume-subpaths/scratch/app/1"));
        std::fs::create_dir_all(&sub).unwrap();
        let err = disks.redirect(&mut spec_with(&sub)).unwrap_err().to_string();
        assert!(err.contains("emptyDir scratch has a size limit") && err.contains("subPath"), "{err}");
        // A subPath of a volume that is not a limited emptyDir is kubelet's business.
        let other = PathBuf::from(format!("{kubelet}/pods/{UID}/volume-subpaths/config/app/1"));
        std::fs::create_dir_all(&other).unwrap();
        disks.redirect(&mut spec_with(&other)).unwrap();
        let mem_sub = PathBuf::from(format!("{kubelet}/pods/{UID}/volume-subpaths/mem/app/2"));
        std::fs::create_dir_all(&mem_sub).unwrap();
        disks.redirect(&mut spec_with(&mem_sub)).unwrap();
    }
}
