//! A small QMP client: one connection per command, every read bounded in length and time, events
//! that arrive in between skipped; or a connection kept open to wait for one event.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Longest QMP line read; QEMU's replies to the commands used here are far shorter.
const MAX_LINE: u64 = 64 * 1024;
/// Lines read while waiting for one reply (events may come first).
const MAX_LINES: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("QMP socket {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("QMP: {0}")]
    Protocol(String),
    #[error("QMP {command}: {class}: {desc}")]
    Command { command: String, class: String, desc: String },
}

pub struct Qmp {
    path: String,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    deadline: Instant,
}

impl Qmp {
    /// Connects and negotiates capabilities; every later exchange must finish before `timeout`
    /// from now.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, QmpError> {
        let p = path.display().to_string();
        let io = |source| QmpError::Io { path: p.clone(), source };
        let stream = UnixStream::connect(path).map_err(io)?;
        let writer = stream.try_clone().map_err(io)?;
        let mut qmp =
            Self { path: p.clone(), reader: BufReader::new(stream), writer, deadline: Instant::now() + timeout };
        let greeting = qmp.read_message()?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(format!("no greeting: {greeting}")));
        }
        qmp.execute("qmp_capabilities")?;
        Ok(qmp)
    }

    /// Runs `command` without arguments and returns its `return` value.
    pub fn execute(&mut self, command: &str) -> Result<Value, QmpError> {
        self.execute_with(command, Value::Null)
    }

    /// Runs `command` with `arguments` (an object, or null for none).
    pub fn execute_with(&mut self, command: &str, arguments: Value) -> Result<Value, QmpError> {
        let mut message = json!({ "execute": command });
        if !arguments.is_null() {
            message["arguments"] = arguments;
        }
        let mut line = message.to_string();
        line.push('\n');
        self.set_timeout()?;
        let path = self.path.clone();
        self.writer.write_all(line.as_bytes()).map_err(|source| QmpError::Io { path, source })?;
        for _ in 0..MAX_LINES {
            let message = self.read_message()?;
            if let Some(ret) = message.get("return") {
                return Ok(ret.clone());
            }
            if let Some(err) = message.get("error") {
                let field = |k: &str| err.get(k).and_then(Value::as_str).unwrap_or("?").to_string();
                return Err(QmpError::Command { command: command.into(), class: field("class"), desc: field("desc") });
            }
            // An asynchronous event ({"event": ...}): not our reply.
        }
        Err(QmpError::Protocol(format!("no reply to {command} within {MAX_LINES} messages")))
    }

    /// Reads until QEMU sends event `name` and returns its `data` (null if it has none). No
    /// deadline: the event may come hours after the connection was made; every line is still
    /// bounded in length, and QEMU closing the connection ends the wait with an error.
    pub fn wait_for_event(&mut self, name: &str) -> Result<Value, QmpError> {
        let path = self.path.clone();
        self.reader.get_ref().set_read_timeout(None).map_err(|source| QmpError::Io { path, source })?;
        loop {
            let message = self.read_line()?;
            if message.get("event").and_then(Value::as_str) == Some(name) {
                return Ok(message.get("data").cloned().unwrap_or(Value::Null));
            }
        }
    }

    fn set_timeout(&self) -> Result<(), QmpError> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(QmpError::Protocol("timed out".into()));
        }
        let io = |source| QmpError::Io { path: self.path.clone(), source };
        self.writer.set_write_timeout(Some(left)).map_err(io)?;
        self.reader.get_ref().set_read_timeout(Some(left)).map_err(io)
    }

    fn read_message(&mut self) -> Result<Value, QmpError> {
        self.set_timeout()?;
        self.read_line()
    }

    /// One message, with whatever read timeout the socket has.
    fn read_line(&mut self) -> Result<Value, QmpError> {
        let mut line = Vec::new();
        let path = self.path.clone();
        (&mut self.reader)
            .take(MAX_LINE + 1)
            .read_until(b'\n', &mut line)
            .map_err(|source| QmpError::Io { path, source })?;
        if line.is_empty() {
            return Err(QmpError::Protocol("QEMU closed the connection".into()));
        }
        if line.len() as u64 > MAX_LINE {
            return Err(QmpError::Protocol(format!("a line longer than {MAX_LINE} bytes")));
        }
        serde_json::from_slice(&line).map_err(|e| QmpError::Protocol(format!("bad message: {e}")))
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A QMP peer that sends `script` lines after each line it reads.
    pub(in super::super) fn peer(dir: &Path, greeting: &'static str, replies: Vec<&'static str>) -> std::path::PathBuf {
        let path = dir.join("q.sock");
        let listener = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.write_all(greeting.as_bytes()).unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            for reply in replies {
                let mut l = String::new();
                if r.read_line(&mut l).unwrap_or(0) == 0 {
                    return;
                }
                s.write_all(reply.as_bytes()).unwrap();
            }
            std::thread::sleep(Duration::from_secs(5));
        });
        path
    }

    pub(in super::super) const GREETING: &str = "{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n";

    #[test]
    fn replies_are_found_behind_events() {
        let dir = tempfile::tempdir().unwrap();
        let path = peer(
            dir.path(),
            GREETING,
            vec![
                "{\"return\": {}}\n",
                "{\"event\": \"STOP\"}\n{\"return\": {\"status\": \"paused\"}}\n",
                "{\"error\": {\"class\": \"GenericError\", \"desc\": \"nope\"}}\n",
            ],
        );
        let mut q = Qmp::connect(&path, Duration::from_secs(5)).unwrap();
        assert_eq!(q.execute("query-status").unwrap()["status"], "paused");
        let err = q.execute("cont").unwrap_err().to_string();
        assert!(err.contains("GenericError: nope"), "{err}");
    }

    #[test]
    fn an_awaited_event_is_found_among_others_and_a_closed_socket_ends_the_wait() {
        let dir = tempfile::tempdir().unwrap();
        let path = peer(
            dir.path(),
            GREETING,
            vec![concat!(
                "{\"return\": {}}\n",
                "{\"event\": \"STOP\"}\n",
                "{\"event\": \"SHUTDOWN\", \"data\": {\"guest\": true, \"reason\": \"guest-reset\"}}\n"
            )],
        );
        let mut q = Qmp::connect(&path, Duration::from_secs(5)).unwrap();
        let data = q.wait_for_event("SHUTDOWN").unwrap();
        assert_eq!(data["reason"], "guest-reset");
        // The peer closes after its script (and a pause): the wait ends with an error, not forever.
        let err = q.wait_for_event("SHUTDOWN").unwrap_err().to_string();
        assert!(err.contains("closed"), "{err}");
    }

    #[test]
    fn an_over_long_event_line_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let long: &'static str =
            Box::leak(format!("{{\"return\": {{}}}}\n{}\n", "x".repeat(MAX_LINE as usize + 10)).into());
        let path = peer(dir.path(), GREETING, vec![long]);
        let mut q = Qmp::connect(&path, Duration::from_secs(5)).unwrap();
        let err = q.wait_for_event("SHUTDOWN").unwrap_err().to_string();
        assert!(err.contains("longer than"), "{err}");
    }

    #[test]
    fn a_silent_or_garbled_peer_fails_in_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = peer(dir.path(), "not json\n", vec![]);
        assert!(Qmp::connect(&path, Duration::from_secs(5)).is_err());
        let dir = tempfile::tempdir().unwrap();
        let path = peer(dir.path(), GREETING, vec![]);
        // The peer never answers qmp_capabilities: the deadline ends the wait.
        assert!(Qmp::connect(&path, Duration::from_millis(300)).is_err());
    }
}
