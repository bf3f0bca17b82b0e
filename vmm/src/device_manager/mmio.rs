//! The virtio-mmio slots of a VM being built (Firecracker's `device_manager/mmio.rs`). Each virtio
//! device takes the next slot, in the order the manager adds them: slot `i` is 4 KiB at
//! `guest_layout::virtio_mmio_addr(i)` with GSI `VIRTIO_IRQ_BASE + i`. On a restore, slot `i` must hold
//! the device the snapshot saved there, by name and kind, and nothing may be left over. `attach`
//! then puts every device on the MMIO bus behind its transport (fresh, or restored from the
//! slot's saved registers), wires its interrupt to its GSI and lists it for the kernel cmdline.

use std::sync::{Arc, Mutex};

use vmm_sys_util::eventfd::EventFd;

use super::context::{CmdlineDevice, DeviceContext};
use super::error::DeviceManagerError;
use super::persist::{SaveableSlot, VirtioHandle, VirtioKind, VirtioSlotState};
use crate::devices::bus::{Bus, BusDevice};
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::persist::MmioTransportConstructorArgs;
use crate::devices::virtio::{IrqTrigger, VirtioDevice};
use crate::guest_layout;
use crate::persist::Persist;

/// The slots handed out so far, and on a restore the snapshot's.
pub(super) struct MmioSlots<'a> {
    saved: Option<&'a [VirtioSlotState]>,
    built: Vec<Built<'a>>,
}

struct Built<'a> {
    slot: Slot<'a>,
    device: Arc<Mutex<dyn VirtioDevice>>,
    handle: VirtioHandle,
}

/// One slot being filled: the device's name, the interrupt it shares with its transport and, on
/// a restore, what the snapshot saved here.
struct Slot<'a> {
    name: String,
    irq: IrqTrigger,
    saved: Option<&'a VirtioSlotState>,
}

/// The slots on the bus: what a snapshot saves and what the cmdline announces.
pub(super) struct Attached {
    pub saveable: Vec<SaveableSlot>,
    pub cmdline_devices: Vec<CmdlineDevice>,
}

impl<'a> MmioSlots<'a> {
    pub fn new(saved: Option<&'a [VirtioSlotState]>) -> Self {
        Self { saved, built: Vec::new() }
    }

    /// Puts a device of kind `D` named `name` in the next slot: `new` builds it fresh, or, on a
    /// restore, `args` makes what its `Persist::restore` takes besides the slot's saved state
    /// (given the slot's interrupt). Returns the device, for the event loop.
    pub fn add<D: VirtioKind>(
        &mut self,
        name: String,
        new: impl FnOnce() -> Result<D, DeviceManagerError>,
        args: impl FnOnce(IrqTrigger) -> Result<D::ConstructorArgs, DeviceManagerError>,
    ) -> Result<Arc<Mutex<D>>, DeviceManagerError> {
        let slot = self.next(name)?;
        let device = match slot.saved {
            None => new()?,
            Some(s) => {
                let state = D::saved(&s.device).ok_or_else(|| DeviceManagerError::Slot {
                    what: slot.name.clone(),
                    reason: "the snapshot has another kind of device in this slot".into(),
                })?;
                D::restore(args(slot.irq.clone())?, state)
                    .map_err(|source| DeviceManagerError::Restore { what: slot.name.clone(), source })?
            }
        };
        let device = Arc::new(Mutex::new(device));
        let handle = D::handle(device.clone());
        self.built.push(Built { slot, device: device.clone(), handle });
        Ok(device)
    }

    fn next(&self, name: String) -> Result<Slot<'a>, DeviceManagerError> {
        let index = self.built.len();
        let saved = match self.saved {
            None => None,
            Some(list) => match list.get(index) {
                Some(s) if s.name == name => Some(s),
                Some(s) => {
                    let reason = format!("virtio slot {index} holds {} in the snapshot", s.name);
                    return Err(DeviceManagerError::Slot { what: name, reason });
                }
                None => {
                    let reason = "the snapshot has no such device".into();
                    return Err(DeviceManagerError::Slot { what: name, reason });
                }
            },
        };
        let evt = EventFd::new(libc::EFD_NONBLOCK)
            .map_err(|source| DeviceManagerError::Device { what: "irq eventfd".into(), source })?;
        Ok(Slot { name, irq: IrqTrigger::new(evt), saved })
    }

    /// Puts every device on the MMIO bus behind a transport (fresh or restored) and wires its
    /// interrupt to its GSI.
    pub fn attach(self, ctx: &DeviceContext, mmio: &mut Bus) -> Result<Attached, DeviceManagerError> {
        if let Some(extra) = self.saved.and_then(|list| list.get(self.built.len())) {
            let reason = "the snapshot has this device but the run does not".to_string();
            return Err(DeviceManagerError::Slot { what: extra.name.clone(), reason });
        }
        let mut saveable = Vec::new();
        let mut cmdline_devices = Vec::new();
        for (i, Built { slot, device, handle }) in self.built.into_iter().enumerate() {
            let base = guest_layout::virtio_mmio_addr(i);
            let gsi = guest_layout::VIRTIO_IRQ_BASE + i as u32;
            if ctx.irqchip {
                ctx.vm
                    .register_irqfd(slot.irq.eventfd(), gsi)
                    .map_err(|source| DeviceManagerError::Kvm { what: "irqfd", source })?;
            }
            let transport = match slot.saved {
                None => MmioTransport::new(slot.name.clone(), ctx.mem.clone(), device, slot.irq)
                    .map_err(|source| DeviceManagerError::Device { what: slot.name.clone(), source })?,
                Some(s) => {
                    let args = MmioTransportConstructorArgs {
                        name: slot.name.clone(),
                        mem: ctx.mem.clone(),
                        device,
                        irq: slot.irq,
                    };
                    MmioTransport::restore(args, &s.transport).map_err(|source| DeviceManagerError::Restore {
                        what: format!("{} transport", slot.name),
                        source,
                    })?
                }
            };
            let transport = Arc::new(Mutex::new(transport));
            let on_bus: Arc<Mutex<dyn BusDevice>> = transport.clone();
            mmio.insert(on_bus, base, guest_layout::VIRTIO_MMIO_SIZE)?;
            cmdline_devices.push((base, guest_layout::VIRTIO_MMIO_SIZE, gsi));
            saveable.push(SaveableSlot { name: slot.name, transport, device: handle });
        }
        Ok(Attached { saveable, cmdline_devices })
    }
}
