//! A small, consistent snapshot state, for tests here and for the fuzz crate (feature
//! `test-utils`), so the two never keep diverging copies of one fixture.

use crate::config::{BootSource, RawFormat, RawGuestConfig, ValidConfig};
use crate::device_manager::persist::DevicesState;
use crate::snapshot::state::*;

/// A small, consistent state (one vCPU, no irqchip, no virtio devices).
pub fn sample_state() -> VmState {
    let config = ValidConfig {
        boot: BootSource::Raw(RawGuestConfig { image: "/g.elf".into(), format: RawFormat::Elf, load_addr: 0x10_0000 }),
        vcpus: 1,
        mem_bytes: 32 << 20,
        serial_log: None,
        vsock: None,
        block: vec![],
        fs: vec![],
        net: vec![],
        api_socket: None,
        balloon: None,
    };
    let vcpu = VcpuState {
        id: 0,
        cpuid: vec![kvm_bindings::kvm_cpuid_entry2 { function: 1, eax: 0xa00f11, ..Default::default() }],
        mp_state: Default::default(),
        regs: kvm_bindings::kvm_regs { rip: 0x10_0000, rax: 42, ..Default::default() },
        sregs: Default::default(),
        fpu: FpuState { fcw: 0x37f, ..Default::default() },
        xsave: vec![7; XSAVE_WORDS],
        xcrs: None,
        debugregs: Default::default(),
        lapic: None,
        msrs: vec![kvm_bindings::kvm_msr_entry { index: 0x10, data: 99, ..Default::default() }],
        vcpu_events: Default::default(),
        tsc_khz: Some(2_000_000),
    };
    VmState {
        config,
        host_cpu: "TestCPU".into(),
        mem_file_bytes: 32 << 20,
        vm: KvmVmState { irqchip: None, pit: None, clock: Default::default() },
        vcpus: vec![vcpu],
        devices: DevicesState { serial: Default::default(), i8042: Default::default(), virtio: vec![] },
    }
}
