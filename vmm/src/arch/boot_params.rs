//! The Linux zero page (`boot_params`): setup header fields and the e820 memory map.

use linux_loader::loader::bootparam::{boot_e820_entry, boot_params, setup_header};

use crate::guest_layout::{EBDA_START, HIMEM_START, MMIO_HOLE_END, MMIO_HOLE_START};

pub const E820_RAM: u32 = 1;
pub const E820_RESERVED: u32 = 2;
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448;
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT_BYTES: u32 = 0x0100_0000;
const E820_MAX: usize = 128;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BootParamsError {
    #[error("e820 table is full")]
    E820Full,
    #[error("guest memory ({0} bytes) is too small to hold the kernel")]
    MemoryTooSmall(u64),
}

/// Inputs to the zero page.
#[derive(Debug, Clone)]
pub struct BootParamsInput {
    /// The bzImage's own setup header; `None` for an ELF vmlinux.
    pub setup_header: Option<setup_header>,
    pub cmdline_addr: u64,
    /// Length of the cmdline including its NUL.
    pub cmdline_size: u32,
    pub initramfs: Option<(u64, u32)>,
    pub mem_bytes: u64,
}

fn add_e820(params: &mut boot_params, addr: u64, size: u64, kind: u32) -> Result<(), BootParamsError> {
    let idx = params.e820_entries as usize;
    if idx >= E820_MAX {
        return Err(BootParamsError::E820Full);
    }
    params.e820_table[idx] = boot_e820_entry { addr, size, r#type: kind };
    params.e820_entries += 1;
    Ok(())
}

/// Builds the zero page for the given memory size, cmdline and initramfs.
pub fn build_boot_params(input: &BootParamsInput) -> Result<boot_params, BootParamsError> {
    if input.mem_bytes <= HIMEM_START {
        return Err(BootParamsError::MemoryTooSmall(input.mem_bytes));
    }
    let mut params = boot_params::default();
    if let Some(hdr) = input.setup_header {
        params.hdr = hdr;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = input.cmdline_addr as u32;
    params.hdr.cmdline_size = input.cmdline_size;
    if params.hdr.kernel_alignment == 0 {
        params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT_BYTES;
    }
    if let Some((addr, size)) = input.initramfs {
        params.hdr.ramdisk_image = addr as u32;
        params.hdr.ramdisk_size = size;
    }

    add_e820(&mut params, 0, EBDA_START, E820_RAM)?;
    let low_end = input.mem_bytes.min(MMIO_HOLE_START);
    add_e820(&mut params, HIMEM_START, low_end - HIMEM_START, E820_RAM)?;
    add_e820(&mut params, MMIO_HOLE_START, MMIO_HOLE_END - MMIO_HOLE_START, E820_RESERVED)?;
    if input.mem_bytes > MMIO_HOLE_START {
        add_e820(&mut params, MMIO_HOLE_END, input.mem_bytes - MMIO_HOLE_START, E820_RAM)?;
    }
    Ok(params)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(mem_bytes: u64) -> BootParamsInput {
        BootParamsInput {
            setup_header: None,
            cmdline_addr: 0x2_0000,
            cmdline_size: 10,
            initramfs: Some((0x700_0000, 0x1000)),
            mem_bytes,
        }
    }

    fn entries(p: &boot_params) -> Vec<(u64, u64, u32)> {
        p.e820_table[..p.e820_entries as usize].iter().map(|e| (e.addr, e.size, e.r#type)).collect()
    }

    #[test]
    fn small_vm_has_low_ram_himem_and_hole() {
        let p = build_boot_params(&input(128 << 20)).unwrap();
        assert_eq!(
            entries(&p),
            vec![
                (0, EBDA_START, E820_RAM),
                (HIMEM_START, (128 << 20) - HIMEM_START, E820_RAM),
                (MMIO_HOLE_START, MMIO_HOLE_END - MMIO_HOLE_START, E820_RESERVED),
            ]
        );
        let hdr = p.hdr;
        assert_eq!({ hdr.boot_flag }, 0xaa55);
        assert_eq!({ hdr.header }, 0x5372_6448);
        assert_eq!({ hdr.cmd_line_ptr }, 0x2_0000);
        assert_eq!({ hdr.cmdline_size }, 10);
        assert_eq!({ hdr.ramdisk_image }, 0x700_0000);
        assert_eq!({ hdr.ramdisk_size }, 0x1000);
        assert_eq!({ hdr.type_of_loader }, 0xff);
    }

    #[test]
    fn big_vm_gets_ram_above_4g() {
        let p = build_boot_params(&input(5 << 30)).unwrap();
        let e = entries(&p);
        assert_eq!(e[1], (HIMEM_START, MMIO_HOLE_START - HIMEM_START, E820_RAM));
        assert_eq!(e[3], (MMIO_HOLE_END, (5 << 30) - MMIO_HOLE_START, E820_RAM));
        let ram: u64 = e.iter().filter(|x| x.2 == E820_RAM).map(|x| x.1).sum();
        assert_eq!(ram, (5 << 30) - (HIMEM_START - EBDA_START));
    }

    #[test]
    fn tiny_memory_is_an_error() {
        assert!(matches!(build_boot_params(&input(0x8_0000)), Err(BootParamsError::MemoryTooSmall(0x8_0000))));
    }
}
