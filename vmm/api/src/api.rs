//! The API socket's messages: one JSON object per line each way. A request is
//! `{"cmd": "pause" | "resume" | "shutdown" | "info"}`, `{"cmd": "snapshot", "dir": "/path"}`,
//! `{"cmd": "balloon", "mib": 256}` or,
//! to a `--prepare`d VMM, `{"cmd": "restore", "config": {..RestoreConfig..}}`; every request gets
//! one [`Response`] line. Both sides bound a line's length, so neither can make the other buffer
//! without limit.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::memory::Mib;
use crate::restore::RestoreConfig;

/// Longest request line the VMM reads; longer input closes the connection.
pub const MAX_REQUEST_LINE: usize = 4096;
/// Longest response line a client reads.
pub const MAX_RESPONSE_LINE: usize = 16 * 1024;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "cmd", rename_all = "lowercase", deny_unknown_fields)]
pub enum Request {
    Pause,
    Resume,
    Shutdown,
    Info,
    /// Pauses every vCPU and writes the snapshot files into `dir` (created, one level, if missing;
    /// files are replaced atomically). The VM stays paused: `resume` or `shutdown` it afterwards.
    Snapshot {
        dir: PathBuf,
    },
    /// To a VMM started with `--prepare`: restore the prepared snapshot with this run's settings.
    /// The VM stays paused until `resume`, unless the config says `resume`.
    Restore {
        config: RestoreConfig,
    },
    /// Asks the guest to hold `mib` of its memory in the balloon, inflating or deflating to it
    /// (0 gives it all back). The driver gets there on its own time: `info` says how far it is.
    Balloon {
        mib: Mib,
    },
}

/// Run state of the vCPUs as the API reports it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum RunState {
    Running,
    Paused,
    /// A `--prepare`d VMM waiting for its `restore` request.
    Prepared,
}

#[derive(Debug, Serialize, Deserialize, PartialEq, Eq, Clone)]
pub struct VmInfo {
    pub state: RunState,
    pub pid: u32,
    pub vcpus: u8,
    pub mem_mib: Mib,
    pub irqchip: bool,
    /// Wall-clock ns when the VMM process started its `main`.
    pub start_unix_ns: u64,
    /// Wall-clock ns of the first KVM_RUN, once it happened.
    pub first_kvm_run_unix_ns: Option<u64>,
    /// How the restore went, for a restored VM.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub restore: Option<RestoreReport>,
    /// How the boot went, for a booted VM.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub boot: Option<BootReport>,
    /// The balloon, for a VM that has one.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub balloon: Option<BalloonInfo>,
}

/// The balloon's target and what the guest's driver says it holds (whole MiB, rounded down).
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq, Clone, Copy)]
pub struct BalloonInfo {
    pub target_mib: Mib,
    pub actual_mib: Mib,
}

/// What a snapshot wrote and how long it took.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq, Clone, Default)]
pub struct SnapshotReport {
    pub state_bytes: u64,
    pub memory_bytes: u64,
    /// Bytes of non-zero pages actually written (the memory file is sparse).
    pub memory_written_bytes: u64,
    pub pause_us: u64,
    pub save_us: u64,
    pub write_us: u64,
    /// MSRs KVM lists as saveable that this host refused to read; they are not in the snapshot.
    #[serde(default)]
    pub msrs_unreadable: Vec<u32>,
}

/// One timed step of a VMM's start (boot or restore). `host` steps are host kernel work the VMM
/// only waits on (KVM ioctls, the boot images' page allocation and copy); the others are the
/// VMM's own work. Builds before the image copy was split out called the field `kvm`.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq, Clone)]
pub struct Phase {
    pub name: String,
    pub us: u64,
    #[serde(alias = "kvm")]
    pub host: bool,
}

/// How a restore went, step by step, from `main` (arguments, filters, jail) through reading the
/// snapshot to vCPU threads waiting to run. A `--prepare`d VMM reports the prepare steps too.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq, Clone, Default)]
pub struct RestoreReport {
    pub phases: Vec<Phase>,
    /// Wall-clock ns when the restore request arrived, for a prepared VMM.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub requested_unix_ns: Option<u64>,
    /// Wall-clock ns when the VM was ready to resume.
    pub ready_unix_ns: u64,
}

/// How a boot went, step by step, from `main` to the moment the vCPU threads are spawned
/// (`ready_unix_ns`); the rest of the way to the first KVM_RUN is `first_kvm_run_unix_ns` minus
/// `ready_unix_ns`: thread start, its seccomp filter, KVM_RUN.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq, Clone, Default)]
pub struct BootReport {
    pub phases: Vec<Phase>,
    pub ready_unix_ns: u64,
}

#[derive(Debug, Serialize, Deserialize, PartialEq, Eq, Clone)]
pub struct Response {
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub info: Option<VmInfo>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub snapshot: Option<SnapshotReport>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub restore: Option<RestoreReport>,
}

impl Response {
    pub fn ok() -> Self {
        Self { ok: true, error: None, info: None, snapshot: None, restore: None }
    }

    pub fn error(message: impl Into<String>) -> Self {
        Self { ok: false, error: Some(message.into()), ..Self::ok() }
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
        assert_eq!(
            parse_request(br#"{"cmd":"snapshot","dir":"/var/snap"}"#),
            Ok(Request::Snapshot { dir: "/var/snap".into() })
        );
        let restore = parse_request(br#"{"cmd":"restore","config":{"vsock_uds_path":"/run/v.sock"}}"#).unwrap();
        let Request::Restore { config } = restore else { panic!("not a restore") };
        assert_eq!(config.vsock_uds_path, Some("/run/v.sock".into()));
        assert!(parse_request(br#"{"cmd":"restore","config":{"vcpus":4}}"#).is_err(), "unknown run setting");
        assert!(parse_request(br#"{"cmd":"snapshot"}"#).is_err(), "a snapshot needs a dir");
        assert_eq!(parse_request(br#"{"cmd":"balloon","mib":256}"#), Ok(Request::Balloon { mib: Mib(256) }));
        for junk in [&br#"{"cmd":"balloon"}"#[..], br#"{"cmd":"balloon","mib":-1}"#, br#"{"cmd":"balloon","mib":"x"}"#]
        {
            assert!(parse_request(junk).is_err(), "{}", String::from_utf8_lossy(junk));
        }
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
            mem_mib: Mib(256),
            irqchip: true,
            start_unix_ns: 1,
            first_kvm_run_unix_ns: None,
            restore: Some(RestoreReport {
                phases: vec![Phase { name: "memslots".into(), us: 5000, host: true }],
                requested_unix_ns: None,
                ready_unix_ns: 2,
            }),
            boot: Some(BootReport {
                phases: vec![Phase { name: "jail".into(), us: 700, host: false }],
                ready_unix_ns: 3,
            }),
            balloon: Some(BalloonInfo { target_mib: Mib(256), actual_mib: Mib(100) }),
        };
        let resp = Response { info: Some(info), snapshot: Some(SnapshotReport::default()), ..Response::ok() };
        let line = encode_line(&resp);
        assert_eq!(parse_response(&line[..line.len() - 1]), Ok(resp));
        assert!(parse_response(br#"{"ok":"#).is_err());
        assert!(parse_response(&vec![b'x'; MAX_RESPONSE_LINE + 1]).is_err());
    }
}
