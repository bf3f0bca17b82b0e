//! A container's rootfs: the shim's rootfs mounts made under it (each registered for undo while
//! the create is under way), the check that it is a directory, and the unmounts at removal. All
//! mounts go through the [`Syscall`] seam.

use std::path::{Path, PathBuf};

use crate::{
    error::{AgentError, Result},
    mount::GuestMount,
    rollback::Rollback,
    syscall::Syscall,
};

/// Mounts `mounts` in order under `rootfs` (a destination of "/" is the rootfs itself),
/// registering each unmount on `undo`. Returns the mount points, for [`unmount_all`].
pub fn mount_all<'a>(
    sys: &'a dyn Syscall,
    rootfs: &Path,
    mounts: &[GuestMount],
    undo: &mut Rollback<'a>,
) -> Result<Vec<PathBuf>> {
    let mut targets = Vec::with_capacity(mounts.len());
    for m in mounts {
        let target = rootfs.join(m.destination.strip_prefix("/").unwrap_or(&m.destination));
        sys.mkdir_all(&target).map_err(|e| AgentError::internal("mkdir rootfs mount", e))?;
        m.mount_on(sys, &target)
            .map_err(|e| AgentError::FailedPrecondition(format!("rootfs mount {}: {e}", m.source)))?;
        let mounted = target.clone();
        undo.push(format!("unmount {}", target.display()), move || sys.umount(&mounted));
        targets.push(target);
    }
    Ok(targets)
}

/// After the mounts: the rootfs libcontainer pivots into must be a directory.
pub fn check_is_dir(rootfs: &Path) -> Result<()> {
    if !rootfs.is_dir() {
        return Err(AgentError::InvalidArgument(format!("rootfs {} is not a directory", rootfs.display())));
    }
    Ok(())
}

/// Unmounts what [`mount_all`] mounted, newest first; a failure is logged and the rest still go.
pub fn unmount_all(sys: &dyn Syscall, targets: &[PathBuf]) {
    for t in targets.iter().rev() {
        if let Err(e) = sys.umount(t) {
            tracing::warn!(path = %t.display(), error = %e, "unmount at remove");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::syscall::test::{Call, RecordingSyscall};

    fn bind(source: &str, destination: &str) -> GuestMount {
        GuestMount {
            source: source.into(),
            destination: destination.into(),
            fstype: String::new(),
            options: vec!["rbind".into()],
        }
    }

    fn mount_targets(calls: &[Call]) -> Vec<PathBuf> {
        calls
            .iter()
            .filter_map(|c| if let Call::Mount { target, .. } = c { Some(target.clone()) } else { None })
            .collect()
    }

    #[test]
    fn mounts_land_under_the_rootfs_in_order() {
        let sys = RecordingSyscall::default();
        let mut undo = Rollback::default();
        let mounts = [bind("/snap/overlay", "/"), bind("/vol/data", "/var/data"), bind("/vol/cfg", "etc/cfg")];
        let targets = mount_all(&sys, Path::new("/run/c1/rootfs"), &mounts, &mut undo).unwrap();
        undo.disarm();
        let want: Vec<PathBuf> =
            ["/run/c1/rootfs", "/run/c1/rootfs/var/data", "/run/c1/rootfs/etc/cfg"].iter().map(PathBuf::from).collect();
        assert_eq!(targets, want);
        let calls = sys.calls();
        assert_eq!(mount_targets(&calls), want);
        assert_eq!(calls[0], Call::Mkdir("/run/c1/rootfs".into()), "each mount point is made first");
        assert!(!calls.iter().any(|c| matches!(c, Call::Umount(_))), "a disarmed rollback unmounts nothing");
    }

    #[test]
    fn a_failed_mount_unmounts_only_the_earlier_ones_newest_first() {
        let sys = RecordingSyscall::failing_mount("/r/c", libc::EPERM);
        let mut undo = Rollback::default();
        let mounts = [bind("a", "/a"), bind("b", "/b"), bind("c", "/c"), bind("d", "/d")];
        let err = mount_all(&sys, Path::new("/r"), &mounts, &mut undo).unwrap_err();
        assert!(matches!(&err, AgentError::FailedPrecondition(m) if m.contains("rootfs mount c")), "{err}");
        drop(undo);
        let calls = sys.calls();
        assert_eq!(mount_targets(&calls), [PathBuf::from("/r/a"), "/r/b".into(), "/r/c".into()], "d is never tried");
        let unmounts: Vec<&Call> = calls.iter().filter(|c| matches!(c, Call::Umount(_))).collect();
        assert_eq!(unmounts, [&Call::Umount("/r/b".into()), &Call::Umount("/r/a".into())]);
    }

    #[test]
    fn removal_unmounts_newest_first() {
        let sys = RecordingSyscall::default();
        unmount_all(&sys, &["/r".into(), "/r/a".into()]);
        assert_eq!(sys.calls(), [Call::Umount("/r/a".into()), Call::Umount("/r".into())]);
    }

    #[test]
    fn a_rootfs_that_is_not_a_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        check_is_dir(dir.path()).unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, b"").unwrap();
        assert!(matches!(check_is_dir(&file), Err(AgentError::InvalidArgument(_))));
        assert!(matches!(check_is_dir(&dir.path().join("missing")), Err(AgentError::InvalidArgument(_))));
    }
}
