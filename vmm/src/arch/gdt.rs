//! The flat 64-bit GDT every vCPU starts with, and the matching KVM segment registers.

use kvm_bindings::kvm_segment;

/// GDT entries: null, 64-bit code, data, TSS.
pub const BOOT_GDT: [u64; 4] =
    [gdt_entry(0, 0, 0), gdt_entry(0xa09b, 0, 0xfffff), gdt_entry(0xc093, 0, 0xfffff), gdt_entry(0x808b, 0, 0xfffff)];
pub const CODE_SELECTOR_INDEX: u8 = 1;
pub const DATA_SELECTOR_INDEX: u8 = 2;
pub const TSS_SELECTOR_INDEX: u8 = 3;

/// Packs flags/base/limit into a GDT descriptor.
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << (56 - 24))
        | ((flags as u64 & 0x0000_f0ff) << 40)
        | ((limit as u64 & 0x000f_0000) << (48 - 16))
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
}

fn get_base(entry: u64) -> u64 {
    ((entry & 0xff00_0000_0000_0000) >> 32)
        | ((entry & 0x0000_00ff_0000_0000) >> 16)
        | ((entry & 0x0000_0000_ffff_0000) >> 16)
}

fn get_limit(entry: u64) -> u32 {
    let limit = (((entry & 0x000f_0000_0000_0000) >> 32) | (entry & 0x0000_0000_0000_ffff)) as u32;
    // Granularity 4 KiB: the limit counts pages.
    if (entry >> 55) & 1 == 1 {
        (limit << 12) | 0xfff
    } else {
        limit
    }
}

/// The KVM segment register matching GDT entry `index`.
pub fn kvm_segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    kvm_segment {
        base: get_base(entry),
        limit: get_limit(entry),
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g: ((entry >> 55) & 1) as u8,
        avl: ((entry >> 52) & 1) as u8,
        padding: 0,
        unusable: u8::from((entry >> 47) & 1 == 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_segment_is_64bit_ring0() {
        let cs = kvm_segment_from_gdt(BOOT_GDT[1], CODE_SELECTOR_INDEX);
        assert_eq!(cs.selector, 8);
        assert_eq!(cs.l, 1, "long mode code segment");
        assert_eq!(cs.db, 0, "L=1 requires D=0");
        assert_eq!(cs.dpl, 0);
        assert_eq!(cs.present, 1);
        assert_eq!(cs.type_, 0xb);
        assert_eq!(cs.limit, 0xffff_ffff);
    }

    #[test]
    fn data_and_tss_segments() {
        let ds = kvm_segment_from_gdt(BOOT_GDT[2], DATA_SELECTOR_INDEX);
        assert_eq!((ds.selector, ds.type_, ds.db, ds.l), (16, 3, 1, 0));
        let tr = kvm_segment_from_gdt(BOOT_GDT[3], TSS_SELECTOR_INDEX);
        assert_eq!((tr.selector, tr.type_, tr.s), (24, 0xb, 0));
    }

    #[test]
    fn entry_roundtrips_base_and_limit() {
        let e = gdt_entry(0x0093, 0x1234_5678, 0xabcde);
        assert_eq!(get_base(e), 0x1234_5678);
        assert_eq!(get_limit(e), 0xabcde);
    }
}
