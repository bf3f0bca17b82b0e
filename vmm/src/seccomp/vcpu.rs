//! A vCPU thread: runs the guest and emulates the port I/O and MMIO it exits on. Device work
//! reached from here is in-memory (registers, queue setup), an eventfd write (notify, IRQ), or
//! a hand-over to a device's own thread (virtio-fs start and reset: a futex, in `common`). For a
//! snapshot, each parked vCPU reads its own state (only a vCPU's thread may use its fd).

use kvm_bindings::{
    kvm_cpuid2, kvm_debugregs, kvm_fpu, kvm_lapic_state, kvm_mp_state, kvm_msrs, kvm_regs, kvm_sregs, kvm_vcpu_events,
    kvm_xcrs, kvm_xsave, KVMIO,
};
use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr, ioctl_iowr_nr};

use super::{always, arg_in, Syscall};

ioctl_io_nr!(KVM_RUN, KVMIO, 0x80);
ioctl_ior_nr!(KVM_GET_REGS, KVMIO, 0x81, kvm_regs);
ioctl_ior_nr!(KVM_GET_SREGS, KVMIO, 0x83, kvm_sregs);
ioctl_iowr_nr!(KVM_GET_MSRS, KVMIO, 0x88, kvm_msrs);
ioctl_ior_nr!(KVM_GET_FPU, KVMIO, 0x8c, kvm_fpu);
ioctl_ior_nr!(KVM_GET_LAPIC, KVMIO, 0x8e, kvm_lapic_state);
ioctl_iowr_nr!(KVM_GET_CPUID2, KVMIO, 0x91, kvm_cpuid2);
ioctl_ior_nr!(KVM_GET_MP_STATE, KVMIO, 0x98, kvm_mp_state);
ioctl_ior_nr!(KVM_GET_VCPU_EVENTS, KVMIO, 0x9f, kvm_vcpu_events);
ioctl_ior_nr!(KVM_GET_DEBUGREGS, KVMIO, 0xa1, kvm_debugregs);
ioctl_io_nr!(KVM_GET_TSC_KHZ, KVMIO, 0xa3);
ioctl_ior_nr!(KVM_GET_XSAVE, KVMIO, 0xa4, kvm_xsave);
ioctl_ior_nr!(KVM_GET_XCRS, KVMIO, 0xa6, kvm_xcrs);

/// The vCPU state reads of a snapshot (`snapshot::kvm::save_vcpu`), all read-only.
pub(super) fn snapshot_ioctls() -> [u64; 12] {
    [
        KVM_GET_MP_STATE(),
        KVM_GET_REGS(),
        KVM_GET_SREGS(),
        KVM_GET_FPU(),
        KVM_GET_XSAVE(),
        KVM_GET_XCRS(),
        KVM_GET_DEBUGREGS(),
        KVM_GET_LAPIC(),
        KVM_GET_TSC_KHZ(),
        KVM_GET_CPUID2(),
        KVM_GET_MSRS(),
        KVM_GET_VCPU_EVENTS(),
    ]
}

pub(super) fn list() -> Vec<Syscall> {
    // KVM_RUN runs the guest (and, before a snapshot, completes a half-done I/O exit);
    // TUNSETOFFLOAD gives a tap the offloads the guest acked (virtio-net activate and reset run
    // on the vCPU that wrote the status register); the KVM_GET_* reads save a parked vCPU for a
    // snapshot (KVM_GET_REGS also reports where an emulation failure happened).
    let mut ioctls = vec![KVM_RUN(), libc::TUNSETOFFLOAD];
    ioctls.extend(snapshot_ioctls());
    vec![
        arg_in(libc::SYS_ioctl, 1, &ioctls),
        // Return from the kick handler whose signal takes a vCPU out of KVM_RUN (pause).
        always(libc::SYS_rt_sigreturn),
        // The vCPU fd is closed when its thread ends.
        always(libc::SYS_close),
    ]
}
