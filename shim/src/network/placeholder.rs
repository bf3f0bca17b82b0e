//! A network namespace of the shim's own, holding placeholder links, for a template VM. The
//! guest's NICs are virtio-mmio devices fixed at boot, so a template for pods with a network
//! must be booted with as many NICs, of the same MTUs, before any pod exists. Each placeholder
//! is a veth link standing in for a CNI interface (up, the pods' MTU, an address from
//! TEST-NET-1 that no frame ever carries; its peer stays in the namespace, up, with no
//! address), so [`super::attach_vm`] plumbs a tap to it exactly as it does for a pod. veth,
//! not dummy: CNI itself needs veth, while some node kernels are built without dummy. Nothing is sent: the template's guest never configures its NICs; the
//! agent does that at a pod's SetupSandbox, the CNI interface's MAC included.
//!
//! The namespace lives as long as a bind mount of its nsfs file at the given path pins it. A
//! build killed midway leaves that pin behind: [`PlaceholderNetns::remove_at`] clears it.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use rtnetlink::{LinkUnspec, LinkVeth};

use super::error::NetworkError;
use super::netns::Netns;
use super::{link_index, LIMIT};

/// Most placeholders (NICs) a template may have.
pub const MAX_NICS: usize = 8;

/// A pinned namespace with its placeholder links; dropping it unpins and removes it.
#[derive(Debug)]
pub struct PlaceholderNetns {
    path: PathBuf,
}

impl PlaceholderNetns {
    /// Creates the namespace, pinned at `path`, with one placeholder link per MTU, in order.
    pub async fn create(path: &Path, mtus: &[u16]) -> Result<Self, NetworkError> {
        if mtus.len() > MAX_NICS {
            return Err(NetworkError::Unsupported(format!("{} NICs; a template has at most {MAX_NICS}", mtus.len())));
        }
        Self::remove_at(path);
        let pinned = Self { path: path.to_path_buf() };
        let err = |source: std::io::Error| NetworkError::Netns { path: path.to_path_buf(), source };
        std::fs::OpenOptions::new().write(true).create_new(true).open(path).map_err(err)?;
        let target = path.to_path_buf();
        // A thread of its own: unshare moves the calling thread for good, and it must end.
        tokio::task::spawn_blocking(move || {
            std::thread::Builder::new()
                .name("bulkhead-netns-new".into())
                .spawn(move || -> nix::Result<()> {
                    unshare(CloneFlags::CLONE_NEWNET)?;
                    mount(Some("/proc/thread-self/ns/net"), &target, None::<&str>, MsFlags::MS_BIND, None::<&str>)
                })
                .map_err(|e| e.to_string())?
                .join()
                .map_err(|_| "the thread panicked".to_string())?
                .map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| NetworkError::Thread(format!("new network namespace: {e}")))?
        .map_err(|e| NetworkError::Thread(format!("new network namespace at {}: {e}", path.display())))?;
        let mtus = mtus.to_vec();
        Netns::open(path)?
            .run("placeholder links", LIMIT, move |h| async move {
                for (i, mtu) in mtus.iter().enumerate() {
                    let (name, peer) = (format!("eth{i}"), format!("peer{i}"));
                    h.link()
                        .add(LinkVeth::new(&name, &peer).mtu(u32::from(*mtu)).up().build())
                        .execute()
                        .await
                        .map_err(|e| NetworkError::netlink(format!("add placeholder {name} (MTU {mtu})"), e))?;
                    let peer_index = link_index(&h, &peer).await?;
                    h.link()
                        .set(LinkUnspec::new_with_index(peer_index).up().build())
                        .execute()
                        .await
                        .map_err(|e| NetworkError::netlink(format!("set {peer} up"), e))?;
                    let index = link_index(&h, &name).await?;
                    let addr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, i as u8 + 1));
                    h.address()
                        .add(index, addr, 32)
                        .execute()
                        .await
                        .map_err(|e| NetworkError::netlink(format!("address {addr} on {name}"), e))?;
                }
                Ok(())
            })
            .await?;
        Ok(pinned)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Unpins a namespace pinned at `path` (if any) and removes the file. The namespace, and
    /// every link in it, goes once no process is left in it.
    pub fn remove_at(path: &Path) {
        match umount2(path, MntFlags::MNT_DETACH) {
            Ok(()) | Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOENT) => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot unpin a placeholder network namespace")
            }
        }
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(path = %path.display(), error = %e, "cannot remove a placeholder netns file"),
        }
    }
}

impl Drop for PlaceholderNetns {
    fn drop(&mut self) {
        Self::remove_at(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn placeholders_look_like_cni_interfaces_and_go_with_the_namespace() {
        if !nix::unistd::geteuid().is_root() {
            println!("SKIPPED: placeholders_look_like_cni_interfaces_and_go_with_the_namespace: needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tpl.netns");
        let ns = PlaceholderNetns::create(&path, &[1500, 9001]).await.unwrap();
        let found = Netns::open(ns.path())
            .unwrap()
            .run("look", LIMIT, |h| async move {
                let links = super::super::discover::links(&h).await?;
                let addrs = super::super::discover::addresses(&h).await?;
                super::super::discover::vm_nics(&links, &addrs)
            })
            .await
            .unwrap();
        assert_eq!(
            found.iter().map(|n| (n.name.as_str(), n.mtu)).collect::<Vec<_>>(),
            [("eth0", 1500), ("eth1", 9001)]
        );
        drop(ns);
        assert!(!path.exists(), "unpinned and removed");
        // A pin left behind (a killed build) is cleared by the next create.
        let again = PlaceholderNetns::create(&path, &[1500]).await.unwrap();
        std::mem::forget(again);
        let third = PlaceholderNetns::create(&path, &[]).await.unwrap();
        drop(third);
        assert!(!path.exists());
    }

    #[tokio::test]
    async fn too_many_nics_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let err = PlaceholderNetns::create(&dir.path().join("n"), &[1500; MAX_NICS + 1]).await.unwrap_err();
        assert!(err.to_string().contains("at most 8"), "{err}");
    }
}
