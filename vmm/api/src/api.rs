//! The API socket's messages: one JSON object per line each way. A request is
//! `{"cmd": "pause" | "resume" | "shutdown" | "info"}`; every request gets one [`Response`] line.
//! Both sides bound a line's length, so neither can make the other buffer without limit.

use serde::{Deserialize, Serialize};

/// Longest request line the VMM reads; longer input closes the connection.
pub const MAX_REQUEST_LINE: usize = 4096;
/// Longest response line a client reads.
pub const MAX_RESPONSE_LINE: usize = 16 * 1024;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "cmd", rename_all = "lowercase", deny_unknown_fields)]
pub enum Request {
    Pause,
    Resume,
    Shutdown,
    Info,
}

/// Run state of the vCPUs as the API reports it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum RunState {
    Running,
    Paused,
}

#[derive(Debug, Serialize, Deserialize, PartialEq, Eq, Clone)]
pub struct VmInfo {
    pub state: RunState,
    pub pid: u32,
    pub vcpus: u8,
    pub mem_mib: u64,
    pub irqchip: bool,
    /// Wall-clock ns when the VMM process started its `main`.
    pub start_unix_ns: u64,
    /// Wall-clock ns of the first KVM_RUN, once it happened.
    pub first_kvm_run_unix_ns: Option<u64>,
}

#[derive(Debug, Serialize, Deserialize, PartialEq, Eq, Clone)]
pub struct Response {
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub info: Option<VmInfo>,
}

impl Response {
    pub fn ok() -> Self {
        Self { ok: true, error: None, info: None }
    }

    pub fn error(message: impl Into<String>) -> Self {
        Self { ok: false, error: Some(message.into()), info: None }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MessageError {
    #[error("line is longer than {0} bytes")]
    TooLong(usize),
    #[error("bad message: {0}")]
    Parse(String),
}

/// Parses one request line (without its newline).
pub fn parse_request(line: &[u8]) -> Result<Request, MessageError> {
    if line.len() > MAX_REQUEST_LINE {
        return Err(MessageError::TooLong(MAX_REQUEST_LINE));
    }
    serde_json::from_slice(line).map_err(|e| MessageError::Parse(e.to_string()))
}

/// Parses one response line (without its newline).
pub fn parse_response(line: &[u8]) -> Result<Response, MessageError> {
    if line.len() > MAX_RESPONSE_LINE {
        return Err(MessageError::TooLong(MAX_RESPONSE_LINE));
    }
    serde_json::from_slice(line).map_err(|e| MessageError::Parse(e.to_string()))
}

/// One message as a line, newline included.
pub fn encode_line<T: Serialize>(message: &T) -> Vec<u8> {
    // Serializing these plain structs cannot fail; an empty object keeps the peer's parser honest.
    let mut out = serde_json::to_vec(message).unwrap_or_else(|_| b"{}".to_vec());
    out.push(b'\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_requests_and_rejects_junk() {
        assert_eq!(parse_request(br#"{"cmd":"pause"}"#), Ok(Request::Pause));
        assert_eq!(parse_request(br#"{"cmd":"info"}"#), Ok(Request::Info));
        assert!(parse_request(br#"{"cmd":"reboot"}"#).is_err());
        assert!(parse_request(b"\xff\xfe").is_err());
        assert!(matches!(parse_request(&[b' '; MAX_REQUEST_LINE + 1]), Err(MessageError::TooLong(_))));
    }

    #[test]
    fn requests_and_responses_round_trip() {
        let line = encode_line(&Request::Shutdown);
        assert_eq!(line.last(), Some(&b'\n'));
        assert_eq!(parse_request(&line[..line.len() - 1]), Ok(Request::Shutdown));
        let info = VmInfo {
            state: RunState::Paused,
            pid: 7,
            vcpus: 2,
            mem_mib: 256,
            irqchip: true,
            start_unix_ns: 1,
            first_kvm_run_unix_ns: None,
        };
        let resp = Response { ok: true, error: None, info: Some(info) };
        let line = encode_line(&resp);
        assert_eq!(parse_response(&line[..line.len() - 1]), Ok(resp));
        assert!(parse_response(br#"{"ok":"#).is_err());
        assert!(parse_response(&vec![b'x'; MAX_RESPONSE_LINE + 1]).is_err());
    }
}
