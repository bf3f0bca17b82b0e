//! VM mode: the pod's shared directory. When the kernel command line names a virtio-fs tag
//! (`bulkhead.shared_fs=<tag>`; the shim's `vm` backend always does), the agent mounts that tag
//! at [`SHARED_DIR`] when the sandbox gets its identity (SetupSandbox), not at boot: a VM that
//! has booted to "agent listening" then holds nothing of any pod, and is what a template is
//! snapshotted from. Each container's rootfs and volumes are subdirectories of the share
//! (`bulkhead_protocol::guest`), so a create needs no mount of its own beyond libcontainer's.
//! Through the [`Syscall`] seam, so the plan is unit-tested without a VM.

use std::io::Read;
use std::path::Path;

use anyhow::Context;
use bulkhead_protocol::guest::{shared_fs_tag, SHARED_DIR};
use nix::mount::MsFlags;

use crate::{cli::Mode, syscall::Syscall};

/// Longest kernel command line read (the x86 limit is 2 KiB; more is not a command line).
const MAX_CMDLINE: u64 = 64 * 1024;

/// The kernel command line, bounded; empty if it cannot be read.
pub fn kernel_cmdline() -> String {
    let mut text = String::new();
    if let Ok(file) = std::fs::File::open("/proc/cmdline") {
        let _ = file.take(MAX_CMDLINE).read_to_string(&mut text);
    }
    text
}

/// In guest mode, mounts the virtio-fs tag `cmdline` names at [`SHARED_DIR`]; returns the tag
/// mounted. A named tag that cannot be mounted is fatal: no container could start.
pub fn mount_shared_dir(mode: Mode, sys: &dyn Syscall, cmdline: &str) -> anyhow::Result<Option<String>> {
    if mode != Mode::Guest {
        return Ok(None);
    }
    let Some(tag) = shared_fs_tag(cmdline) else {
        return Ok(None);
    };
    let dir = Path::new(SHARED_DIR);
    sys.mkdir_all(dir).with_context(|| format!("create {SHARED_DIR}"))?;
    // No nosuid/nodev: container rootfs come through here, with their setuid binaries.
    sys.mount(Some(tag), dir, Some("virtiofs"), MsFlags::empty(), None)
        .with_context(|| format!("mount virtio-fs tag {tag:?} at {SHARED_DIR}"))?;
    tracing::info!(tag, dir = SHARED_DIR, "pod shared directory mounted");
    Ok(Some(tag.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::syscall::test::{Call, RecordingSyscall};

    #[test]
    fn guest_mode_mounts_the_tag_the_command_line_names() {
        let sys = RecordingSyscall::default();
        let cmdline = "console=ttyS0 reboot=k bulkhead.shared_fs=bulkhead virtio_mmio.device=4K@0xd0000000:5";
        assert_eq!(mount_shared_dir(Mode::Guest, &sys, cmdline).unwrap().as_deref(), Some("bulkhead"));
        assert_eq!(
            sys.calls(),
            [
                Call::Mkdir(SHARED_DIR.into()),
                Call::Mount {
                    source: Some("bulkhead".into()),
                    target: SHARED_DIR.into(),
                    fstype: Some("virtiofs".into()),
                    flags: MsFlags::empty(),
                    data: None,
                },
            ]
        );
    }

    #[test]
    fn nothing_is_mounted_unless_a_guest_is_asked_to() {
        let sys = RecordingSyscall::default();
        assert_eq!(mount_shared_dir(Mode::Guest, &sys, "console=ttyS0").unwrap(), None);
        assert_eq!(mount_shared_dir(Mode::Namespace, &sys, "bulkhead.shared_fs=bulkhead").unwrap(), None);
        assert!(sys.calls().is_empty(), "{:?}", sys.calls());
    }

    #[test]
    fn a_tag_that_does_not_mount_is_fatal_and_named() {
        let sys = RecordingSyscall::failing_mount(SHARED_DIR, libc::ENODEV);
        let err = mount_shared_dir(Mode::Guest, &sys, "bulkhead.shared_fs=pod1").unwrap_err();
        assert!(format!("{err:#}").contains("\"pod1\""), "{err:#}");
    }
}
