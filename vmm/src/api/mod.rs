//! The API socket: JSON lines over a Unix socket, on a thread of its own with the smallest
//! seccomp filter, since it parses input from outside the VM. The messages are
//! `bulkhead_vmm_api::api`'s; every request gets one line back. Two servers answer there, one
//! per file:
//! - [`server`]: a running VM's. The API thread only talks: a `snapshot` pauses the vCPUs (as
//!   `pause` does) and hands the rest to the event loop (`snapshotter::SnapshotRequests`),
//!   which owns the devices and may write files;
//! - [`prepared`]: a `--prepare`d VMM's, before its VM exists, on a thread with the same
//!   filter; it hands a `restore` request to the main thread, which builds the VM.
//!
//! This file holds what both share: binding the socket, cutting request lines, and the answer
//! to a malformed one.

pub mod prepared;
pub mod server;

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bulkhead_vmm_api::api::{MessageError, Response, MAX_REQUEST_LINE};

pub use prepared::{
    prepared_info, prepared_request, spawn_prepared, Handover, PreparedApi, PreparedEvent, PreparedRequest,
};
pub use server::{spawn, ApiEndpoint, VmController};

/// How long one client read or write may take, on either server.
const IO_TIMEOUT: Duration = Duration::from_secs(1);

/// A client's bytes cut into request lines. Bounded: once more than [`MAX_REQUEST_LINE`] bytes
/// wait without a newline, the client is dropped.
#[derive(Debug, Default)]
pub struct RequestLines {
    buf: Vec<u8>,
}

impl RequestLines {
    /// Adds bytes the client sent.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete line, without its newline.
    pub fn next_line(&mut self) -> Option<Vec<u8>> {
        let pos = self.buf.iter().position(|&b| b == b'\n')?;
        let mut line: Vec<u8> = self.buf.drain(..=pos).collect();
        line.pop();
        Some(line)
    }

    /// Bytes already received after the last complete line.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The client sent an overlong line: drop it.
    pub fn overlong(&self) -> bool {
        self.buf.len() > MAX_REQUEST_LINE
    }
}

/// Binds `path` as an API socket, replacing a stale one; mode 0600 (the VMM's umask already
/// keeps it from others, `main`). The socket is bound and listening under a sibling name first
/// and renamed into place, so a client that waits for `path` to appear and then connects never
/// meets a socket that is bound but not yet listening (ECONNREFUSED).
pub fn bind_api_socket(path: &Path) -> std::io::Result<UnixListener> {
    let mut binding = path.as_os_str().to_owned();
    binding.push("~");
    let binding = PathBuf::from(binding);
    // A stale socket from a previous run would make bind fail.
    for stale in [path, binding.as_path()] {
        if stale.exists() {
            std::fs::remove_file(stale)?;
        }
    }
    let listener = UnixListener::bind(&binding)?;
    let placed = std::fs::set_permissions(&binding, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .and_then(|()| std::fs::rename(&binding, path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&binding);
        return Err(e);
    }
    Ok(listener)
}

/// The answer to a line that is not a request. The parser's message may quote the line (an
/// unknown command, say), and JSON escaping can make that up to six times longer: bounded, so
/// the answer always fits a client's response limit.
pub(super) fn malformed(e: &MessageError) -> Response {
    const MAX_ERROR_TEXT: usize = 512;
    let mut text = e.to_string();
    if text.len() > MAX_ERROR_TEXT {
        let mut end = MAX_ERROR_TEXT;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str("...");
    }
    Response::error(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn request_lines_are_cut_bounded_and_every_line_gets_an_answer() {
        let mut lines = RequestLines::default();
        lines.push(b"{\"cmd\":\"info\"}\n\xff\n{\"cmd\":");
        let c = VmController::idle(0);
        let answers: Vec<Response> = std::iter::from_fn(|| lines.next_line())
            .map(|line| {
                let (answer, stop) = c.answer_line(&line);
                assert_eq!((answer.last(), stop), (Some(&b'\n'), None));
                bulkhead_vmm_api::api::parse_response(&answer[..answer.len() - 1]).unwrap()
            })
            .collect();
        assert_eq!(answers.iter().map(|a| a.ok).collect::<Vec<_>>(), [true, false], "info, then a malformed line");
        assert_eq!(lines.pending(), 7);
        assert!(!lines.overlong());
        lines.push(&[b' '; MAX_REQUEST_LINE]);
        assert!(lines.overlong(), "no newline within the limit");
        assert!(matches!(prepared_request(br#"{"cmd":"restore","config":{}}"#, true), PreparedRequest::Answer(_)));
        assert!(matches!(prepared_request(br#"{"cmd":"restore","config":{}}"#, false), PreparedRequest::Restore(_)));
        assert!(matches!(prepared_request(br#"{"cmd":"pause"}"#, false), PreparedRequest::Answer(r) if !r.ok));
        // An unknown command of control characters: the error quotes it, escaped six times longer.
        let mut evil = br#"{"cmd":""#.to_vec();
        evil.extend(std::iter::repeat_n(1u8, MAX_REQUEST_LINE - 20));
        evil.extend_from_slice(br#""}"#);
        let (answer, _) = c.answer_line(&evil);
        assert!(answer.len() < 1024, "{} bytes", answer.len());
    }

    #[test]
    fn the_api_socket_appears_listening_and_replaces_stale_ones() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let binding = dir.path().join("api.sock~");
        // What a killed VMM leaves: its socket, and one it had not renamed yet.
        for stale in [&path, &binding] {
            drop(UnixListener::bind(stale).unwrap());
        }
        let listener = bind_api_socket(&path).unwrap();
        assert!(!binding.exists(), "the binding name is gone");
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let _client = UnixStream::connect(&path).expect("listening as soon as it is there");
        assert!(listener.accept().is_ok());
    }
}
