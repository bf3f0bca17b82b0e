//! The host-CPU fingerprint a snapshot carries: a snapshot restores only where the guest sees
//! the same CPU (vendor, model, features), because the guest kernel picked code paths and saved
//! register state for it.

use kvm_bindings::{kvm_cpuid_entry2, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::Kvm;
use sha2::{Digest, Sha256};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostCpu {
    /// e.g. `AuthenticAMD family 0x19 model 0x1 stepping 0x1 (AMD EPYC)`.
    pub description: String,
    /// SHA-256 over every CPUID entry KVM supports here, without the fields that name the host
    /// CPU the process happens to run on (APIC IDs).
    pub fingerprint: [u8; 32],
}

impl HostCpu {
    /// This host, as KVM presents it to guests (KVM_GET_SUPPORTED_CPUID).
    pub fn probe(kvm: &Kvm) -> Result<Self, kvm_ioctls::Error> {
        let cpuid = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)?;
        Ok(Self::from_entries(cpuid.as_slice()))
    }

    pub fn from_entries(entries: &[kvm_cpuid_entry2]) -> Self {
        let mut h = Sha256::new();
        for e in entries {
            let e = without_cpu_ids(e);
            for v in [e.function, e.index, e.flags, e.eax, e.ebx, e.ecx, e.edx] {
                h.update(v.to_le_bytes());
            }
        }
        Self { description: describe(entries), fingerprint: h.finalize().into() }
    }
}

/// KVM's supported CPUID carries the APIC ID of the host CPU the caller runs on: two
/// processes on one host would otherwise disagree.
fn without_cpu_ids(e: &kvm_cpuid_entry2) -> kvm_cpuid_entry2 {
    let mut e = *e;
    match e.function {
        0x1 => e.ebx &= 0x00ff_ffff, // initial APIC ID in bits 31:24
        0xb | 0x1f => e.edx = 0,     // x2APIC ID
        0x8000_001e => {
            // extended APIC ID, core and node IDs
            e.eax = 0;
            e.ebx = 0;
            e.ecx = 0;
        }
        _ => {}
    }
    e
}

fn leaf(entries: &[kvm_cpuid_entry2], function: u32) -> Option<&kvm_cpuid_entry2> {
    entries.iter().find(|e| e.function == function && e.index == 0)
}

fn describe(entries: &[kvm_cpuid_entry2]) -> String {
    let text = |regs: &[u32]| -> String {
        let bytes: Vec<u8> = regs.iter().flat_map(|r| r.to_le_bytes()).filter(|b| *b != 0).collect();
        String::from_utf8_lossy(&bytes).trim().to_string()
    };
    let vendor = leaf(entries, 0).map(|e| text(&[e.ebx, e.edx, e.ecx])).unwrap_or_else(|| "unknown vendor".into());
    let mut out = vendor;
    if let Some(e) = leaf(entries, 1) {
        let (base_family, base_model, stepping) = ((e.eax >> 8) & 0xf, (e.eax >> 4) & 0xf, e.eax & 0xf);
        let family = if base_family == 0xf { base_family + ((e.eax >> 20) & 0xff) } else { base_family };
        let model = if base_family >= 0x6 { base_model | ((e.eax >> 12) & 0xf0) } else { base_model };
        out.push_str(&format!(" family {family:#x} model {model:#x} stepping {stepping:#x}"));
    }
    let brand: Vec<u32> = (0x8000_0002..=0x8000_0004)
        .filter_map(|f| leaf(entries, f))
        .flat_map(|e| [e.eax, e.ebx, e.ecx, e.edx])
        .collect();
    let brand = text(&brand);
    if !brand.is_empty() {
        out.push_str(&format!(" ({brand})"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, eax: u32, ebx: u32, ecx: u32, edx: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 { function, eax, ebx, ecx, edx, ..Default::default() }
    }

    #[test]
    fn describes_vendor_family_model_and_brand() {
        let word = |s: &[u8; 4]| u32::from_le_bytes(*s);
        let entries = [
            entry(0, 0x10, word(b"Auth"), word(b"cAMD"), word(b"enti")),
            entry(1, 0x00a0_0f11, 0, 0, 0),
            entry(0x8000_0002, word(b"AMD "), word(b"EPYC"), 0, 0),
        ];
        let cpu = HostCpu::from_entries(&entries);
        assert_eq!(cpu.description, "AuthenticAMD family 0x19 model 0x1 stepping 0x1 (AMD EPYC)");
        let mut other = entries;
        other[1].ecx = 1; // one more feature bit
        assert_ne!(HostCpu::from_entries(&other).fingerprint, cpu.fingerprint);
        let mut elsewhere = entries;
        elsewhere[1].ebx |= 1 << 24; // the same CPU model, another core
        assert_eq!(HostCpu::from_entries(&elsewhere).fingerprint, cpu.fingerprint);
        assert_eq!(HostCpu::from_entries(&entries), cpu, "deterministic");
    }
}
