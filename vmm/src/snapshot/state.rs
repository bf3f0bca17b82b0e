//! The snapshot's state document: plain serialisable data, no fds. `VmState::check` bounds every
//! list before anything acts on it (the file is untrusted input: it may be corrupt or hostile).

use serde::{Deserialize, Serialize};

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_fpu, kvm_irqchip, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs,
};

use crate::config::{ValidConfig, MAX_BLOCK_DEVICES, MAX_FS_DEVICES, MAX_MEM, MAX_NET_DEVICES, MAX_VCPUS, MIN_MEM};
use crate::device_manager::persist::DevicesState;

/// More MSRs or CPUID entries than KVM can ever report means a corrupt file.
pub const MAX_MSRS: usize = 1024;
pub const MAX_CPUID_ENTRIES: usize = kvm_bindings::KVM_MAX_CPUID_ENTRIES;
/// 32-bit words of the legacy XSAVE area (KVM_GET_XSAVE).
pub const XSAVE_WORDS: usize = 1024;
pub const MAX_VIRTIO_SLOTS: usize = 32;

/// Everything a snapshot holds besides guest memory.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmState {
    /// The config the VM was built from; a restore keeps its shape and takes the per-run settings
    /// (sockets, logs, disks) from its own config.
    pub config: ValidConfig,
    /// Human-readable host CPU, for the error when a snapshot moves to another CPU.
    pub host_cpu: String,
    /// Guest memory: the memory file holds exactly this many bytes, the RAM ranges in order.
    pub mem_file_bytes: u64,
    pub vm: KvmVmState,
    pub vcpus: Vec<VcpuState>,
    pub devices: DevicesState,
}

/// VM-wide KVM state: the in-kernel irqchip (PIC master, PIC slave, IOAPIC), PIT and kvmclock.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KvmVmState {
    /// None when the VM ran without an in-kernel irqchip.
    pub irqchip: Option<IrqchipState>,
    pub pit: Option<kvm_pit_state2>,
    pub clock: kvm_clock_data,
}

#[derive(Clone, Serialize, Deserialize)]
pub struct IrqchipState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
}

impl std::fmt::Debug for IrqchipState {
    // kvm_irqchip is a C union without Debug.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IrqchipState { .. }")
    }
}

/// One vCPU, everything KVM lets us read back.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VcpuState {
    pub id: u8,
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub mp_state: kvm_mp_state,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub fpu: FpuState,
    /// The legacy 4 KiB XSAVE area.
    pub xsave: Vec<u32>,
    /// None when the host has no KVM_CAP_XCRS.
    pub xcrs: Option<kvm_xcrs>,
    pub debugregs: kvm_debugregs,
    /// None without an in-kernel irqchip.
    pub lapic: Option<kvm_lapic_state>,
    /// Every MSR of KVM's saveable list that this host let us read.
    pub msrs: Vec<kvm_msr_entry>,
    pub vcpu_events: kvm_vcpu_events,
    /// The guest TSC frequency, when KVM reports it.
    pub tsc_khz: Option<u32>,
}

/// `kvm_fpu` has no serde impl in kvm-bindings; this mirrors it field by field.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct FpuState {
    pub fpr: [[u8; 16]; 8],
    pub fcw: u16,
    pub fsw: u16,
    pub ftwx: u8,
    pub last_opcode: u16,
    pub last_ip: u64,
    pub last_dp: u64,
    pub xmm: [[u8; 16]; 16],
    pub mxcsr: u32,
}

impl From<&kvm_fpu> for FpuState {
    fn from(f: &kvm_fpu) -> Self {
        Self {
            fpr: f.fpr,
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: f.xmm,
            mxcsr: f.mxcsr,
        }
    }
}

impl From<&FpuState> for kvm_fpu {
    fn from(f: &FpuState) -> Self {
        kvm_fpu {
            fpr: f.fpr,
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: f.xmm,
            mxcsr: f.mxcsr,
            ..Default::default()
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StateError {
    #[error("the snapshot is inconsistent: {0}")]
    Inconsistent(String),
}

fn bad(why: String) -> Result<(), StateError> {
    Err(StateError::Inconsistent(why))
}

impl VmState {
    /// Structural checks on a decoded snapshot: shapes in range and lists within what KVM and
    /// the devices can ever produce. Devices check their own contents when they restore.
    pub fn check(&self) -> Result<(), StateError> {
        let c = &self.config;
        if c.vcpus == 0 || c.vcpus > MAX_VCPUS || self.vcpus.len() != usize::from(c.vcpus) {
            return bad(format!("{} vCPU states for a VM of {} vCPUs", self.vcpus.len(), c.vcpus));
        }
        if !(MIN_MEM.get() << 20..=MAX_MEM.get() << 20).contains(&c.mem_bytes) || !c.mem_bytes.is_multiple_of(1 << 20) {
            return bad(format!("guest memory of {} bytes", c.mem_bytes));
        }
        if self.mem_file_bytes != c.mem_bytes {
            return bad(format!(
                "memory file of {} bytes for {} bytes of guest memory",
                self.mem_file_bytes, c.mem_bytes
            ));
        }
        if c.block.len() > MAX_BLOCK_DEVICES || c.fs.len() > MAX_FS_DEVICES || c.net.len() > MAX_NET_DEVICES {
            return bad("more devices than a VM may have".into());
        }
        if self.devices.virtio.len() > MAX_VIRTIO_SLOTS {
            return bad(format!("{} virtio slots", self.devices.virtio.len()));
        }
        for (i, v) in self.vcpus.iter().enumerate() {
            if usize::from(v.id) != i {
                return bad(format!("vCPU state {i} claims id {}", v.id));
            }
            if v.cpuid.len() > MAX_CPUID_ENTRIES || v.msrs.len() > MAX_MSRS || v.xsave.len() != XSAVE_WORDS {
                return bad(format!(
                    "vCPU {i}: {} CPUID entries, {} MSRs, {} XSAVE words",
                    v.cpuid.len(),
                    v.msrs.len(),
                    v.xsave.len()
                ));
            }
            if v.lapic.is_some() != self.vm.irqchip.is_some() {
                return bad(format!("vCPU {i}: LAPIC state and irqchip state disagree"));
            }
        }
        Ok(())
    }
}
