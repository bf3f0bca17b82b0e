//! A read-side guard in front of ttrpc, for both ends: the agent wraps what the shim sends,
//! and [`crate::client::connect_agent`] wraps what the (hostile) guest sends back. ttrpc
//! itself answers a frame over 4 MiB with a precise INVALID_ARGUMENT, but only after reading
//! (discarding) the whole declared body, and it waits forever for a truncated frame. The
//! guard fails the read (ttrpc then drops the connection) instead when
//! - a frame header declares more than [`HARD_MAX_FRAME`] bytes (e.g. a 64 MiB prefix or
//!   garbage read as a length), or
//! - a frame that has started makes no progress for the stall timeout.
//!
//! Idle time between frames is not limited: the shim keeps its connection open.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// ttrpc's own limit (`MESSAGE_LENGTH_MAX`); frames up to [`HARD_MAX_FRAME`] still reach
/// ttrpc so the client gets its precise "message too large" status.
pub const TTRPC_MAX_FRAME: usize = 4 << 20;
/// Above this the connection is closed without reading the body.
pub const HARD_MAX_FRAME: usize = 2 * TTRPC_MAX_FRAME;
const HEADER_LEN: usize = 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FrameState {
    /// Between frames; `n` header bytes seen so far (0 = idle).
    Header { n: usize, len_bytes: [u8; 4] },
    /// Inside a body with `remaining` bytes to go.
    Body { remaining: usize },
}

pub struct FrameGuard<S> {
    inner: S,
    state: FrameState,
    stall: Duration,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S> FrameGuard<S> {
    pub fn new(inner: S, stall: Duration) -> Self {
        Self { inner, state: FrameState::Header { n: 0, len_bytes: [0; 4] }, stall, deadline: None }
    }

    fn in_frame(&self) -> bool {
        !matches!(self.state, FrameState::Header { n: 0, .. })
    }

    /// Advances the frame parser over `bytes`; errors if a header declares too much.
    fn scan(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            match &mut self.state {
                FrameState::Header { n, len_bytes } => {
                    if *n < 4 {
                        len_bytes[*n] = bytes[0];
                    }
                    *n += 1;
                    bytes = &bytes[1..];
                    if *n == HEADER_LEN {
                        let len = u32::from_be_bytes(*len_bytes) as usize;
                        if len > HARD_MAX_FRAME {
                            tracing::warn!(
                                declared = len,
                                limit = HARD_MAX_FRAME,
                                "ttrpc frame too large; closing the connection"
                            );
                            return Err(io::Error::new(
                                io::ErrorKind::InvalidData,
                                format!("frame of {len} bytes exceeds {HARD_MAX_FRAME}"),
                            ));
                        }
                        self.state = if len == 0 {
                            FrameState::Header { n: 0, len_bytes: [0; 4] }
                        } else {
                            FrameState::Body { remaining: len }
                        };
                    }
                }
                FrameState::Body { remaining } => {
                    let take = (*remaining).min(bytes.len());
                    *remaining -= take;
                    bytes = &bytes[take..];
                    if *remaining == 0 {
                        self.state = FrameState::Header { n: 0, len_bytes: [0; 4] };
                    }
                }
            }
        }
        Ok(())
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for FrameGuard<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let got = buf.filled()[before..].to_vec();
                if got.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                if let Err(e) = this.scan(&got) {
                    buf.set_filled(before);
                    return Poll::Ready(Err(e));
                }
                // Progress: restart (or clear) the stall clock.
                this.deadline = this.in_frame().then(|| Box::pin(tokio::time::sleep(this.stall)));
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                if let Some(d) = this.deadline.as_mut() {
                    if d.as_mut().poll(cx).is_ready() {
                        // ttrpc drops the connection on this error without a word: say why here.
                        tracing::warn!(stall = ?this.stall, frame = ?this.state, "ttrpc frame stalled mid-way; closing the connection");
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "ttrpc frame stalled mid-way",
                        )));
                    }
                }
                Poll::Pending
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FrameGuard<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

use std::future::Future as _;

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn header(len: u32) -> Vec<u8> {
        let mut h = len.to_be_bytes().to_vec();
        h.extend_from_slice(&[0, 0, 0, 1, 1, 0]);
        h
    }

    #[tokio::test]
    async fn passes_well_formed_frames_in_any_chunking() {
        let (mut a, b) = tokio::io::duplex(1 << 16);
        let mut g = FrameGuard::new(b, Duration::from_secs(5));
        let mut stream = header(3);
        stream.extend_from_slice(b"abc");
        stream.extend_from_slice(&header(0));
        for chunk in stream.chunks(2) {
            a.write_all(chunk).await.unwrap();
        }
        let mut out = vec![0u8; stream.len()];
        g.read_exact(&mut out).await.unwrap();
        assert_eq!(out, stream);
        assert!(!g.in_frame());
    }

    #[tokio::test]
    async fn closes_on_huge_length_prefix() {
        let (mut a, b) = tokio::io::duplex(1 << 16);
        let mut g = FrameGuard::new(b, Duration::from_secs(5));
        a.write_all(&header(64 << 20)).await.unwrap();
        let mut out = [0u8; 64];
        let err = g.read(&mut out).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    #[tokio::test(start_paused = true)]
    async fn closes_a_stalled_frame_but_not_an_idle_connection() {
        let (mut a, b) = tokio::io::duplex(1 << 16);
        let mut g = FrameGuard::new(b, Duration::from_millis(500));
        // Idle: nothing in flight, so no deadline.
        let mut out = [0u8; 64];
        assert!(tokio::time::timeout(Duration::from_secs(60), g.read(&mut out)).await.is_err());
        a.write_all(&header(100)[..7]).await.unwrap();
        assert_eq!(g.read(&mut out).await.unwrap(), 7);
        let err = g.read(&mut out).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }
}
