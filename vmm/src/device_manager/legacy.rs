//! The legacy devices on port I/O (Firecracker's `device_manager/legacy.rs`): the 8250 UART at
//! 0x3f8 on GSI 4, writing to the run's serial log (capped) or nowhere, and the i8042 whose reset
//! line stops the VM. Fresh, or restored from the snapshot's state with the new run's log and
//! interrupt.

use std::fs::OpenOptions;
use std::io::Write;
use std::sync::{Arc, Mutex};

use vmm_sys_util::eventfd::EventFd;

use super::context::DeviceContext;
use super::error::DeviceManagerError;
use super::persist::DevicesState;
use crate::config::ValidConfig;
use crate::devices::bus::Bus;
use crate::devices::legacy::i8042::{ResetTrigger, I8042, I8042_PORT, I8042_PORT_LEN};
use crate::devices::legacy::persist::{I8042ConstructorArgs, SerialConstructorArgs};
use crate::devices::legacy::serial::{CappedWriter, SerialDevice, SERIAL_LOG_LIMIT, SERIAL_PORT, SERIAL_PORT_LEN};
use crate::devices::legacy::EventFdTrigger;
use crate::exit::ExitReason;
use crate::guest_layout;
use crate::persist::Persist;

/// The legacy devices with state, for snapshots.
pub(super) struct Legacy {
    pub serial: Arc<Mutex<SerialDevice>>,
    pub i8042: Arc<Mutex<I8042>>,
}

/// Builds the legacy devices (from `saved` state when restoring) and puts them on `pio`.
pub(super) fn attach(
    cfg: &ValidConfig,
    ctx: &DeviceContext,
    saved: Option<&DevicesState>,
    pio: &mut Bus,
) -> Result<Legacy, DeviceManagerError> {
    let device_err = |what: String| move |source| DeviceManagerError::Device { what, source };
    let serial_out: Box<dyn Write + Send> = match &cfg.serial_log {
        Some(p) => Box::new(CappedWriter::new(
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(device_err(format!("serial log {}", p.display())))?,
            SERIAL_LOG_LIMIT,
        )),
        None => Box::new(std::io::sink()),
    };
    let serial_irq = EventFdTrigger(irq_line(ctx, guest_layout::SERIAL_IRQ)?);
    let serial = match saved {
        None => SerialDevice::new(serial_irq, serial_out),
        Some(s) => SerialDevice::restore(SerialConstructorArgs { irq: serial_irq, out: serial_out }, &s.serial)
            .map_err(|source| DeviceManagerError::RestoreLegacy { what: "serial", source })?,
    };
    let serial = Arc::new(Mutex::new(serial));
    pio.insert(serial.clone(), SERIAL_PORT, SERIAL_PORT_LEN)?;

    let exit = ctx.exit.clone();
    let on_reset = ResetTrigger(Box::new(move || {
        tracing::info!("guest reset through i8042");
        exit.signal(ExitReason::GuestReset);
    }));
    let i8042 = match saved {
        None => I8042::new(on_reset),
        Some(s) => I8042::restore(I8042ConstructorArgs { on_reset }, &s.i8042)
            .map_err(|source| DeviceManagerError::RestoreLegacy { what: "i8042", source })?,
    };
    let i8042 = Arc::new(Mutex::new(i8042));
    pio.insert(i8042.clone(), I8042_PORT, I8042_PORT_LEN)?;
    Ok(Legacy { serial, i8042 })
}

/// An interrupt line: an irqfd on `gsi` when the irqchip exists, a plain eventfd otherwise
/// (test guests poll and never take interrupts).
fn irq_line(ctx: &DeviceContext, gsi: u32) -> Result<EventFd, DeviceManagerError> {
    let evt = EventFd::new(libc::EFD_NONBLOCK)
        .map_err(|source| DeviceManagerError::Device { what: "irq eventfd".into(), source })?;
    if ctx.irqchip {
        ctx.vm.register_irqfd(&evt, gsi).map_err(|source| DeviceManagerError::Kvm { what: "irqfd", source })?;
    }
    Ok(evt)
}
