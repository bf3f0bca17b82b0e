//! Snapshots: what a VM is besides its memory, written as a versioned, checksummed state file
//! next to a memory file, and read back by a restore.
//!
//! - `state.rs`: the state document (vCPUs, irqchip/PIT/clock, devices, the VM's config);
//! - `file.rs`: the state file's header, checksum and size limits (a fuzz target);
//! - `cpu.rs`: the host-CPU fingerprint a snapshot is bound to;
//! - `kvm.rs`: reading and writing KVM's share of the state through ioctls.
//!
//! Boundaries: devices save and restore themselves (`Persist`), and the device manager keeps the
//! device set's state (`device_manager/persist.rs`); building the VM around restored state is the
//! builder's job, taking a snapshot the snapshotter's.

pub mod cpu;
pub mod file;
pub mod kvm;
pub mod state;

/// The two files of a snapshot directory.
pub use bulkhead_vmm_api::restore::{MEMORY_FILE, STATE_FILE};
