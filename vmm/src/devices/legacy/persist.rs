//! Serialisable state of the legacy devices and their [`Persist`] impls. The i8042 of
//! vm-superio is stateless (it only forwards the reset line), so only the UART has state to keep.

use std::io::Write;

use serde::{Deserialize, Serialize};
use vm_superio::serial::{NoEvents, SerialState as UartState};
use vm_superio::Serial;

use super::i8042::{ResetTrigger, I8042};
use super::serial::SerialDevice;
use super::EventFdTrigger;
use crate::persist::Persist;

/// Bytes the guest has not read yet; the 8250 FIFO is 64 bytes, anything larger is corrupt.
pub const MAX_SERIAL_IN_BUFFER: usize = 64;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LegacyPersistError {
    #[error("serial input buffer of {0} bytes exceeds the {MAX_SERIAL_IN_BUFFER}-byte FIFO")]
    SerialInBuffer(usize),
    #[error("serial state rejected: {0}")]
    Serial(String),
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct SerialState {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    pub in_buffer: Vec<u8>,
}

impl From<&UartState> for SerialState {
    fn from(s: &UartState) -> Self {
        Self {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

impl SerialState {
    /// Back to vm-superio's state, refusing an oversized input buffer.
    pub fn to_state(&self) -> Option<UartState> {
        if self.in_buffer.len() > MAX_SERIAL_IN_BUFFER {
            return None;
        }
        Some(UartState {
            baud_divisor_low: self.baud_divisor_low,
            baud_divisor_high: self.baud_divisor_high,
            interrupt_enable: self.interrupt_enable,
            interrupt_identification: self.interrupt_identification,
            line_control: self.line_control,
            line_status: self.line_status,
            modem_control: self.modem_control,
            modem_status: self.modem_status,
            scratch: self.scratch,
            in_buffer: self.in_buffer.clone(),
        })
    }
}

/// What a restored UART needs from the new process: its interrupt line and its output (the new
/// run's serial log).
pub struct SerialConstructorArgs {
    pub irq: EventFdTrigger,
    pub out: Box<dyn Write + Send>,
}

impl Persist for SerialDevice {
    type State = SerialState;
    type ConstructorArgs = SerialConstructorArgs;
    type Error = LegacyPersistError;

    fn save(&self) -> SerialState {
        SerialState::from(&self.serial.state())
    }

    fn restore(args: SerialConstructorArgs, state: &SerialState) -> Result<Self, LegacyPersistError> {
        let s = state.to_state().ok_or(LegacyPersistError::SerialInBuffer(state.in_buffer.len()))?;
        let serial = Serial::from_state(&s, args.irq, NoEvents, args.out)
            .map_err(|e| LegacyPersistError::Serial(format!("{e:?}")))?;
        Ok(Self { serial, write_errors: Default::default() })
    }
}

/// The i8042 keeps nothing between accesses; the empty record keeps the device list uniform.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct I8042State {}

/// What a restored i8042 needs from the new process: the reset line that ends its VM.
pub struct I8042ConstructorArgs {
    pub on_reset: ResetTrigger,
}

impl Persist for I8042 {
    type State = I8042State;
    type ConstructorArgs = I8042ConstructorArgs;
    type Error = LegacyPersistError;

    fn save(&self) -> I8042State {
        I8042State {}
    }

    fn restore(args: I8042ConstructorArgs, _state: &I8042State) -> Result<Self, LegacyPersistError> {
        Ok(I8042::new(args.on_reset))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::bus::BusDevice;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use vmm_sys_util::eventfd::EventFd;

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn irq() -> EventFdTrigger {
        EventFdTrigger(EventFd::new(libc::EFD_NONBLOCK).unwrap())
    }

    #[test]
    fn serial_state_roundtrips_and_rejects_oversized_input() {
        let state = UartState { scratch: 0x5a, line_control: 3, ..Default::default() };
        let snap = SerialState::from(&state);
        let json = serde_json::to_string(&snap).unwrap();
        let back: SerialState = serde_json::from_str(&json).unwrap();
        assert_eq!(back.to_state(), Some(state));
        let bad = SerialState { in_buffer: vec![0; 65], ..Default::default() };
        assert_eq!(bad.to_state(), None);
    }

    #[test]
    fn serial_device_roundtrips_registers_and_writes_to_the_new_output() {
        let mut dev = SerialDevice::new(irq(), Box::new(std::io::sink()));
        dev.write(3, &[0x83]); // DLAB on, 8 bits
        dev.write(0, &[0x0c]); // divisor low: 9600 baud
        dev.write(3, &[0x03]); // DLAB off
        dev.write(1, &[0x02]); // THR-empty interrupt on
        dev.write(7, &[0x99]);
        let saved = dev.save();
        let bytes = postcard::to_stdvec(&saved).unwrap();
        let back: SerialState = postcard::from_bytes(&bytes).unwrap();

        let out = Shared::default();
        let mut restored =
            SerialDevice::restore(SerialConstructorArgs { irq: irq(), out: Box::new(out.clone()) }, &back).unwrap();
        assert_eq!(restored.save(), saved);
        let mut b = [0u8];
        restored.read(7, &mut b);
        assert_eq!(b[0], 0x99);
        restored.read(1, &mut b);
        assert_eq!(b[0], 0x02, "interrupt enable survives");
        restored.write(0, b"x");
        assert_eq!(&*out.0.lock().unwrap(), b"x");

        let bad = SerialState { in_buffer: vec![0; 65], ..saved };
        let err =
            SerialDevice::restore(SerialConstructorArgs { irq: irq(), out: Box::new(std::io::sink()) }, &bad).err();
        assert_eq!(err, Some(LegacyPersistError::SerialInBuffer(65)));
    }

    #[test]
    fn i8042_roundtrips_and_keeps_the_new_reset_line() {
        let dev = I8042::new(ResetTrigger(Box::new(|| {})));
        let saved = dev.save();
        let fired = Arc::new(AtomicBool::new(false));
        let f = fired.clone();
        let on_reset = ResetTrigger(Box::new(move || f.store(true, Ordering::SeqCst)));
        let mut restored = I8042::restore(I8042ConstructorArgs { on_reset }, &saved).unwrap();
        assert_eq!(restored.save(), saved);
        restored.write(4, &[0xfe]);
        assert!(fired.load(Ordering::SeqCst));
    }
}
