//! `bulkhead-vmm`: the per-pod VMM of bulkhead, built on rust-vmm crates.
//!
//! Job: take a JSON [`config::VmConfig`] from the shim, build a KVM VM (memfd guest memory with
//! an MMIO hole, 64-bit Linux boot or a raw long-mode test guest), serve its devices (8250 serial
//! to a log file, i8042 reset, virtio-mmio block, hybrid vsock, vhost-user-fs and net on a tap) and an API
//! socket (pause, resume, shutdown, info), and exit 0 on an orderly stop or non-zero with a clear
//! message.
//!
//! Boundaries: the VMM knows nothing about pods or containers; the shim owns those. Snapshots
//! come later: every device keeps its state in a `persist` module of plain serde structs so a
//! snapshot is a walk over the devices.
//!
//! Threads: one per vCPU (KVM_RUN + bus dispatch), one event loop (event-manager) for device
//! queues, host sockets and signals, and one for the API socket; each installs its own seccomp
//! filter (`seccomp`). While a vhost-user exchange runs, a short-lived watchdog thread
//! (`fs-watchdog`) bounds it. With `--jail`, the process first confines itself (`jail`).

pub mod api;
pub mod arch;
pub mod boot;
pub mod devices;
pub mod exit;
pub mod jail;
pub mod layout;
pub mod memory;
pub mod persist;
pub mod seccomp;
pub mod vcpu;
pub mod vmm;

/// The VM config document lives in the KVM-free contract crate, shared with the shim.
pub use bulkhead_vmm_api::config;
