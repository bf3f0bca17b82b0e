//! Why the VM stops, and the one-shot signal that wakes the main loop when it does.

use std::sync::Mutex;

use vmm_sys_util::eventfd::EventFd;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitReason {
    /// The guest pulsed the i8042 reset line or asked KVM for a reset/shutdown.
    GuestReset,
    /// A vCPU executed HLT with nobody to wake it (no in-kernel irqchip).
    GuestHalted,
    /// Triple fault.
    GuestTripleFault,
    ApiShutdown,
    Signal(i32),
    VcpuError {
        vcpu: u8,
        message: String,
    },
    /// The API thread could not start or keep serving.
    ApiFailed(String),
    /// A VMM thread panicked (`crash.rs`): which, where and what it said.
    Panicked(String),
}

impl ExitReason {
    /// Process exit status: 0 for every orderly stop, 1 when the guest crashed or a VMM thread failed.
    pub fn exit_code(&self) -> i32 {
        match self {
            ExitReason::VcpuError { .. }
            | ExitReason::ApiFailed(_)
            | ExitReason::GuestTripleFault
            | ExitReason::Panicked(_) => 1,
            _ => 0,
        }
    }
}

pub struct ExitSignal {
    reason: Mutex<Option<ExitReason>>,
    evt: EventFd,
}

impl ExitSignal {
    pub fn new() -> std::io::Result<Self> {
        Ok(Self { reason: Mutex::new(None), evt: EventFd::new(libc::EFD_NONBLOCK)? })
    }

    /// Records `reason` unless an earlier reason won, and wakes the main loop. A panic wins over
    /// an orderly stop that came first: the process must not exit 0 after a bug.
    pub fn signal(&self, reason: ExitReason) {
        let mut r = crate::devices::bus::lock(&self.reason);
        let replaces = match r.as_ref() {
            None => true,
            Some(earlier) => matches!(reason, ExitReason::Panicked(_)) && earlier.exit_code() == 0,
        };
        if replaces {
            *r = Some(reason);
        }
        let _ = self.evt.write(1);
    }

    pub fn reason(&self) -> Option<ExitReason> {
        crate::devices::bus::lock(&self.reason).clone()
    }

    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_reason_wins_and_codes_are_right() {
        let s = ExitSignal::new().unwrap();
        assert_eq!(s.reason(), None);
        s.signal(ExitReason::GuestReset);
        s.signal(ExitReason::VcpuError { vcpu: 0, message: "x".into() });
        assert_eq!(s.reason(), Some(ExitReason::GuestReset));
        assert_eq!(ExitReason::GuestReset.exit_code(), 0);
        assert_eq!(ExitReason::Signal(15).exit_code(), 0);
        assert_eq!(ExitReason::VcpuError { vcpu: 1, message: String::new() }.exit_code(), 1);
        assert_eq!(ExitReason::ApiFailed(String::new()).exit_code(), 1);
        assert_eq!(s.eventfd().read().unwrap(), 2);
    }
}
