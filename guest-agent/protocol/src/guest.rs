//! Where things are inside a VM guest, as the shim and the agent must agree.
//!
//! The `vm` backend shares the pod's directory over virtio-fs: the shim names the device's tag
//! on the kernel command line (`bulkhead.shared_fs=<tag>`), and the agent mounts it at
//! [`SHARED_DIR`] once, at boot. Below it each container has `<id>/rootfs` (its rootfs) and
//! `<id>/volumes/<n>` (the source of its OCI spec's n-th mount), which is what the shim writes
//! into the specs it sends.

/// Kernel command line parameter whose value is the virtio-fs tag the agent mounts.
pub const SHARED_FS_PARAM: &str = "bulkhead.shared_fs";

/// Where the agent mounts the pod's shared directory in the guest.
pub const SHARED_DIR: &str = "/run/bulkhead/shared";

/// The value of [`SHARED_FS_PARAM`] on a kernel command line, if it names a tag.
pub fn shared_fs_tag(cmdline: &str) -> Option<&str> {
    cmdline
        .split_ascii_whitespace()
        .filter_map(|arg| arg.strip_prefix(SHARED_FS_PARAM)?.strip_prefix('='))
        .find(|tag| !tag.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tag_comes_from_the_command_line() {
        assert_eq!(shared_fs_tag("console=ttyS0 bulkhead.shared_fs=pod quiet"), Some("pod"));
        assert_eq!(shared_fs_tag("console=ttyS0 quiet"), None);
        assert_eq!(shared_fs_tag("bulkhead.shared_fs= bulkhead.shared_fsx=a"), None);
        assert_eq!(shared_fs_tag("xbulkhead.shared_fs=a"), None);
    }
}
