//! CPUID filtering: start from KVM_GET_SUPPORTED_CPUID and make it describe *this* vCPU of *this*
//! VM (APIC ids, topology, hypervisor bit) while hiding features a guest must not rely on.

use kvm_bindings::kvm_cpuid_entry2;

const LEAF_FEATURES: u32 = 0x1;
const LEAF_CACHE: u32 = 0x4;
const LEAF_POWER: u32 = 0x6;
const LEAF_EXT_FEATURES: u32 = 0x7;
const LEAF_TOPOLOGY: u32 = 0xb;

// Leaf 1 ECX.
const ECX_MONITOR: u32 = 1 << 3;
const ECX_VMX: u32 = 1 << 5;
const ECX_SMX: u32 = 1 << 6;
const ECX_EST: u32 = 1 << 7;
const ECX_TM2: u32 = 1 << 8;
const ECX_PDCM: u32 = 1 << 15;
const ECX_TSC_DEADLINE: u32 = 1 << 24;
const ECX_HYPERVISOR: u32 = 1 << 31;
// Leaf 1 EDX.
const EDX_HTT: u32 = 1 << 28;
// Leaf 6 ECX: energy performance bias.
const ECX_EPB: u32 = 1 << 3;
// Leaf 7.0 EBX/ECX.
const EBX_SGX: u32 = 1 << 2;
const EBX_RTM: u32 = 1 << 11;
const EBX_MPX: u32 = 1 << 14;
const EBX_PT: u32 = 1 << 25;
const ECX_WAITPKG: u32 = 1 << 5;

/// Rewrites `entries` in place for vCPU `cpu_index` of a VM with `cpu_count` vCPUs.
pub fn filter_cpuid(entries: &mut [kvm_cpuid_entry2], cpu_index: u8, cpu_count: u8) {
    for e in entries.iter_mut() {
        match e.function {
            LEAF_FEATURES => {
                // EBX[31:24] initial APIC id, [23:16] logical processors, [15:8] CLFLUSH size.
                e.ebx = (u32::from(cpu_index) << 24) | (u32::from(cpu_count) << 16) | (8 << 8);
                e.ecx &= !(ECX_MONITOR | ECX_VMX | ECX_SMX | ECX_EST | ECX_TM2 | ECX_PDCM);
                e.ecx |= ECX_HYPERVISOR;
                // KVM's supported list leaves this off even though the in-kernel LAPIC emulates it.
                e.ecx |= ECX_TSC_DEADLINE;
                if cpu_count > 1 {
                    e.edx |= EDX_HTT;
                } else {
                    e.edx &= !EDX_HTT;
                }
            }
            LEAF_CACHE => {
                // EAX[31:26]: cores per package - 1. Keep cache info, fix the topology.
                e.eax &= !(0x3f << 26);
                e.eax |= (u32::from(cpu_count.saturating_sub(1)) & 0x3f) << 26;
            }
            LEAF_POWER => e.ecx &= !ECX_EPB,
            LEAF_EXT_FEATURES if e.index == 0 => {
                e.ebx &= !(EBX_SGX | EBX_RTM | EBX_MPX | EBX_PT);
                e.ecx &= !ECX_WAITPKG;
            }
            LEAF_TOPOLOGY => {
                // EDX is the x2APIC id of this vCPU on every sub-leaf.
                e.edx = u32::from(cpu_index);
                match e.index {
                    0 => {
                        e.eax = 0;
                        e.ebx = 1;
                        e.ecx = 1 << 8;
                    }
                    1 => {
                        e.eax = bits_for(cpu_count);
                        e.ebx = u32::from(cpu_count);
                        e.ecx = (2 << 8) | 1;
                    }
                    _ => {
                        e.eax = 0;
                        e.ebx = 0;
                        e.ecx = e.index;
                    }
                }
            }
            _ => {}
        }
    }
}

/// Number of APIC-id bits needed to number `count` CPUs.
fn bits_for(count: u8) -> u32 {
    let mut bits = 0;
    while (1u32 << bits) < u32::from(count) {
        bits += 1;
    }
    bits
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax: 0xffff_ffff,
            ebx: 0xffff_ffff,
            ecx: 0xffff_ffff,
            edx: 0xffff_ffff,
            ..Default::default()
        }
    }

    #[test]
    fn leaf1_gets_apic_id_hypervisor_bit_and_loses_host_only_features() {
        let mut e = [leaf(1, 0)];
        filter_cpuid(&mut e, 3, 4);
        assert_eq!(e[0].ebx >> 24, 3);
        assert_eq!((e[0].ebx >> 16) & 0xff, 4);
        assert_ne!(e[0].ecx & ECX_HYPERVISOR, 0);
        assert_ne!(e[0].ecx & ECX_TSC_DEADLINE, 0);
        for bit in [ECX_MONITOR, ECX_VMX, ECX_SMX, ECX_PDCM] {
            assert_eq!(e[0].ecx & bit, 0, "bit {bit:#x} must be hidden");
        }
        assert_ne!(e[0].edx & EDX_HTT, 0);
    }

    #[test]
    fn single_vcpu_has_no_htt() {
        let mut e = [leaf(1, 0)];
        filter_cpuid(&mut e, 0, 1);
        assert_eq!(e[0].edx & EDX_HTT, 0);
    }

    #[test]
    fn topology_leaf_reports_x2apic_id_and_count() {
        let mut e = [leaf(0xb, 0), leaf(0xb, 1), leaf(0xb, 2)];
        filter_cpuid(&mut e, 2, 3);
        assert!(e.iter().all(|l| l.edx == 2));
        assert_eq!((e[1].eax, e[1].ebx), (2, 3));
        assert_eq!(e[2].ebx, 0);
    }

    #[test]
    fn ext_features_hide_sgx_rtm_pt_and_other_leaves_untouched() {
        let mut e = [leaf(7, 0), leaf(7, 1), leaf(0x8000_0001, 0)];
        filter_cpuid(&mut e, 0, 1);
        assert_eq!(e[0].ebx & (EBX_SGX | EBX_RTM | EBX_PT | EBX_MPX), 0);
        assert_eq!(e[0].ecx & ECX_WAITPKG, 0);
        assert_eq!(e[1].ebx, 0xffff_ffff, "sub-leaf 1 untouched");
        assert_eq!(e[2].edx, 0xffff_ffff);
    }

    #[test]
    fn cache_leaf_core_count() {
        let mut e = [leaf(4, 0)];
        filter_cpuid(&mut e, 0, 2);
        assert_eq!(e[0].eax >> 26, 1);
    }
}
