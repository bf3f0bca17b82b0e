//! Loading what the guest boots: a Linux kernel (ELF vmlinux or bzImage, cmdline, initramfs,
//! zero page) or a raw test guest. Produces the entry state every vCPU starts from. The kernel
//! and initramfs go into guest memory through `memory::ImageFile` (one copy, in the kernel).

use std::fs::File;
use std::path::Path;

use linux_loader::cmdline::Cmdline;
use linux_loader::loader::{load_cmdline, BzImage, Elf, KernelLoader};
use vm_memory::{Address, ByteValued, Bytes, GuestAddress, GuestMemoryMmap};

use crate::arch::boot_params::{build_boot_params, BootParamsInput};
use crate::arch::paging::setup_identity_paging;
use crate::arch::regs::write_gdt_idt;
use crate::config::{BootSource, RawFormat};
use crate::guest_layout::{
    BOOT_STACK_POINTER, CMDLINE_MAX_SIZE, CMDLINE_START, HIMEM_START, MMIO_HOLE_START, RAW_STACK_TOP, ZERO_PAGE_START,
};
use crate::memory::ImageFile;

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("cannot open {path}")]
    Open { path: String, source: std::io::Error },
    #[error("kernel {path} is neither a loadable ELF vmlinux nor a bzImage (elf: {elf}; bzImage: {bz})")]
    KernelFormat { path: String, elf: String, bz: String },
    #[error("kernel command line: {0}")]
    Cmdline(String),
    #[error("initramfs of {size} bytes does not fit in guest memory")]
    InitramfsTooBig { size: u64 },
    #[error("writing boot data to guest memory")]
    Memory(#[from] vm_memory::GuestMemoryError),
    #[error("boot params")]
    BootParams(#[from] crate::arch::boot_params::BootParamsError),
    #[error(transparent)]
    MpTable(#[from] crate::arch::mptable::MpTableError),
    #[error("raw guest image {path} could not be loaded: {reason}")]
    RawImage { path: String, reason: String },
}

/// Where and how every vCPU starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryPoint {
    pub rip: u64,
    pub rsp: u64,
    /// The zero page address for Linux (passed in rsi), 0 for raw guests.
    pub rsi: u64,
    pub cr3: u64,
}

/// A loaded guest: where its vCPUs start, and how long of the load the host kernel spent copying
/// the kernel and initramfs into guest memory (zero for a raw guest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loaded {
    pub entry: EntryPoint,
    pub image_copy: std::time::Duration,
}

/// Loads `boot` into `mem`. `mmio_devices` are (base, size, irq) entries added to the cmdline;
/// `vcpus` goes into the MP table.
pub fn load(
    mem: &GuestMemoryMmap,
    boot: &BootSource,
    mem_bytes: u64,
    mmio_devices: &[(u64, u64, u32)],
    vcpus: u8,
) -> Result<Loaded, BootError> {
    write_gdt_idt(mem)?;
    let cr3 = setup_identity_paging(mem)?;
    match boot {
        BootSource::Linux { kernel, initramfs, cmdline } => {
            let loaded = load_linux(mem, kernel, initramfs.as_deref(), cmdline, mem_bytes, mmio_devices, cr3)?;
            // Linux without ACPI finds the vCPUs and the IOAPIC here.
            crate::arch::mptable::setup_mptable(mem, vcpus)?;
            Ok(loaded)
        }
        BootSource::Raw(raw) => {
            let entry = load_raw(mem, &raw.image, raw.format, raw.load_addr, cr3)?;
            Ok(Loaded { entry, image_copy: std::time::Duration::ZERO })
        }
    }
}

fn open(path: &Path) -> Result<File, BootError> {
    File::open(path).map_err(|source| BootError::Open { path: path.display().to_string(), source })
}

/// Builds the kernel cmdline with one `virtio_mmio.device=` entry per device.
pub fn build_cmdline(base: &str, mmio_devices: &[(u64, u64, u32)]) -> Result<Cmdline, BootError> {
    let err = |e: linux_loader::cmdline::Error| BootError::Cmdline(e.to_string());
    let mut cmdline = Cmdline::new(CMDLINE_MAX_SIZE).map_err(err)?;
    cmdline.insert_str(base).map_err(err)?;
    for (base, size, irq) in mmio_devices {
        cmdline.add_virtio_mmio_device(*size, GuestAddress(*base), *irq, None).map_err(err)?;
    }
    Ok(cmdline)
}

fn load_linux(
    mem: &GuestMemoryMmap,
    kernel: &Path,
    initramfs: Option<&Path>,
    cmdline: &str,
    mem_bytes: u64,
    mmio_devices: &[(u64, u64, u32)],
    cr3: u64,
) -> Result<Loaded, BootError> {
    // Into the memfd in the kernel (sendfile), not through the VMM's mapping.
    let mut file = ImageFile::new(open(kernel)?, mem);
    let start = GuestAddress(HIMEM_START);
    let (entry, setup_header, kernel_end) = match Elf::load(mem, None, &mut file, Some(start)) {
        Ok(r) => (r.kernel_load.raw_value(), None, r.kernel_end),
        Err(elf_err) => match BzImage::load(mem, None, &mut file, Some(start)) {
            // The 64-bit entry of a bzImage sits 0x200 past its protected-mode code.
            Ok(r) => (r.kernel_load.raw_value() + 0x200, r.setup_header, r.kernel_end),
            Err(bz_err) => {
                return Err(BootError::KernelFormat {
                    path: kernel.display().to_string(),
                    elf: elf_err.to_string(),
                    bz: bz_err.to_string(),
                })
            }
        },
    };

    let cmdline = build_cmdline(cmdline, mmio_devices)?;
    load_cmdline(mem, GuestAddress(CMDLINE_START), &cmdline).map_err(|e| BootError::Cmdline(e.to_string()))?;
    let cmdline_size =
        cmdline.as_cstring().map_err(|e| BootError::Cmdline(e.to_string()))?.as_bytes_with_nul().len() as u32;

    let mut image_copy = file.in_kernel();
    let initramfs = match initramfs {
        Some(path) => {
            let (addr, size, copy) = load_initramfs(mem, path, mem_bytes, kernel_end)?;
            image_copy += copy;
            Some((addr, size))
        }
        None => None,
    };
    let params = build_boot_params(&BootParamsInput {
        setup_header,
        cmdline_addr: CMDLINE_START,
        cmdline_size,
        initramfs,
        mem_bytes,
    })?;
    mem.write_obj(BootParamsBytes(params), GuestAddress(ZERO_PAGE_START))?;
    let entry = EntryPoint { rip: entry, rsp: BOOT_STACK_POINTER, rsi: ZERO_PAGE_START, cr3 };
    Ok(Loaded { entry, image_copy })
}

/// Wrapper so we can write the zero page with `write_obj`.
#[derive(Clone, Copy, Default)]
#[repr(transparent)]
struct BootParamsBytes(linux_loader::loader::bootparam::boot_params);
// SAFETY: boot_params is a plain C struct of integers; any byte pattern is valid.
unsafe impl ByteValued for BootParamsBytes {}

/// Puts the initramfs at the top of low memory, page aligned, above the kernel: its address, size
/// and the host kernel's copy time.
fn load_initramfs(
    mem: &GuestMemoryMmap,
    path: &Path,
    mem_bytes: u64,
    kernel_end: u64,
) -> Result<(u64, u32, std::time::Duration), BootError> {
    let mut file = ImageFile::new(open(path)?, mem);
    let size =
        file.file().metadata().map_err(|source| BootError::Open { path: path.display().to_string(), source })?.len();
    let top = mem_bytes.min(MMIO_HOLE_START);
    let addr = top.checked_sub(size).map(|a| a & !0xfff);
    let addr = match addr {
        Some(a) if a >= kernel_end && size <= u64::from(u32::MAX) => a,
        _ => return Err(BootError::InitramfsTooBig { size }),
    };
    mem.read_exact_volatile_from(GuestAddress(addr), &mut file, size as usize)?;
    Ok((addr, size as u32, file.in_kernel()))
}

fn load_raw(
    mem: &GuestMemoryMmap,
    image: &Path,
    format: RawFormat,
    load_addr: u64,
    cr3: u64,
) -> Result<EntryPoint, BootError> {
    let raw_err = |reason: String| BootError::RawImage { path: image.display().to_string(), reason };
    let mut file = open(image)?;
    let rip = match format {
        RawFormat::Elf => {
            let r =
                Elf::load(mem, None, &mut file, Some(GuestAddress(HIMEM_START))).map_err(|e| raw_err(e.to_string()))?;
            r.kernel_load.raw_value()
        }
        RawFormat::Flat => {
            let size = file.metadata().map_err(|e| raw_err(e.to_string()))?.len() as usize;
            let mut f = &mut file;
            let read =
                mem.read_volatile_from(GuestAddress(load_addr), &mut f, size).map_err(|e| raw_err(e.to_string()))?;
            if read != size {
                return Err(raw_err(format!("short load: {read} of {size} bytes")));
            }
            load_addr
        }
    };
    // rsp + 8 is 16-byte aligned, as at a normal function entry.
    Ok(EntryPoint { rip, rsp: RAW_STACK_TOP - 8, rsi: 0, cr3 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmdline_announces_virtio_mmio_devices() {
        let c = build_cmdline("console=ttyS0", &[(0xd000_0000, 0x1000, 5), (0xd000_1000, 0x1000, 6)]).unwrap();
        let s = c.as_cstring().unwrap().into_string().unwrap();
        assert_eq!(s, "console=ttyS0 virtio_mmio.device=4K@0xd0000000:5 virtio_mmio.device=4K@0xd0001000:6");
    }

    #[test]
    fn flat_raw_guest_is_loaded_at_its_address() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        let mut f = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut f, &[0xf4, 0x90]).unwrap();
        let raw =
            crate::config::RawGuestConfig { image: f.path().to_owned(), format: RawFormat::Flat, load_addr: 0x20_0000 };
        let entry = load(&mem, &BootSource::Raw(raw), 4 << 20, &[], 1).unwrap().entry;
        assert_eq!(entry.rip, 0x20_0000);
        assert_eq!(entry.rsp % 16, 8);
        assert_eq!(mem.read_obj::<u16>(GuestAddress(0x20_0000)).unwrap(), 0x90f4);
    }

    #[test]
    fn bzimage_gets_64bit_entry_and_zero_page() {
        use linux_loader::loader::bootparam::boot_params;
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 16 << 20)]).unwrap();
        let mut img = vec![0u8; 1024];
        img[0x1f1] = 1;
        img[0x202..0x206].copy_from_slice(b"HdrS");
        img[0x206..0x208].copy_from_slice(&0x020cu16.to_le_bytes());
        img[0x211] = 0x01;
        img[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes());
        img.extend_from_slice(&[0x90; 0x400]);
        let mut f = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut f, &img).unwrap();
        let mut initrd = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut initrd, &[0xab; 5000]).unwrap();
        let boot = BootSource::Linux {
            kernel: f.path().to_owned(),
            initramfs: Some(initrd.path().to_owned()),
            cmdline: "console=ttyS0".into(),
        };
        let entry = load(&mem, &boot, 16 << 20, &[(0xd000_0000, 0x1000, 5)], 2).unwrap().entry;
        assert_eq!(entry.rip, 0x10_0200);
        assert_eq!(entry.rsi, ZERO_PAGE_START);
        let zp: BootParamsBytes = mem.read_obj(GuestAddress(ZERO_PAGE_START)).unwrap();
        let p: boot_params = zp.0;
        let hdr = p.hdr;
        assert_eq!({ hdr.version }, 0x020c, "the kernel's own header is kept");
        assert_eq!({ hdr.loadflags } & 1, 1);
        assert_eq!({ hdr.cmd_line_ptr } as u64, CMDLINE_START);
        let want = "console=ttyS0 virtio_mmio.device=4K@0xd0000000:5";
        assert_eq!({ hdr.cmdline_size } as usize, want.len() + 1);
        let mut cl = vec![0u8; want.len()];
        mem.read_slice(&mut cl, GuestAddress(CMDLINE_START)).unwrap();
        assert_eq!(cl, want.as_bytes());
        let (rd_addr, rd_size) = ({ hdr.ramdisk_image } as u64, { hdr.ramdisk_size });
        assert_eq!(rd_size, 5000);
        assert_eq!(rd_addr % 4096, 0);
        assert!(rd_addr + 5000 <= 16 << 20);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(rd_addr + 4999)).unwrap(), 0xab);
        assert_eq!(p.e820_entries, 3);
        let mut sig = [0u8; 4];
        mem.read_slice(&mut sig, GuestAddress(crate::arch::mptable::MPTABLE_START)).unwrap();
        assert_eq!(&sig, b"_MP_", "Linux boots get an MP table");
    }

    #[test]
    fn garbage_kernel_is_a_clear_error() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        let mut f = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut f, &[0u8; 8192]).unwrap();
        let boot = BootSource::Linux { kernel: f.path().to_owned(), initramfs: None, cmdline: "x".into() };
        let err = load(&mem, &boot, 4 << 20, &[], 1).unwrap_err();
        assert!(err.to_string().contains("neither a loadable ELF"), "{err}");
    }
}
