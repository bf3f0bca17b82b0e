//! The connection state machine of one vsock stream.

pub mod connection;

pub use connection::{ConnState, VsockConnection};
