//! Identity page tables for the first 4 GiB (2 MiB pages), so both the kernel and test guests can
//! reach RAM and the MMIO hole at their physical addresses.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::guest_layout::{PDE_COUNT, PDE_START, PDPTE_START, PML4_START};

const PRESENT_RW: u64 = 0x3;
const PAGE_SIZE_2M: u64 = 0x80;

/// Writes PML4 -> PDPT -> `PDE_COUNT` page directories. Returns the CR3 value.
pub fn setup_identity_paging(mem: &GuestMemoryMmap) -> Result<u64, vm_memory::GuestMemoryError> {
    mem.write_obj(PDPTE_START | PRESENT_RW, GuestAddress(PML4_START))?;
    for dir in 0..PDE_COUNT {
        let pd = PDE_START + dir * 0x1000;
        mem.write_obj(pd | PRESENT_RW, GuestAddress(PDPTE_START + dir * 8))?;
        let mut table = [0u8; 4096];
        for (i, slot) in table.chunks_exact_mut(8).enumerate() {
            let phys = ((dir << 9) + i as u64) << 21;
            slot.copy_from_slice(&(phys | PRESENT_RW | PAGE_SIZE_2M).to_le_bytes());
        }
        mem.write_slice(&table, GuestAddress(pd))?;
    }
    Ok(PML4_START)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Walks the tables the way the MMU would, for a 2 MiB mapping.
    fn translate(mem: &GuestMemoryMmap, cr3: u64, va: u64) -> Option<u64> {
        let pml4e: u64 = mem.read_obj(GuestAddress(cr3 + ((va >> 39) & 0x1ff) * 8)).ok()?;
        if pml4e & 1 == 0 {
            return None;
        }
        let pdpte: u64 = mem.read_obj(GuestAddress((pml4e & !0xfff) + ((va >> 30) & 0x1ff) * 8)).ok()?;
        if pdpte & 1 == 0 {
            return None;
        }
        let pde: u64 = mem.read_obj(GuestAddress((pdpte & !0xfff) + ((va >> 21) & 0x1ff) * 8)).ok()?;
        if pde & 1 == 0 || pde & PAGE_SIZE_2M == 0 {
            return None;
        }
        Some((pde & !0x1f_ffff & 0x000f_ffff_ffff_ffff) | (va & 0x1f_ffff))
    }

    #[test]
    fn identity_maps_ram_and_mmio_hole() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let cr3 = setup_identity_paging(&mem).unwrap();
        assert_eq!(cr3, PML4_START);
        for va in [0u64, 0x10_0000, 0x1234_5678, 0xd000_0000, 0xffff_f000] {
            assert_eq!(translate(&mem, cr3, va), Some(va), "{va:#x}");
        }
        assert_eq!(translate(&mem, cr3, 0x1_0000_0000), None, "beyond 4 GiB is unmapped");
    }
}
