//! Reading and writing KVM's share of the VM: every vCPU's registers and in-kernel state, the
//! irqchip, PIT and kvmclock. The order follows KVM's constraints (the same as Firecracker's):
//! MP state is read first because reading it flushes pending APIC events; CPUID is set before
//! anything else and the LAPIC after the sregs that hold its base; vcpu events go last.
//!
//! Some hosts (PVM) lack a state ioctl or refuse a few MSRs. Every failure names the vCPU, the
//! ioctl and the errno, and MSRs KVM lists but cannot read are skipped and reported.

use kvm_bindings::{
    kvm_irqchip, kvm_msr_entry, kvm_xsave, CpuId, Msrs, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE, KVM_MAX_CPUID_ENTRIES, KVM_MAX_MSR_ENTRIES,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};

use super::state::{FpuState, IrqchipState, KvmVmState, VcpuState, XSAVE_WORDS};

#[derive(Debug, thiserror::Error)]
pub enum KvmStateError {
    #[error("vCPU {vcpu}: {ioctl} failed: {source}")]
    Vcpu { vcpu: u8, ioctl: &'static str, source: kvm_ioctls::Error },
    #[error("VM: {ioctl} failed: {source}")]
    Vm { ioctl: &'static str, source: kvm_ioctls::Error },
    #[error("vCPU {vcpu}: KVM_SET_MSRS refused MSR {index:#x} (set {set} of {wanted} in its batch)")]
    MsrRefused { vcpu: u8, index: u32, set: usize, wanted: usize },
    #[error("KVM_GET_MSR_INDEX_LIST failed: {0}")]
    MsrList(kvm_ioctls::Error),
    #[error("this host's XSAVE area is {0} bytes (KVM_CAP_XSAVE2); only the legacy 4096-byte area is supported")]
    XsaveTooBig(usize),
    #[error("vCPU {vcpu}: {what} in the snapshot is malformed")]
    Malformed { vcpu: u8, what: &'static str },
    #[error("VM: {0} in the snapshot is malformed")]
    MalformedVm(&'static str),
}

/// The MSRs KVM says it can save and restore (KVM_GET_MSR_INDEX_LIST).
pub fn saveable_msrs(kvm: &Kvm) -> Result<Vec<u32>, KvmStateError> {
    Ok(kvm.get_msr_index_list().map_err(KvmStateError::MsrList)?.as_slice().to_vec())
}

/// A vCPU's state, plus the MSRs of `msr_indices` this host would not read.
pub fn save_vcpu(
    fd: &VcpuFd,
    id: u8,
    msr_indices: &[u32],
    irqchip: bool,
    has_xcrs: bool,
) -> Result<(VcpuState, Vec<u32>), KvmStateError> {
    let e = |ioctl: &'static str| move |source| KvmStateError::Vcpu { vcpu: id, ioctl, source };
    let mp_state = fd.get_mp_state().map_err(e("KVM_GET_MP_STATE"))?;
    let regs = fd.get_regs().map_err(e("KVM_GET_REGS"))?;
    let sregs = fd.get_sregs().map_err(e("KVM_GET_SREGS"))?;
    let fpu = FpuState::from(&fd.get_fpu().map_err(e("KVM_GET_FPU"))?);
    let xsave = fd.get_xsave().map_err(e("KVM_GET_XSAVE"))?.region.to_vec();
    let xcrs = if has_xcrs { Some(fd.get_xcrs().map_err(e("KVM_GET_XCRS"))?) } else { None };
    let debugregs = fd.get_debug_regs().map_err(e("KVM_GET_DEBUGREGS"))?;
    let lapic = if irqchip { Some(fd.get_lapic().map_err(e("KVM_GET_LAPIC"))?) } else { None };
    let tsc_khz = fd.get_tsc_khz().ok();
    let cpuid = fd.get_cpuid2(KVM_MAX_CPUID_ENTRIES).map_err(e("KVM_GET_CPUID2"))?.as_slice().to_vec();
    let (msrs, unreadable) = read_msrs(fd, id, msr_indices)?;
    let vcpu_events = fd.get_vcpu_events().map_err(e("KVM_GET_VCPU_EVENTS"))?;
    let state =
        VcpuState { id, cpuid, mp_state, regs, sregs, fpu, xsave, xcrs, debugregs, lapic, msrs, vcpu_events, tsc_khz };
    Ok((state, unreadable))
}

/// Reads the MSRs in batches. KVM_GET_MSRS stops at the first MSR it cannot read and returns
/// how many it read, so a short count names the culprit: skip it and go on.
fn read_msrs(fd: &VcpuFd, id: u8, indices: &[u32]) -> Result<(Vec<kvm_msr_entry>, Vec<u32>), KvmStateError> {
    let mut out = Vec::with_capacity(indices.len());
    let mut unreadable = Vec::new();
    let mut rest = indices;
    while !rest.is_empty() {
        let batch = &rest[..rest.len().min(KVM_MAX_MSR_ENTRIES)];
        let entries: Vec<kvm_msr_entry> =
            batch.iter().map(|&index| kvm_msr_entry { index, ..Default::default() }).collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(|_| KvmStateError::Vcpu {
            vcpu: id,
            ioctl: "KVM_GET_MSRS",
            source: kvm_ioctls::Error::new(libc::E2BIG),
        })?;
        let read =
            fd.get_msrs(&mut msrs).map_err(|source| KvmStateError::Vcpu { vcpu: id, ioctl: "KVM_GET_MSRS", source })?;
        out.extend_from_slice(&msrs.as_slice()[..read.min(batch.len())]);
        if read < batch.len() {
            unreadable.push(batch[read]);
            rest = &rest[read + 1..];
        } else {
            rest = &rest[batch.len()..];
        }
    }
    Ok((out, unreadable))
}

/// Puts a saved state into a fresh vCPU.
pub fn restore_vcpu(fd: &VcpuFd, s: &VcpuState) -> Result<(), KvmStateError> {
    let id = s.id;
    let e = |ioctl: &'static str| move |source| KvmStateError::Vcpu { vcpu: id, ioctl, source };
    let cpuid = CpuId::from_entries(&s.cpuid).map_err(|_| KvmStateError::Malformed { vcpu: id, what: "CPUID" })?;
    fd.set_cpuid2(&cpuid).map_err(e("KVM_SET_CPUID2"))?;
    fd.set_mp_state(s.mp_state).map_err(e("KVM_SET_MP_STATE"))?;
    fd.set_regs(&s.regs).map_err(e("KVM_SET_REGS"))?;
    fd.set_sregs(&s.sregs).map_err(e("KVM_SET_SREGS"))?;
    fd.set_fpu(&(&s.fpu).into()).map_err(e("KVM_SET_FPU"))?;
    let region: [u32; XSAVE_WORDS] =
        s.xsave.as_slice().try_into().map_err(|_| KvmStateError::Malformed { vcpu: id, what: "XSAVE area" })?;
    let xsave = kvm_xsave { region, ..Default::default() };
    // SAFETY: kvm_xsave holds the legacy 4 KiB area; `check_xsave_size` refused hosts whose
    // XSAVE area (KVM_CAP_XSAVE2) is larger, so KVM reads no more than the struct holds.
    unsafe { fd.set_xsave(&xsave) }.map_err(e("KVM_SET_XSAVE"))?;
    if let Some(xcrs) = &s.xcrs {
        fd.set_xcrs(xcrs).map_err(e("KVM_SET_XCRS"))?;
    }
    fd.set_debug_regs(&s.debugregs).map_err(e("KVM_SET_DEBUGREGS"))?;
    if let Some(lapic) = &s.lapic {
        fd.set_lapic(lapic).map_err(e("KVM_SET_LAPIC"))?;
    }
    if let Some(khz) = s.tsc_khz {
        if fd.get_tsc_khz().ok() != Some(khz) {
            fd.set_tsc_khz(khz).map_err(e("KVM_SET_TSC_KHZ"))?;
        }
    }
    for batch in s.msrs.chunks(KVM_MAX_MSR_ENTRIES) {
        let msrs = Msrs::from_entries(batch).map_err(|_| KvmStateError::Malformed { vcpu: id, what: "MSR list" })?;
        let set = fd.set_msrs(&msrs).map_err(e("KVM_SET_MSRS"))?;
        if set < batch.len() {
            return Err(KvmStateError::MsrRefused { vcpu: id, index: batch[set].index, set, wanted: batch.len() });
        }
    }
    fd.set_vcpu_events(&s.vcpu_events).map_err(e("KVM_SET_VCPU_EVENTS"))?;
    Ok(())
}

/// Refuses hosts whose XSAVE area outgrows `kvm_xsave` (AMX): their state would be cut short.
pub fn check_xsave_size(kvm: &Kvm) -> Result<(), KvmStateError> {
    let size = kvm.check_extension_int(Cap::Xsave2);
    if size > std::mem::size_of::<kvm_xsave>() as i32 {
        return Err(KvmStateError::XsaveTooBig(size as usize));
    }
    Ok(())
}

/// Whether vCPUs have XCRs to save here.
pub fn has_xcrs(kvm: &Kvm) -> bool {
    kvm.check_extension(Cap::Xcrs)
}

fn get_chip(vm: &VmFd, chip_id: u32, ioctl: &'static str) -> Result<kvm_irqchip, KvmStateError> {
    let mut chip = kvm_irqchip { chip_id, ..Default::default() };
    vm.get_irqchip(&mut chip).map_err(|source| KvmStateError::Vm { ioctl, source })?;
    Ok(chip)
}

/// The irqchip, PIT and clock. Call with every vCPU paused.
pub fn save_vm(vm: &VmFd, irqchip: bool) -> Result<KvmVmState, KvmStateError> {
    let vm_err = |ioctl: &'static str| move |source| KvmStateError::Vm { ioctl, source };
    let (irqchip, pit) = if irqchip {
        let chips = IrqchipState {
            pic_master: get_chip(vm, KVM_IRQCHIP_PIC_MASTER, "KVM_GET_IRQCHIP (PIC master)")?,
            pic_slave: get_chip(vm, KVM_IRQCHIP_PIC_SLAVE, "KVM_GET_IRQCHIP (PIC slave)")?,
            ioapic: get_chip(vm, KVM_IRQCHIP_IOAPIC, "KVM_GET_IRQCHIP (IOAPIC)")?,
        };
        (Some(chips), Some(vm.get_pit2().map_err(vm_err("KVM_GET_PIT2"))?))
    } else {
        (None, None)
    };
    let clock = vm.get_clock().map_err(vm_err("KVM_GET_CLOCK"))?;
    Ok(KvmVmState { irqchip, pit, clock })
}

/// Restores the VM-wide state into a VM whose irqchip and PIT exist already.
pub fn restore_vm(vm: &VmFd, s: &KvmVmState) -> Result<(), KvmStateError> {
    let vm_err = |ioctl: &'static str| move |source| KvmStateError::Vm { ioctl, source };
    if let Some(pit) = &s.pit {
        vm.set_pit2(pit).map_err(vm_err("KVM_SET_PIT2"))?;
    }
    // The guest's clock continues from the snapshot; the shim sets the wall clock afterwards.
    // Without KVM_CLOCK_REALTIME, KVM does not advance it by the time the snapshot sat on disk.
    let mut clock = s.clock;
    clock.flags = 0;
    vm.set_clock(&clock).map_err(vm_err("KVM_SET_CLOCK"))?;
    if let Some(chips) = &s.irqchip {
        for (chip, id, ioctl) in [
            (&chips.pic_master, KVM_IRQCHIP_PIC_MASTER, "KVM_SET_IRQCHIP (PIC master)"),
            (&chips.pic_slave, KVM_IRQCHIP_PIC_SLAVE, "KVM_SET_IRQCHIP (PIC slave)"),
            (&chips.ioapic, KVM_IRQCHIP_IOAPIC, "KVM_SET_IRQCHIP (IOAPIC)"),
        ] {
            if chip.chip_id != id {
                return Err(KvmStateError::MalformedVm("irqchip order"));
            }
            vm.set_irqchip(chip).map_err(vm_err(ioctl))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A KVM VM with an irqchip, PIT and two vCPUs, or None (SKIPPED printed) without /dev/kvm.
    fn vm(test: &str) -> Option<(Kvm, VmFd, VcpuFd, VcpuFd)> {
        let kvm = match Kvm::new() {
            Ok(k) => k,
            Err(e) => {
                println!("SKIPPED: {test}: /dev/kvm is not usable: {e}");
                return None;
            }
        };
        let vm = kvm.create_vm().unwrap();
        vm.create_irq_chip().unwrap();
        vm.create_pit2(kvm_bindings::kvm_pit_config::default()).unwrap();
        let (a, b) = (vm.create_vcpu(0).unwrap(), vm.create_vcpu(1).unwrap());
        Some((kvm, vm, a, b))
    }

    const NOT_AN_MSR: u32 = 0xdead_beef;
    const MSR_IA32_TSC: u32 = 0x10;
    const MSR_IA32_SYSENTER_CS: u32 = 0x174;

    #[test]
    fn unreadable_msrs_are_skipped_and_named() {
        let Some((_kvm, _vm, vcpu, _)) = vm("unreadable_msrs_are_skipped_and_named") else { return };
        let (msrs, unreadable) = read_msrs(&vcpu, 0, &[MSR_IA32_TSC, NOT_AN_MSR, MSR_IA32_SYSENTER_CS]).unwrap();
        assert_eq!(unreadable, vec![NOT_AN_MSR]);
        assert_eq!(msrs.iter().map(|m| m.index).collect::<Vec<_>>(), vec![MSR_IA32_TSC, MSR_IA32_SYSENTER_CS]);
    }

    #[test]
    fn vcpu_and_vm_state_move_to_a_fresh_vcpu_and_refusals_are_named() {
        let Some((kvm, vm, a, b)) = vm("vcpu_and_vm_state_move_to_a_fresh_vcpu_and_refusals_are_named") else { return };
        check_xsave_size(&kvm).unwrap();
        let msrs = saveable_msrs(&kvm).unwrap();
        let mut regs = a.get_regs().unwrap();
        regs.rax = 0x1234_5678;
        regs.rip = 0x10_0000;
        a.set_regs(&regs).unwrap();
        let (saved, _) = save_vcpu(&a, 0, &msrs, true, has_xcrs(&kvm)).unwrap();
        assert!(saved.lapic.is_some() && !saved.msrs.is_empty() && saved.xsave.len() == XSAVE_WORDS);

        let moved = VcpuState { id: 1, ..saved.clone() };
        restore_vcpu(&b, &moved).unwrap();
        assert_eq!((b.get_regs().unwrap().rax, b.get_regs().unwrap().rip), (0x1234_5678, 0x10_0000));

        let mut refused = moved.clone();
        refused.msrs.push(kvm_msr_entry { index: NOT_AN_MSR, ..Default::default() });
        match restore_vcpu(&b, &refused) {
            Err(KvmStateError::MsrRefused { vcpu: 1, index: NOT_AN_MSR, .. }) => {}
            other => panic!("expected the refused MSR to be named, got {other:?}"),
        }
        let short = VcpuState { xsave: vec![0; 3], ..moved };
        assert!(matches!(restore_vcpu(&b, &short), Err(KvmStateError::Malformed { what: "XSAVE area", .. })));

        let state = save_vm(&vm, true).unwrap();
        assert!(state.irqchip.is_some() && state.pit.is_some());
        restore_vm(&vm, &state).unwrap();
        let mut swapped = state.clone();
        if let Some(chips) = swapped.irqchip.as_mut() {
            std::mem::swap(&mut chips.pic_master, &mut chips.ioapic);
        }
        assert!(matches!(restore_vm(&vm, &swapped), Err(KvmStateError::MalformedVm(_))));
    }
}
