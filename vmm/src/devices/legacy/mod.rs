//! Legacy PC devices on port I/O.

pub mod i8042;
pub mod persist;
pub mod serial;

use vmm_sys_util::eventfd::EventFd;

/// vm-superio interrupt trigger backed by an eventfd (an irqfd when the in-kernel irqchip exists).
pub struct EventFdTrigger(pub EventFd);

impl vm_superio::Trigger for EventFdTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}
