//! What device assembly is given by the VM being built ([`DeviceContext`]), and what it hands the
//! event loop and the kernel cmdline per device.

use std::sync::{Arc, Mutex};

use event_manager::MutEventSubscriber;
use kvm_ioctls::VmFd;
use vm_memory::GuestMemoryMmap;

use crate::exit::ExitSignal;
use crate::seccomp::Filters;
use crate::thread::Unconfirmed;

/// A device's event-loop half.
pub type Subscriber = Arc<Mutex<dyn MutEventSubscriber + Send>>;

/// (base, size, gsi) of a virtio-mmio device, for the kernel cmdline.
pub type CmdlineDevice = (u64, u64, u32);

/// What device assembly needs from the VM being built.
pub struct DeviceContext<'a> {
    pub vm: &'a VmFd,
    /// Whether the in-kernel irqchip exists (interrupt lines are irqfds then).
    pub irqchip: bool,
    pub mem: &'a GuestMemoryMmap,
    /// What the i8042's reset line signals.
    pub exit: &'a Arc<ExitSignal>,
    /// The seccomp filters of the threads devices start.
    pub filters: &'a Filters,
    /// Where those threads' confinement waits to be confirmed (the builder does, before the VM
    /// runs).
    pub threads: &'a Unconfirmed,
}
