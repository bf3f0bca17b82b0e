//! `bulkhead-vmm`: the per-pod VMM of bulkhead, built on rust-vmm crates.
//!
//! Job: take a JSON [`config::VmConfig`] from the shim, build a KVM VM (memfd guest memory with
//! an MMIO hole, 64-bit Linux boot or a raw long-mode test guest), serve its devices (8250 serial
//! to a log file, i8042 reset, virtio-mmio block, hybrid vsock, vhost-user-fs, net on a tap and a
//! balloon for free page reporting) and an API socket (pause, resume, snapshot, shutdown, info),
//! and exit 0 on an orderly stop or non-zero with a clear message. Or restore a VM from a
//! snapshot (`builder::prepare` + `Prepared::restore`).
//!
//! Boundaries: the VMM knows nothing about pods or containers; the shim owns those. Every device
//! implements [`persist::Persist`], so a snapshot is a walk over the devices (`snapshotter.rs`),
//! and boot and restore share one builder (`builder.rs`: KVM VM, memory, vCPUs) and one device
//! manager (`device_manager/`: every device, its bus slot and interrupt, the set's state).
//!
//! Threads: one per vCPU (KVM_RUN + bus dispatch), one event loop (event-manager) for device
//! queues (the balloon's freed pages included), host sockets and signals, and one for the API
//! socket; each installs its own seccomp filter (`seccomp`). Each virtio-fs device adds a backend
//! thread for its vhost-user exchanges and a watchdog thread that bounds them. With `--jail`, the
//! process first confines itself (`jail`).

pub mod api;
pub mod arch;
pub mod boot;
pub mod builder;
pub mod crash;
pub mod device_manager;
pub mod devices;
pub mod error;
pub mod exit;
pub mod guest_layout;
pub mod jail;
pub mod log_throttle;
pub mod memory;
pub mod persist;
pub mod phases;
pub mod seccomp;
pub mod snapshot;
pub mod snapshotter;
pub mod thread;
pub mod vcpu;
pub mod vmm;

/// The VM config document lives in the KVM-free contract crate, shared with the shim.
pub use bulkhead_vmm_api::config;
