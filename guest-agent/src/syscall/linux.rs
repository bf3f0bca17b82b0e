//! The real [`Syscall`] implementation.

use std::{io, os::fd::AsRawFd, path::Path};

use nix::mount::MsFlags;

use super::Syscall;

pub struct LinuxSyscall;

fn nix_io(e: nix::Error) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// A raw libc return code as a Result: 0 is success, anything else leaves its cause in errno.
fn zero_or_errno(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl Syscall for LinuxSyscall {
    fn mount(
        &self,
        source: Option<&str>,
        target: &Path,
        fstype: Option<&str>,
        flags: MsFlags,
        data: Option<&str>,
    ) -> io::Result<()> {
        nix::mount::mount(source, target, fstype, flags, data).map_err(nix_io)
    }

    fn umount(&self, target: &Path) -> io::Result<()> {
        nix::mount::umount2(target, nix::mount::MntFlags::MNT_DETACH).map_err(nix_io)
    }

    fn mkdir_all(&self, path: &Path) -> io::Result<()> {
        std::fs::create_dir_all(path)
    }

    fn symlink(&self, target: &Path, link: &Path) -> io::Result<()> {
        match std::os::unix::fs::symlink(target, link) {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            r => r,
        }
    }

    fn write_file(&self, path: &Path, data: &[u8]) -> io::Result<()> {
        std::fs::write(path, data)
    }

    fn set_child_subreaper(&self) -> io::Result<()> {
        // SAFETY: prctl with integer arguments only.
        zero_or_errno(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) })
    }

    fn sethostname(&self, name: &str) -> io::Result<()> {
        nix::unistd::sethostname(name).map_err(nix_io)
    }

    fn set_realtime_clock(&self, unix_nanos: i64) -> io::Result<()> {
        let ts =
            nix::sys::time::TimeSpec::new(unix_nanos.div_euclid(1_000_000_000), unix_nanos.rem_euclid(1_000_000_000));
        nix::time::clock_settime(nix::time::ClockId::CLOCK_REALTIME, ts).map_err(nix_io)
    }

    fn add_entropy(&self, seed: &[u8]) -> io::Result<()> {
        // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
        let mut buf = Vec::with_capacity(8 + seed.len());
        let bits = i32::try_from(seed.len().saturating_mul(8)).unwrap_or(i32::MAX);
        let len = i32::try_from(seed.len()).unwrap_or(i32::MAX);
        buf.extend_from_slice(&bits.to_ne_bytes());
        buf.extend_from_slice(&len.to_ne_bytes());
        buf.extend_from_slice(seed);
        buf.resize(8 + seed.len().div_ceil(4) * 4, 0);
        let f = std::fs::OpenOptions::new().write(true).open("/dev/random")?;
        const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
        const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
        // SAFETY: buf is a valid rand_pool_info of the advertised size and outlives the call.
        zero_or_errno(unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY as _, buf.as_ptr()) })?;
        // Credited entropy reseeds the CRNG only at the kernel's pace; a VM cloned from a template
        // must stop handing out the template's stream now.
        // SAFETY: RNDRESEEDCRNG takes no argument.
        zero_or_errno(unsafe { libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG as _) })
    }

    fn mknod_char(&self, path: &Path, major: u64, minor: u64, mode: u32) -> io::Result<()> {
        use nix::sys::stat::{makedev, mknod, Mode, SFlag};
        mknod(path, SFlag::S_IFCHR, Mode::from_bits_truncate(mode), makedev(major, minor)).map_err(nix_io)?;
        // mknod(2) applies the umask; the node gets exactly `mode`.
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode))
    }

    fn pivot_root(&self, new_root: &Path) -> io::Result<()> {
        // runc's way: pivot onto the new root with the old one stacked below it at ".", then
        // detach the old one. Needs no directory for the old root inside the new one.
        nix::unistd::chdir(new_root).map_err(nix_io)?;
        nix::unistd::pivot_root(".", ".").map_err(nix_io)?;
        nix::mount::umount2(".", nix::mount::MntFlags::MNT_DETACH).map_err(nix_io)?;
        nix::unistd::chdir("/").map_err(nix_io)
    }
}
