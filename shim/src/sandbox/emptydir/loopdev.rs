//! A loop block device over an emptyDir image, so the host kernel can mount the image.
//!
//! The device is configured with `LO_FLAGS_AUTOCLEAR`: the kernel detaches it when its last
//! opener closes it, that is once the filesystem on it is unmounted (after the holder of this
//! [`LoopDevice`] dropped it). So nothing has to find and detach loop devices at teardown, and
//! a shim that dies at any point leaves none behind: before the mount its descriptor closes with
//! it; after the mount, unmounting the pod's state (`delete` after a crash does) releases the
//! device. `LOOP_CONFIGURE` (Linux 5.8) does it in one step; older kernels get `LOOP_SET_FD`
//! then `LOOP_SET_STATUS64`.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;

use nix::errno::Errno;
use nix::fcntl::{open, OFlag};
use nix::sys::stat::Mode;

// linux/loop.h
const LOOP_SET_FD: libc::c_ulong = 0x4C00;
const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LOOP_SET_STATUS64: libc::c_ulong = 0x4C04;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_NAME_SIZE: usize = 64;
const LO_KEY_SIZE: usize = 32;

/// `struct loop_info64`.
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; LO_KEY_SIZE],
    lo_init: [u64; 2],
}

/// `struct loop_config`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);
const _: () = assert!(std::mem::size_of::<LoopConfig>() == 304);

/// How often a free device that another process took first is looked for again.
const ATTEMPTS: usize = 8;

/// A loop device bound to a file. Dropping it closes the shim's descriptor; the device then
/// detaches itself once nothing else holds it (module docs).
#[derive(Debug)]
pub struct LoopDevice {
    pub path: PathBuf,
    _device: File,
}

fn info(label: &str) -> LoopInfo64 {
    let mut name = [0u8; LO_NAME_SIZE];
    // NUL-terminated: at most LO_NAME_SIZE - 1 bytes of the label.
    let len = label.len().min(LO_NAME_SIZE - 1);
    name[..len].copy_from_slice(&label.as_bytes()[..len]);
    LoopInfo64 {
        lo_device: 0,
        lo_inode: 0,
        lo_rdevice: 0,
        lo_offset: 0,
        lo_sizelimit: 0,
        lo_number: 0,
        lo_encrypt_type: 0,
        lo_encrypt_key_size: 0,
        lo_flags: LO_FLAGS_AUTOCLEAR,
        lo_file_name: name,
        lo_crypt_name: [0; LO_NAME_SIZE],
        lo_encrypt_key: [0; LO_KEY_SIZE],
        lo_init: [0; 2],
    }
}

/// Binds `file` (read-write) to a free loop device with autoclear; `label` (cut to 63 bytes)
/// is what `losetup` shows as the device's file name when the backing file is gone.
pub fn attach(file: &File, label: &str) -> Result<LoopDevice, Errno> {
    let control = open("/dev/loop-control", OFlag::O_RDWR | OFlag::O_CLOEXEC, Mode::empty())?;
    let mut last = Errno::EBUSY;
    for _ in 0..ATTEMPTS {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number or -1.
        let number = Errno::result(unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) })?;
        let path = PathBuf::from(format!("/dev/loop{number}"));
        let device: OwnedFd = open(&path, OFlag::O_RDWR | OFlag::O_CLOEXEC, Mode::empty())?;
        match configure(&device, file, label) {
            Ok(()) => return Ok(LoopDevice { path, _device: File::from(device) }),
            // Another process bound this device between GET_FREE and now: ask again.
            Err(Errno::EBUSY) => last = Errno::EBUSY,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

fn configure(device: &OwnedFd, file: &File, label: &str) -> Result<(), Errno> {
    let fd = u32::try_from(file.as_raw_fd()).map_err(|_| Errno::EBADF)?;
    let config = LoopConfig { fd, block_size: 0, info: info(label), reserved: [0; 8] };
    // SAFETY: LOOP_CONFIGURE reads one `struct loop_config`, which `config` is (layout checked
    // above) and which outlives the call; the descriptors are open.
    let rc = unsafe { libc::ioctl(device.as_raw_fd(), LOOP_CONFIGURE, &config as *const LoopConfig) };
    match Errno::result(rc) {
        Ok(_) => Ok(()),
        // Kernels before 5.8 do not know LOOP_CONFIGURE.
        Err(Errno::EINVAL | Errno::ENOTTY) => configure_legacy(device, file, label),
        Err(e) => Err(e),
    }
}

fn configure_legacy(device: &OwnedFd, file: &File, label: &str) -> Result<(), Errno> {
    // SAFETY: LOOP_SET_FD takes the backing file's descriptor as its integer argument.
    Errno::result(unsafe { libc::ioctl(device.as_raw_fd(), LOOP_SET_FD, file.as_raw_fd()) })?;
    let status = info(label);
    // SAFETY: LOOP_SET_STATUS64 reads one `struct loop_info64`, which `status` is and which
    // outlives the call.
    let rc = unsafe { libc::ioctl(device.as_raw_fd(), LOOP_SET_STATUS64, &status as *const LoopInfo64) };
    if let Err(e) = Errno::result(rc) {
        // Without autoclear the device would stay bound: undo the binding.
        // SAFETY: LOOP_CLR_FD takes no argument.
        let _ = unsafe { libc::ioctl(device.as_raw_fd(), LOOP_CLR_FD, 0) };
        return Err(e);
    }
    Ok(())
}

/// The backing file of every bound loop device, from sysfs (`/sys/block/loopN/loop/backing_file`;
/// a deleted file ends in " (deleted)"), as (device, backing file).
pub fn bound_devices() -> Vec<(String, String)> {
    let Ok(entries) = std::fs::read_dir("/sys/block") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            if !name.starts_with("loop") {
                return None;
            }
            let backing = std::fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
            Some((name, backing.trim_end_matches('\n').to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_label_is_cut_and_terminated() {
        let long = "x".repeat(100);
        let i = info(&long);
        assert_eq!(i.lo_file_name[62], b'x');
        assert_eq!(i.lo_file_name[63], 0);
        assert_eq!(i.lo_flags, LO_FLAGS_AUTOCLEAR);
        assert_eq!(&info("pod/vol").lo_file_name[..8], b"pod/vol\0");
    }

    #[test]
    fn a_device_detaches_itself_when_its_last_holder_closes_it() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 || !std::path::Path::new("/dev/loop-control").exists() {
            println!(
                "SKIPPED: a_device_detaches_itself_when_its_last_holder_closes_it: needs root and /dev/loop-control"
            );
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("img");
        let file = std::fs::OpenOptions::new().create(true).truncate(true).read(true).write(true).open(&image).unwrap();
        file.set_len(1 << 20).unwrap();
        let device = attach(&file, "bulkhead-test").unwrap();
        let name = device.path.file_name().unwrap().to_str().unwrap().to_string();
        let ours = |name: &str| {
            bound_devices().into_iter().any(|(d, b)| d == name && b.starts_with(&*image.to_string_lossy()))
        };
        assert!(ours(&name), "{name} is bound to {}", image.display());
        // A second holder keeps it bound after ours closes, as a mount does.
        let holder = File::from(open(&device.path, OFlag::O_RDONLY | OFlag::O_CLOEXEC, Mode::empty()).unwrap());
        drop(device);
        assert!(ours(&name), "still held");
        drop(holder);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while ours(&name) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(!ours(&name), "{name} detached itself once nothing held it");
    }
}
