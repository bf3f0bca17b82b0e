//! Special and general registers for a vCPU entering 64-bit long mode at CPL0.

use kvm_bindings::{kvm_fpu, kvm_regs, kvm_sregs};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::gdt::{kvm_segment_from_gdt, BOOT_GDT, CODE_SELECTOR_INDEX, DATA_SELECTOR_INDEX, TSS_SELECTOR_INDEX};
use crate::guest_layout::{GDT_START, IDT_START};

const X86_CR0_PE: u64 = 0x1;
const X86_CR0_ET: u64 = 0x10;
const X86_CR0_PG: u64 = 0x8000_0000;
const X86_CR4_PAE: u64 = 0x20;
const EFER_LME: u64 = 0x100;
const EFER_LMA: u64 = 0x400;

/// Writes the GDT and an empty IDT into guest memory.
pub fn write_gdt_idt(mem: &GuestMemoryMmap) -> Result<(), vm_memory::GuestMemoryError> {
    for (i, entry) in BOOT_GDT.iter().enumerate() {
        mem.write_obj(*entry, GuestAddress(GDT_START + i as u64 * 8))?;
    }
    mem.write_obj(0u64, GuestAddress(IDT_START))
}

/// Long mode, paging on, flat segments from the boot GDT. `sregs` should come from
/// KVM_GET_SREGS so fields we do not touch (APIC base etc.) keep KVM's defaults.
pub fn long_mode_sregs(mut sregs: kvm_sregs, cr3: u64) -> kvm_sregs {
    let code = kvm_segment_from_gdt(BOOT_GDT[1], CODE_SELECTOR_INDEX);
    let data = kvm_segment_from_gdt(BOOT_GDT[2], DATA_SELECTOR_INDEX);
    let tss = kvm_segment_from_gdt(BOOT_GDT[3], TSS_SELECTOR_INDEX);
    sregs.gdt.base = GDT_START;
    sregs.gdt.limit = (BOOT_GDT.len() * 8 - 1) as u16;
    sregs.idt.base = IDT_START;
    sregs.idt.limit = 7;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;
    sregs.cr3 = cr3;
    sregs.cr4 |= X86_CR4_PAE;
    sregs.cr0 |= X86_CR0_PE | X86_CR0_PG | X86_CR0_ET;
    sregs.efer |= EFER_LME | EFER_LMA;
    sregs
}

/// General registers: entry point, stack, and `rsi` (the zero page for Linux).
pub fn boot_regs(entry: u64, stack: u64, rsi: u64) -> kvm_regs {
    kvm_regs { rflags: 0x2, rip: entry, rsp: stack, rbp: stack, rsi, ..Default::default() }
}

/// FPU state Linux expects (x87 control word, MXCSR defaults).
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu { fcw: 0x37f, mxcsr: 0x1f80, ..Default::default() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sregs_enter_long_mode() {
        let s = long_mode_sregs(kvm_sregs::default(), 0x9000);
        assert_eq!(s.cr3, 0x9000);
        assert_ne!(s.cr0 & X86_CR0_PG, 0);
        assert_ne!(s.cr0 & X86_CR0_PE, 0);
        assert_ne!(s.cr4 & X86_CR4_PAE, 0);
        assert_eq!(s.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
        assert_eq!(s.cs.l, 1);
        assert_eq!(s.cs.dpl, 0);
        assert_eq!(s.ss.selector, 0x10);
        assert_eq!(s.gdt.limit, 31);
    }

    #[test]
    fn gdt_lands_in_memory() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x1000)]).unwrap();
        write_gdt_idt(&mem).unwrap();
        let code: u64 = mem.read_obj(GuestAddress(GDT_START + 8)).unwrap();
        assert_eq!(code, BOOT_GDT[1]);
    }

    #[test]
    fn regs_start_with_interrupts_off() {
        let r = boot_regs(0x10_0000, 0x8ff0, 0x7000);
        assert_eq!((r.rip, r.rsp, r.rsi, r.rflags), (0x10_0000, 0x8ff0, 0x7000, 2));
    }
}
