//! `bulkhead-ctl agent POD`: dials the pod's agent exactly as the shim does (the hybrid-vsock
//! CONNECT preamble on the pod's agent socket, then the ttrpc Version handshake) and reports
//! what it said. A second connection: the shim's own keeps working.

use std::time::{Duration, Instant};

use super::error::{CtlError, Outcome};
use super::pods;
use crate::agent::{AgentClient, Timeouts};
use crate::config::Config;

pub async fn run(config: &Config, query: &str) -> Result<Outcome, CtlError> {
    let pod = pods::find(&config.state_dir, query)?;
    let socket = pod.paths.agent_socket();
    let timeouts = Timeouts {
        connect: Duration::from_millis(config.agent.connect_timeout_ms),
        rpc: Duration::from_millis(config.agent.rpc_timeout_ms),
    };
    let started = Instant::now();
    let agent = AgentClient::connect(&socket, timeouts)
        .await
        .map_err(|e| CtlError::Failed(format!("pod {}: the agent does not answer: {e}", pod.label())))?;
    let took = started.elapsed();
    let json = serde_json::json!({
        "pod": pod.id,
        "name": pod.label(),
        "socket": socket,
        "ok": true,
        "protocol_version": bulkhead_protocol::PROTOCOL_VERSION,
        "agent_version": agent.agent_version,
        "mode": agent.mode,
        "handshake_ms": took.as_secs_f64() * 1000.0,
    });
    let text = format!(
        "agent of {} answers: version {}, mode {}, protocol {} ({:.1} ms, {})\n",
        pod.label(),
        agent.agent_version,
        agent.mode,
        bulkhead_protocol::PROTOCOL_VERSION,
        took.as_secs_f64() * 1000.0,
        socket.display()
    );
    Ok(Outcome { json, text, ok: true })
}
