//! Guest memory: memfd-backed for a booted VM (so vhost-user backends can share the pages), or
//! for a restored VM a private mapping of the snapshot's memory file (so every VM restored from
//! one snapshot shares its clean pages with the others and none writes to the file), or, when a
//! vhost-user backend must share it, a memfd the memory file is copied into. Also writes guest
//! memory out as a sparse memory file, and reads boot images (kernel, initramfs) into a memfd in
//! the kernel ([`ImageFile`]).

use std::ffi::CString;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::path::Path;

use vm_memory::bitmap::BitmapSlice;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{
    Address, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap,
    MemoryRegionAddress, ReadVolatile, VolatileMemoryError, VolatileSlice,
};

use crate::guest_layout;

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

/// Writes every RAM region, in order, into `file` (new and empty), leaving all-zero chunks as
/// holes, then syncs it. `path` names the file in errors.
pub fn save_guest_memory(mem: &GuestMemoryMmap, file: &File, path: &Path) -> Result<SavedMemory, MemoryError> {
    let err = |source| MemoryError::File { path: path.display().to_string(), source };
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

/// Checks a snapshot's memory file (open read-only) holds `mem_bytes`.
fn check_memory_file(file: File, path: &Path, mem_bytes: u64) -> Result<File, MemoryError> {
    let p = path.display().to_string();
    let got = file.metadata().map_err(|source| MemoryError::File { path: p.clone(), source })?.len();
    if got != mem_bytes {
        return Err(MemoryError::FileSize { path: p, got, want: mem_bytes });
    }
    Ok(file)
}

/// Maps a snapshot's memory file (open read-only; `path` names it in errors) as guest memory of
/// `mem_bytes`: private copy-on-write mapping, so the guest's writes stay in this process.
pub fn map_snapshot_memory(file: File, path: &Path, mem_bytes: u64) -> Result<GuestMemoryMmap, MemoryError> {
    let p = path.display().to_string();
    let file = check_memory_file(file, path, mem_bytes)?;
    let file = std::sync::Arc::new(file);
    let mut offset = 0u64;
    let mut regions = Vec::new();
    for (start, len) in guest_layout::ram_ranges(mem_bytes) {
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
    map_memfd(new_memfd(mem_bytes)?, mem_bytes)
}

/// An empty memfd of `mem_bytes`: the RAM ranges one after the other. Sealed at that size: a
/// vhost-user backend it is shared with (virtiofsd, the most guest-exposed host process) could
/// otherwise truncate it, and every VMM access past the new end would be a SIGBUS.
fn new_memfd(mem_bytes: u64) -> Result<File, MemoryError> {
    let name = CString::new("bulkhead-guest-mem").map_err(|e| MemoryError::Memfd(e.into()))?;
    // SAFETY: name is a valid NUL-terminated string; the return value is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(MemoryError::Memfd(std::io::Error::last_os_error()));
    }
    // SAFETY: fd was just created and is owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(mem_bytes).map_err(|source| MemoryError::Truncate { size: mem_bytes, source })?;
    // Hole punching (the balloon's free page reporting) stays allowed: only a write seal stops it.
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: F_ADD_SEALS takes an int of seal bits; the fd is ours and open.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(MemoryError::Memfd(std::io::Error::last_os_error()));
    }
    Ok(file)
}

/// Maps a memfd made by [`new_memfd`] shared, as guest memory.
fn map_memfd(file: File, mem_bytes: u64) -> Result<GuestMemoryMmap, MemoryError> {
    let file = std::sync::Arc::new(file);
    let mut offset = 0u64;
    let mut ranges = Vec::new();
    for (start, len) in guest_layout::ram_ranges(mem_bytes) {
        ranges.push((GuestAddress(start), len as usize, Some(FileOffset::from_arc(file.clone(), offset))));
        offset += len;
    }
    Ok(GuestMemoryMmap::from_ranges_with_files(ranges)?)
}

/// A boot image (kernel, initramfs) as the loaders read it into guest memory (linux-loader's ELF
/// and bzImage loaders, the initramfs load): where the bytes land in a shared, writable memfd
/// region, they go in with sendfile, page cache to memfd inside the kernel. Read through the
/// mapping instead, every page would first be faulted in and zero-filled by the VMM (a second
/// pass over the whole image) and then copied. The VMM does not map those pages until the guest
/// touches them. Anywhere else (a header read into a struct, anonymous memory in unit tests, a
/// private mapping) it is a plain read.
pub struct ImageFile<'a> {
    file: File,
    mem: &'a GuestMemoryMmap,
    in_kernel: std::time::Duration,
}

impl<'a> ImageFile<'a> {
    pub fn new(file: File, mem: &'a GuestMemoryMmap) -> Self {
        Self { file, mem, in_kernel: std::time::Duration::ZERO }
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    /// Time spent in sendfile so far: the host kernel allocating the memfd's pages and copying
    /// into them, which any VMM pays for these bytes (the start's phases show it apart).
    pub fn in_kernel(&self) -> std::time::Duration {
        self.in_kernel
    }

    /// The memfd and offset that back `len` bytes at host address `ptr`, when one shared,
    /// writable file mapping holds all of them.
    fn backing(&self, ptr: *const u8, len: usize) -> Option<(RawFd, u64)> {
        let addr = ptr as usize;
        self.mem.iter().find_map(|region| {
            let base = region.get_host_address(MemoryRegionAddress(0)).ok()? as usize;
            let inside = addr >= base && addr.checked_add(len)? <= base.checked_add(region.len() as usize)?;
            let shared = region.flags() & libc::MAP_SHARED != 0 && region.prot() & libc::PROT_WRITE != 0;
            let fo = region.file_offset().filter(|_| inside && shared)?;
            Some((fo.file().as_raw_fd(), fo.start() + (addr - base) as u64))
        })
    }
}

impl Read for ImageFile<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.file.read(buf)
    }
}

impl Seek for ImageFile<'_> {
    fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
        self.file.seek(pos)
    }
}

impl ReadVolatile for ImageFile<'_> {
    fn read_volatile<B: BitmapSlice>(&mut self, buf: &mut VolatileSlice<B>) -> Result<usize, VolatileMemoryError> {
        let Some((memfd, offset)) = self.backing(buf.ptr_guard_mut().as_ptr(), buf.len()) else {
            return (&self.file).read_volatile(buf);
        };
        let io = |e: std::io::Error| VolatileMemoryError::IOError(e);
        // SAFETY: lseek on the memfd this guest memory maps (only this thread uses its position
        // while the guest is loaded); the result is checked.
        if unsafe { libc::lseek64(memfd, offset as libc::off64_t, libc::SEEK_SET) } < 0 {
            return Err(io(std::io::Error::last_os_error()));
        }
        let began = std::time::Instant::now();
        // SAFETY: both fds are open for the call; a null offset reads at (and advances) the
        // image's own position, as read(2) would; at most `buf.len()` bytes land in the memfd,
        // inside the region `backing` found.
        let n = unsafe { libc::sendfile64(memfd, self.file.as_raw_fd(), std::ptr::null_mut(), buf.len()) };
        self.in_kernel += began.elapsed();
        if n < 0 {
            return Err(io(std::io::Error::last_os_error()));
        }
        let n = n as usize;
        buf.bitmap().mark_dirty(0, n);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    #[test]
    fn guest_memory_cannot_be_shrunk_or_grown_by_whoever_it_is_shared_with() {
        let mem = create_guest_memory(8 << 20).unwrap();
        let region = mem.iter().next().unwrap();
        let file = region.file_offset().unwrap().file();
        for len in [4 << 20, 16 << 20, 0] {
            let err = file.set_len(len).unwrap_err();
            assert_eq!(err.raw_os_error(), Some(libc::EPERM), "resize to {len}: {err}");
        }
        // SAFETY: F_GET_SEALS reads the seals of our open fd.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        assert_eq!(
            seals,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
            "and no one can add or lift one"
        );
        // Punching a hole (free page reporting) still works.
        // SAFETY: a plain fallocate on our fd.
        let punched = unsafe {
            libc::fallocate(file.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, 0, 4096)
        };
        assert_eq!(punched, 0, "{}", std::io::Error::last_os_error());
    }

    #[test]
    fn an_image_lands_in_a_memfd_without_the_vmm_touching_the_pages() {
        let mem = create_guest_memory(16 << 20).unwrap();
        let mut image = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..(3 << 20) + 123).map(|i| (i % 251) as u8).collect();
        std::io::Write::write_all(&mut image, &data[..]).unwrap();
        let mut image = ImageFile::new(image, &mem);
        image.seek(SeekFrom::Start(100)).unwrap();
        let mut header = [0u8; 4];
        image.read_exact(&mut header).unwrap();
        assert_eq!(header, data[100..104]);
        let rss = || rss_of(&mem);
        let before = rss();
        image.rewind().unwrap();
        mem.read_exact_volatile_from(GuestAddress(0x20_0000), &mut image, data.len()).unwrap();
        assert!(rss() < before + 64, "loading mapped {} KiB into the VMM", rss() - before);
        assert_eq!(image.file().stream_position().unwrap(), data.len() as u64, "the image's position moved on");
        let mut back = vec![0u8; data.len()];
        mem.read_slice(&mut back, GuestAddress(0x20_0000)).unwrap();
        assert!(back == data, "the guest sees the image");
        assert!(image.in_kernel() > std::time::Duration::ZERO, "the copy's time is kept for the start's phases");
        // Not memfd-backed: a plain read.
        let anon = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let mut image = ImageFile::new(image.file, &anon);
        image.rewind().unwrap();
        anon.read_exact_volatile_from(GuestAddress(0x1000), &mut image, 4096).unwrap();
        assert_eq!(anon.read_obj::<u8>(GuestAddress(0x1001)).unwrap(), data[1]);
        assert_eq!(image.in_kernel(), std::time::Duration::ZERO, "no sendfile, no host copy time");
    }

    /// KiB of this process's resident pages of `mem`'s (first) mapping.
    fn rss_of(mem: &GuestMemoryMmap) -> u64 {
        let base = mem.iter().next().unwrap().get_host_address(MemoryRegionAddress(0)).unwrap() as usize;
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut lines = smaps.lines();
        while let Some(line) = lines.next() {
            let start = line.split('-').next().and_then(|s| usize::from_str_radix(s, 16).ok());
            if start == Some(base) {
                let rss = lines.find(|l| l.starts_with("Rss:")).unwrap();
                return rss.split_whitespace().nth(1).unwrap().parse().unwrap();
            }
        }
        panic!("no mapping at {base:#x}");
    }

    #[test]
    fn saved_memory_maps_back_privately_and_sparsely() {
        let mem = create_guest_memory(16 << 20).unwrap();
        mem.write_obj(0x1122_3344u32, GuestAddress(0x1000)).unwrap();
        mem.write_obj(0x5566_7788u32, GuestAddress((16 << 20) - 4)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory");
        let file = std::fs::OpenOptions::new().write(true).create_new(true).open(&path).unwrap();
        let saved = save_guest_memory(&mem, &file, &path).unwrap();
        assert_eq!(saved, SavedMemory { file_bytes: 16 << 20, written_bytes: 2 * SAVE_CHUNK as u64 });
        let before = std::fs::read(&path).unwrap();

        let a = map_snapshot_memory(File::open(&path).unwrap(), &path, 16 << 20).unwrap();
        let b = map_snapshot_memory(File::open(&path).unwrap(), &path, 16 << 20).unwrap();
        assert_eq!(a.read_obj::<u32>(GuestAddress(0x1000)).unwrap(), 0x1122_3344);
        assert_eq!(a.read_obj::<u32>(GuestAddress((16 << 20) - 4)).unwrap(), 0x5566_7788);
        a.write_obj(0xdeadu32, GuestAddress(0x1000)).unwrap();
        assert_eq!(b.read_obj::<u32>(GuestAddress(0x1000)).unwrap(), 0x1122_3344, "private to each VM");
        assert_eq!(std::fs::read(&path).unwrap(), before, "the file is never written");

        let err = map_snapshot_memory(File::open(&path).unwrap(), &path, 32 << 20).unwrap_err();
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
