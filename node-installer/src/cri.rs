//! The readiness check: ask the node's own containerd, over CRI, whether it has loaded the handler.
//!
//! CRI `Status` with `verbose = true` returns containerd's effective CRI config as JSON under `info["config"]`;
//! the handler is registered when `containerd.runtimes.<handler>` is there. This proves the drop-in was merged,
//! not just written.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::StatusRequest;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::error::{Error, Result};

/// Upper bound on the config JSON we accept (a real one is a few KiB).
const MAX_CONFIG_JSON: usize = 1 << 20;

pub async fn connect(socket: &Path) -> Result<RuntimeServiceClient<Channel>> {
    let path: PathBuf = socket.to_path_buf();
    // The URI is a placeholder: the connector below always dials the Unix socket.
    let channel = Endpoint::try_from("http://[::1]:1")
        .map_err(|e| Error::Cri(e.to_string()))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { tokio::net::UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|e| Error::Cri(format!("connect {}: {}", socket.display(), chain(&e))))?;
    Ok(RuntimeServiceClient::new(channel))
}

/// An error with its sources, on one line (tonic's top-level message alone is just "transport error").
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// One check: Ok(true) when containerd reports the handler.
pub async fn handler_registered(socket: &Path, handler: &str) -> Result<bool> {
    let mut client = connect(socket).await?;
    let resp = client
        .status(StatusRequest { verbose: true })
        .await
        .map_err(|e| Error::Cri(format!("Status: {}", chain(&e))))?
        .into_inner();
    let config = resp.info.get("config").ok_or_else(|| Error::Cri("Status has no verbose config".into()))?;
    runtimes_contain(config, handler)
}

/// Parse containerd's config JSON and look for the handler.
pub fn runtimes_contain(config_json: &str, handler: &str) -> Result<bool> {
    if config_json.len() > MAX_CONFIG_JSON {
        return Err(Error::Cri(format!("config JSON is {} bytes, over {MAX_CONFIG_JSON}", config_json.len())));
    }
    let v: serde_json::Value =
        serde_json::from_str(config_json).map_err(|e| Error::Cri(format!("config JSON: {e}")))?;
    Ok(v.get("containerd").and_then(|c| c.get("runtimes")).and_then(|r| r.get(handler)).is_some())
}

/// Poll until the handler is registered or `timeout` passes (containerd may still be starting after a restart).
pub async fn wait_for_handler(socket: &Path, handler: &str, timeout: Duration) -> Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let last = match handler_registered(socket, handler).await {
            Ok(true) => {
                tracing::info!(socket = %socket.display(), handler, "CRI reports handler registered");
                return Ok(());
            }
            Ok(false) => format!("containerd's CRI config has no runtime {handler:?}"),
            Err(e) => e.to_string(),
        };
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::Cri(format!("after {timeout:?}: {last}")));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_handler_in_config_json() {
        let j = r#"{"containerd":{"runtimes":{"runc":{"runtimeType":"io.containerd.runc.v2"},"bulkhead":{}}}}"#;
        assert!(runtimes_contain(j, "bulkhead").unwrap());
        assert!(!runtimes_contain(j, "kata").unwrap());
    }

    #[test]
    fn malformed_or_huge_config_is_an_error() {
        assert!(runtimes_contain("{not json", "bulkhead").is_err());
        assert!(!runtimes_contain("[]", "bulkhead").unwrap());
        let huge = format!("\"{}\"", "a".repeat(MAX_CONFIG_JSON + 1));
        assert!(runtimes_contain(&huge, "bulkhead").is_err());
    }
}
