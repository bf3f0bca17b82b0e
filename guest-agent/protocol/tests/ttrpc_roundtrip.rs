//! The generated service and client talk over a Unix socket after the CONNECT preamble,
//! exactly as shim and agent do (a toy agent that only answers Version).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

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

/// A hostile "agent" answers the preamble, then replies with `reply` to the Version call.
async fn hostile_agent(reply: Vec<u8>) -> tempfile::TempDir {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let listener = tokio::net::UnixListener::bind(dir.path().join("agent.sock")).unwrap();
    tokio::spawn(async move {
        if let Ok((mut s, _)) = listener.accept().await {
            let _ = handshake::accept(&mut s, &[ports::AGENT_TTRPC], handshake::DEFAULT_TIMEOUT).await;
            let mut buf = [0u8; 512];
            let _ = s.read(&mut buf).await;
            let _ = s.write_all(&reply).await;
            // Keep the connection open: only the guard can end the wait early.
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
    });
    dir
}

#[tokio::test]
async fn oversized_or_garbage_replies_fail_fast_on_the_host() {
    let mut huge = (64u32 << 20).to_be_bytes().to_vec();
    huge.extend_from_slice(&[0, 0, 0, 1, 2, 0]);
    for (what, reply) in [("64 MiB reply", huge), ("garbage reply", b"\xde\xad\xbe\xef garbage garbage".to_vec())] {
        let dir = hostile_agent(reply).await;
        let t0 = std::time::Instant::now();
        let r = connect_agent(dir.path().join("agent.sock"), "test", Duration::from_secs(20)).await;
        assert!(r.is_err(), "{what}: accepted");
        assert!(t0.elapsed() < Duration::from_secs(2), "{what}: took {:?}", t0.elapsed());
    }
}
