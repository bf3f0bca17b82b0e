//! Client side of the agent protocol (`bulkhead-protocol`): dial, version handshake, and one
//! method per RPC with the configured deadline. stdio streams are dialled here too; their
//! bytes are moved by [`crate::io`].
//!
//! The agent is untrusted: every reply is bounded by ttrpc's message limit and by a deadline,
//! except the waits (process exit, OOM long-poll) which legitimately take as long as the workload.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bulkhead_protocol::agent as pb;
use bulkhead_protocol::agent_ttrpc::AgentClient as RawClient;
use bulkhead_protocol::client::HOST_FRAME_STALL;
use bulkhead_protocol::frame_guard::FrameGuard;
use bulkhead_protocol::handshake::{self, HandshakeError};
use bulkhead_protocol::stream::{HeaderError, StreamHeader, StreamKind};
use bulkhead_protocol::{ports, PROTOCOL_VERSION};
use tokio::net::UnixStream;

#[derive(Debug, thiserror::Error)]
pub enum AgentClientError {
    #[error("agent at {socket}: connect: {source}")]
    Dial { socket: PathBuf, source: HandshakeError },
    #[error("agent speaks protocol version {agent}, the shim speaks {PROTOCOL_VERSION}")]
    Version { agent: u32 },
    #[error("agent {method}: {source}")]
    Rpc { method: &'static str, source: ttrpc::Error },
    #[error("agent stream {kind:?} for {id}: {source}")]
    Stream { kind: StreamKind, id: String, source: HeaderError },
    #[error("agent reply to {method}: {what}")]
    BadReply { method: &'static str, what: String },
}

/// Longest error text of the agent's that the shim passes on (containerd logs it, CRI shows it).
pub const MAX_AGENT_ERROR: usize = 4096;

impl AgentClientError {
    /// The ttrpc status code the agent answered with, if it answered at all, and if it is one
    /// the agent may use: a guest cannot make containerd believe the shim is unimplemented,
    /// unauthenticated or out of resources on the host, nor send a code out of range.
    pub fn code(&self) -> Option<ttrpc::Code> {
        use ttrpc::Code;
        match self {
            AgentClientError::Rpc { source: ttrpc::Error::RpcStatus(status), .. } => Some(match status.code() {
                code @ (Code::CANCELLED
                | Code::INVALID_ARGUMENT
                | Code::DEADLINE_EXCEEDED
                | Code::NOT_FOUND
                | Code::ALREADY_EXISTS
                | Code::PERMISSION_DENIED
                | Code::FAILED_PRECONDITION
                | Code::ABORTED
                | Code::OUT_OF_RANGE) => code,
                _ => Code::UNKNOWN,
            }),
            _ => None,
        }
    }

    /// Whether the agent connection failed (closed, a bad or stalled frame, no answer within
    /// the deadline) rather than the agent answering with an error: the pod's processes are
    /// then beyond the shim's reach through this agent.
    pub fn is_transport(&self) -> bool {
        match self {
            AgentClientError::Rpc { source, .. } => !matches!(source, ttrpc::Error::RpcStatus(_)),
            AgentClientError::Dial { .. } | AgentClientError::Stream { .. } => true,
            AgentClientError::Version { .. } | AgentClientError::BadReply { .. } => false,
        }
    }

    /// The agent's own words for an RPC error, else the whole error.
    pub fn message(&self) -> String {
        match self {
            AgentClientError::Rpc { source: ttrpc::Error::RpcStatus(status), .. } => status.message().to_string(),
            other => other.to_string(),
        }
    }
}

/// Deadlines for talking to the agent.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub connect: Duration,
    pub rpc: Duration,
}

/// How a process ended, as the agent reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgentExit {
    /// Exit status, 128+signal when signalled (runc's convention).
    pub code: u32,
    pub oom_killed: bool,
    /// Nanoseconds since the epoch; 0 if the agent did not say.
    pub at_unix_nanos: i64,
}

/// Checks the agent's exit report: an exit status 0..=255, or 128+signal. (Public for the fuzz
/// crate's `agent_reply` target, as the other checks of guest-made replies here.)
pub fn exit_from_reply(reply: &pb::WaitProcessResponse) -> Result<AgentExit, AgentClientError> {
    let bad = |what: String| AgentClientError::BadReply { method: "WaitProcess", what };
    let code = u32::try_from(reply.exit_code).map_err(|_| bad(format!("negative exit code {}", reply.exit_code)))?;
    if code > 255 {
        return Err(bad(format!("exit code {code} out of range")));
    }
    if reply.exited_at_unix_nanos < 0 {
        return Err(bad(format!("exit time {} before the epoch", reply.exited_at_unix_nanos)));
    }
    Ok(AgentExit { code, oom_killed: reply.oom_killed, at_unix_nanos: reply.exited_at_unix_nanos })
}

/// An OOM event must at least name a well-formed container id.
pub fn check_oom_event(event: pb::OomEvent) -> Result<pb::OomEvent, AgentClientError> {
    bulkhead_protocol::stream::validate_id(&event.container_id)
        .map_err(|e| AgentClientError::BadReply { method: "GetOomEvent", what: format!("container id: {e}") })?;
    Ok(event)
}

pub struct AgentClient {
    raw: RawClient,
    socket: PathBuf,
    timeouts: Timeouts,
    /// What the agent said about itself, for logs.
    pub agent_version: String,
    pub mode: String,
}

/// Wraps an RPC failure; an agent's error text is cut at [`MAX_AGENT_ERROR`] bytes here, once,
/// so no log line, event or CRI answer carries more of it.
fn rpc_err(method: &'static str) -> impl FnOnce(ttrpc::Error) -> AgentClientError {
    move |source| {
        let source = match source {
            ttrpc::Error::RpcStatus(mut status) if status.message.len() > MAX_AGENT_ERROR => {
                status.message = bounded_text(&status.message, MAX_AGENT_ERROR);
                ttrpc::Error::RpcStatus(status)
            }
            other => other,
        };
        AgentClientError::Rpc { method, source }
    }
}

/// `text` cut to at most `max` bytes on a character boundary, saying how much was cut.
pub fn bounded_text(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes cut)", &text[..end], text.len() - end)
}

impl AgentClient {
    /// Dials the agent's ttrpc port over its hybrid-vsock socket and checks the version.
    pub async fn connect(socket: &Path, timeouts: Timeouts) -> Result<Self, AgentClientError> {
        let stream = handshake::dial_unix(socket, ports::AGENT_TTRPC, timeouts.connect)
            .await
            .map_err(|source| AgentClientError::Dial { socket: socket.into(), source })?;
        // A reply frame that declares too much or stalls half-way fails the connection instead of
        // blocking every RPC on it (ttrpc alone waits forever for the rest of a frame).
        let stream = FrameGuard::new(stream, HOST_FRAME_STALL);
        let client = ttrpc::asynchronous::Client::new(ttrpc::asynchronous::transport::Socket::new(stream));
        let raw = RawClient::new(client);
        let reply = raw
            .version(
                ttrpc::context::with_timeout(timeouts.rpc.as_nanos() as i64),
                &pb::VersionRequest {
                    protocol_version: PROTOCOL_VERSION,
                    client: format!("containerd-shim-bulkhead-v2 {}", env!("CARGO_PKG_VERSION")),
                    ..Default::default()
                },
            )
            .await
            .map_err(rpc_err("Version"))?;
        if reply.protocol_version != PROTOCOL_VERSION {
            return Err(AgentClientError::Version { agent: reply.protocol_version });
        }
        Ok(Self { raw, socket: socket.into(), timeouts, agent_version: reply.agent_version, mode: reply.mode })
    }

    /// The same connection with other deadlines: a dial's attempt uses short ones, the client
    /// the configured ones.
    pub fn with_timeouts(self, timeouts: Timeouts) -> Self {
        Self { timeouts, ..self }
    }

    /// A Version call on the open connection: the agent still answers (metrics, health).
    /// Returns the output bytes the agent has dropped so far.
    pub async fn ping(&self) -> Result<u64, AgentClientError> {
        let req = pb::VersionRequest {
            protocol_version: PROTOCOL_VERSION,
            client: format!("containerd-shim-bulkhead-v2 {}", env!("CARGO_PKG_VERSION")),
            ..Default::default()
        };
        let reply = self.raw.version(self.ctx(), &req).await.map_err(rpc_err("Version"))?;
        if reply.protocol_version != PROTOCOL_VERSION {
            return Err(AgentClientError::Version { agent: reply.protocol_version });
        }
        Ok(reply.dropped_output_bytes)
    }

    fn ctx(&self) -> ttrpc::context::Context {
        ttrpc::context::with_timeout(self.timeouts.rpc.as_nanos() as i64)
    }

    /// SetupSandbox; the agent's answer says whether the pod got a user namespace of its own (an
    /// agent that predates them answers no).
    pub async fn setup_sandbox(
        &self,
        req: pb::SetupSandboxRequest,
    ) -> Result<pb::SetupSandboxResponse, AgentClientError> {
        self.raw.setup_sandbox(self.ctx(), &req).await.map_err(rpc_err("SetupSandbox"))
    }

    pub async fn destroy_sandbox(&self, grace: Duration) -> Result<(), AgentClientError> {
        let req = pb::DestroySandboxRequest {
            timeout_ms: grace.as_millis().min(u32::MAX as u128) as u32,
            ..Default::default()
        };
        // The grace period is part of the call, so the deadline covers it.
        let ctx = ttrpc::context::with_timeout((self.timeouts.rpc + grace).as_nanos() as i64);
        self.raw.destroy_sandbox(ctx, &req).await.map_err(rpc_err("DestroySandbox"))?;
        Ok(())
    }

    pub async fn create_container(&self, req: pb::CreateContainerRequest) -> Result<u32, AgentClientError> {
        let reply = self.raw.create_container(self.ctx(), &req).await.map_err(rpc_err("CreateContainer"))?;
        Ok(reply.pid)
    }

    pub async fn start_container(&self, container_id: &str) -> Result<u32, AgentClientError> {
        let req = pb::StartContainerRequest { container_id: container_id.into(), ..Default::default() };
        let reply = self.raw.start_container(self.ctx(), &req).await.map_err(rpc_err("StartContainer"))?;
        Ok(reply.pid)
    }

    pub async fn remove_container(&self, container_id: &str, force: bool) -> Result<(), AgentClientError> {
        let req = pb::RemoveContainerRequest { container_id: container_id.into(), force, ..Default::default() };
        self.raw.remove_container(self.ctx(), &req).await.map_err(rpc_err("RemoveContainer"))?;
        Ok(())
    }

    pub async fn exec_process(&self, req: pb::ExecProcessRequest) -> Result<u32, AgentClientError> {
        let reply = self.raw.exec_process(self.ctx(), &req).await.map_err(rpc_err("ExecProcess"))?;
        Ok(reply.pid)
    }

    pub async fn signal_process(
        &self,
        container_id: &str,
        exec_id: Option<&str>,
        signal: u32,
        all: bool,
    ) -> Result<(), AgentClientError> {
        let req = pb::SignalProcessRequest {
            container_id: container_id.into(),
            exec_id: exec_id.unwrap_or_default().into(),
            signal,
            all,
            ..Default::default()
        };
        self.raw.signal_process(self.ctx(), &req).await.map_err(rpc_err("SignalProcess"))?;
        Ok(())
    }

    /// Waits for a process to exit; no deadline (a workload may run for months).
    pub async fn wait_process(&self, container_id: &str, exec_id: Option<&str>) -> Result<AgentExit, AgentClientError> {
        let req = pb::WaitProcessRequest {
            container_id: container_id.into(),
            exec_id: exec_id.unwrap_or_default().into(),
            ..Default::default()
        };
        let reply =
            self.raw.wait_process(ttrpc::context::Context::default(), &req).await.map_err(rpc_err("WaitProcess"))?;
        exit_from_reply(&reply)
    }

    pub async fn resize_pty(
        &self,
        container_id: &str,
        exec_id: Option<&str>,
        cols: u32,
        rows: u32,
    ) -> Result<(), AgentClientError> {
        let req = pb::ResizePtyRequest {
            container_id: container_id.into(),
            exec_id: exec_id.unwrap_or_default().into(),
            rows,
            cols,
            ..Default::default()
        };
        self.raw.resize_pty(self.ctx(), &req).await.map_err(rpc_err("ResizePty"))?;
        Ok(())
    }

    pub async fn close_stdin(&self, container_id: &str, exec_id: Option<&str>) -> Result<(), AgentClientError> {
        let req = pb::CloseStdinRequest {
            container_id: container_id.into(),
            exec_id: exec_id.unwrap_or_default().into(),
            ..Default::default()
        };
        self.raw.close_stdin(self.ctx(), &req).await.map_err(rpc_err("CloseStdin"))?;
        Ok(())
    }

    pub async fn stats(&self, container_id: &str) -> Result<pb::StatsResponse, AgentClientError> {
        let req = pb::StatsRequest { container_id: container_id.into(), ..Default::default() };
        self.raw.stats(self.ctx(), &req).await.map_err(rpc_err("Stats"))
    }

    fn container_req(container_id: &str) -> pb::ContainerRequest {
        pb::ContainerRequest { container_id: container_id.into(), ..Default::default() }
    }

    pub async fn pause_container(&self, container_id: &str) -> Result<(), AgentClientError> {
        self.raw
            .pause_container(self.ctx(), &Self::container_req(container_id))
            .await
            .map_err(rpc_err("PauseContainer"))?;
        Ok(())
    }

    pub async fn resume_container(&self, container_id: &str) -> Result<(), AgentClientError> {
        self.raw
            .resume_container(self.ctx(), &Self::container_req(container_id))
            .await
            .map_err(rpc_err("ResumeContainer"))?;
        Ok(())
    }

    pub async fn update_container(&self, container_id: &str, resources_json: Vec<u8>) -> Result<(), AgentClientError> {
        let req =
            pb::UpdateContainerRequest { container_id: container_id.into(), resources_json, ..Default::default() };
        self.raw.update_container(self.ctx(), &req).await.map_err(rpc_err("UpdateContainer"))?;
        Ok(())
    }

    /// Brings `count` of the guest's CPUs online (the others offline); the count online after.
    pub async fn set_online_cpus(&self, count: u32) -> Result<u32, AgentClientError> {
        let req = pb::SetOnlineCpusRequest { count, ..Default::default() };
        Ok(self.raw.set_online_cpus(self.ctx(), &req).await.map_err(rpc_err("SetOnlineCpus"))?.online)
    }

    pub async fn list_pids(&self, container_id: &str) -> Result<Vec<u32>, AgentClientError> {
        let reply =
            self.raw.list_pids(self.ctx(), &Self::container_req(container_id)).await.map_err(rpc_err("ListPids"))?;
        Ok(reply.pids)
    }

    /// One OOM long-poll: the first event after `after_seq`, or `None` after `wait`.
    pub async fn next_oom_event(
        &self,
        after_seq: u64,
        wait: Duration,
    ) -> Result<Option<pb::OomEvent>, AgentClientError> {
        let req = pb::GetOomEventRequest {
            after_seq,
            wait_ms: wait.as_millis().min(u32::MAX as u128) as u32,
            ..Default::default()
        };
        let ctx = ttrpc::context::with_timeout((self.timeouts.rpc + wait).as_nanos() as i64);
        let reply = self.raw.get_oom_event(ctx, &req).await.map_err(rpc_err("GetOomEvent"))?;
        reply.event.into_option().map(check_oom_event).transpose()
    }

    /// Opens one stdio stream connection and has the agent attach it.
    pub async fn open_stream(
        &self,
        container_id: &str,
        exec_id: Option<&str>,
        kind: StreamKind,
    ) -> Result<UnixStream, AgentClientError> {
        let id = match exec_id {
            Some(exec) => format!("{container_id}/{exec}"),
            None => container_id.to_string(),
        };
        let mut stream = handshake::dial_unix(&self.socket, ports::AGENT_STREAMS, self.timeouts.connect)
            .await
            .map_err(|source| AgentClientError::Dial { socket: self.socket.clone(), source })?;
        StreamHeader::new(container_id, exec_id, kind)
            .open(&mut stream, self.timeouts.connect)
            .await
            .map_err(|source| AgentClientError::Stream { kind, id, source })?;
        Ok(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait_reply(exit_code: i32, at: i64) -> pb::WaitProcessResponse {
        pb::WaitProcessResponse { exit_code, exited_at_unix_nanos: at, ..Default::default() }
    }

    fn rpc_status(code: ttrpc::Code, message: String) -> AgentClientError {
        rpc_err("Test")(ttrpc::Error::RpcStatus(ttrpc::get_status(code, message)))
    }

    #[test]
    fn a_huge_error_text_is_cut_once_on_a_char_boundary() {
        let err = rpc_status(ttrpc::Code::NOT_FOUND, "é".repeat(512 * 1024)); // 1 MiB
        let message = err.message();
        assert!(message.len() <= MAX_AGENT_ERROR + 40, "{}", message.len());
        assert!(message.ends_with("bytes cut)"), "{}", &message[message.len() - 40..]);
        assert!(err.to_string().len() <= MAX_AGENT_ERROR + 400, "{}", err.to_string().len());
        assert_eq!(rpc_status(ttrpc::Code::NOT_FOUND, "short".into()).message(), "short");
    }

    #[test]
    fn only_connection_failures_count_as_transport() {
        assert!(!rpc_status(ttrpc::Code::NOT_FOUND, "gone".into()).is_transport());
        assert!(rpc_err("Test")(ttrpc::Error::RemoteClosed).is_transport());
        assert!(rpc_err("Test")(ttrpc::Error::Others("Request deadline elapsed".into())).is_transport());
    }

    #[test]
    fn agent_codes_are_mapped_deliberately() {
        use ttrpc::Code;
        assert_eq!(rpc_status(Code::NOT_FOUND, String::new()).code(), Some(Code::NOT_FOUND));
        assert_eq!(rpc_status(Code::FAILED_PRECONDITION, String::new()).code(), Some(Code::FAILED_PRECONDITION));
        for host_only in [Code::UNIMPLEMENTED, Code::UNAUTHENTICATED, Code::RESOURCE_EXHAUSTED, Code::INTERNAL] {
            assert_eq!(rpc_status(host_only, String::new()).code(), Some(Code::UNKNOWN), "{host_only:?}");
        }
        let mut status = ttrpc::get_status(Code::OK, "x");
        status.code = protobuf::EnumOrUnknown::from_i32(999);
        let err = rpc_err("Test")(ttrpc::Error::RpcStatus(status));
        assert_eq!(err.code(), Some(Code::UNKNOWN));
    }

    #[test]
    fn exit_reports_are_range_checked() {
        assert_eq!(exit_from_reply(&wait_reply(3, 1)).unwrap().code, 3);
        assert_eq!(exit_from_reply(&wait_reply(137, 0)).unwrap().code, 137);
        assert!(exit_from_reply(&wait_reply(-1, 0)).is_err());
        assert!(exit_from_reply(&wait_reply(100_000, 0)).is_err());
        assert!(exit_from_reply(&wait_reply(0, -5)).is_err());
    }

    #[test]
    fn oom_events_need_a_valid_container_id() {
        let ok = pb::OomEvent { seq: 1, container_id: "abc123".into(), ..Default::default() };
        assert!(check_oom_event(ok).is_ok());
        for bad in ["", "../etc", &"a".repeat(300)] {
            let ev = pb::OomEvent { seq: 1, container_id: bad.into(), ..Default::default() };
            assert!(check_oom_event(ev).is_err(), "{bad:?}");
        }
    }
}
