//! Serialisable state shared by all virtio devices: virtqueues and the mmio transport.
//! Plain data only; restoring validates it again (the snapshot file is untrusted input).

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueState};

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct QueueSnapshot {
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

impl From<&Queue> for QueueSnapshot {
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

impl TryFrom<QueueSnapshot> for Queue {
    type Error = virtio_queue::Error;
    fn try_from(s: QueueSnapshot) -> Result<Self, Self::Error> {
        Queue::try_from(QueueState {
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

/// State of the virtio-mmio transport registers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct MmioTransportSnapshot {
    pub device_status: u32,
    pub driver_features: u64,
    pub device_features_select: u32,
    pub driver_features_select: u32,
    pub queue_select: u32,
    pub interrupt_status: u32,
    pub config_generation: u32,
    /// Queues still owned by the transport (before DRIVER_OK).
    pub queues: Vec<QueueSnapshot>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::QueueT;

    #[test]
    fn queue_snapshot_roundtrips_through_json() {
        let mut q = Queue::new(16).unwrap();
        q.set_size(8);
        q.set_desc_table_address(Some(0x1000), Some(0));
        q.set_next_avail(5);
        q.set_next_used(4);
        q.set_ready(true);
        let snap = QueueSnapshot::from(&q);
        let json = serde_json::to_string(&snap).unwrap();
        let back: QueueSnapshot = serde_json::from_str(&json).unwrap();
        let q2 = Queue::try_from(back).unwrap();
        assert_eq!(q2.next_avail(), 5);
        assert_eq!(q2.next_used(), 4);
        assert_eq!(q2.size(), 8);
        assert_eq!(q2.desc_table(), 0x1000);
    }

    #[test]
    fn bogus_snapshot_is_rejected() {
        let bad = QueueSnapshot { max_size: 16, size: 3, ..Default::default() };
        assert!(Queue::try_from(bad).is_err());
    }
}
