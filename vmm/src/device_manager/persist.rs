//! The state of a VM's whole device set, and handles on the live devices that produce it: a
//! snapshot walks these, a restore hands each entry back to its device's `Persist::restore`.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::bus::lock;
use super::legacy::i8042::I8042;
use super::legacy::persist::{I8042State, SerialState};
use super::legacy::serial::SerialDevice;
use super::virtio::balloon::persist::BalloonState;
use super::virtio::balloon::Balloon;
use super::virtio::block::persist::BlockState;
use super::virtio::block::Block;
use super::virtio::fs::persist::FsState;
use super::virtio::fs::Fs;
use super::virtio::mmio::MmioTransport;
use super::virtio::net::persist::NetState;
use super::virtio::net::Net;
use super::virtio::persist::MmioTransportState;
use super::virtio::vsock::persist::VsockState;
use super::virtio::vsock::Vsock;
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

/// The state of one virtio device, by kind.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub enum VirtioDeviceState {
    Block(BlockState),
    Vsock(VsockState),
    Fs(FsState),
    Net(NetState),
    /// Added in format version 3; last, so the earlier variants keep their tags.
    Balloon(BalloonState),
}

impl VirtioDeviceState {
    pub fn block(&self) -> Option<&BlockState> {
        match self {
            Self::Block(s) => Some(s),
            _ => None,
        }
    }

    pub fn vsock(&self) -> Option<&VsockState> {
        match self {
            Self::Vsock(s) => Some(s),
            _ => None,
        }
    }

    pub fn fs(&self) -> Option<&FsState> {
        match self {
            Self::Fs(s) => Some(s),
            _ => None,
        }
    }

    pub fn net(&self) -> Option<&NetState> {
        match self {
            Self::Net(s) => Some(s),
            _ => None,
        }
    }

    pub fn balloon(&self) -> Option<&BalloonState> {
        match self {
            Self::Balloon(s) => Some(s),
            _ => None,
        }
    }
}

/// A virtio device by kind, so a snapshot can save its typed state.
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
