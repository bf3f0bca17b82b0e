//! Snapshots: what a VM is besides its memory, written as a versioned, checksummed state file
//! next to a memory file, and read back by a restore.
//!
//! - `state.rs`: the state document (vCPUs, irqchip/PIT/clock, devices, the VM's config);
//! - `file.rs`: the state file's header, checksum and size limits (a fuzz target);
//! - `cpu.rs`: the host-CPU fingerprint a snapshot is bound to;
//! - `kvm.rs`: reading and writing KVM's share of the state through ioctls.
//!
//! Boundaries: devices save and restore themselves (`Persist`), and the device manager keeps the
//! device set's state (`device_manager/persist.rs`); building the VM around restored state is the
//! builder's job, taking a snapshot the snapshotter's.

pub mod cpu;
pub mod file;
pub mod kvm;
#[cfg(any(test, feature = "test-utils"))]
pub mod sample;
pub mod state;

/// The two files of a snapshot directory.
pub use bulkhead_vmm_api::restore::{MEMORY_FILE, STATE_FILE};

use std::fs::File;
use std::path::{Path, PathBuf};

/// A snapshot's two files, opened. A jailed VMM opens them while still root (the template store
/// is root's alone: 0700 directories, 0400 files), before it drops its privileges.
#[derive(Debug)]
pub struct SnapshotFiles {
    pub dir: PathBuf,
    pub state: File,
    pub memory: File,
}

impl SnapshotFiles {
    /// Opens `dir`'s state and memory files read-only, following no link.
    pub fn open(dir: &Path) -> std::io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let open = |name: &str, what: &str| {
            let path = dir.join(name);
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&path)
                .map_err(|e| std::io::Error::new(e.kind(), format!("cannot read {what} {}: {e}", path.display())))
        };
        Ok(Self {
            dir: dir.to_owned(),
            state: open(STATE_FILE, "state file")?,
            memory: open(MEMORY_FILE, "memory file")?,
        })
    }
}
