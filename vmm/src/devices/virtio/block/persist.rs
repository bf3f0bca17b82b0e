//! Serialisable virtio-blk state.

use serde::{Deserialize, Serialize};

use crate::devices::virtio::persist::QueueSnapshot;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BlockSnapshot {
    pub path: String,
    pub read_only: bool,
    pub capacity_sectors: u64,
    pub acked_features: u64,
    /// Empty while the device is inactive.
    pub queues: Vec<QueueSnapshot>,
    pub broken: bool,
}
