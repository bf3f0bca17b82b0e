//! fstab-style mount options ("ro", "bind", "mode=0755", ...) to flags + data.

use nix::mount::MsFlags;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountOptions {
    pub flags: MsFlags,
    /// Options the kernel filesystem parses itself, comma-joined.
    pub data: Option<String>,
}

pub fn parse_mount_options(opts: &[String]) -> MountOptions {
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
