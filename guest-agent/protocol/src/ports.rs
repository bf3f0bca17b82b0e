//! Well-known vsock ports of the agent. Over the hybrid-vsock Unix socket the same numbers
//! travel in the `CONNECT <port>` preamble.

/// The ttrpc `bulkhead.agent.v1.Agent` service.
pub const AGENT_TTRPC: u32 = 1024;
/// stdio stream connections (each opened with a [`crate::stream::StreamHeader`]).
pub const AGENT_STREAMS: u32 = 1025;

/// Every port the agent answers; anything else is refused.
pub const ALL: [u32; 2] = [AGENT_TTRPC, AGENT_STREAMS];
