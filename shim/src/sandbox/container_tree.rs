//! One container's mounts on the host, the same skeleton for both backends: `<mounts>/<id>/rootfs`
//! (containerd's rootfs mounts, or the bundle's rootfs bound) and `<mounts>/<id>/volumes/<n>` (the
//! source of the OCI spec's n-th bind mount), the spec's sources rewritten to where the agent sees
//! them, everything undone when a step fails, and on release all of it unmounted and only the
//! empty mount points it made removed.
//!
//! `<mounts>` is host-only (0700), a mount of its own in a peer group of its own (shared); the
//! agent's side sees it through `<view>`, a read-only, nosuid, nodev bind of it and a slave, so
//! every mount made below `<mounts>` later appears there too, and nothing travels back. What
//! differs between the backends is how a rootfs and a volume are bound, so that each is born with
//! its flags in every propagated copy: a [`Binder`] ([`super::namespace_mounts`] attaches detached
//! clones, [`super::vm::share`] stages, remounts and moves).

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use containerd_shim::protos::types::mount::Mount as RootfsMount;
use nix::mount::{mount, MsFlags};
use oci_spec::runtime::{Mount as SpecMount, Spec};
use tracing::warn;

use super::idmap::{take_mount_maps, IdmapUserns};
use super::mounts::{
    bind_source, flags_only, io, is_bind, make_point, mount_err, mounts_below, options_of, remove_mount_points,
    unmount_all, MountError,
};

/// One bind mount of a container's spec, its mount point made in the tree.
pub struct Volume<'a> {
    /// Its place among the spec's mounts (the `<n>` of `volumes/<n>`).
    pub index: usize,
    /// The host path it names (absolute, existing).
    pub source: &'a Path,
    pub is_dir: bool,
    /// Its mount point: `<mounts>/<id>/volumes/<n>`.
    pub target: &'a Path,
    /// Its fstab-style options (`rbind`, `ro`, propagation).
    pub options: &'a [String],
    /// Bound idmapped with the pod's maps (a user-namespaced pod's: [`super::idmap`]).
    pub idmap: bool,
}

/// How a backend binds into the tree.
pub trait Binder {
    /// Mounts container `id`'s rootfs at `rootfs`, an empty directory of the tree: containerd's
    /// `mounts`, or a bind of `bundle_rootfs` when there are none.
    fn rootfs(
        &self,
        id: &str,
        bundle_rootfs: &Path,
        mounts: &[RootfsMount],
        spec: &Spec,
        rootfs: &Path,
    ) -> Result<(), MountError>;

    /// Binds `volume`'s source at its target.
    fn volume(&self, id: &str, volume: &Volume<'_>) -> Result<(), MountError>;

    /// The pod's id-map user namespace, if the pod has a user namespace of its own and the
    /// backend idmaps its mounts (none by default: a mount with id maps is refused).
    fn idmap_userns(&self) -> Option<&IdmapUserns> {
        None
    }

    /// Where a bind mount the backend serves by other means points instead of at a volume of
    /// the tree (none by default).
    fn own_source(&self, _m: &SpecMount) -> Option<PathBuf> {
        None
    }

    /// Clears what the binder keeps for container `id` outside the tree: after every prepare,
    /// and before a release.
    fn clear(&self, _id: &str) {}
}

/// The tree of a pod's containers' mounts and the agent's view of it (module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerTree {
    /// Host-only: where the shim mounts.
    mounts: PathBuf,
    /// The agent's read-only view of `mounts`.
    view: PathBuf,
}

impl ContainerTree {
    pub fn new(mounts: PathBuf, view: PathBuf) -> Self {
        Self { mounts, view }
    }

    pub fn view(&self) -> &Path {
        &self.view
    }

    /// Makes both directories and their mounts (module docs). Before the agent's side starts
    /// (the launcher, virtiofsd), so its copy of the view receives what is mounted later.
    pub fn create(&self) -> Result<(), MountError> {
        for (dir, mode) in [(&self.mounts, 0o700), (&self.view, 0o755)] {
            std::fs::DirBuilder::new().mode(mode).create(dir).map_err(io("create", dir))?;
        }
        mount(Some(&self.mounts), &self.mounts, None::<&str>, MsFlags::MS_BIND, None::<&str>)
            .map_err(mount_err("bind onto itself", &self.mounts))?;
        flags_only(&self.mounts, MsFlags::MS_PRIVATE, "private")?;
        flags_only(&self.mounts, MsFlags::MS_SHARED, "shared")?;
        mount(Some(&self.mounts), &self.view, None::<&str>, MsFlags::MS_BIND, None::<&str>)
            .map_err(mount_err(format!("bind {}", self.mounts.display()), &self.view))?;
        let read_only = MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY;
        flags_only(&self.view, read_only | MsFlags::MS_NOSUID | MsFlags::MS_NODEV, "read-only")?;
        flags_only(&self.view, MsFlags::MS_SLAVE, "slave")
    }

    pub(super) fn container_dir(&self, id: &str) -> Result<PathBuf, MountError> {
        bulkhead_protocol::stream::validate_id(id).map_err(|_| MountError::Id(id.to_string()))?;
        Ok(self.mounts.join(id))
    }

    /// Mounts container `id`'s rootfs and the sources of its spec's bind mounts, the way `binder`
    /// binds, and rewrites those sources to where the agent sees them: below `seen`, the tree's
    /// path on the agent's side. Returns the rootfs's path there. On failure, whatever was done
    /// is undone.
    pub fn prepare(
        &self,
        binder: &impl Binder,
        id: &str,
        bundle_rootfs: &Path,
        mounts: &[RootfsMount],
        spec: &mut Spec,
        seen: &Path,
    ) -> Result<PathBuf, MountError> {
        let dir = self.container_dir(id)?;
        let seen = seen.join(id);
        // Run once, so that any failure on the way is undone below.
        let result = (|| {
            let rootfs = dir.join("rootfs");
            let volumes = dir.join("volumes");
            for d in [&dir, &rootfs, &volumes] {
                make_point(d, false)?;
            }
            binder.rootfs(id, bundle_rootfs, mounts, spec, &rootfs)?;
            for (index, m) in spec.mounts_mut().iter_mut().flatten().enumerate() {
                if !is_bind(m) {
                    continue;
                }
                let idmap = take_mount_maps(binder.idmap_userns(), m)?;
                if let Some(own) = binder.own_source(m) {
                    m.set_source(Some(own));
                    continue;
                }
                let (source, is_dir) = bind_source(index, m)?;
                let target = volumes.join(index.to_string());
                make_point(&target, !is_dir)?;
                let volume = Volume { index, source: &source, is_dir, target: &target, options: options_of(m), idmap };
                binder.volume(id, &volume)?;
                m.set_source(Some(seen.join("volumes").join(index.to_string())));
            }
            Ok(seen.join("rootfs"))
        })();
        binder.clear(id);
        if result.is_err() {
            self.release(binder, id);
        }
        result
    }

    /// Unmounts what [`ContainerTree::prepare`] mounted for `id` (its copies on the agent's side
    /// go with it) and removes its mount points; idempotent. Never removes anything below a
    /// mount that stayed.
    pub fn release(&self, binder: &impl Binder, id: &str) {
        let Ok(dir) = self.container_dir(id) else { return };
        binder.clear(id);
        unmount_all(&dir);
        let left = mounts_below(&dir);
        if !left.is_empty() {
            warn!(container = id, mounts = ?left, "container mounts stayed; leaving their mount points");
            return;
        }
        remove_mount_points(&dir);
    }
}
