//! The namespace backend's container mounts. The agent lives in a minimal root of its own
//! (guest-agent README, "Namespace mode") and cannot reach the host paths containerd names (the
//! snapshotter's layers, kubelet's volume directories); the shim, as root on the host, mounts
//! each container's rootfs and volume sources before CreateContainer, into a directory the
//! agent's root keeps, and rewrites the spec to name them there:
//! ```text
//! <pod>/rootfs/  host-only (0700), a mount of its own in a peer group of its own (shared):
//!                <id>/rootfs is containerd's rootfs mounts (or a bind of the bundle's rootfs),
//!                <id>/volumes/<n> a bind of the source of the spec's n-th bind mount (emptyDir,
//!                hostPath, ConfigMap, Secret, the service-account token, /etc/hosts, the
//!                pod's /dev/shm...)
//! <pod>/view/    a read-only, nosuid, nodev bind of rootfs/ and a slave of it: what the agent
//!                keeps (`--share-dir`), at this same path, so the spec's paths mean the same
//!                on both sides
//! ```
//! **Propagation.** The agent's mount namespace exists before any container does, so the
//! mounts made here later must travel into it. The launcher's child and then the agent copy the
//! host's mounts into mount namespaces of their own and make every copy a slave; view/ is a
//! slave of rootfs/'s peer group, so a mount made below rootfs/ appears below view/ on the host
//! and in the agent's copy of view/, and nothing the agent mounts travels back. (The other way,
//! the agent mounting host paths itself, needs those paths in its root: containerd's snapshot
//! directory holds every image's layers and every container's writable layer, other pods'
//! included.) What the shim binds here from the host is private, though (or a slave of its
//! source where the spec says `rslave`: [`bind_propagation`]): a clone of a host mount would
//! otherwise join its source's peer group, and a mount the host makes below a readOnly hostPath
//! later (another pod's secret tmpfs) would reach the containers with its own, writable, flags.
//!
//! **nodev.** Every rootfs and volume is mounted nodev. An image layer (or a volume) may hold a
//! device node, which containerd creates as it is; runc relies on the devices cgroup to refuse
//! opening it, and the agent, serving from a user namespace of its own, can neither load the BPF
//! program that is that cgroup on v2 nor write `devices.allow` on v1. Containers get their /dev
//! from the agent, which binds the handful of nodes they may use from its own root.
//!
//! **Read-only.** A remount never propagates: a volume made read-only here after the bind would
//! stay writable in the agent's copy. So a read-only volume is bound as a detached clone made
//! read-only before it is attached (`open_tree`, `mount_setattr`, `move_mount`): read-only in
//! every copy. view/'s own directories are read-only too, so a process that reaches the agent's
//! mount namespace with a container's capabilities cannot plant a link where the shim mounts
//! next (the agent itself holds CAP_SYS_ADMIN and could remount it: see the README on what that
//! capability is without a VM). Removal unmounts, then removes only the empty mount points it
//! made.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use containerd_shim::protos::types::mount::Mount;
use nix::mount::MsFlags;
use oci_spec::runtime::Spec;

use super::container_tree::{Binder, ContainerTree, Volume};
use super::idmap::{take_rootfs_maps, IdmapUserns};
use super::mounts::{
    attach_clone, bind_propagation, mount_err, mount_idmapped_rootfs, mount_rootfs, CloneAttrs, MountError,
};
use super::paths::PodPaths;

/// How the namespace backend binds: detached clones, born with their flags, idmapped with the
/// pod's maps for a user-namespaced pod (crate::sandbox::idmap).
struct CloneBinder<'a> {
    userns: Option<&'a IdmapUserns>,
    /// Host-only: where an idmapped rootfs's layers are bound while its overlay is mounted.
    scratch: &'a Path,
}

impl Binder for CloneBinder<'_> {
    fn rootfs(
        &self,
        id: &str,
        bundle_rootfs: &Path,
        mounts: &[Mount],
        _spec: &Spec,
        rootfs: &Path,
    ) -> Result<(), MountError> {
        if mounts.is_empty() {
            // Private: not in the bundle's peer group (module docs, "Propagation").
            let attrs = CloneAttrs {
                recursive: true,
                read_only: false,
                nodev: true,
                propagation: MsFlags::MS_PRIVATE,
                idmap: None,
            };
            attach_clone(bundle_rootfs, rootfs, attrs)
                .map_err(mount_err(format!("rootfs {}", bundle_rootfs.display()), rootfs))?;
        }
        for m in mounts {
            match (take_rootfs_maps(self.userns, &m.options)?, self.userns) {
                ((options, true), Some(userns)) => {
                    let scratch = self.scratch.join(id);
                    mount_idmapped_rootfs(m, options, rootfs, &scratch, userns, MsFlags::MS_NODEV)?
                }
                _ => mount_rootfs(std::slice::from_ref(m), rootfs, MsFlags::MS_NODEV)?,
            }
        }
        Ok(())
    }

    fn volume(&self, _id: &str, v: &Volume<'_>) -> Result<(), MountError> {
        let recursive = v.options.iter().any(|o| o == "rbind");
        let read_only = v.options.iter().any(|o| o == "ro");
        let idmap = if v.idmap { self.userns.map(IdmapUserns::fd) } else { None };
        let attrs = CloneAttrs { recursive, read_only, nodev: true, propagation: bind_propagation(v.options), idmap };
        attach_clone(v.source, v.target, attrs).map_err(mount_err(format!("volume {}", v.source.display()), v.target))
    }

    fn idmap_userns(&self) -> Option<&IdmapUserns> {
        self.userns
    }
}

/// The pod's container mounts on the host (module docs): `<pod>/rootfs`, seen by the agent as
/// `<pod>/view`.
#[derive(Debug, Clone)]
pub struct PodMounts {
    tree: ContainerTree,
    /// A user-namespaced pod's id maps, which its containers' mounts are idmapped with.
    userns: Option<Arc<IdmapUserns>>,
    scratch: PathBuf,
}

impl PodMounts {
    pub fn new(paths: &PodPaths, userns: Option<Arc<IdmapUserns>>) -> Self {
        let tree = ContainerTree::new(paths.rootfs_dir(), paths.dir.join("view"));
        Self { tree, userns, scratch: paths.dir.join("idmap") }
    }

    fn binder(&self) -> CloneBinder<'_> {
        CloneBinder { userns: self.userns.as_deref(), scratch: &self.scratch }
    }

    /// The directory the agent's minimal root keeps (its `--share-dir`).
    pub fn view(&self) -> &Path {
        self.tree.view()
    }

    /// Makes both directories and their mounts (module docs). Before the launcher starts, so
    /// the agent's copy of the view receives what is mounted later.
    pub fn create(&self) -> Result<(), MountError> {
        self.tree.create()
    }

    /// Mounts container `id`'s rootfs and volume sources ([`ContainerTree::prepare`]); the
    /// view is at the same path on both sides. Returns the agent's rootfs path.
    pub fn prepare(
        &self,
        id: &str,
        bundle_rootfs: &Path,
        mounts: &[Mount],
        spec: &mut Spec,
    ) -> Result<PathBuf, MountError> {
        self.tree.prepare(&self.binder(), id, bundle_rootfs, mounts, spec, self.tree.view())
    }

    /// Unmounts container `id`'s mounts (their copies in the view and the agent go with them).
    pub fn release(&self, id: &str) {
        self.tree.release(&self.binder(), id)
    }
}

#[cfg(test)]
mod tests {
    use super::super::mounts::{mounts_below, unmount_all};
    use super::*;
    use nix::mount::mount;
    use serde_json::json;

    #[test]
    fn the_view_is_a_sibling_the_agent_keeps_and_ids_stay_plain() {
        let paths = PodPaths::new(Path::new("/run/bh"), "pod1").unwrap();
        let pod = PodMounts::new(&paths, None);
        assert_eq!(pod.view(), Path::new("/run/bh/pod1/view"));
        assert_eq!(pod.tree.container_dir("c1").unwrap(), Path::new("/run/bh/pod1/rootfs/c1"));
        for bad in ["", "..", "a/b", "/x"] {
            assert!(matches!(pod.tree.container_dir(bad), Err(MountError::Id(_))), "{bad:?}");
        }
    }

    /// Unmounts everything below the test's scratch dir, also when the test fails.
    struct Unmount(PathBuf);

    impl Drop for Unmount {
        fn drop(&mut self) {
            unmount_all(&self.0);
        }
    }

    /// A readOnly hostPath whose source is in a shared peer group: a tmpfs the host mounts below
    /// it after the container was prepared (another pod's secret volume) does not appear in the
    /// view the agent keeps; with `rslave` (CRI's HostToContainer) it does, as the spec asks.
    #[test]
    fn the_hosts_later_mounts_below_a_volume_do_not_reach_the_view() {
        if !nix::unistd::geteuid().is_root() {
            println!("SKIPPED: the_hosts_later_mounts_below_a_volume_do_not_reach_the_view: needs root");
            return;
        }
        let scratch = tempfile::tempdir_in("/run").unwrap();
        let _unmount = Unmount(scratch.path().to_owned());
        let s = |p: &str| scratch.path().join(p);
        for d in ["bundle-rootfs", "pods/other", "slave/other"] {
            std::fs::create_dir_all(s(d)).unwrap();
        }
        for source in [s("pods"), s("slave")] {
            mount(Some(&source), &source, None::<&str>, MsFlags::MS_BIND, None::<&str>).unwrap();
            mount(None::<&str>, &source, None::<&str>, MsFlags::MS_PRIVATE, None::<&str>).unwrap();
            mount(None::<&str>, &source, None::<&str>, MsFlags::MS_SHARED, None::<&str>).unwrap();
        }
        let paths = PodPaths::new(scratch.path(), "pod").unwrap();
        std::fs::create_dir_all(&paths.dir).unwrap();
        let pod = PodMounts::new(&paths, None);
        pod.create().unwrap();
        let mounts = json!({"mounts": [
            {"destination": "/pods", "type": "bind", "source": s("pods"), "options": ["rbind", "rprivate", "ro"]},
            {"destination": "/slave", "type": "bind", "source": s("slave"), "options": ["rbind", "rslave", "ro"]},
        ]});
        let mut spec: Spec = serde_json::from_slice(&serde_json::to_vec(&mounts).unwrap()).unwrap();
        pod.prepare("c1", &s("bundle-rootfs"), &[], &mut spec).unwrap();
        for source in [s("pods/other"), s("slave/other")] {
            mount(Some("tmpfs"), &source, Some("tmpfs"), MsFlags::empty(), Some("size=64k")).unwrap();
            std::fs::write(source.join("secret"), b"token").unwrap();
        }
        let view = pod.view().join("c1");
        assert!(!view.join("volumes/0/other/secret").exists(), "the host's later mount reached the view");
        assert!(std::fs::write(view.join("volumes/0/other/planted"), b"x").is_err());
        assert_eq!(std::fs::read(view.join("volumes/1/other/secret")).unwrap(), b"token", "rslave follows the host");
        pod.release("c1");
        assert!(!paths.rootfs("c1").exists());
    }

    /// As root: a container's rootfs and volumes are mounted below rootfs/, appear in the
    /// read-only view and in a mount namespace copied before they existed (the agent's case),
    /// a read-only volume is read-only there too, no device node opens from any of them, the spec
    /// names the view, and release leaves nothing. Skipped without root.
    #[test]
    fn prepared_mounts_reach_an_earlier_slave_copy_read_only_where_asked() {
        if !nix::unistd::geteuid().is_root() {
            println!("SKIPPED: prepared_mounts_reach_an_earlier_slave_copy_read_only_where_asked: needs root");
            return;
        }
        let scratch = tempfile::tempdir_in("/run").unwrap();
        let _unmount = Unmount(scratch.path().to_owned());
        let paths = PodPaths::new(scratch.path(), "pod").unwrap();
        std::fs::create_dir_all(&paths.dir).unwrap();
        let pod = PodMounts::new(&paths, None);
        pod.create().unwrap();

        // The agent's side: a process whose mount namespace was copied now, made a slave,
        // watches for what comes later (no thread of this test process may unshare).
        let (ready_r, ready_w) = std::io::pipe().unwrap();
        let (go_r, go_w) = std::io::pipe().unwrap();
        let view = pod.view().to_owned();
        let script = format!(
            "mount --make-rslave / && echo ready && read _ && \
             cat {v}/c1/rootfs/hello && cat {v}/c1/volumes/0/data && \
             (touch {v}/c1/volumes/1/x 2>/dev/null && echo ro-volume-writable || echo ro-volume-refused) && \
             (mkdir {v}/planted 2>/dev/null && echo view-writable || echo view-refused) && \
             for n in rootfs/null volumes/0/null; do \
             (: < {v}/c1/$n) 2>/dev/null && echo $n-opened || echo $n-refused; done",
            v = view.display()
        );
        let mut child = std::process::Command::new("unshare")
            .args(["--mount", "--propagation", "unchanged", "sh", "-c", &script])
            .stdin(go_r)
            .stdout(ready_w)
            .spawn()
            .unwrap();
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(ready_r));
        assert_eq!(lines.next().unwrap().unwrap(), "ready");

        // The sources on a tmpfs of the test's own, so device nodes open there whatever /run is.
        let sources = scratch.path().join("sources");
        std::fs::create_dir_all(&sources).unwrap();
        mount(Some("tmpfs"), &sources, Some("tmpfs"), MsFlags::empty(), Some("size=1m")).unwrap();
        let bundle_rootfs = sources.join("bundle-rootfs");
        std::fs::create_dir_all(&bundle_rootfs).unwrap();
        std::fs::write(bundle_rootfs.join("hello"), "from-rootfs\n").unwrap();
        let rw = sources.join("rw");
        let ro = sources.join("ro");
        std::fs::create_dir_all(&rw).unwrap();
        std::fs::create_dir_all(&ro).unwrap();
        std::fs::write(rw.join("data"), "from-volume\n").unwrap();
        // /dev/null's numbers, as an image layer or a volume may carry them (module docs, "nodev").
        for dir in [&bundle_rootfs, &rw] {
            let node = dir.join("null");
            nix::sys::stat::mknod(
                &node,
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o666),
                nix::sys::stat::makedev(1, 3),
            )
            .unwrap();
            std::fs::File::open(&node).expect("the node opens where it was made");
        }
        let mounts = json!({"mounts": [
            {"destination": "/data", "type": "bind", "source": rw, "options": ["rbind", "rw"]},
            {"destination": "/cfg", "type": "bind", "source": ro, "options": ["rbind", "ro"]},
            {"destination": "/proc", "type": "proc", "source": "proc"},
        ]});
        let mut spec: Spec = serde_json::from_slice(&serde_json::to_vec(&mounts).unwrap()).unwrap();
        let rootfs = pod.prepare("c1", &bundle_rootfs, &[], &mut spec).unwrap();
        assert_eq!(rootfs, view.join("c1/rootfs"));
        let sources: Vec<_> = spec.mounts().iter().flatten().map(|m| m.source().clone().unwrap()).collect();
        let want = [view.join("c1/volumes/0"), view.join("c1/volumes/1"), "proc".into()];
        assert_eq!(sources, want, "the view's paths for binds; non-bind mounts are left alone");

        std::io::Write::write_all(&mut &go_w, b"go\n").unwrap();
        drop(go_w);
        let out: Vec<String> = lines.map(|l| l.unwrap()).collect();
        assert!(child.wait().unwrap().success(), "{out:?}");
        assert_eq!(
            out,
            [
                "from-rootfs",
                "from-volume",
                "ro-volume-refused",
                "view-refused",
                "rootfs/null-refused",
                "volumes/0/null-refused"
            ]
        );
        // On the host too, the read-only volume is read-only in the view, and the source stays writable.
        assert!(std::fs::write(view.join("c1/volumes/1/x"), b"x").is_err());
        std::fs::write(ro.join("y"), b"y").unwrap();

        pod.release("c1");
        assert!(mounts_below(&paths.rootfs_dir())
            .iter()
            .chain(mounts_below(&view).iter())
            .all(|m| m == &paths.rootfs_dir() || m == &view));
        assert!(!paths.rootfs("c1").exists());
        assert!(pod.prepare("../x", &bundle_rootfs, &[], &mut Spec::default()).is_err());
    }
}
