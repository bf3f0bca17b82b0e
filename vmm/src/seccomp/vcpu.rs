//! A vCPU thread: runs the guest and emulates the port I/O and MMIO it exits on. Device work
//! reached from here is in-memory (registers, queue setup), an eventfd write (notify, IRQ), or
//! a hand-over to a device's own thread (virtio-fs start and reset: a futex, in `common`).

use kvm_bindings::{kvm_regs, KVMIO};
use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr};

use super::{always, arg_in, Syscall};

ioctl_io_nr!(KVM_RUN, KVMIO, 0x80);
ioctl_ior_nr!(KVM_GET_REGS, KVMIO, 0x81, kvm_regs);

pub(super) fn list() -> Vec<Syscall> {
    vec![
        // KVM_RUN runs the guest; KVM_GET_REGS reports where an emulation failure happened;
        // TUNSETOFFLOAD gives a tap the offloads the guest acked (virtio-net activate and reset
        // run on the vCPU that wrote the status register).
        arg_in(libc::SYS_ioctl, 1, &[KVM_RUN(), KVM_GET_REGS(), libc::TUNSETOFFLOAD]),
        // Return from the kick handler whose signal takes a vCPU out of KVM_RUN (pause).
        always(libc::SYS_rt_sigreturn),
        // The vCPU fd is closed when its thread ends.
        always(libc::SYS_close),
    ]
}
