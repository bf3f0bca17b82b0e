//! The syscall seam: guest init, SetupSandbox and the container mounts call these, never libc
//! directly, so their plans are unit-tested without root ([`test::RecordingSyscall`]); the
//! integration tests exercise [`LinuxSyscall`]. youki's `libcontainer::syscall` is the model.

mod linux;
#[cfg(test)]
pub mod test;

pub use linux::LinuxSyscall;

use std::{io, path::Path};

use nix::mount::MsFlags;

pub trait Syscall: Send + Sync {
    fn mount(
        &self,
        source: Option<&str>,
        target: &Path,
        fstype: Option<&str>,
        flags: MsFlags,
        data: Option<&str>,
    ) -> io::Result<()>;
    fn umount(&self, target: &Path) -> io::Result<()>;
    fn mkdir_all(&self, path: &Path) -> io::Result<()>;
    fn symlink(&self, target: &Path, link: &Path) -> io::Result<()>;
    fn write_file(&self, path: &Path, data: &[u8]) -> io::Result<()>;
    fn set_child_subreaper(&self) -> io::Result<()>;
    fn sethostname(&self, name: &str) -> io::Result<()>;
    fn set_realtime_clock(&self, unix_nanos: i64) -> io::Result<()>;
    /// Mixes `seed` into the kernel's pool, credited, and reseeds the CRNG at once.
    fn add_entropy(&self, seed: &[u8]) -> io::Result<()>;
    /// A character device node `major:minor` at `path` with permissions `mode`.
    fn mknod_char(&self, path: &Path, major: u64, minor: u64, mode: u32) -> io::Result<()>;
    /// Makes `new_root` (a mount point) this mount namespace's root, detaches the old root and
    /// leaves the working directory at the new `/`.
    fn pivot_root(&self, new_root: &Path) -> io::Result<()>;
}
