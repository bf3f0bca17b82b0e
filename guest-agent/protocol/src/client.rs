//! Host-side convenience: dial the agent's ttrpc service through a hybrid-vsock Unix socket
//! and check the protocol version, so every caller gets the same connect sequence.

use std::{path::Path, time::Duration};

use crate::{
    agent::VersionRequest, agent_ttrpc::AgentClient, frame_guard::FrameGuard, handshake, ports, PROTOCOL_VERSION,
};

/// A reply frame from the guest that stalls this long mid-way fails the connection. Generous,
/// because an emulated guest can be slow; idle time between frames is not limited.
pub const HOST_FRAME_STALL: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("agent connect: {0}")]
    Handshake(#[from] handshake::HandshakeError),
    #[error("agent Version rpc: {0}")]
    Rpc(#[from] ttrpc::Error),
    #[error("agent speaks protocol {agent}, this side speaks {ours}")]
    VersionMismatch { agent: u32, ours: u32 },
}

/// Dials `path` (hybrid-vsock Unix socket), performs `CONNECT 1024`, wraps the stream in a
/// ttrpc client and runs the `Version` handshake. Bounded by `timeout` per step.
pub async fn connect_agent(
    path: impl AsRef<Path>,
    client_name: &str,
    timeout: Duration,
) -> Result<AgentClient, ConnectError> {
    let stream = handshake::dial_unix(path, ports::AGENT_TTRPC, timeout).await?;
    // The guest's replies are bounded like the shim's requests are in the agent.
    let stream = FrameGuard::new(stream, HOST_FRAME_STALL);
    let client = AgentClient::new(ttrpc::r#async::Client::new(ttrpc::r#async::transport::Socket::new(stream)));
    let req =
        VersionRequest { protocol_version: PROTOCOL_VERSION, client: client_name.to_owned(), ..Default::default() };
    let resp =
        client.version(ttrpc::context::with_timeout(timeout.as_nanos().min(i64::MAX as u128) as i64), &req).await?;
    if resp.protocol_version != PROTOCOL_VERSION {
        return Err(ConnectError::VersionMismatch { agent: resp.protocol_version, ours: PROTOCOL_VERSION });
    }
    Ok(client)
}
