//! The bulkhead agent protocol, shared by the shim (host side) and `bulkhead-agent` (guest side).
//!
//! - [`agent`] / [`agent_ttrpc`]: messages and the async ttrpc client/server generated from
//!   `proto/agent.proto` (package `bulkhead.agent.v1`).
//! - [`handshake`]: the hybrid-vsock preamble (`CONNECT <port>\n` -> `OK <port>\n`).
//! - [`stream`]: the header that opens each stdio stream connection.
//! - [`ports`] and [`PROTOCOL_VERSION`]: the well-known numbers both sides agree on.
//! - [`frame_guard`]: size and stall limits on incoming ttrpc frames, used by both sides.
//! - [`guest`]: where the pod's shared directory is in a VM guest, and how the agent learns its tag.
//! - [`unix`]: dialing a socket in a directory a less privileged process can write.
//!
//! This crate does no I/O policy of its own beyond bounded, timed reads of the
//! preambles; it is the contract, not the runtime. It holds no unsafe code.
#![forbid(unsafe_code)]

#[allow(warnings, clippy::all, clippy::pedantic, clippy::restriction)]
pub mod agent {
    include!(concat!(env!("OUT_DIR"), "/agent.rs"));
}

#[allow(warnings, clippy::all, clippy::pedantic, clippy::restriction)]
pub mod agent_ttrpc {
    include!(concat!(env!("OUT_DIR"), "/agent_ttrpc.rs"));
}

pub mod client;
pub mod frame_guard;
pub mod guest;
pub mod handshake;
pub mod ports;
pub mod stream;
pub mod unix;

/// Version of the agent protocol. The shim sends it in `Version` and refuses an agent that
/// answers with a different number; the agent refuses a shim likewise.
/// Bump on any change an older peer would misread.
pub const PROTOCOL_VERSION: u32 = 1;

/// Re-exported so both sides name the same ttrpc/protobuf versions.
pub use protobuf;
pub use ttrpc;
