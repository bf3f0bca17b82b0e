//! Serialisable virtio-fs state. It is the frontend's view only: the backend's FUSE session (open
//! files, inode numbers) lives in virtiofsd and is not part of it, so a restore needs a fresh
//! backend handshake and the guest sees a backend restart. That is why the device offers a plain
//! `Fs::snapshot` rather than `crate::persist::Persist`, whose `restore` would have to talk to
//! a backend.

use serde::{Deserialize, Serialize};

use crate::devices::virtio::persist::QueueSnapshot;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FsSnapshot {
    pub tag: String,
    /// The backend's socket at save time (a restore may be given another).
    pub socket: String,
    pub queue_size: u16,
    pub acked_features: u64,
    /// hiprio, then the request queue: addresses, size, and the used index the backend had
    /// published (a fresh backend restarts there). Empty while inactive.
    pub vrings: Vec<QueueSnapshot>,
    pub broken: bool,
}
