//! Serialisable virtio-vsock state. Host connections are not part of it: after a restore the
//! device starts with no connections and the guest sees them reset, as with Firecracker.

use serde::{Deserialize, Serialize};

use crate::devices::virtio::persist::QueueSnapshot;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VsockSnapshot {
    pub guest_cid: u64,
    pub uds_path: String,
    pub acked_features: u64,
    /// rx, tx, event; empty while inactive.
    pub queues: Vec<QueueSnapshot>,
    pub broken: bool,
}
