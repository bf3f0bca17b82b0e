//! i8042 controller: only what Linux needs, and the reset line (0xfe to port 0x64) that ends the VM.

use vm_superio::I8042Device;

use crate::devices::bus::BusDevice;

pub const I8042_PORT: u64 = 0x60;
pub const I8042_PORT_LEN: u64 = 5;

/// Called when the guest pulses the reset line.
pub struct ResetTrigger(pub Box<dyn Fn() + Send>);

impl vm_superio::Trigger for ResetTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        (self.0)();
        Ok(())
    }
}

pub struct I8042 {
    dev: I8042Device<ResetTrigger>,
}

impl I8042 {
    pub fn new(on_reset: ResetTrigger) -> Self {
        Self { dev: I8042Device::new(on_reset) }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if data.len() == 1 {
            data[0] = self.dev.read(offset as u8);
        } else {
            data.fill(0xff);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if data.len() == 1 {
            if let Err(e) = self.dev.write(offset as u8, data[0]) {
                tracing::warn!(error = %e, "i8042 write failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[test]
    fn reset_command_fires_the_trigger() {
        let fired = Arc::new(AtomicBool::new(false));
        let f = fired.clone();
        let mut dev = I8042::new(ResetTrigger(Box::new(move || f.store(true, Ordering::SeqCst))));
        dev.write(4, &[0x20]); // read command byte: not a reset
        assert!(!fired.load(Ordering::SeqCst));
        dev.write(4, &[0xfe]);
        assert!(fired.load(Ordering::SeqCst));
    }
}
