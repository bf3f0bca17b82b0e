//! The device set as a snapshot sees it (Firecracker's `device_manager/persist.rs`): the state of
//! every device in bus order ([`DevicesState`]), and handles on the live devices that produce it
//! ([`SaveableDevices`]). A snapshot walks the handles; a restore hands each saved entry back to
//! its device's `Persist::restore` (`mmio.rs`, `legacy.rs`). Each virtio device kind appears here
//! once: a variant of [`VirtioDeviceState`] and of [`VirtioHandle`], and its [`VirtioKind`].

use std::sync::{Arc, Mutex};

use event_manager::MutEventSubscriber;
use serde::{Deserialize, Serialize};

use crate::devices::bus::lock;
use crate::devices::legacy::i8042::I8042;
use crate::devices::legacy::persist::{I8042State, SerialState};
use crate::devices::legacy::serial::SerialDevice;
use crate::devices::virtio::balloon::persist::BalloonState;
use crate::devices::virtio::balloon::Balloon;
use crate::devices::virtio::block::persist::BlockState;
use crate::devices::virtio::block::Block;
use crate::devices::virtio::fs::persist::FsState;
use crate::devices::virtio::fs::Fs;
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::net::persist::NetState;
use crate::devices::virtio::net::Net;
use crate::devices::virtio::persist::{MmioTransportState, VirtioPersistError};
use crate::devices::virtio::vsock::persist::VsockState;
use crate::devices::virtio::vsock::Vsock;
use crate::devices::virtio::VirtioDevice;
use crate::persist::Persist;

/// Every device, in bus order.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DevicesState {
    pub serial: SerialState,
    pub i8042: I8042State,
    /// One entry per virtio-mmio slot, in slot order.
    pub virtio: Vec<VirtioSlotState>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VirtioSlotState {
    /// The slot's device name (`blk0`, `vsock`, ...): a restore matches devices by it.
    pub name: String,
    pub transport: MmioTransportState,
    pub device: VirtioDeviceState,
}

/// The state of one virtio device, by kind. The variants' order is their tag in the state file:
/// a new kind goes last (and the file's format version goes up).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub enum VirtioDeviceState {
    Block(BlockState),
    Vsock(VsockState),
    Fs(FsState),
    Net(NetState),
    /// Added in format version 3.
    Balloon(BalloonState),
}

/// A live virtio device by kind, so a snapshot can save its typed state.
#[derive(Clone)]
pub enum VirtioHandle {
    Block(Arc<Mutex<Block>>),
    Vsock(Arc<Mutex<Vsock>>),
    Fs(Arc<Mutex<Fs>>),
    Net(Arc<Mutex<Net>>),
    Balloon(Arc<Mutex<Balloon>>),
}

impl VirtioHandle {
    fn save(&self) -> VirtioDeviceState {
        match self {
            VirtioHandle::Block(d) => VirtioDeviceState::Block(lock(d).save()),
            VirtioHandle::Vsock(d) => VirtioDeviceState::Vsock(lock(d).save()),
            VirtioHandle::Fs(d) => VirtioDeviceState::Fs(lock(d).save()),
            VirtioHandle::Net(d) => VirtioDeviceState::Net(lock(d).save()),
            VirtioHandle::Balloon(d) => VirtioDeviceState::Balloon(lock(d).save()),
        }
    }

    /// Why the device's state cannot be snapshotted now, if it cannot.
    fn snapshot_blocker(&self) -> Option<String> {
        match self {
            VirtioHandle::Fs(d) => lock(d).snapshot_blocker(),
            VirtioHandle::Block(_) | VirtioHandle::Vsock(_) | VirtioHandle::Net(_) | VirtioHandle::Balloon(_) => None,
        }
    }
}

/// A virtio device kind as the device set knows it: which saved state is its own, and how a live
/// one is held for snapshots. Every virtio device restores with [`VirtioPersistError`] and serves
/// its queues on the event loop.
pub trait VirtioKind:
    Persist<Error = VirtioPersistError> + VirtioDevice + MutEventSubscriber + Send + Sized + 'static
{
    /// This kind's state, if `state` is of this kind.
    fn saved(state: &VirtioDeviceState) -> Option<&Self::State>;
    fn handle(device: Arc<Mutex<Self>>) -> VirtioHandle;
}

impl VirtioKind for Block {
    fn saved(state: &VirtioDeviceState) -> Option<&BlockState> {
        match state {
            VirtioDeviceState::Block(s) => Some(s),
            _ => None,
        }
    }

    fn handle(device: Arc<Mutex<Self>>) -> VirtioHandle {
        VirtioHandle::Block(device)
    }
}

impl VirtioKind for Vsock {
    fn saved(state: &VirtioDeviceState) -> Option<&VsockState> {
        match state {
            VirtioDeviceState::Vsock(s) => Some(s),
            _ => None,
        }
    }

    fn handle(device: Arc<Mutex<Self>>) -> VirtioHandle {
        VirtioHandle::Vsock(device)
    }
}

impl VirtioKind for Fs {
    fn saved(state: &VirtioDeviceState) -> Option<&FsState> {
        match state {
            VirtioDeviceState::Fs(s) => Some(s),
            _ => None,
        }
    }

    fn handle(device: Arc<Mutex<Self>>) -> VirtioHandle {
        VirtioHandle::Fs(device)
    }
}

impl VirtioKind for Net {
    fn saved(state: &VirtioDeviceState) -> Option<&NetState> {
        match state {
            VirtioDeviceState::Net(s) => Some(s),
            _ => None,
        }
    }

    fn handle(device: Arc<Mutex<Self>>) -> VirtioHandle {
        VirtioHandle::Net(device)
    }
}

impl VirtioKind for Balloon {
    fn saved(state: &VirtioDeviceState) -> Option<&BalloonState> {
        match state {
            VirtioDeviceState::Balloon(s) => Some(s),
            _ => None,
        }
    }

    fn handle(device: Arc<Mutex<Self>>) -> VirtioHandle {
        VirtioHandle::Balloon(device)
    }
}

/// One virtio-mmio slot: its transport and its device.
#[derive(Clone)]
pub struct SaveableSlot {
    pub name: String,
    pub transport: Arc<Mutex<MmioTransport>>,
    pub device: VirtioHandle,
}

/// Handles on every device with state, in the order a snapshot lists them.
#[derive(Clone)]
pub struct SaveableDevices {
    pub serial: Arc<Mutex<SerialDevice>>,
    pub i8042: Arc<Mutex<I8042>>,
    pub virtio: Vec<SaveableSlot>,
}

impl SaveableDevices {
    /// Why the devices cannot be snapshotted now, if they cannot (a virtio-fs device whose
    /// guest has a FUSE session). Call with the vCPUs paused.
    pub fn refuse_snapshot(&self) -> Option<String> {
        self.virtio.iter().find_map(|s| s.device.snapshot_blocker())
    }

    /// Tells the guest's drivers what a restore changed under them: a NIC's link, now the run's
    /// (`Net::tell_link_change`). Call once the VM's irqchip state is back, before the vCPUs run.
    pub fn tell_restored_changes(&self) {
        for slot in &self.virtio {
            if let VirtioHandle::Net(d) = &slot.device {
                lock(d).tell_link_change();
            }
        }
    }

    /// Every device's state. Call on the event-loop thread (no device work runs meanwhile) with
    /// the vCPUs paused.
    pub fn save(&self) -> DevicesState {
        DevicesState {
            serial: lock(&self.serial).save(),
            i8042: lock(&self.i8042).save(),
            virtio: self
                .virtio
                .iter()
                .map(|s| VirtioSlotState {
                    name: s.name.clone(),
                    transport: lock(&s.transport).save(),
                    device: s.device.save(),
                })
                .collect(),
        }
    }
}
