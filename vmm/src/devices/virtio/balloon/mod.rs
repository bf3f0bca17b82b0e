//! virtio-balloon, for free page reporting (VIRTIO_BALLOON_F_REPORTING): the guest's kernel
//! reports pages it freed, the VMM gives them back to the host kernel, so a pod's guest memory
//! charge shrinks when its workload frees memory.
//!
//! `device.rs` speaks virtio (features, config space, the inflate, deflate and reporting queues),
//! `packet.rs` turns guest chains into checked page ranges, `discard.rs` is the host end (punch a
//! hole in the memfd, or drop private pages), `metrics.rs` counts what the guest asked for and
//! what was done, `persist.rs` is the snapshot state and `event_handler.rs` turns queue notifies
//! into device work on the event loop. The device never asks the guest for memory (the balloon
//! target stays 0), so inflate and deflate carry work only if the guest volunteers it.

pub mod device;
pub mod discard;
pub mod event_handler;
pub mod metrics;
pub mod packet;
pub mod persist;

pub use device::Balloon;
