//! The node exporter under slow clients (issue 32): requests that never read their answer cost
//! the exporter their sockets' buffers, not a copy of the body each. A copy each put 64 slow
//! readers × the merged body of every pod over the exporter container's 64 Mi limit. Alone in
//! its binary, so the process's RSS is this test's.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use bulkhead_shim::ctl::metrics::{serve_on, ScrapeCache, MAX_CONNECTIONS};

/// The process's resident memory, in MiB.
fn rss_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() / 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_metrics_clients_share_one_body() {
    const BODY_MIB: usize = 8;
    let body: Arc<str> = Arc::from("bulkhead_test_sample 1\n".repeat((BODY_MIB << 20) / 23));
    let gather_body = body.clone();
    let cache = Arc::new(ScrapeCache::new(move || {
        let body = gather_body.clone();
        async move { body.to_string() }
    }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve_on(listener, cache));

    // One whole answer first: the body is gathered and cached.
    let first = tokio::task::spawn_blocking(move || {
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut answer = Vec::new();
        std::io::Read::read_to_end(&mut c, &mut answer).unwrap();
        answer.len()
    })
    .await
    .unwrap();
    assert!(first > BODY_MIB << 20, "the whole body was served: {first} bytes");
    let before = rss_mib();

    // As many slow readers as the exporter serves at once: each asks and never reads.
    let mut slow = Vec::new();
    for _ in 0..MAX_CONNECTIONS {
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        slow.push(c);
    }
    // Every request is being answered (its writer blocked on a full socket) well within this.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = rss_mib();
    drop(slow);
    // A copy per request would be MAX_CONNECTIONS × BODY_MIB = 512 MiB.
    assert!(
        during < before + 64,
        "{} slow clients grew the exporter from {before} MiB to {during} MiB",
        MAX_CONNECTIONS
    );
    assert_eq!(body.len(), (BODY_MIB << 20) / 23 * 23);
}
