//! The balloon's host end: giving whole guest pages back to the host kernel. How depends on how
//! the RAM region holding them is mapped (`memory.rs`):
//!
//! - shared and file-backed (the memfd of a booted VM, or the memfd a virtio-fs restore copies
//!   into): `fallocate(PUNCH_HOLE | KEEP_SIZE)` on the file. Dropping our mapping alone would free
//!   nothing: the pages belong to the memfd (and a vhost-user backend maps them too). The kernel
//!   unmaps the range everywhere, and the guest reads zeros next time;
//! - private (a snapshot's memory file mapped copy-on-write, or anonymous memory in tests):
//!   `madvise(MADV_DONTNEED)`. It drops this VM's private copies; the guest next reads the
//!   snapshot's page again (shared in the page cache) or zeros. Never a hole in the memory file:
//!   it is read-only, and shared with every other VM restored from it;
//! - shared and anonymous (not built by this VMM, handled for completeness): `madvise(MADV_REMOVE)`.
//!
//! Both calls only drop memory: whatever the guest asked, the worst outcome is that its own pages
//! read back as zeros or as the snapshot's bytes, which is what a reported free page may hold
//! (no PAGE_POISON was offered). The event loop makes these calls; its seccomp list allows
//! `fallocate` with exactly that mode, and `madvise` is on every thread's list.

use std::os::fd::AsRawFd;

use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap};

use super::packet::PageRange;

/// The only `fallocate` mode the balloon uses (and the event loop's filter allows).
pub const PUNCH_HOLE_MODE: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    PunchHole,
    DontNeed,
    Remove,
}

#[derive(Debug, thiserror::Error)]
pub enum DiscardError {
    #[error("{addr:#x}+{len:#x} is not inside one guest RAM region")]
    NotInRegion { addr: u64, len: u64 },
    #[error("{method:?} of {addr:#x}+{len:#x} failed: {source}")]
    Syscall { method: Method, addr: u64, len: u64, source: std::io::Error },
}

/// How pages of `region` are given back.
pub fn method(region: &GuestRegionMmap) -> Method {
    if region.flags() & libc::MAP_SHARED == 0 {
        Method::DontNeed
    } else if region.file_offset().is_some() {
        Method::PunchHole
    } else {
        Method::Remove
    }
}

/// Gives the pages of `range` back to the host. `range` came from `packet::page_range`, so it is
/// whole pages inside one region; that is checked again here, as this makes the syscall.
pub fn discard(mem: &GuestMemoryMmap, range: PageRange) -> Result<Method, DiscardError> {
    let not_in_region = || DiscardError::NotInRegion { addr: range.addr.0, len: range.len };
    let region = mem.find_region(range.addr).ok_or_else(not_in_region)?;
    let offset = range.addr.0 - region.start_addr().0;
    if offset.checked_add(range.len).is_none_or(|end| end > region.len()) {
        return Err(not_in_region());
    }
    let method = method(region);
    let fail = |source| DiscardError::Syscall { method, addr: range.addr.0, len: range.len, source };
    match (method, region.file_offset()) {
        (Method::PunchHole, Some(file)) => {
            let at = file.start().checked_add(offset).and_then(|o| i64::try_from(o).ok());
            let len = i64::try_from(range.len).ok();
            let (Some(at), Some(len)) = (at, len) else { return Err(not_in_region()) };
            loop {
                // SAFETY: plain syscall on an fd the region keeps open; it only drops file pages.
                let r = unsafe { libc::fallocate64(file.file().as_raw_fd(), PUNCH_HOLE_MODE, at, len) };
                if r == 0 {
                    return Ok(method);
                }
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(fail(e));
                }
            }
        }
        _ => {
            let host = mem.get_host_address(range.addr).map_err(|_| not_in_region())?;
            let advice = if method == Method::Remove { libc::MADV_REMOVE } else { libc::MADV_DONTNEED };
            // SAFETY: [host, host+len) lies inside the region's mapping, which lives as long as
            // `mem`. Both advices only drop pages: the range stays mapped and reads back as zeros
            // or as the underlying file, never as another process's memory. Guest code may be
            // touching these pages concurrently; that is the guest's own (reported) memory.
            let r = unsafe { libc::madvise(host.cast(), range.len as usize, advice) };
            if r != 0 {
                return Err(fail(std::io::Error::last_os_error()));
            }
            Ok(method)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileExt, MetadataExt};
    use vm_memory::{Bytes, GuestAddress};

    const MIB: u64 = 1 << 20;

    fn range(addr: u64, len: u64) -> PageRange {
        PageRange { addr: GuestAddress(addr), len }
    }

    /// Bytes the memfd behind `mem`'s first region has allocated.
    fn allocated(mem: &GuestMemoryMmap) -> u64 {
        let region = mem.find_region(GuestAddress(0)).unwrap();
        region.file_offset().unwrap().file().metadata().unwrap().blocks() * 512
    }

    fn fill(mem: &GuestMemoryMmap, addr: u64, len: u64, byte: u8) {
        mem.write_slice(&vec![byte; len as usize], GuestAddress(addr)).unwrap();
    }

    #[test]
    fn memfd_pages_are_punched_out_and_read_back_as_zeros() {
        let mem = crate::memory::create_guest_memory(16 * MIB).unwrap();
        fill(&mem, 4 * MIB, 4 * MIB, 0xaa);
        fill(&mem, 12 * MIB, 0x1000, 0xbb);
        let before = allocated(&mem);
        assert!(before >= 4 * MIB, "{before}");
        assert_eq!(discard(&mem, range(4 * MIB, 4 * MIB)).unwrap(), Method::PunchHole);
        let after = allocated(&mem);
        assert!(before - after >= 4 * MIB, "{before} -> {after}");
        assert_eq!(mem.read_obj::<u64>(GuestAddress(4 * MIB)).unwrap(), 0);
        assert_eq!(mem.read_obj::<u64>(GuestAddress(8 * MIB - 8)).unwrap(), 0);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(12 * MIB)).unwrap(), 0xbb, "pages outside the range stay");
    }

    #[test]
    fn private_snapshot_pages_fall_back_to_the_file_which_is_never_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory");
        let file = std::fs::File::create(&path).unwrap();
        file.set_len(16 * MIB).unwrap();
        file.write_all_at(&[0x11; 0x2000], 2 * MIB).unwrap();
        drop(file);
        let mem = crate::memory::map_snapshot_memory(std::fs::File::open(&path).unwrap(), &path, 16 * MIB).unwrap();
        fill(&mem, 2 * MIB, 0x2000, 0x22);
        fill(&mem, 6 * MIB, 0x1000, 0x33);
        assert_eq!(discard(&mem, range(2 * MIB, 0x2000)).unwrap(), Method::DontNeed);
        assert_eq!(discard(&mem, range(6 * MIB, 0x1000)).unwrap(), Method::DontNeed);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(2 * MIB + 0x1fff)).unwrap(), 0x11, "the snapshot's byte again");
        assert_eq!(mem.read_obj::<u8>(GuestAddress(6 * MIB)).unwrap(), 0, "a hole in the file reads as zero");
        let mut on_disk = [0u8; 1];
        std::fs::File::open(&path).unwrap().read_exact_at(&mut on_disk, 6 * MIB).unwrap();
        assert_eq!(on_disk, [0]);
    }

    #[test]
    fn anonymous_private_pages_read_back_as_zeros() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MIB as usize)]).unwrap();
        fill(&mem, 0x10_000, 0x1000, 0x44);
        assert_eq!(discard(&mem, range(0x10_000, 0x1000)).unwrap(), Method::DontNeed);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(0x10_000)).unwrap(), 0);
    }

    #[test]
    fn a_range_beyond_its_region_is_refused_before_any_syscall() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MIB as usize)]).unwrap();
        assert!(matches!(discard(&mem, range(MIB - 0x1000, 0x2000)), Err(DiscardError::NotInRegion { .. })));
        assert!(matches!(discard(&mem, range(2 * MIB, 0x1000)), Err(DiscardError::NotInRegion { .. })));
        assert!(matches!(discard(&mem, range(0x1000, u64::MAX - 0xfff)), Err(DiscardError::NotInRegion { .. })));
    }
}
