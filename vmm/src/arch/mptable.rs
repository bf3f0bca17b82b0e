//! The Intel MultiProcessor table, so a Linux guest without ACPI finds every vCPU, the IOAPIC
//! and the ISA interrupt routing. Written into the last KiB of base memory (Linux scans it).

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::guest_layout::EBDA_START;

pub const MPTABLE_START: u64 = EBDA_START;
const APIC_DEFAULT_BASE: u32 = 0xfee0_0000;
const IOAPIC_DEFAULT_BASE: u32 = 0xfec0_0000;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const MP_SPEC_REV: u8 = 4;
/// IOAPIC input pins routed 1:1 from ISA IRQs.
pub const IOAPIC_PINS: u8 = 24;
const CPU_ENABLED: u8 = 1;
const CPU_BOOTPROCESSOR: u8 = 2;
/// Family 6; FPU and APIC present.
const CPU_SIGNATURE: u32 = 0x600;
const CPU_FEATURES: u32 = 0x201;
const MP_IRQ_INT: u8 = 0;
const MP_IRQ_NMI: u8 = 1;
const MP_IRQ_EXTINT: u8 = 3;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MpTableError {
    #[error("too many vCPUs for an MP table: {0}")]
    TooManyCpus(u8),
    #[error("writing the MP table: {0}")]
    Memory(String),
}

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// Builds the floating pointer + configuration table for `cpus` vCPUs placed at `base`.
pub fn build_mptable(cpus: u8, base: u64) -> Result<Vec<u8>, MpTableError> {
    if cpus == 0 || cpus >= 254 {
        return Err(MpTableError::TooManyCpus(cpus));
    }
    let ioapic_id = cpus + 1;
    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    for cpu in 0..cpus {
        let mut e = [0u8; 20];
        e[0] = 0; // processor
        e[1] = cpu;
        e[2] = APIC_VERSION;
        e[3] = CPU_ENABLED | if cpu == 0 { CPU_BOOTPROCESSOR } else { 0 };
        e[4..8].copy_from_slice(&CPU_SIGNATURE.to_le_bytes());
        e[8..12].copy_from_slice(&CPU_FEATURES.to_le_bytes());
        entries.extend_from_slice(&e);
        count += 1;
    }
    // Bus 0: ISA.
    entries.extend_from_slice(&[1, 0, b'I', b'S', b'A', b' ', b' ', b' ']);
    count += 1;
    let mut ioapic = [2u8, ioapic_id, IOAPIC_VERSION, 1, 0, 0, 0, 0];
    ioapic[4..8].copy_from_slice(&IOAPIC_DEFAULT_BASE.to_le_bytes());
    entries.extend_from_slice(&ioapic);
    count += 1;
    for irq in 0..IOAPIC_PINS {
        entries.extend_from_slice(&[3, MP_IRQ_INT, 0, 0, 0, irq, ioapic_id, irq]);
        count += 1;
    }
    // LINT0 = ExtINT (the PIC), LINT1 = NMI, on every local APIC.
    entries.extend_from_slice(&[4, MP_IRQ_EXTINT, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[4, MP_IRQ_NMI, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let table_len = 44 + entries.len();
    let mut table = vec![0u8; 44];
    table[0..4].copy_from_slice(b"PCMP");
    table[4..6].copy_from_slice(&(table_len as u16).to_le_bytes());
    table[6] = MP_SPEC_REV;
    table[8..16].copy_from_slice(b"BULKHEAD");
    table[16..28].copy_from_slice(b"MICROVM     ");
    table[34..36].copy_from_slice(&count.to_le_bytes());
    table[36..40].copy_from_slice(&APIC_DEFAULT_BASE.to_le_bytes());
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut fp = [0u8; 16];
    fp[0..4].copy_from_slice(b"_MP_");
    fp[4..8].copy_from_slice(&((base + 16) as u32).to_le_bytes());
    fp[8] = 1; // length in 16-byte units
    fp[9] = MP_SPEC_REV;
    fp[10] = checksum(&fp);

    let mut out = fp.to_vec();
    out.extend_from_slice(&table);
    Ok(out)
}

/// Writes the MP table for `cpus` vCPUs at `MPTABLE_START`.
pub fn setup_mptable(mem: &GuestMemoryMmap, cpus: u8) -> Result<(), MpTableError> {
    let bytes = build_mptable(cpus, MPTABLE_START)?;
    mem.write_slice(&bytes, GuestAddress(MPTABLE_START)).map_err(|e| MpTableError::Memory(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
    }

    #[test]
    fn checksums_and_layout_are_valid() {
        let t = build_mptable(4, MPTABLE_START).unwrap();
        assert_eq!(&t[0..4], b"_MP_");
        assert_eq!(sum(&t[..16]), 0, "floating pointer checksum");
        let cfg_at = u32::from_le_bytes(t[4..8].try_into().unwrap()) as u64 - MPTABLE_START;
        let cfg = &t[cfg_at as usize..];
        assert_eq!(&cfg[0..4], b"PCMP");
        let len = u16::from_le_bytes(cfg[4..6].try_into().unwrap()) as usize;
        assert_eq!(len, cfg.len());
        assert_eq!(sum(cfg), 0, "config table checksum");
        let count = u16::from_le_bytes(cfg[34..36].try_into().unwrap());
        assert_eq!(count, 4 + 1 + 1 + u16::from(IOAPIC_PINS) + 2);
        assert!(t.len() <= 1024, "fits in the last KiB of base memory");
    }

    #[test]
    fn cpus_are_listed_with_one_boot_processor() {
        let t = build_mptable(3, MPTABLE_START).unwrap();
        let cpus: Vec<&[u8]> = t[16 + 44..].chunks(20).take(3).collect();
        for (i, c) in cpus.iter().enumerate() {
            assert_eq!((c[0], c[1]), (0, i as u8));
            assert_eq!(c[3] & CPU_ENABLED, CPU_ENABLED);
            assert_eq!(c[3] & CPU_BOOTPROCESSOR != 0, i == 0);
        }
    }

    #[test]
    fn absurd_cpu_counts_are_rejected() {
        assert_eq!(build_mptable(0, 0), Err(MpTableError::TooManyCpus(0)));
        assert_eq!(build_mptable(255, 0), Err(MpTableError::TooManyCpus(255)));
    }

    #[test]
    fn max_config_fits_below_1mib() {
        let t = build_mptable(crate::config::MAX_VCPUS, MPTABLE_START).unwrap();
        assert!(MPTABLE_START + t.len() as u64 <= 0xa_0000);
    }
}
