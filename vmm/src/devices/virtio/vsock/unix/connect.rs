//! Non-blocking connects to host Unix listeners, for guest-initiated vsock connections: the event
//! loop must never sleep in `connect()` because a host listener does not accept.
//!
//! An AF_UNIX stream connect never goes "in progress": it completes at once (the connection
//! waits in the listener's backlog until accepted) or, non-blocking, fails with EAGAIN when that
//! backlog is full, which is exactly where a blocking connect would sleep. So no SO_ERROR or
//! writability wait is needed: a busy listener is retried later on the same socket.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;

use nix::errno::Errno;
use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};

/// What one connect attempt did.
#[derive(Debug, PartialEq, Eq)]
pub enum Attempt {
    Connected,
    /// The listener's backlog is full: try again later.
    Busy,
}

/// A fresh non-blocking, close-on-exec Unix stream socket, not connected yet.
pub fn stream_socket() -> std::io::Result<UnixStream> {
    let fd =
        socket::socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)?;
    Ok(UnixStream::from(fd))
}

/// One connect attempt of `stream` (from [`stream_socket`]) to the listener at `path`; never
/// blocks. An error (no listener, refused, path too long) is final.
pub fn try_connect(stream: &UnixStream, path: &Path) -> std::io::Result<Attempt> {
    let addr = UnixAddr::new(path)?;
    match socket::connect(stream.as_raw_fd(), &addr) {
        // EISCONN: an earlier attempt went through after all.
        Ok(()) | Err(Errno::EISCONN) => Ok(Attempt::Connected),
        Err(Errno::EAGAIN) | Err(Errno::EINTR) => Ok(Attempt::Busy),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::time::{Duration, Instant};

    /// A listener with the smallest backlog (one waiting connection), never accepting.
    fn tiny_listener(path: &Path) -> OwnedFd {
        let fd = socket::socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).unwrap();
        socket::bind(fd.as_raw_fd(), &UnixAddr::new(path).unwrap()).unwrap();
        socket::listen(&fd, socket::Backlog::new(0).unwrap()).unwrap();
        fd
    }

    #[test]
    fn a_full_backlog_is_busy_at_once_and_a_retry_connects_once_there_is_room() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.sock");
        let listener = tiny_listener(&path);
        let started = Instant::now();
        let mut waiting = Vec::new();
        let busy = loop {
            let s = stream_socket().unwrap();
            match try_connect(&s, &path).unwrap() {
                Attempt::Connected => waiting.push(s),
                Attempt::Busy => break s,
            }
            assert!(waiting.len() < 16, "the backlog never filled");
        };
        assert!(started.elapsed() < Duration::from_secs(1), "a connect blocked");
        assert_eq!(try_connect(&busy, &path).unwrap(), Attempt::Busy, "still full");

        // Accepting one makes room; the same socket connects on the next attempt.
        // SAFETY: accept4 on our listening fd; the result is checked and owned at once.
        let accepted = unsafe { libc::accept4(listener.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut(), 0) };
        assert!(accepted >= 0);
        // SAFETY: accepted is a fresh fd nobody else owns.
        let mut peer = UnixStream::from(unsafe { OwnedFd::from_raw_fd(accepted) });
        assert_eq!(try_connect(&busy, &path).unwrap(), Attempt::Connected);
        waiting[0].write_all(b"hi").unwrap();
        let mut got = [0u8; 2];
        peer.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hi");
    }

    #[test]
    fn no_listener_is_a_final_error() {
        let dir = tempfile::tempdir().unwrap();
        let s = stream_socket().unwrap();
        assert!(try_connect(&s, &dir.path().join("none.sock")).is_err());
        let long = dir.path().join("x".repeat(200));
        assert!(try_connect(&s, &long).is_err(), "a path longer than sun_path");
    }
}
