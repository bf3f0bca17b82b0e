//! Just enough HTTP/1.0 for Prometheus text: one GET per connection, then close. Used by the
//! shim's per-pod Unix socket, by `bulkhead-ctl metrics` (client of those sockets, and server of
//! the node's `/metrics`), and nothing else. Every read is bounded in size and time.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Longest request head a server reads.
const MAX_REQUEST_HEAD: usize = 8 * 1024;
/// How long a client may take to send its request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// The content type of the OpenMetrics text that `prometheus-client` encodes (Prometheus reads it).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("no complete request or response within {0:?}")]
    Timeout(Duration),
    #[error("larger than {0} bytes")]
    TooLarge(usize),
    #[error("malformed HTTP: {0}")]
    Malformed(String),
    #[error("HTTP status {status}: {body}")]
    Status { status: u16, body: String },
}

/// Reads a request head and returns the method and path of its request line.
pub async fn read_request<S: AsyncRead + Unpin>(stream: &mut S) -> Result<(String, String), HttpError> {
    let head = tokio::time::timeout(REQUEST_TIMEOUT, read_head(stream))
        .await
        .map_err(|_| HttpError::Timeout(REQUEST_TIMEOUT))??;
    let line = head.lines().next().unwrap_or_default();
    let mut parts = line.split(' ');
    match (parts.next(), parts.next()) {
        (Some(method), Some(path)) if !method.is_empty() => Ok((method.to_string(), path.to_string())),
        _ => Err(HttpError::Malformed(format!("request line {line:?}"))),
    }
}

async fn read_head<S: AsyncRead + Unpin>(stream: &mut S) -> Result<String, HttpError> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && !head.ends_with(b"\n\n") {
        if stream.read(&mut byte).await? == 0 {
            break;
        }
        head.push(byte[0]);
        if head.len() > MAX_REQUEST_HEAD {
            return Err(HttpError::TooLarge(MAX_REQUEST_HEAD));
        }
    }
    Ok(String::from_utf8_lossy(&head).into_owned())
}

/// Writes a whole response and closes the write side.
pub async fn respond<S: AsyncWrite + Unpin>(
    stream: &mut S,
    status: u16,
    content_type: &str,
    body: &[u8],
) -> std::io::Result<()> {
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Error",
    };
    let head = format!(
        "HTTP/1.0 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body).await?;
    stream.shutdown().await
}

/// Answers one metrics request: `GET /metrics` (or `/`) gets `body`, anything else an error.
/// The body is written from whatever holds it (a shared `Arc<str>`: no copy per request).
pub async fn serve_one<S, F, B>(stream: &mut S, body: F) -> Result<(), HttpError>
where
    S: AsyncRead + AsyncWrite + Unpin,
    F: std::future::Future<Output = B>,
    B: AsRef<str>,
{
    let (method, path) = read_request(stream).await?;
    if method != "GET" {
        respond(stream, 405, "text/plain", b"only GET\n").await?;
    } else if path != "/metrics" && path != "/" {
        respond(stream, 404, "text/plain", b"try /metrics\n").await?;
    } else {
        respond(stream, 200, CONTENT_TYPE, body.await.as_ref().as_bytes()).await?;
    }
    Ok(())
}

/// GETs `path` over an open stream and returns the body of a 200 answer.
pub async fn get<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    path: &str,
    limit: usize,
    timeout: Duration,
) -> Result<String, HttpError> {
    let exchange = async {
        stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: bulkhead\r\n\r\n").as_bytes()).await?;
        let mut raw = Vec::new();
        stream.take(limit as u64 + 1).read_to_end(&mut raw).await?;
        if raw.len() > limit {
            return Err(HttpError::TooLarge(limit));
        }
        parse_response(&raw)
    };
    tokio::time::timeout(timeout, exchange).await.map_err(|_| HttpError::Timeout(timeout))?
}

fn parse_response(raw: &[u8]) -> Result<String, HttpError> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) =
        text.split_once("\r\n\r\n").ok_or_else(|| HttpError::Malformed("response without an end of headers".into()))?;
    let status = head
        .lines()
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| HttpError::Malformed(format!("status line {:?}", head.lines().next())))?;
    if status != 200 {
        return Err(HttpError::Status { status, body: body.trim().chars().take(200).collect() });
    }
    Ok(body.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn exchange(request: &[u8]) -> String {
        let (mut client, mut server) = tokio::io::duplex(64 * 1024);
        client.write_all(request).await.unwrap();
        let served = tokio::spawn(async move {
            let _ = serve_one(&mut server, async { "m 1\n# EOF\n".to_string() }).await;
        });
        let mut out = String::new();
        client.read_to_string(&mut out).await.unwrap();
        served.await.unwrap();
        out
    }

    #[tokio::test]
    async fn get_metrics_round_trips() {
        let (mut client, mut server) = tokio::io::duplex(64 * 1024);
        let served = tokio::spawn(async move { serve_one(&mut server, async { "m 1\n".to_string() }).await });
        let body = get(&mut client, "/metrics", 1 << 20, Duration::from_secs(5)).await.unwrap();
        assert_eq!(body, "m 1\n");
        served.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn other_paths_and_methods_are_refused() {
        assert!(exchange(b"GET /nope HTTP/1.0\r\n\r\n").await.starts_with("HTTP/1.0 404"));
        assert!(exchange(b"POST /metrics HTTP/1.0\r\n\r\n").await.starts_with("HTTP/1.0 405"));
        assert!(exchange(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await.contains("\r\n\r\nm 1\n"));
    }

    #[tokio::test]
    async fn malformed_or_oversized_requests_are_errors() {
        let (mut client, mut server) = tokio::io::duplex(64 * 1024);
        client.write_all(&vec![b'a'; MAX_REQUEST_HEAD + 10]).await.unwrap();
        assert!(matches!(read_request(&mut server).await, Err(HttpError::TooLarge(_))));
        let (mut client, mut server) = tokio::io::duplex(1024);
        client.write_all(b"\r\n\r\n").await.unwrap();
        assert!(matches!(read_request(&mut server).await, Err(HttpError::Malformed(_))));
    }

    #[tokio::test]
    async fn a_silent_client_times_out() {
        let (_client, mut server) = tokio::io::duplex(1024);
        assert!(matches!(read_request(&mut server).await, Err(HttpError::Timeout(_))));
    }

    #[test]
    fn responses_are_checked() {
        assert_eq!(parse_response(b"HTTP/1.0 200 OK\r\nA: b\r\n\r\nbody").unwrap(), "body");
        assert!(matches!(
            parse_response(b"HTTP/1.0 500 Error\r\n\r\nboom"),
            Err(HttpError::Status { status: 500, .. })
        ));
        assert!(parse_response(b"garbage").is_err());
    }
}
