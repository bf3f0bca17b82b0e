//! The hybrid-vsock preamble, as Firecracker defines it for host-initiated connections:
//! the dialer writes `CONNECT <port>\n`, the acceptor answers `OK <port>\n`, and from then
//! on the connection carries the port's protocol.
//!
//! Both sides read the line byte by byte so that no byte after the newline is consumed
//! (the next bytes belong to ttrpc or to a stream header). Every read is bounded by
//! [`MAX_LINE`] and by a caller-supplied timeout. The port number in the `OK` line is the
//! acceptor's choice (Firecracker answers with a host-side port), so the dialer accepts any.

use std::{io, path::Path, time::Duration};

use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::UnixStream,
};

/// Longest preamble line accepted, newline included (`CONNECT 4294967295\n` is 19 bytes).
pub const MAX_LINE: usize = 32;

/// A sensible default for both sides; a healthy peer answers in microseconds.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("handshake i/o: {0}")]
    Io(#[from] io::Error),
    #[error("handshake timed out after {0:?}")]
    Timeout(Duration),
    #[error("handshake line longer than {MAX_LINE} bytes")]
    TooLong,
    #[error("peer closed the connection during the handshake")]
    Closed,
    #[error("malformed handshake line {line:?}: expected {expected}")]
    Malformed { line: String, expected: &'static str },
    #[error("port {0} is not served here")]
    UnknownPort(u32),
}

/// `CONNECT <port>\n`
pub fn encode_connect(port: u32) -> String {
    format!("CONNECT {port}\n")
}

/// `OK <port>\n`
pub fn encode_ok(port: u32) -> String {
    format!("OK {port}\n")
}

/// Parses a full `CONNECT <port>\n` line (newline included).
pub fn parse_connect(line: &[u8]) -> Result<u32, HandshakeError> {
    parse_line(line, "CONNECT ", "CONNECT <port>\\n")
}

/// Parses a full `OK <port>\n` line (newline included).
pub fn parse_ok(line: &[u8]) -> Result<u32, HandshakeError> {
    parse_line(line, "OK ", "OK <port>\\n")
}

fn parse_line(line: &[u8], prefix: &str, expected: &'static str) -> Result<u32, HandshakeError> {
    let malformed = || HandshakeError::Malformed { line: String::from_utf8_lossy(line).into_owned(), expected };
    let text = std::str::from_utf8(line).map_err(|_| malformed())?;
    let digits = text.strip_prefix(prefix).and_then(|rest| rest.strip_suffix('\n')).ok_or_else(malformed)?;
    // Strict decimal: u32::from_str would also take a leading '+'.
    if digits.is_empty() || digits.len() > 10 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(malformed());
    }
    digits.parse::<u32>().map_err(|_| malformed())
}

/// Reads one `\n`-terminated line of at most `max` bytes without reading past it.
pub async fn read_line<R: AsyncRead + Unpin>(reader: &mut R, max: usize) -> Result<Vec<u8>, HandshakeError> {
    let mut line = Vec::with_capacity(max.min(MAX_LINE));
    loop {
        if line.len() >= max {
            return Err(HandshakeError::TooLong);
        }
        let mut byte = [0u8; 1];
        match reader.read(&mut byte).await? {
            0 => return Err(HandshakeError::Closed),
            _ => {
                line.push(byte[0]);
                if byte[0] == b'\n' {
                    return Ok(line);
                }
            }
        }
    }
}

/// Dialer side on an already connected stream: sends `CONNECT <port>\n`, waits for
/// `OK <n>\n` and returns `n`.
pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    port: u32,
    timeout: Duration,
) -> Result<u32, HandshakeError> {
    let fut = async {
        stream.write_all(encode_connect(port).as_bytes()).await?;
        stream.flush().await?;
        let line = read_line(stream, MAX_LINE).await?;
        parse_ok(&line)
    };
    tokio::time::timeout(timeout, fut).await.map_err(|_| HandshakeError::Timeout(timeout))?
}

/// Connects to a hybrid-vsock Unix socket (the VMM's, or the agent's own in namespace
/// mode), never through a symlink ([`crate::unix`]), and performs the preamble for `port`. The
/// whole dial is bounded by `timeout`.
pub async fn dial_unix(path: impl AsRef<Path>, port: u32, timeout: Duration) -> Result<UnixStream, HandshakeError> {
    let mut stream = tokio::time::timeout(timeout, crate::unix::connect_no_follow(path.as_ref()))
        .await
        .map_err(|_| HandshakeError::Timeout(timeout))??;
    connect(&mut stream, port, timeout).await?;
    Ok(stream)
}

/// Acceptor side: reads `CONNECT <port>\n`; if `port` is in `served`, answers `OK <port>\n`
/// and returns it. An unknown port gets no answer (the caller closes the connection),
/// which is what a vsock peer sees for a port nobody listens on.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    served: &[u32],
    timeout: Duration,
) -> Result<u32, HandshakeError> {
    let fut = async {
        let line = read_line(stream, MAX_LINE).await?;
        let port = parse_connect(&line)?;
        if !served.contains(&port) {
            return Err(HandshakeError::UnknownPort(port));
        }
        stream.write_all(encode_ok(port).as_bytes()).await?;
        stream.flush().await?;
        Ok(port)
    };
    tokio::time::timeout(timeout, fut).await.map_err(|_| HandshakeError::Timeout(timeout))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_well_formed_lines() {
        assert_eq!(parse_connect(b"CONNECT 1024\n").unwrap(), 1024);
        assert_eq!(parse_ok(b"OK 0\n").unwrap(), 0);
        assert_eq!(parse_ok(b"OK 4294967295\n").unwrap(), u32::MAX);
        assert_eq!(encode_connect(7), "CONNECT 7\n");
        assert_eq!(encode_ok(7), "OK 7\n");
    }

    #[test]
    fn rejects_malformed_lines() {
        for bad in [
            &b"CONNECT\n"[..],
            b"CONNECT \n",
            b"CONNECT +5\n",
            b"CONNECT -5\n",
            b"CONNECT 4294967296\n",
            b"CONNECT 12345678901\n",
            b"CONNECT 1024",
            b"CONNECT 1024 \n",
            b"connect 1024\n",
            b"OK 1024\n",
            b"\xff\xfe\n",
            b"",
        ] {
            assert!(matches!(parse_connect(bad), Err(HandshakeError::Malformed { .. })), "accepted {bad:?}");
        }
        assert!(parse_ok(b"CONNECT 5\n").is_err());
        assert!(parse_ok(b"OK x\n").is_err());
    }

    #[tokio::test]
    async fn dialer_and_acceptor_agree_and_do_not_overread() {
        let (mut a, mut b) = tokio::io::duplex(64);
        let server = tokio::spawn(async move {
            let port = accept(&mut b, &[1024, 1025], DEFAULT_TIMEOUT).await.unwrap();
            let mut rest = [0u8; 5];
            b.read_exact(&mut rest).await.unwrap();
            (port, rest)
        });
        assert_eq!(connect(&mut a, 1025, DEFAULT_TIMEOUT).await.unwrap(), 1025);
        a.write_all(b"hello").await.unwrap();
        let (port, rest) = server.await.unwrap();
        assert_eq!(port, 1025);
        assert_eq!(&rest, b"hello");
    }

    #[tokio::test]
    async fn acceptor_refuses_unknown_port_and_long_lines() {
        let (mut a, mut b) = tokio::io::duplex(256);
        a.write_all(b"CONNECT 9\n").await.unwrap();
        assert!(matches!(accept(&mut b, &[1024], DEFAULT_TIMEOUT).await, Err(HandshakeError::UnknownPort(9))));

        let (mut a, mut b) = tokio::io::duplex(256);
        a.write_all(&[b'A'; 100]).await.unwrap();
        assert!(matches!(accept(&mut b, &[1024], DEFAULT_TIMEOUT).await, Err(HandshakeError::TooLong)));
    }

    #[tokio::test(start_paused = true)]
    async fn silent_or_closing_peer_is_bounded() {
        let (mut a, _b_kept_open) = tokio::io::duplex(64);
        assert!(matches!(connect(&mut a, 1024, Duration::from_millis(100)).await, Err(HandshakeError::Timeout(_))));

        let (mut a, b) = tokio::io::duplex(64);
        drop(b);
        assert!(connect(&mut a, 1024, DEFAULT_TIMEOUT).await.is_err());

        let (a, mut b) = tokio::io::duplex(64);
        drop(a);
        assert!(matches!(accept(&mut b, &[1024], DEFAULT_TIMEOUT).await, Err(HandshakeError::Closed)));
    }
}
