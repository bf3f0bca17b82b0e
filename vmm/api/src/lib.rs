//! `bulkhead-vmm-api`: the contract between the shim and `bulkhead-vmm`, with no KVM code.
//!
//! Job: the types both sides agree on, so the shim writes exactly what the VMM reads and never
//! links KVM code:
//! - [`config`]: the VM config document (JSON) and its validation;
//! - [`jail`]: how the VMM is confined (chroot, uid/gid, namespaces, cgroup);
//! - [`api`]: the API socket's request and response lines, bounded on both sides;
//! - [`probe`]: what kind of KVM this host offers, the one probe every crate uses;
//! - [`restore`]: a snapshot directory's files and the per-run settings of a restore.
//!
//! Boundaries: plain data, parsing and validation only. Building and running a VM is `bulkhead-vmm`'s.

pub mod api;
pub mod config;
pub mod jail;
pub mod probe;
pub mod restore;
