//! Serialisable state of the legacy devices. The i8042 of vm-superio is stateless (it only
//! forwards the reset line), so only the UART has state to keep.

use serde::{Deserialize, Serialize};
use vm_superio::serial::SerialState;

/// Bytes the guest has not read yet; the 8250 FIFO is 64 bytes, anything larger is corrupt.
pub const MAX_SERIAL_IN_BUFFER: usize = 64;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct SerialSnapshot {
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

impl From<&SerialState> for SerialSnapshot {
    fn from(s: &SerialState) -> Self {
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

impl SerialSnapshot {
    /// Back to vm-superio's state, refusing an oversized input buffer.
    pub fn to_state(&self) -> Option<SerialState> {
        if self.in_buffer.len() > MAX_SERIAL_IN_BUFFER {
            return None;
        }
        Some(SerialState {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serial_state_roundtrips_and_rejects_oversized_input() {
        let state = SerialState { scratch: 0x5a, line_control: 3, ..Default::default() };
        let snap = SerialSnapshot::from(&state);
        let json = serde_json::to_string(&snap).unwrap();
        let back: SerialSnapshot = serde_json::from_str(&json).unwrap();
        assert_eq!(back.to_state(), Some(state));
        let bad = SerialSnapshot { in_buffer: vec![0; 65], ..Default::default() };
        assert_eq!(bad.to_state(), None);
    }
}
