//! Serialisable state shared by all virtio devices: virtqueues and the mmio transport, with the
//! transport's [`Persist`] impl and the queue checks every device's restore shares. Plain data
//! only; restoring validates it again (the snapshot file is untrusted input).

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;

use super::mmio::{fresh_queues, DriverState, MmioTransport};
use super::{DeviceError, IrqTrigger, VirtioDevice};
use crate::devices::bus::lock;
use crate::persist::Persist;

/// Why a virtio device or transport refused its saved state.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum VirtioPersistError {
    #[error("queue {index}: {reason}")]
    Queue { index: usize, reason: String },
    #[error("{got} queues saved, the device has {expected}")]
    QueueCount { expected: usize, got: usize },
    #[error("driver status {0:#x} is not a state the transport can be in")]
    DriverStatus(u32),
    #[error("acked features {acked:#x} include some the device does not offer ({offered:#x})")]
    Features { acked: u64, offered: u64 },
    #[error("the run's device does not match the snapshot: {0}")]
    Mismatch(String),
    #[error("saved state the device cannot be in: {0}")]
    Invalid(String),
    #[error("the saved queues cannot go live: {0}")]
    Activate(DeviceError),
    #[error("host backend: {0}")]
    Backend(String),
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct QueueState {
    pub max_size: u16,
    pub size: u16,
    pub ready: bool,
    pub next_avail: u16,
    pub next_used: u16,
    pub event_idx_enabled: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
}

impl From<&Queue> for QueueState {
    fn from(q: &Queue) -> Self {
        let s = q.state();
        Self {
            max_size: s.max_size,
            size: s.size,
            ready: s.ready,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx_enabled: s.event_idx_enabled,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
        }
    }
}

impl TryFrom<QueueState> for Queue {
    type Error = virtio_queue::Error;
    fn try_from(s: QueueState) -> Result<Self, Self::Error> {
        Queue::try_from(virtio_queue::QueueState {
            max_size: s.max_size,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx_enabled: s.event_idx_enabled,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
        })
    }
}

/// What every virtio device's saved state has in common: the features its driver acked, its
/// live queues (empty while inactive) and whether it was broken. Each device's state keeps these
/// fields where format 4 put them (the layout test pins the encoding) and lends them through its
/// `common()`; [`VirtioCommonState::restore`] is the one restore rule they all go through.
#[derive(Debug, Clone, Copy)]
pub struct VirtioCommonState<'a> {
    pub acked_features: u64,
    pub queues: &'a [QueueState],
    pub broken: bool,
}

/// What a device's common state comes back as.
#[derive(Debug)]
pub enum CommonRestore {
    /// It was broken when the snapshot was taken, and stays so until the driver resets it.
    Broken(DeviceError),
    Inactive,
    /// Its live queues, checked.
    Active(Vec<Queue>),
}

impl VirtioCommonState<'_> {
    /// The checked restore of untrusted saved state: the acked features must be among those the
    /// device `offered`, else the restore is refused; a broken device stays broken; no queues
    /// means inactive; otherwise one queue per `max_sizes` entry, each with exactly that maximum,
    /// ready and inside guest memory ([`restore_active_queues`]).
    pub fn restore(
        &self,
        offered: u64,
        max_sizes: &[u16],
        mem: &GuestMemoryMmap,
    ) -> Result<CommonRestore, VirtioPersistError> {
        if self.acked_features & !offered != 0 {
            return Err(VirtioPersistError::Features { acked: self.acked_features, offered });
        }
        if self.broken {
            return Ok(CommonRestore::Broken(DeviceError::Request(
                "the device was broken when the snapshot was taken".into(),
            )));
        }
        if self.queues.is_empty() {
            return Ok(CommonRestore::Inactive);
        }
        restore_active_queues(self.queues, max_sizes, mem).map(CommonRestore::Active)
    }
}

/// Rebuilds live queues from saved ones: one per queue the device has, each within the device's
/// maximum, ready and inside guest memory.
pub fn restore_active_queues(
    saved: &[QueueState],
    max_sizes: &[u16],
    mem: &GuestMemoryMmap,
) -> Result<Vec<Queue>, VirtioPersistError> {
    if saved.len() != max_sizes.len() {
        return Err(VirtioPersistError::QueueCount { expected: max_sizes.len(), got: saved.len() });
    }
    let mut queues = Vec::with_capacity(saved.len());
    for (index, (s, &max)) in saved.iter().zip(max_sizes).enumerate() {
        let err = |reason: String| VirtioPersistError::Queue { index, reason };
        if s.max_size != max {
            return Err(err(format!("max size {} differs from the device's {max}", s.max_size)));
        }
        let q = Queue::try_from(*s).map_err(|e| err(e.to_string()))?;
        if !q.ready() || !q.is_valid(mem) {
            return Err(err("not ready or outside guest memory".into()));
        }
        queues.push(q);
    }
    Ok(queues)
}

/// State of the virtio-mmio transport registers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct MmioTransportState {
    pub device_status: u32,
    pub driver_features: u64,
    pub device_features_select: u32,
    pub driver_features_select: u32,
    pub queue_select: u32,
    pub interrupt_status: u32,
    pub config_generation: u32,
    /// Queues still owned by the transport (before DRIVER_OK).
    pub queues: Vec<QueueState>,
}

/// What a restored transport needs from the new process: its device (restored first), guest
/// memory and the interrupt it shares with the device.
pub struct MmioTransportConstructorArgs {
    pub name: String,
    pub mem: GuestMemoryMmap,
    pub device: Arc<Mutex<dyn VirtioDevice>>,
    pub irq: IrqTrigger,
}

impl Persist for MmioTransport {
    type State = MmioTransportState;
    type ConstructorArgs = MmioTransportConstructorArgs;
    type Error = VirtioPersistError;

    fn save(&self) -> MmioTransportState {
        MmioTransportState {
            device_status: self.state.status_bits(),
            driver_features: self.driver_features,
            device_features_select: self.device_features_sel,
            driver_features_select: self.driver_features_sel,
            queue_select: self.queue_sel,
            interrupt_status: self.irq.status(),
            config_generation: self.config_generation,
            queues: self.queues.iter().map(QueueState::from).collect(),
        }
    }

    fn restore(args: MmioTransportConstructorArgs, s: &MmioTransportState) -> Result<Self, VirtioPersistError> {
        let state =
            DriverState::from_status_bits(s.device_status).ok_or(VirtioPersistError::DriverStatus(s.device_status))?;
        let (queue_evts, max_sizes, device_id, offered) = {
            let d = lock(&args.device);
            let evts = d
                .queue_events()
                .iter()
                .map(|e| e.try_clone())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| VirtioPersistError::Backend(e.to_string()))?;
            (evts, d.queue_max_sizes().to_vec(), d.device_type(), d.avail_features())
        };
        if s.driver_features & !offered != 0 {
            return Err(VirtioPersistError::Features { acked: s.driver_features, offered });
        }
        // Before DRIVER_OK the transport holds the queues being configured; once live the device
        // owns them (and a failed activation may have left none behind).
        let queues = if s.queues.is_empty() && matches!(state, DriverState::Live | DriverState::Failed) {
            Vec::new()
        } else if s.queues.len() == max_sizes.len() {
            let mut queues = fresh_queues(&max_sizes);
            for (index, (q, saved)) in queues.iter_mut().zip(&s.queues).enumerate() {
                if saved.max_size != q.max_size() {
                    let reason = format!("max size {} differs from the device's {}", saved.max_size, q.max_size());
                    return Err(VirtioPersistError::Queue { index, reason });
                }
                *q = Queue::try_from(*saved).map_err(|e| VirtioPersistError::Queue { index, reason: e.to_string() })?;
            }
            queues
        } else {
            return Err(VirtioPersistError::QueueCount { expected: max_sizes.len(), got: s.queues.len() });
        };
        args.irq.restore_status(s.interrupt_status);
        Ok(MmioTransport {
            device: args.device,
            mem: args.mem,
            irq: args.irq,
            queue_evts,
            device_id,
            queues,
            state,
            device_features_sel: s.device_features_select,
            driver_features_sel: s.driver_features_select,
            driver_features: s.driver_features,
            queue_sel: s.queue_select,
            config_generation: s.config_generation,
            name: args.name,
            logs: Default::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::chain::test_utils::{mem, TestQueue};

    fn common(acked_features: u64, queues: &[QueueState], broken: bool) -> VirtioCommonState<'_> {
        VirtioCommonState { acked_features, queues, broken }
    }

    #[test]
    fn the_common_restore_checks_features_breakage_and_every_queue() {
        let mem = mem();
        let live = [QueueState::from(&TestQueue::new(0x1000, 8).device_queue(256)); 2];
        let refused = common(0b101, &live, false).restore(0b001, &[256, 256], &mem).unwrap_err();
        assert_eq!(refused, VirtioPersistError::Features { acked: 0b101, offered: 0b001 });
        assert!(matches!(common(1, &live, true).restore(1, &[256, 256], &mem), Ok(CommonRestore::Broken(_))));
        assert!(matches!(common(1, &[], false).restore(1, &[256, 256], &mem), Ok(CommonRestore::Inactive)));
        let Ok(CommonRestore::Active(queues)) = common(1, &live, false).restore(1, &[256, 256], &mem) else {
            panic!("two good queues")
        };
        assert_eq!(queues.len(), 2);
        // A saved maximum other than the device's, or a missing queue, is refused.
        let err = common(1, &live, false).restore(1, &[256, 128], &mem).unwrap_err();
        assert!(matches!(err, VirtioPersistError::Queue { index: 1, .. }), "{err}");
        let err = common(1, &live[..1], false).restore(1, &[256, 256], &mem).unwrap_err();
        assert_eq!(err, VirtioPersistError::QueueCount { expected: 2, got: 1 });
    }

    #[test]
    fn queue_snapshot_roundtrips_through_json() {
        let mut q = Queue::new(16).unwrap();
        q.set_size(8);
        q.set_desc_table_address(Some(0x1000), Some(0));
        q.set_next_avail(5);
        q.set_next_used(4);
        q.set_ready(true);
        let snap = QueueState::from(&q);
        let json = serde_json::to_string(&snap).unwrap();
        let back: QueueState = serde_json::from_str(&json).unwrap();
        let q2 = Queue::try_from(back).unwrap();
        assert_eq!(q2.next_avail(), 5);
        assert_eq!(q2.next_used(), 4);
        assert_eq!(q2.size(), 8);
        assert_eq!(q2.desc_table(), 0x1000);
    }

    #[test]
    fn bogus_snapshot_is_rejected() {
        let bad = QueueState { max_size: 16, size: 3, ..Default::default() };
        assert!(Queue::try_from(bad).is_err());
    }
}
