//! The guest physical address map (x86_64).
//!
//! ```text
//! 0x0000_0500  GDT            0x0000_0520  IDT
//! 0x0000_7000  zero page (boot_params)
//! 0x0000_8ff0  boot stack top
//! 0x0000_9000  PML4, 0xa000 PDPT, 0xb000..0xf000 four page directories (identity map of 4 GiB)
//! 0x0002_0000  kernel cmdline
//! 0x0010_0000  kernel / raw guest image
//! 0xc000_0000 .. 0x1_0000_0000   MMIO hole (devices at 0xd000_0000, 4 KiB each)
//! 0x1_0000_0000 ..               RAM above the hole when mem > 3 GiB
//! ```

pub const GDT_START: u64 = 0x500;
pub const IDT_START: u64 = 0x520;
pub const ZERO_PAGE_START: u64 = 0x7000;
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
pub const PML4_START: u64 = 0x9000;
pub const PDPTE_START: u64 = 0xa000;
pub const PDE_START: u64 = 0xb000;
/// Number of page directories: each maps 1 GiB with 2 MiB pages.
pub const PDE_COUNT: u64 = 4;
pub const CMDLINE_START: u64 = 0x2_0000;
pub const CMDLINE_MAX_SIZE: usize = 4096;
/// Start of the EBDA; RAM below 1 MiB ends here in the e820 map.
pub const EBDA_START: u64 = 0x9_fc00;
pub const HIMEM_START: u64 = 0x10_0000;
/// Raw test guests get their stack just below this (page tables live lower).
pub const RAW_STACK_TOP: u64 = 0x8_0000;

pub const MMIO_HOLE_START: u64 = 0xc000_0000;
pub const MMIO_HOLE_END: u64 = 0x1_0000_0000;
pub const VIRTIO_MMIO_BASE: u64 = 0xd000_0000;
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;
/// First GSI handed to virtio-mmio devices (legacy ISA uses the ones below).
pub const VIRTIO_IRQ_BASE: u32 = 5;
pub const SERIAL_IRQ: u32 = 4;
pub const TSS_ADDRESS: usize = 0xfffb_d000;

/// Guest RAM ranges for `mem_bytes` of memory, skipping the MMIO hole.
pub fn ram_ranges(mem_bytes: u64) -> Vec<(u64, u64)> {
    if mem_bytes <= MMIO_HOLE_START {
        vec![(0, mem_bytes)]
    } else {
        vec![(0, MMIO_HOLE_START), (MMIO_HOLE_END, mem_bytes - MMIO_HOLE_START)]
    }
}

/// MMIO window of the `index`-th virtio device.
pub fn virtio_mmio_addr(index: usize) -> u64 {
    VIRTIO_MMIO_BASE + index as u64 * VIRTIO_MMIO_SIZE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_memory_is_one_range() {
        assert_eq!(ram_ranges(128 << 20), vec![(0, 128 << 20)]);
    }

    #[test]
    fn large_memory_skips_the_hole() {
        let r = ram_ranges(4 << 30);
        assert_eq!(r, vec![(0, MMIO_HOLE_START), (MMIO_HOLE_END, (4 << 30) - MMIO_HOLE_START)]);
        let total: u64 = r.iter().map(|(_, l)| l).sum();
        assert_eq!(total, 4 << 30);
    }
}
