//! The generated service and client talk over a Unix socket after the CONNECT preamble,
//! exactly as shim and agent do (a toy agent that only answers Version).

use std::{sync::Arc, time::Duration};

use bulkhead_protocol::{
    agent::{VersionRequest, VersionResponse},
    agent_ttrpc::{create_agent, Agent},
    client::{connect_agent, ConnectError},
    handshake, ports, PROTOCOL_VERSION,
};
use ttrpc::r#async::{transport::Listener, Server, TtrpcContext};

struct Toy(u32);

#[async_trait::async_trait]
impl Agent for Toy {
    async fn version(&self, _ctx: &TtrpcContext, _req: VersionRequest) -> ttrpc::Result<VersionResponse> {
        Ok(VersionResponse { protocol_version: self.0, agent_version: "toy".into(), ..Default::default() })
    }
}

async fn serve(version: u32) -> (tempfile::TempDir, Server) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.sock");
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            if handshake::accept(&mut s, &[ports::AGENT_TTRPC], handshake::DEFAULT_TIMEOUT).await.is_ok()
                && tx.send(Ok::<_, std::io::Error>(s)).await.is_err()
            {
                break;
            }
        }
    });
    let stream = futures_stream(rx);
    let mut server =
        Server::new().add_listener(Listener::new(stream)).register_service(create_agent(Arc::new(Toy(version))));
    server.start().await.unwrap();
    (dir, server)
}

fn futures_stream(
    rx: tokio::sync::mpsc::Receiver<std::io::Result<tokio::net::UnixStream>>,
) -> impl futures::Stream<Item = std::io::Result<tokio::net::UnixStream>> + Send + 'static {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|s| (s, rx)) })
}

#[tokio::test]
async fn version_handshake_over_hybrid_vsock_preamble() {
    let (dir, _server) = serve(PROTOCOL_VERSION).await;
    let path = dir.path().join("agent.sock");
    connect_agent(&path, "test", Duration::from_secs(5)).await.unwrap();
}

#[tokio::test]
async fn version_mismatch_is_refused() {
    let (dir, _server) = serve(PROTOCOL_VERSION + 1).await;
    let path = dir.path().join("agent.sock");
    let err = connect_agent(&path, "test", Duration::from_secs(5)).await.err().unwrap();
    assert!(matches!(err, ConnectError::VersionMismatch { .. }), "{err}");
}
