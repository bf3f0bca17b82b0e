//! Namespace mode on cgroup v1: libcgroups writes every container's `devices.deny` ("a") and
//! `devices.allow` (the default nodes) whatever the spec says, and the kernel takes those writes
//! only from CAP_SYS_ADMIN over the host's user namespace, which the agent serving from its own
//! (`guest_init::user_ns`) does not have. So before libcontainer makes a container's cgroup, the
//! agent makes its directory in the devices hierarchy and binds /dev/null over both files in its
//! own mount namespace ([`DevicesStub::place`]); libcgroups's writes land there, and the cgroup
//! keeps its parent's device list.
//!
//! That gives nothing away: a container cannot make a device node (mknod needs the host's user
//! namespace), and every rootfs and volume is mounted nodev (the shim's `namespace_mounts`), so
//! the only nodes a container opens are those the runtime binds into its /dev from the agent's
//! root. The binds must go before the cgroup is removed: rmdir of a directory with a mount
//! inside fails with EBUSY ([`DevicesStub::lift`]).

use std::path::{Path, PathBuf};

use nix::mount::MsFlags;

use crate::error::{AgentError, Result};
use crate::syscall::Syscall;

/// The files libcgroups writes, in the order it writes them.
const FILES: [&str; 2] = ["devices.deny", "devices.allow"];
/// What they are bound to: every write succeeds and goes nowhere.
const SINK: &str = "/dev/null";

/// Where the devices hierarchy is mounted in this mount namespace.
pub fn hierarchy() -> Result<PathBuf> {
    libcgroups::v1::util::get_subsystem_mount_point(&libcgroups::v1::ControllerType::Devices)
        .map_err(|e| AgentError::FailedPrecondition(format!("the cgroup v1 devices hierarchy: {e}")))
}

/// One container's stubbed devices cgroup in the agent's mount namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevicesStub {
    dir: PathBuf,
}

impl DevicesStub {
    /// Makes the cgroup `cgroup` (absolute in the hierarchy) in the devices hierarchy mounted at
    /// `devices_root`, and binds [`SINK`] over its [`FILES`]. A failure leaves nothing bound.
    pub fn place(sys: &dyn Syscall, devices_root: &Path, cgroup: &Path) -> Result<Self> {
        let relative = cgroup.strip_prefix("/").unwrap_or(cgroup);
        let plain = relative.components().all(|c| matches!(c, std::path::Component::Normal(_)));
        if !plain || relative.as_os_str().is_empty() {
            return Err(AgentError::InvalidArgument(format!("cgroup path {} for a devices stub", cgroup.display())));
        }
        let stub = Self { dir: devices_root.join(relative) };
        sys.mkdir_all(&stub.dir)
            .map_err(|e| AgentError::internal(&format!("mkdir the devices cgroup {}", stub.dir.display()), e))?;
        for (n, name) in FILES.iter().enumerate() {
            let file = stub.dir.join(name);
            if let Err(e) = sys.mount(Some(SINK), &file, None, MsFlags::MS_BIND, None) {
                stub.unbind(sys, n);
                stub.remove_dir();
                return Err(AgentError::internal(&format!("bind {SINK} over {}", file.display()), e));
            }
        }
        tracing::debug!(dir = %stub.dir.display(), "devices cgroup stubbed (cgroup v1 in a user namespace)");
        Ok(stub)
    }

    /// Unbinds the files, so that the cgroup can be removed.
    pub fn lift(&self, sys: &dyn Syscall) {
        self.unbind(sys, FILES.len());
    }

    /// [`Self::lift`], then removes the directory if nothing uses it: the undo of a create that
    /// may have failed before libcontainer made (and would remove) the cgroup.
    pub fn lift_and_remove(&self, sys: &dyn Syscall) {
        self.lift(sys);
        self.remove_dir();
    }

    /// Unbinds the first `placed` files, the last bound first.
    fn unbind(&self, sys: &dyn Syscall, placed: usize) {
        for name in FILES[..placed].iter().rev() {
            let file = self.dir.join(name);
            if let Err(e) = sys.umount(&file) {
                tracing::warn!(file = %file.display(), error = %e, "unbind the devices stub");
            }
        }
    }

    fn remove_dir(&self) {
        match std::fs::remove_dir(&self.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            // Busy (a process still in it) or already being removed: libcontainer's delete or
            // the shim's teardown removes it.
            Err(e) => tracing::debug!(dir = %self.dir.display(), error = %e, "devices cgroup left for its remover"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::syscall::test::{Call, RecordingSyscall};

    #[test]
    fn both_files_are_bound_to_the_sink_and_unbound_last_first() {
        let sys = RecordingSyscall::default();
        let root = tempfile::tempdir().unwrap();
        let stub = DevicesStub::place(&sys, root.path(), Path::new("/kubepods/pod1/ctr1")).unwrap();
        let dir = root.path().join("kubepods/pod1/ctr1");
        assert_eq!(stub.dir, dir);
        stub.lift(&sys);
        let calls = sys.calls();
        let binds: Vec<(Option<String>, PathBuf)> = calls
            .iter()
            .filter_map(|c| match c {
                Call::Mount { source, target, flags, .. } if *flags == MsFlags::MS_BIND => {
                    Some((source.clone(), target.clone()))
                }
                _ => None,
            })
            .collect();
        let sink = Some(SINK.to_string());
        assert_eq!(binds, [(sink.clone(), dir.join("devices.deny")), (sink, dir.join("devices.allow"))]);
        let unmounts: Vec<&Call> = calls.iter().filter(|c| matches!(c, Call::Umount(_))).collect();
        assert_eq!(unmounts, [&Call::Umount(dir.join("devices.allow")), &Call::Umount(dir.join("devices.deny"))]);
    }

    #[test]
    fn a_failed_bind_leaves_nothing_bound_and_the_directory_gone() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("c")).unwrap();
        let sys =
            RecordingSyscall::failing_mount(&root.path().join("c/devices.allow").display().to_string(), libc::EPERM);
        let err = DevicesStub::place(&sys, root.path(), Path::new("/c")).unwrap_err();
        assert!(err.to_string().contains("devices.allow"), "{err}");
        assert_eq!(sys.calls().iter().filter(|c| matches!(c, Call::Umount(_))).count(), 1, "the first bind undone");
        assert!(!root.path().join("c").exists(), "the directory it made is removed");
    }

    #[test]
    fn only_a_plain_path_below_the_hierarchy_gets_a_stub() {
        let sys = RecordingSyscall::default();
        let root = Path::new("/sys/fs/cgroup/devices");
        for bad in ["/", "", "/a/../../etc", "../etc"] {
            assert!(DevicesStub::place(&sys, root, Path::new(bad)).is_err(), "{bad:?}");
        }
        assert!(sys.calls().is_empty());
    }
}
