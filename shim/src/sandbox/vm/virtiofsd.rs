//! The pod's virtiofsd: one per pod, run as root outside the VMM's jail, sandboxed by virtiofsd's
//! own means (`--sandbox namespace`: new mount/pid/net namespaces with the shared directory as
//! its root; `--seccomp kill`), serving only the pod's shared directory.
//!
//! As root, virtiofsd keeps only the capabilities a passthrough server needs once its sandbox
//! is set up (CHOWN, DAC_OVERRIDE, FOWNER, FSETID, SETGID, SETUID, SETFCAP, and MKNOD), in its
//! bounding set too. We take MKNOD away as well ([`MODCAPS`]): with it the guest could create
//! real device nodes on the host's disk (in a container's writable layer, or a hostPath), where
//! any host process that later opens them reaches the host's devices. A guest's device nodes
//! belong on its own filesystems (its /dev); FIFOs and sockets need no capability and still work.
//! A non-root uid would not narrow it further: every capability above overrides file ownership,
//! and virtiofsd as non-root serves the share through a user namespace that maps only its own
//! uid, which cannot serve a root-owned rootfs.
//!
//! Its socket is laid out as `vmm/README.md` ("virtio-fs in a jail") asks: the shim binds and
//! listens at `<chroot>/run/fs0.sock` before either process starts, hands it to the jail's uid
//! (owner, mode 0600) and passes the listener to virtiofsd with `--fd`. virtiofsd serves the one
//! connection the VMM makes and exits when the VMM closes it.

use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::Path;

use super::super::cgroups;

/// Binds and listens at `socket` (in a directory only root has touched yet) and gives it to
/// `uid:gid`, mode 0600, so the jailed VMM can connect and nobody else can.
pub fn listen(socket: &Path, uid: u32, gid: u32) -> std::io::Result<UnixListener> {
    let listener = UnixListener::bind(socket)?;
    std::os::unix::fs::lchown(socket, Some(uid), Some(gid))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// virtiofsd's `--modcaps`: its default set without CAP_MKNOD (module docs).
pub const MODCAPS: &str = "-mknod";

/// The arguments that identify a pod's virtiofsd (cleanup after a crash checks them).
pub fn identity(shared_dir: &Path) -> [String; 2] {
    ["--shared-dir".into(), shared_dir.display().to_string()]
}

/// virtiofsd serving `shared_dir` on `listener`, which the child inherits, in the cgroups whose
/// `cgroup.procs` are `cgroup_procs` (the pod's, so its memory is charged to the pod), joined
/// before exec so its sandboxed worker starts there too. The caller closes its own copy of the
/// listener once the child is spawned.
pub fn command(
    bin: &Path,
    shared_dir: &Path,
    listener: &UnixListener,
    cgroup_procs: Vec<CString>,
) -> tokio::process::Command {
    let fd = listener.as_raw_fd();
    let mut command = tokio::process::Command::new(bin);
    command.arg(format!("--fd={fd}")).args(identity(shared_dir)).args([
        "--sandbox",
        "namespace",
        "--seccomp",
        "kill",
        "--cache",
        "auto",
    ]);
    // One word: clap would take a separate "-mknod" for an option.
    command.arg(format!("--modcaps={MODCAPS}"));
    // SAFETY: between fork and exec; fcntl is async-signal-safe and touches only this fd, which
    // stays open in the parent until the child has been spawned; join_self only opens, writes
    // and closes files whose paths were made before the fork.
    unsafe {
        command.pre_exec(move || {
            if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            cgroups::join_self(&cgroup_procs)
        });
    }
    command
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn the_socket_is_the_jail_users_alone() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("fs0.sock");
        // Only root can give a file away; as anyone else, chown to our own ids.
        // SAFETY: getuid/getgid have no preconditions.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let (uid, gid) = if uid == 0 { (40_000, 40_001) } else { (uid, gid) };
        let _listener = listen(&socket, uid, gid).unwrap();
        let meta = std::fs::symlink_metadata(&socket).unwrap();
        assert_eq!((meta.uid(), meta.gid(), meta.mode() & 0o777), (uid, gid, 0o600));
    }

    #[test]
    fn the_command_names_the_shared_dir_and_the_sandbox() {
        let dir = tempfile::tempdir().unwrap();
        let listener = UnixListener::bind(dir.path().join("s")).unwrap();
        let command = command(Path::new("/usr/bin/virtiofsd"), Path::new("/run/b/p/shared"), &listener, Vec::new());
        let args: Vec<String> = command.as_std().get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        assert_eq!(args[0], format!("--fd={}", listener.as_raw_fd()));
        assert!(args.windows(2).any(|w| w == ["--shared-dir", "/run/b/p/shared"]), "{args:?}");
        assert!(args.windows(2).any(|w| w == ["--sandbox", "namespace"]), "{args:?}");
        assert!(args.windows(2).any(|w| w == ["--seccomp", "kill"]), "{args:?}");
        assert!(args.iter().any(|a| a == "--modcaps=-mknod"), "{args:?}");
    }
}
