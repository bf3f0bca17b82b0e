//! 8250 UART (vm-superio) on port 0x3f8, writing guest output to a log file or a sink.

use std::io::Write;

use vm_superio::Serial;

use super::EventFdTrigger;
use crate::devices::bus::BusDevice;
use crate::log_throttle::LogThrottle;

pub const SERIAL_PORT: u64 = 0x3f8;
pub const SERIAL_PORT_LEN: u64 = 8;
/// A guest must not be able to fill the host disk through its console.
pub const SERIAL_LOG_LIMIT: u64 = 64 << 20;

/// Stops writing after `limit` bytes (with one warning); the guest never notices.
pub struct CappedWriter<W> {
    inner: W,
    written: u64,
    limit: u64,
}

impl<W: Write> CappedWriter<W> {
    pub fn new(inner: W, limit: u64) -> Self {
        Self { inner, written: 0, limit }
    }
}

impl<W: Write> Write for CappedWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.written >= self.limit {
            return Ok(buf.len());
        }
        let room = (self.limit - self.written).min(buf.len() as u64) as usize;
        let n = self.inner.write(&buf[..room])?;
        self.written += n as u64;
        if self.written >= self.limit {
            tracing::warn!(limit = self.limit, "serial log limit reached; dropping further guest output");
        }
        Ok(if n == room { buf.len() } else { n })
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

pub struct SerialDevice {
    pub(super) serial: Serial<EventFdTrigger, vm_superio::serial::NoEvents, Box<dyn Write + Send>>,
    /// Failed writes of guest output (a full disk fails every byte the guest sends).
    pub(super) write_errors: LogThrottle,
}

impl SerialDevice {
    pub fn new(irq: EventFdTrigger, out: Box<dyn Write + Send>) -> Self {
        Self { serial: Serial::new(irq, out), write_errors: LogThrottle::new() }
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if data.len() == 1 && offset < SERIAL_PORT_LEN {
            data[0] = self.serial.read(offset as u8);
        } else {
            data.fill(0xff);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if data.len() == 1 && offset < SERIAL_PORT_LEN {
            if let Err(e) = self.serial.write(offset as u8, data[0]) {
                crate::throttled!(self.write_errors, warn, error = ?e, "serial write failed; guest output lost");
            }
            // Line-oriented logs: flush on newline so readers see whole lines promptly.
            if offset == 0 && data[0] == b'\n' {
                let _ = self.serial.writer_mut().flush();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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

    #[test]
    fn serial_output_is_capped() {
        let out = Shared::default();
        let mut dev =
            SerialDevice::new(EventFdTrigger(EventFd::new(0).unwrap()), Box::new(CappedWriter::new(out.clone(), 4)));
        for b in b"0123456789\n" {
            dev.write(0, &[*b]);
        }
        assert_eq!(&*out.0.lock().unwrap(), b"0123");
    }

    #[test]
    fn thr_writes_reach_the_output_and_lsr_reports_empty() {
        let out = Shared::default();
        let mut dev = SerialDevice::new(EventFdTrigger(EventFd::new(0).unwrap()), Box::new(out.clone()));
        for b in b"hi\n" {
            dev.write(0, &[*b]);
        }
        assert_eq!(&*out.0.lock().unwrap(), b"hi\n");
        let mut lsr = [0u8];
        dev.read(5, &mut lsr);
        assert_ne!(lsr[0] & 0x20, 0, "THR empty");
        let mut wide = [0u8; 2];
        dev.read(0, &mut wide);
        assert_eq!(wide, [0xff, 0xff], "only byte access is defined");
        dev.write(7, &[0x42]);
        assert_eq!(crate::persist::Persist::save(&dev).scratch, 0x42);
    }
}
