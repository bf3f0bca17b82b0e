//! Guest memory: memfd-backed for a booted VM (so vhost-user backends can share the pages), or
//! a private mapping of a snapshot's memory file for a restored VM (so every VM restored from
//! one snapshot shares its clean pages with the others and none writes to the file). Also
//! writes guest memory out as a sparse memory file.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::FromRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{
    Address, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap,
};

use crate::layout;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("memfd_create failed: {0}")]
    Memfd(std::io::Error),
    #[error("sizing the memfd to {size} bytes failed")]
    Truncate { size: u64, source: std::io::Error },
    #[error("mapping guest memory failed")]
    Map(#[from] vm_memory::mmap::FromRangesError),
    #[error("memory file {path}")]
    File { path: String, source: std::io::Error },
    #[error("memory file {path} holds {got} bytes, the snapshot's guest has {want}")]
    FileSize { path: String, got: u64, want: u64 },
    #[error("mapping memory file {path}: {reason}")]
    MapFile { path: String, reason: String },
}

/// Pages are written in chunks of this size; all-zero chunks are left as holes.
const SAVE_CHUNK: usize = 64 << 10;

/// What [`save_guest_memory`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SavedMemory {
    pub file_bytes: u64,
    /// Non-zero data actually written (the rest of the file is holes).
    pub written_bytes: u64,
}

/// Writes every RAM region, in order, into a new sparse file at `path`.
pub fn save_guest_memory(mem: &GuestMemoryMmap, path: &Path) -> Result<SavedMemory, MemoryError> {
    let err = |source| MemoryError::File { path: path.display().to_string(), source };
    // Guest memory may hold secrets: owner-only.
    let file =
        std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path).map_err(err)?;
    let mut offset = 0u64;
    let mut written = 0u64;
    let mut buf = vec![0u8; SAVE_CHUNK];
    for region in mem.iter() {
        let len = region.len();
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(SAVE_CHUNK as u64) as usize;
            let chunk = &mut buf[..n];
            vm_memory::Bytes::read_slice(mem, chunk, region.start_addr().unchecked_add(done))
                .map_err(|e| err(std::io::Error::other(e.to_string())))?;
            if chunk.iter().any(|b| *b != 0) {
                file.write_all_at(chunk, offset + done).map_err(err)?;
                written += n as u64;
            }
            done += n as u64;
        }
        offset += len;
    }
    file.set_len(offset).map_err(err)?;
    file.sync_all().map_err(err)?;
    Ok(SavedMemory { file_bytes: offset, written_bytes: written })
}

/// Maps a snapshot's memory file as guest memory of `mem_bytes`: read-only file, private
/// copy-on-write mapping, so the guest's writes stay in this process.
pub fn map_snapshot_memory(path: &Path, mem_bytes: u64) -> Result<GuestMemoryMmap, MemoryError> {
    let p = path.display().to_string();
    let file = File::open(path).map_err(|source| MemoryError::File { path: p.clone(), source })?;
    let got = file.metadata().map_err(|source| MemoryError::File { path: p.clone(), source })?.len();
    if got != mem_bytes {
        return Err(MemoryError::FileSize { path: p, got, want: mem_bytes });
    }
    let file = std::sync::Arc::new(file);
    let mut offset = 0u64;
    let mut regions = Vec::new();
    for (start, len) in layout::ram_ranges(mem_bytes) {
        let map_err = |reason: String| MemoryError::MapFile { path: p.clone(), reason };
        let region = MmapRegionBuilder::new(len as usize)
            .with_file_offset(FileOffset::from_arc(file.clone(), offset))
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
            .build()
            .map_err(|e| map_err(e.to_string()))?;
        let region = GuestRegionMmap::new(region, GuestAddress(start)).ok_or_else(|| map_err("bad region".into()))?;
        regions.push(region);
        offset += len;
    }
    GuestMemoryMmap::from_regions(regions).map_err(|e| MemoryError::MapFile { path: p, reason: e.to_string() })
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
    use vm_memory::Bytes;

    #[test]
    fn saved_memory_maps_back_privately_and_sparsely() {
        let mem = create_guest_memory(16 << 20).unwrap();
        mem.write_obj(0x1122_3344u32, GuestAddress(0x1000)).unwrap();
        mem.write_obj(0x5566_7788u32, GuestAddress((16 << 20) - 4)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory");
        let saved = save_guest_memory(&mem, &path).unwrap();
        assert_eq!(saved, SavedMemory { file_bytes: 16 << 20, written_bytes: 2 * SAVE_CHUNK as u64 });
        let before = std::fs::read(&path).unwrap();

        let a = map_snapshot_memory(&path, 16 << 20).unwrap();
        let b = map_snapshot_memory(&path, 16 << 20).unwrap();
        assert_eq!(a.read_obj::<u32>(GuestAddress(0x1000)).unwrap(), 0x1122_3344);
        assert_eq!(a.read_obj::<u32>(GuestAddress((16 << 20) - 4)).unwrap(), 0x5566_7788);
        a.write_obj(0xdeadu32, GuestAddress(0x1000)).unwrap();
        assert_eq!(b.read_obj::<u32>(GuestAddress(0x1000)).unwrap(), 0x1122_3344, "private to each VM");
        assert_eq!(std::fs::read(&path).unwrap(), before, "the file is never written");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);

        let err = map_snapshot_memory(&path, 32 << 20).unwrap_err();
        assert!(err.to_string().contains("holds 16777216 bytes"), "{err}");
    }

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
