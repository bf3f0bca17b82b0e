//! `bulkhead-vmm-api`: the contract between the shim and `bulkhead-vmm`, with no KVM code.
//!
//! Job: the types both sides agree on, so the shim writes exactly what the VMM reads and never
//! links KVM code:
//! - [`config`]: the VM config document (JSON) and its validation;
//! - [`jail`]: how the VMM is confined (chroot, uid/gid, namespaces, cgroup);
//! - [`api`]: the API socket's request and response lines, bounded on both sides;
//! - [`probe`]: what kind of KVM this host offers, the one probe every crate uses;
//! - [`restore`]: a snapshot directory's files, the per-run settings of a restore and how they
//!   replace the snapshot's;
//! - [`ifname`]: the one rule for interface (tap) names, which the shim and the VMM check too;
//! - [`bounded`]: the one bounded read of a document from a file;
//! - [`memory`]: guest memory sizes in MiB, one type from the shim's pod shape to the config;
//! - [`command_line`]: the VMM's command line, written by the shim and read by the VMM and the
//!   QEMU stand-in.
//!
//! Boundaries: plain data, parsing and validation only, and no unsafe code. Building and running a
//! VM is `bulkhead-vmm`'s.
#![forbid(unsafe_code)]

pub mod api;
pub mod bounded;
pub mod command_line;
pub mod config;
pub mod ifname;
pub mod jail;
pub mod memory;
pub mod probe;
pub mod restore;
