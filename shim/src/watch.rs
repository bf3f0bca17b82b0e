//! Background watchers of a pod: one per started process (exit → drained stdio → state →
//! TaskExit) and one per sandbox (the agent's OOM events → TaskOOM).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::{info, warn};

use crate::agent::AgentClient;
use crate::events::EventSink;
use crate::exit::ExitInfo;
use crate::process::{ExitSource, Process, ProcessEvent};
use crate::sandbox::Sandbox;

/// How long the exit path waits for stdout/stderr to drain before publishing TaskExit.
const IO_DRAIN: Duration = Duration::from_secs(2);

/// Waits for one process to end, drains its output, records the exit and tells containerd.
pub async fn watch_exit(process: Arc<dyn Process>, events: Arc<EventSink>, oom_reported: Arc<Mutex<HashSet<String>>>) {
    let core = process.core();
    let exit = match process.exit_source() {
        ExitSource::Agent(agent) => {
            match agent.wait_process(&core.container_id, core.exec_id.as_deref()).await {
                Ok(e) => ExitInfo::from_agent(e.code, e.at_unix_nanos, e.oom_killed),
                Err(e) => {
                    // The agent is gone, and with it every process of the pod (SIGKILL).
                    warn!("wait: {e}; reporting the process as killed");
                    ExitInfo::from_agent(128 + 9, 0, false)
                }
            }
        }
        ExitSource::Sandbox(sandbox) => sandbox.wait().await,
    };
    core.io.lock().await.finish(IO_DRAIN).await;
    if exit.oom_killed && core.exec_id.is_none() {
        let first = oom_reported.lock().unwrap_or_else(|p| p.into_inner()).insert(core.container_id.clone());
        if first {
            events.oom(&core.container_id).await;
        }
    }
    let pid = core.state().pid();
    if let Err(e) = core.transition(ProcessEvent::Exited(exit)) {
        warn!("record exit: {e}");
    }
    info!(status = exit.status, oom = exit.oom_killed, "process exited");
    events.exit(&core.container_id, core.event_id(), pid, exit.status, exit.at).await;
}

/// Relays the agent's OOM events as TaskOOM until the sandbox ends.
pub async fn oom_watch(
    agent: Arc<AgentClient>,
    events: Arc<EventSink>,
    oom_reported: Arc<Mutex<HashSet<String>>>,
    pod_workloads: Arc<Mutex<HashSet<String>>>,
    sandbox: Arc<dyn Sandbox>,
) {
    let mut after = 0;
    let ended = sandbox.wait();
    tokio::pin!(ended);
    loop {
        tokio::select! {
            _ = &mut ended => return,
            next = agent.next_oom_event(after, Duration::from_secs(30)) => match next {
                Ok(Some(event)) => {
                    after = event.seq;
                    // The agent may only speak for containers of its own pod, including one whose
                    // task containerd already deleted (the event may trail the exit).
                    let known =
                        pod_workloads.lock().unwrap_or_else(|p| p.into_inner()).contains(&event.container_id);
                    if !known {
                        warn!(container = %event.container_id, "OOM event for a container not in this pod; ignored");
                        continue;
                    }
                    oom_reported
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(event.container_id.clone());
                    events.oom(&event.container_id).await;
                }
                Ok(None) => {}
                Err(e) => {
                    warn!("OOM events: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }
}
