//! A mount the shim asks for (a SetupSandbox volume, a container's rootfs mount): its
//! fstab-style options ("ro", "bind", "mode=0755", ...) turned into flags + data, and the one
//! mount(2) call that makes it, through the [`Syscall`] seam.

use std::{
    io,
    path::{Path, PathBuf},
};

use nix::mount::MsFlags;

use crate::syscall::Syscall;

#[derive(Debug, Clone, Default)]
pub struct GuestMount {
    pub source: String,
    pub destination: PathBuf,
    pub fstype: String,
    pub options: Vec<String>,
}

impl GuestMount {
    /// Mounts this on `target` (which must exist). An empty fstype is left to the kernel (bind).
    pub fn mount_on(&self, sys: &dyn Syscall, target: &Path) -> io::Result<()> {
        let opts = parse_mount_options(&self.options);
        sys.mount(
            Some(&self.source),
            target,
            (!self.fstype.is_empty()).then_some(self.fstype.as_str()),
            opts.flags,
            opts.data.as_deref(),
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct MountOptions {
    flags: MsFlags,
    /// Options the kernel filesystem parses itself, comma-joined.
    data: Option<String>,
}

fn parse_mount_options(opts: &[String]) -> MountOptions {
    let mut flags = MsFlags::empty();
    let mut data = Vec::new();
    for o in opts {
        let (set, clear) = match o.as_str() {
            "ro" => (MsFlags::MS_RDONLY, MsFlags::empty()),
            "rw" => (MsFlags::empty(), MsFlags::MS_RDONLY),
            "nosuid" => (MsFlags::MS_NOSUID, MsFlags::empty()),
            "nodev" => (MsFlags::MS_NODEV, MsFlags::empty()),
            "noexec" => (MsFlags::MS_NOEXEC, MsFlags::empty()),
            "sync" => (MsFlags::MS_SYNCHRONOUS, MsFlags::empty()),
            "noatime" => (MsFlags::MS_NOATIME, MsFlags::empty()),
            "relatime" => (MsFlags::MS_RELATIME, MsFlags::empty()),
            "bind" => (MsFlags::MS_BIND, MsFlags::empty()),
            "rbind" => (MsFlags::MS_BIND | MsFlags::MS_REC, MsFlags::empty()),
            "defaults" | "suid" | "dev" | "exec" | "async" => (MsFlags::empty(), MsFlags::empty()),
            other => {
                data.push(other.to_owned());
                (MsFlags::empty(), MsFlags::empty())
            }
        };
        flags.insert(set);
        flags.remove(clear);
    }
    MountOptions { flags, data: (!data.is_empty()).then(|| data.join(",")) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::syscall::test::{Call, RecordingSyscall};

    #[test]
    fn mount_on_passes_flags_data_and_leaves_an_empty_fstype_to_the_kernel() {
        let sys = RecordingSyscall::default();
        let bind = GuestMount {
            source: "/run/vol".into(),
            destination: "/data".into(),
            fstype: String::new(),
            options: vec!["rbind".into(), "ro".into()],
        };
        bind.mount_on(&sys, Path::new("/rootfs/data")).unwrap();
        let tmpfs =
            GuestMount { source: "tmpfs".into(), fstype: "tmpfs".into(), options: vec!["size=1m".into()], ..bind };
        tmpfs.mount_on(&sys, Path::new("/rootfs/tmp")).unwrap();
        assert_eq!(
            sys.calls(),
            [
                Call::Mount {
                    source: Some("/run/vol".into()),
                    target: "/rootfs/data".into(),
                    fstype: None,
                    flags: MsFlags::MS_BIND | MsFlags::MS_REC | MsFlags::MS_RDONLY,
                    data: None,
                },
                Call::Mount {
                    source: Some("tmpfs".into()),
                    target: "/rootfs/tmp".into(),
                    fstype: Some("tmpfs".into()),
                    flags: MsFlags::empty(),
                    data: Some("size=1m".into()),
                },
            ]
        );
    }

    #[test]
    fn splits_flags_from_data() {
        let o =
            parse_mount_options(&["rbind".into(), "ro".into(), "nosuid".into(), "mode=0755".into(), "size=64m".into()]);
        assert_eq!(o.flags, MsFlags::MS_BIND | MsFlags::MS_REC | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID);
        assert_eq!(o.data.as_deref(), Some("mode=0755,size=64m"));
        let o = parse_mount_options(&["ro".into(), "rw".into()]);
        assert_eq!(o.flags, MsFlags::empty());
        assert_eq!(o.data, None);
    }
}
