//! Idmapped mounts for a `hostUsers: false` pod on the namespace backend: its containers' rootfs
//! and volumes show the pod's user namespace the files' owners it expects (root's files as its
//! root), without a chown, as containerd 2.x and runc 1.2 do.
//!
//! - **The user namespace an idmapped mount takes its maps from** ([`IdmapUserns`]): made with the
//!   pod's maps by a child cloned into it, kept as a descriptor once the child is gone. The pod's
//!   own user namespace is the agent's (crate::sandbox::namespace); its maps are the same, and the
//!   agent's user namespace maps every id onto itself, so the two agree.
//! - **Volumes**: containerd gives each bind mount of a user-namespaced container the pod's maps
//!   (`uidMappings`, `gidMappings` on the OCI mount), which libcontainer refuses. The shim binds the
//!   source idmapped instead and takes the maps off the spec's mount ([`take_mount_maps`]).
//! - **Rootfs**: containerd's overlayfs snapshotter adds `uidmap=` and `gidmap=` to its mounts
//!   (`container:host:size[,...]`), which no kernel filesystem parses; containerd's own mount
//!   code idmaps the layers. So does the shim ([`RootfsIdmap`]): it binds the directory holding
//!   every lower layer idmapped and read-only at a private place, mounts the overlay on layers
//!   seen through it, and drops that bind (the overlay keeps what it uses). The upper layer is
//!   the snapshotter's, already owned by the pod's root.
//!
//! Maps that are not the pod's are refused: a mount is never shifted by other ids than the pod runs as.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::sched::CloneFlags;
use oci_spec::runtime::{LinuxIdMapping, LinuxIdMappingBuilder, Mount as SpecMount};

use crate::spec::PodIdMaps;

/// The child's stack: it only reads a pipe.
const STACK: usize = 16 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum IdmapError {
    #[error("the pod's id-map user namespace: {0}")]
    Userns(String),
    #[error("{what} {maps:?} are not the pod's id maps ({pod})")]
    NotThePods { what: String, maps: String, pod: String },
    #[error("{0}")]
    Malformed(String),
}

/// A user namespace with the pod's maps, for `MOUNT_ATTR_IDMAP` (module docs).
#[derive(Debug)]
pub struct IdmapUserns {
    fd: OwnedFd,
    maps: PodIdMaps,
}

impl IdmapUserns {
    /// Clones a child into a new user namespace, writes `maps` as its uid and gid maps, keeps a
    /// descriptor of the namespace and lets the child go.
    pub fn new(maps: &PodIdMaps) -> Result<Self, IdmapError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| IdmapError::Userns(format!("{what}: {e}"));
        let (hold_r, hold_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| fail("pipe", &e))?;
        let hold_w_raw = hold_w.as_raw_fd();
        // Only syscalls in the child: the shim has threads, and the child a copy of one of them.
        let child = move || -> isize {
            let _ = nix::unistd::close(hold_w_raw);
            let mut byte = [0u8; 1];
            // Returns at EOF: the parent has its descriptor (or gave up).
            let _ = nix::unistd::read(&hold_r, &mut byte);
            0
        };
        let mut stack = vec![0u8; STACK];
        // SAFETY: the child runs only the syscalls above on its own stack and returns.
        let pid =
            unsafe { nix::sched::clone(Box::new(child), &mut stack, CloneFlags::CLONE_NEWUSER, Some(libc::SIGCHLD)) }
                .map_err(|e| fail("clone", &e))?;
        let made = (|| {
            for (file, map) in [("uid_map", &maps.uid), ("gid_map", &maps.gid)] {
                std::fs::write(format!("/proc/{pid}/{file}"), kernel_map(map))
                    .map_err(|e| fail(&format!("write {file}"), &e))?;
            }
            std::fs::File::open(format!("/proc/{pid}/ns/user")).map(OwnedFd::from).map_err(|e| fail("open it", &e))
        })();
        drop(hold_w);
        // The shim's reaper may collect it first; either way it is gone.
        let _ = nix::sys::wait::waitpid(pid, None);
        Ok(Self { fd: made?, maps: maps.clone() })
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Runs `f` on this thread as the pod's root for file creation (fsuid and fsgid): an idmapped
    /// mount refuses to create a file for an id its maps leave out, root's among them, and a file
    /// the pod's root makes there lands on disk as the volume's own root's.
    pub fn as_pod_root<T>(&self, f: impl FnOnce() -> T) -> T {
        let Some((uid, gid)) = host_root(&self.maps) else { return f() };
        // SAFETY: setfsuid/setfsgid only change this thread's filesystem ids, restored below.
        let (old_uid, old_gid) = unsafe { (libc::setfsuid(uid), libc::setfsgid(gid)) };
        let out = f();
        // SAFETY: as above.
        unsafe {
            libc::setfsgid(old_gid as u32);
            libc::setfsuid(old_uid as u32);
        }
        out
    }

    /// Checks that `uid` and `gid` (an OCI mount's, or a rootfs option's) are the pod's maps.
    fn check(&self, what: &str, uid: &[LinuxIdMapping], gid: &[LinuxIdMapping]) -> Result<(), IdmapError> {
        if same(uid, &self.maps.uid) && same(gid, &self.maps.gid) {
            return Ok(());
        }
        Err(IdmapError::NotThePods {
            what: what.into(),
            maps: format!("uid {} gid {}", kernel_map(uid).trim_end(), kernel_map(gid).trim_end()),
            pod: format!("uid {} gid {}", kernel_map(&self.maps.uid).trim_end(), kernel_map(&self.maps.gid).trim_end()),
        })
    }
}

/// One map line as OCI's type (its builder fails only on a field left unset).
pub fn id_mapping(container_id: u32, host_id: u32, size: u32) -> Option<LinuxIdMapping> {
    LinuxIdMappingBuilder::default().container_id(container_id).host_id(host_id).size(size).build().ok()
}

fn same(a: &[LinuxIdMapping], b: &[LinuxIdMapping]) -> bool {
    let key = |m: &LinuxIdMapping| (m.container_id(), m.host_id(), m.size());
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| key(x) == key(y))
}

/// A map as `/proc/<pid>/uid_map` takes it.
fn kernel_map(map: &[LinuxIdMapping]) -> String {
    map.iter().map(|m| format!("{} {} {}\n", m.container_id(), m.host_id(), m.size())).collect()
}

/// `container:host:size[,...]`, containerd's form in `uidmap=`/`gidmap=`.
fn parse_option_map(text: &str) -> Result<Vec<LinuxIdMapping>, IdmapError> {
    let bad = || IdmapError::Malformed(format!("id map {text:?}: expected container:host:size[,...]"));
    text.split(',')
        .map(|line| {
            let mut parts = line.split(':').map(|p| p.parse::<u32>().map_err(|_| bad()));
            let (Some(c), Some(h), Some(s), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
                return Err(bad());
            };
            id_mapping(c?, h?, s?).ok_or_else(bad)
        })
        .collect()
}

/// Takes the id maps off an OCI bind mount of a user-namespaced container: `Some` (after checking
/// they are the pod's) when it had any, so the shim binds its source idmapped.
pub fn take_mount_maps(userns: Option<&IdmapUserns>, m: &mut SpecMount) -> Result<bool, IdmapError> {
    let (uid, gid) = (m.uid_mappings().clone().unwrap_or_default(), m.gid_mappings().clone().unwrap_or_default());
    if uid.is_empty() && gid.is_empty() {
        return Ok(false);
    }
    let what = format!("the id maps of mount {}", m.destination().display());
    let Some(userns) = userns else {
        return Err(IdmapError::Malformed(format!("{what}: the pod has no user namespace of its own")));
    };
    userns.check(&what, &uid, &gid)?;
    m.set_uid_mappings(None);
    m.set_gid_mappings(None);
    Ok(true)
}

/// A rootfs mount's options without `uidmap=` and `gidmap=`, and whether they were there (and
/// the pod's: [`IdmapUserns::check`]). One without the other is refused, as containerd does.
pub fn take_rootfs_maps(userns: Option<&IdmapUserns>, options: &[String]) -> Result<(Vec<String>, bool), IdmapError> {
    let (mut uid, mut gid, mut rest) = (None, None, Vec::with_capacity(options.len()));
    for o in options {
        if let Some(v) = o.strip_prefix("uidmap=") {
            uid = Some(parse_option_map(v)?);
        } else if let Some(v) = o.strip_prefix("gidmap=") {
            gid = Some(parse_option_map(v)?);
        } else {
            rest.push(o.clone());
        }
    }
    match (uid, gid) {
        (None, None) => Ok((rest, false)),
        (Some(uid), Some(gid)) => {
            let Some(userns) = userns else {
                return Err(IdmapError::Malformed("an idmapped rootfs for a pod without a user namespace".into()));
            };
            userns.check("the rootfs's id maps", &uid, &gid)?;
            Ok((rest, true))
        }
        _ => Err(IdmapError::Malformed("a rootfs with only one of uidmap= and gidmap=".into())),
    }
}

/// Where the pod's root is on the host: the host uid and gid its maps give container id 0.
fn host_root(maps: &PodIdMaps) -> Option<(u32, u32)> {
    let root = |map: &[LinuxIdMapping]| {
        map.iter().find(|m| m.container_id() == 0 && m.size() > 0).map(LinuxIdMapping::host_id)
    };
    Some((root(&maps.uid)?, root(&maps.gid)?))
}

/// Lets the pod's root traverse `dirs` (the shim's private pod directories on the way to its
/// containers' rootfs and volumes): mode 0710, group the pod root's host gid, as containerd does a
/// user-namespaced container's bundle. Its containers' init, root only in the pod's user namespace,
/// opens its mounts' sources below them; nobody else on the host gains anything.
pub fn open_to_pod_root(maps: &PodIdMaps, dirs: &[&Path]) -> Result<(), IdmapError> {
    use std::os::unix::fs::PermissionsExt;
    let (_, gid) = host_root(maps).ok_or_else(|| IdmapError::Malformed("the pod's maps give its root no id".into()))?;
    for dir in dirs {
        let fail = |what: &str, e: &dyn std::fmt::Display| IdmapError::Userns(format!("{what} {}: {e}", dir.display()));
        nix::unistd::chown(*dir, None, Some(nix::unistd::Gid::from_raw(gid))).map_err(|e| fail("chgrp", &e))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o710)).map_err(|e| fail("chmod", &e))?;
    }
    Ok(())
}

/// The deepest directory above every one of `dirs` (absolute paths).
fn common_parent(dirs: &[PathBuf]) -> Option<PathBuf> {
    let first = dirs.first()?.parent()?;
    let mut common: Vec<_> = first.components().collect();
    for d in &dirs[1..] {
        let parent: Vec<_> = d.parent()?.components().collect();
        let keep = common.iter().zip(&parent).take_while(|(a, b)| a == b).count();
        common.truncate(keep);
    }
    let path: PathBuf = common.iter().collect();
    (path.is_absolute() && path.parent().is_some()).then_some(path)
}

/// An overlay's lower layers, to be seen through an idmapped bind of the directory holding them
/// (module docs): where that bind goes (`at`), what it binds, and the options with each lower
/// layer rewritten below `at`.
#[derive(Debug, PartialEq, Eq)]
pub struct RootfsIdmap {
    pub source: PathBuf,
    pub at: PathBuf,
    pub options: Vec<String>,
}

impl RootfsIdmap {
    /// Plans the idmapped lower layers of an overlay mounted with `options`, its bind at `at`.
    pub fn plan(options: &[String], at: &Path) -> Result<Self, IdmapError> {
        let lower = options.iter().position(|o| o.starts_with("lowerdir="));
        let Some(lower) = lower else {
            return Err(IdmapError::Malformed("an idmapped overlay rootfs without lowerdir=".into()));
        };
        let dirs: Vec<PathBuf> = options[lower]["lowerdir=".len()..].split(':').map(PathBuf::from).collect();
        if dirs.iter().any(|d| !d.is_absolute()) {
            return Err(IdmapError::Malformed(format!("{}: layers must be absolute paths", options[lower])));
        }
        let source = common_parent(&dirs)
            .ok_or_else(|| IdmapError::Malformed(format!("{}: the layers share no parent", options[lower])))?;
        let seen: Vec<String> = dirs
            .iter()
            .filter_map(|d| d.strip_prefix(&source).ok())
            .map(|rel| at.join(rel).display().to_string())
            .collect();
        let mut rewritten = options.to_vec();
        rewritten[lower] = format!("lowerdir={}", seen.join(":"));
        Ok(Self { source, at: at.to_path_buf(), options: rewritten })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(c: u32, h: u32, s: u32) -> LinuxIdMapping {
        id_mapping(c, h, s).unwrap()
    }

    fn pod() -> PodIdMaps {
        PodIdMaps { uid: vec![map(0, 65536, 65536)], gid: vec![map(0, 65536, 65536)] }
    }

    fn opts(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn containerds_option_maps_parse_and_garbage_is_refused() {
        let parsed = parse_option_map("0:65536:65536,70000:1000:5").unwrap();
        assert_eq!(kernel_map(&parsed), "0 65536 65536\n70000 1000 5\n");
        for bad in ["", "0:1", "0:1:2:3", "a:1:2", "-1:0:1", "0:1:2,"] {
            assert!(parse_option_map(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_layers_are_seen_through_one_bind_of_their_common_parent() {
        let o = opts(&[
            "index=off",
            "lowerdir=/var/lib/c/snapshots/12/fs:/var/lib/c/snapshots/3/fs",
            "upperdir=/var/lib/c/snapshots/13/fs",
        ]);
        let plan = RootfsIdmap::plan(&o, Path::new("/run/bh/pod/idmap-c1")).unwrap();
        assert_eq!(plan.source, Path::new("/var/lib/c/snapshots"));
        assert_eq!(plan.options[1], "lowerdir=/run/bh/pod/idmap-c1/12/fs:/run/bh/pod/idmap-c1/3/fs");
        assert_eq!((&plan.options[0], &plan.options[2]), (&o[0], &o[2]), "the rest is left alone");
        // One layer: its own parent.
        let one = RootfsIdmap::plan(&opts(&["lowerdir=/s/1/fs"]), Path::new("/t")).unwrap();
        assert_eq!((one.source.as_path(), one.options[0].as_str()), (Path::new("/s/1"), "lowerdir=/t/fs"));
        for bad in [&["upperdir=/x"][..], &["lowerdir=rel/1:/s/2"], &["lowerdir=/a:/b"]] {
            assert!(RootfsIdmap::plan(&opts(bad), Path::new("/t")).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn only_the_pods_maps_are_taken_off_a_rootfs_or_a_mount() {
        let userns = IdmapUserns { fd: std::fs::File::open("/dev/null").unwrap().into(), maps: pod() };
        let with = opts(&["lowerdir=/a/1", "uidmap=0:65536:65536", "gidmap=0:65536:65536"]);
        assert_eq!(take_rootfs_maps(Some(&userns), &with).unwrap(), (opts(&["lowerdir=/a/1"]), true));
        assert_eq!(take_rootfs_maps(None, &opts(&["ro"])).unwrap(), (opts(&["ro"]), false));
        assert!(take_rootfs_maps(None, &with).is_err(), "no pod user namespace");
        let other = opts(&["uidmap=0:1000:65536", "gidmap=0:65536:65536"]);
        let err = take_rootfs_maps(Some(&userns), &other).unwrap_err().to_string();
        assert!(err.contains("uid 0 1000 65536") && err.contains("not the pod's"), "{err}");
        assert!(take_rootfs_maps(Some(&userns), &opts(&["uidmap=0:65536:65536"])).is_err(), "half a map");

        let mut m: SpecMount = serde_json::from_value(serde_json::json!({
            "destination": "/data", "type": "bind", "source": "/v",
            "uidMappings": [{"containerID": 0, "hostID": 65536, "size": 65536}],
            "gidMappings": [{"containerID": 0, "hostID": 65536, "size": 65536}]
        }))
        .unwrap();
        let mut other = m.clone();
        assert!(take_mount_maps(Some(&userns), &mut m).unwrap());
        assert!(m.uid_mappings().is_none() && m.gid_mappings().is_none());
        assert!(!take_mount_maps(Some(&userns), &mut m).unwrap(), "nothing left to take");
        other.set_gid_mappings(Some(vec![map(0, 1, 1)]));
        assert!(take_mount_maps(Some(&userns), &mut other).is_err());
        assert!(take_mount_maps(None, &mut m.clone()).is_ok(), "no maps, no user namespace needed");
    }

    #[test]
    fn the_pods_root_may_only_traverse_the_pods_directories() {
        use std::os::unix::fs::MetadataExt;
        assert_eq!(host_root(&pod()), Some((65536, 65536)));
        let shifted = PodIdMaps { uid: vec![map(1, 5, 10), map(0, 70000, 1)], gid: vec![map(0, 80000, 1)] };
        assert_eq!(host_root(&shifted), Some((70000, 80000)));
        assert_eq!(host_root(&PodIdMaps { uid: vec![map(1, 5, 10)], gid: vec![map(0, 1, 1)] }), None);
        if !nix::unistd::geteuid().is_root() {
            println!("SKIPPED: the chgrp needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        open_to_pod_root(&pod(), &[dir.path()]).unwrap();
        let meta = std::fs::metadata(dir.path()).unwrap();
        assert_eq!((meta.mode() & 0o7777, meta.gid(), meta.uid()), (0o710, 65536, 0));
    }

    #[test]
    fn an_idmap_namespace_outlives_its_child() {
        if !nix::unistd::geteuid().is_root() {
            println!("SKIPPED: needs root to map other ids than its own");
            return;
        }
        let userns = IdmapUserns::new(&pod()).unwrap();
        // The namespace outlives its child: its descriptor is still a user namespace.
        let link = std::fs::read_link(format!("/proc/self/fd/{}", userns.fd().as_raw_fd())).unwrap();
        assert!(link.to_string_lossy().starts_with("user:["), "{}", link.display());
    }
}
