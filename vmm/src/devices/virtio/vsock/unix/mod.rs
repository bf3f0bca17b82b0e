//! The host side of hybrid vsock: Unix sockets.

pub mod connect;
pub mod muxer;

pub use muxer::{FdOp, VsockMuxer};
