//! `bulkhead-vmm --jail <jail.json>`: confines the VMM as Firecracker's jailer does, before any
//! thread exists and before the VM is built. The document is `bulkhead_vmm_api::jail::JailConfig`;
//! the shim writes it.
//!
//! Steps, in this order, one module each:
//! 1. `checks`: the host side of the document (chroot owned by root, files and devices exist, we
//!    are root and single-threaded). A refusal here has changed nothing.
//! 2. `process`: close every inherited fd above 2 (the panic hook's eventfd is ours and stays).
//! 3. `cgroup`: join the pod's cgroup in every mounted hierarchy (v1 and v2), creating it if
//!    missing, so guest memory is charged to the pod.
//! 4. `process`: join the pod's network namespace; unshare mount and PID namespaces; fork. The
//!    parent stays root as a small waiter (its own seccomp filter) that forwards SIGTERM/SIGINT and
//!    exits with the VMM's status (code, or 128+signal). The child is PID 1 of the new PID
//!    namespace and dies with SIGKILL if the waiter dies.
//! 5. `root`: (child) private mounts, the chroot bind-mounted onto itself, writable dirs,
//!    read-only bind mounts, `/dev/kvm` (and `/dev/net/tun`), then pivot_root and detach the host.
//! 6. `privileges`: (child) setgroups([]), setresgid, setresuid, no_new_privs, and a check that no
//!    capability is left.
//!
//! Then the child goes on as the normal VMM, where every path of the VM config is a path inside
//! the chroot. Seccomp (`crate::seccomp`) is not part of the jail: every VMM thread installs its
//! filter whether or not it is jailed.

mod cgroup;
mod checks;
mod error;
mod privileges;
mod process;
mod root;

use bulkhead_vmm_api::jail::JailConfig;

use crate::phases::Phases;
use crate::seccomp::{self, ThreadKind};
use error::sys;
pub use error::JailError;

/// Which process returns from [`enter`].
#[derive(Debug, PartialEq, Eq)]
pub enum Jailed<T> {
    /// This is the jailed VMM: build and run the VM, with what `as_root` opened.
    Vmm(T),
    /// This was the waiter; the VMM is gone and this is the status to exit with.
    Exited(i32),
}

/// Applies `jail` to this (single-threaded, root) process. Returns once in the jailed VMM and
/// once, when the VMM has exited, in the waiter. Each step is timed into `phases`. `as_root`
/// runs in the VMM inside the chroot before privileges are dropped: it opens what only root may
/// (a template's files), by their paths in the jail.
pub fn enter<T>(
    jail: &JailConfig,
    phases: &mut Phases,
    as_root: impl FnOnce() -> std::io::Result<T>,
) -> Result<Jailed<T>, JailError> {
    jail.validate().map_err(|e| JailError::Refused(e.to_string()))?;
    let host = checks::check_host(jail)?;
    phases.mark("jail: host checks", false);
    // The panic hook's eventfd is ours, not inherited: closed, a panic would go unnoticed and its
    // wake-up would land in whatever file reused the number.
    let own: Vec<_> = crate::crash::wake_fd().into_iter().collect();
    process::close_inherited_fds(&own)?;
    phases.mark("jail: close inherited fds", false);
    if let Some(cgroup) = &jail.cgroup {
        cgroup::join(cgroup)?;
        phases.mark("jail: join cgroup", false);
    }
    if let Some(netns) = &jail.netns {
        process::join_netns(netns)?;
        phases.mark("jail: join netns", false);
    }
    let forked = process::unshare_and_fork()?;
    phases.mark("jail: unshare mount+pid, fork", false);
    match forked {
        process::Forked::Parent { child, parent_end } => {
            tracing::info!(id = %jail.id, vmm_pid = child.as_raw(), "jailed VMM started");
            seccomp::install(ThreadKind::Waiter, &seccomp::waiter_filter(child.as_raw())?)?;
            let code = process::wait_for_vmm(child)?;
            drop(parent_end);
            Ok(Jailed::Exited(code))
        }
        process::Forked::Child(watch) => {
            watch.arm()?;
            root::build(jail, &host)?;
            phases.mark("jail: mounts, device nodes, pivot_root", false);
            let opened = as_root().map_err(sys("open as root what the VMM reads"))?;
            privileges::drop_to(jail.uid, jail.gid)?;
            // Changing the uid cleared the parent-death signal: set it again.
            watch.arm()?;
            phases.mark("jail: drop privileges", false);
            tracing::info!(id = %jail.id, uid = jail.uid, gid = jail.gid, "jailed");
            Ok(Jailed::Vmm(opened))
        }
    }
}
