//! The pod's metrics socket: `GET /metrics` over HTTP/1.0 on a Unix socket that only root and
//! the metrics group may open ([`super::dir`]). Requests are served one at a time, each
//! bounded by [`http::REQUEST_TIMEOUT`] and [`RESPONSE_TIMEOUT`], so a stuck client delays the
//! next scrape by seconds at most and can never wedge the shim.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::task::JoinHandle;

use super::dir::PodEndpoint;
use super::{http, PodMetrics};

/// Upper bound for answering one request (the agent ping is 1 s of it).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// A running metrics socket; dropping it stops serving and removes the pod's entries.
pub struct MetricsServer {
    task: JoinHandle<()>,
    endpoint: PodEndpoint,
}

impl MetricsServer {
    /// Serves at `endpoint`, whose labels are already published ([`PodEndpoint::publish`]).
    pub fn start(metrics: Arc<PodMetrics>, endpoint: PodEndpoint) -> std::io::Result<Self> {
        let path = &endpoint.socket;
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let listener = std::os::unix::net::UnixListener::bind(path)?;
        endpoint.open_socket()?;
        listener.set_nonblocking(true)?;
        let listener = UnixListener::from_std(listener)?;
        let task = tokio::spawn(serve(listener, metrics));
        tracing::debug!(socket = %path.display(), "serving metrics");
        Ok(Self { task, endpoint })
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.task.abort();
        self.endpoint.remove();
    }
}

async fn serve(listener: UnixListener, metrics: Arc<PodMetrics>) {
    loop {
        let mut stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!("metrics socket accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let answer = http::serve_one(&mut stream, metrics.scrape());
        match tokio::time::timeout(RESPONSE_TIMEOUT, answer).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!("metrics request: {e}"),
            Err(_) => tracing::debug!("metrics request: no answer within {RESPONSE_TIMEOUT:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[tokio::test]
    async fn serves_the_registry_until_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let paths = crate::sandbox::paths::PodPaths::new(dir.path(), "pod").unwrap();
        let endpoint = PodEndpoint::of(&paths, nix::unistd::getegid().as_raw()).unwrap();
        endpoint.publish(&Default::default()).unwrap();
        let path = endpoint.socket.clone();
        let metrics = Arc::new(PodMetrics::new());
        metrics.observe_rpc("start", true, Duration::from_millis(1));
        let server = MetricsServer::start(metrics, endpoint.clone()).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o660);
        let mut stream = tokio::net::UnixStream::connect(&path).await.unwrap();
        let body = http::get(&mut stream, "/metrics", 1 << 20, Duration::from_secs(5)).await.unwrap();
        assert!(body.contains("rpc=\"start\""), "{body}");
        assert!(body.contains("bulkhead_agent_up 0"), "{body}");
        drop(server);
        assert!(!path.exists() && !endpoint.labels.exists(), "the pod's entries go with it");
    }
}
