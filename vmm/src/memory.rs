//! memfd-backed guest memory. A memfd (rather than anonymous memory) lets vhost-user backends and
//! snapshots share the very same pages later.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::FromRawFd;

use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap};

use crate::layout;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("memfd_create failed: {0}")]
    Memfd(std::io::Error),
    #[error("sizing the memfd to {size} bytes failed")]
    Truncate { size: u64, source: std::io::Error },
    #[error("mapping guest memory failed")]
    Map(#[from] vm_memory::mmap::FromRangesError),
}

/// Creates guest memory of `mem_bytes`, laid out around the MMIO hole, in one memfd.
pub fn create_guest_memory(mem_bytes: u64) -> Result<GuestMemoryMmap, MemoryError> {
    let name = CString::new("bulkhead-guest-mem").map_err(|e| MemoryError::Memfd(e.into()))?;
    // SAFETY: name is a valid NUL-terminated string; the return value is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(MemoryError::Memfd(std::io::Error::last_os_error()));
    }
    // SAFETY: fd was just created and is owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(mem_bytes).map_err(|source| MemoryError::Truncate { size: mem_bytes, source })?;
    let file = std::sync::Arc::new(file);
    let mut offset = 0u64;
    let mut ranges = Vec::new();
    for (start, len) in layout::ram_ranges(mem_bytes) {
        ranges.push((GuestAddress(start), len as usize, Some(FileOffset::from_arc(file.clone(), offset))));
        offset += len;
    }
    Ok(GuestMemoryMmap::from_ranges_with_files(ranges)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestMemoryBackend, GuestMemoryRegion};

    #[test]
    fn memory_is_memfd_backed_and_usable() {
        let mem = create_guest_memory(16 << 20).unwrap();
        assert_eq!(mem.num_regions(), 1);
        assert!(mem.iter().all(|r| r.file_offset().is_some()));
        mem.write_obj(0xdead_beefu32, GuestAddress(0x1000)).unwrap();
        assert_eq!(mem.read_obj::<u32>(GuestAddress(0x1000)).unwrap(), 0xdead_beef);
        assert!(mem.read_obj::<u32>(GuestAddress(16 << 20)).is_err());
    }
}
