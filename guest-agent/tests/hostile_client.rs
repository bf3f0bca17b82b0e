//! Hostile clients on the agent's Unix socket: each must be cut off (error or closed
//! connection) within a second, and the agent must still answer a well-formed request.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod common;

use std::time::{Duration, Instant};

use bulkhead_protocol::{client::connect_agent, handshake::dial_unix, ports};
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const LIMIT: Duration = Duration::from_secs(1);

/// Sends `bytes` on a fresh ttrpc connection and measures how long until the agent answers
/// with an error frame or closes.
async fn probe(agent: &Agent, what: &str, bytes: &[u8]) -> Duration {
    let mut s = dial_unix(&agent.sock, ports::AGENT_TTRPC, Duration::from_secs(5)).await.unwrap();
    let t0 = Instant::now();
    // The agent may close before everything is written; that is fine.
    let _ = s.write_all(bytes).await;
    let mut buf = vec![0u8; 4096];
    let r = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await;
    let took = t0.elapsed();
    match r {
        Err(_) => panic!("{what}: connection neither answered nor closed within 5 s"),
        Ok(Ok(0)) | Ok(Err(_)) => println!("{what}: closed after {took:?}"),
        Ok(Ok(n)) => println!("{what}: {n}-byte error frame after {took:?}"),
    }
    assert!(took < LIMIT, "{what}: took {took:?}");
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_truncated_and_oversized_frames_are_cut_off() {
    if !can_run("garbage_truncated_and_oversized_frames_are_cut_off") {
        return;
    }
    // A stall bound below LIMIT (the default is the shim's RPC deadline, 10 s).
    let agent = Agent::start_with_flags("hostile", &["--frame-stall-ms", "300"]).await;

    probe(&agent, "garbage", b"GET / HTTP/1.1\r\nHost: agent\r\n\r\n\x00\xff\xfe garbage").await;

    // Header promises 100 bytes, 20 arrive, then silence.
    let mut truncated = 100u32.to_be_bytes().to_vec();
    truncated.extend_from_slice(&[0, 0, 0, 1, 1, 0]);
    truncated.extend_from_slice(&[0u8; 20]);
    probe(&agent, "truncated frame", &truncated).await;

    let mut huge = (64u32 << 20).to_be_bytes().to_vec();
    huge.extend_from_slice(&[0, 0, 0, 1, 1, 0]);
    probe(&agent, "64 MiB length prefix", &huge).await;

    // Garbage instead of the CONNECT preamble.
    let mut raw = tokio::net::UnixStream::connect(&agent.sock).await.unwrap();
    let t0 = Instant::now();
    let _ = raw.write_all(&[0xAAu8; 64]).await;
    let mut buf = [0u8; 16];
    let r = tokio::time::timeout(Duration::from_secs(5), raw.read(&mut buf)).await;
    assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "preamble garbage: {r:?}");
    assert!(t0.elapsed() < LIMIT, "preamble garbage took {:?}", t0.elapsed());

    // Garbage stream header: rejected, closed.
    let mut s = dial_unix(&agent.sock, ports::AGENT_STREAMS, Duration::from_secs(5)).await.unwrap();
    let t0 = Instant::now();
    s.write_all(b"not a stream header").await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out))
        .await
        .expect("stream connection not closed")
        .ok();
    assert_eq!(out.first(), Some(&1u8), "expected a rejection ack, got {out:?}");
    assert!(t0.elapsed() < LIMIT);

    // And the agent still serves a well-formed client.
    connect_agent(&agent.sock, "after-hostile", Duration::from_secs(5))
        .await
        .unwrap_or_else(|e| panic!("agent stopped serving: {e}\n{}", agent.log()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vsock_listener_serves_without_preamble() {
    if !can_run("vsock_listener_serves_without_preamble") {
        return;
    }
    if !vsock_loopback_works().await {
        bulkhead_integration::skip::host_cannot(
            "vsock_listener_serves_without_preamble",
            "no vsock loopback transport (this kernel has no vsock_loopback module)",
        );
        return;
    }
    let agent = Agent::start_vsock("vsock").await;
    let r = agent
        .client
        .version(
            ctx(),
            &bulkhead_protocol::agent::VersionRequest {
                protocol_version: bulkhead_protocol::PROTOCOL_VERSION,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(r.mode, "namespace");
}
