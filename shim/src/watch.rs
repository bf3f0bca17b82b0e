//! Background watchers of a pod: one per started process (exit → drained stdio → state →
//! TaskExit) and one per sandbox (the agent's OOM events → TaskOOM).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::agent::AgentClient;
use crate::events::EventSink;
use crate::exit::ExitInfo;
use crate::process::{ExitSource, Process, ProcessEvent};
use crate::sandbox::Sandbox;

/// How long the exit path waits for stdout/stderr to drain before publishing TaskExit.
const IO_DRAIN: Duration = Duration::from_secs(2);
/// How long a WaitProcess may still answer once the sandbox has ended.
const SANDBOX_GONE_GRACE: Duration = Duration::from_millis(500);
/// At most one TaskOOM per container in this interval: the agent causes these events, and a
/// flood of them must not reach containerd (kubelet needs one to see the OOM).
const OOM_EVENT_INTERVAL: Duration = Duration::from_secs(1);

/// Admits at most one event per key per interval, and counts what it held back.
#[derive(Debug)]
struct PerKeyLimit {
    interval: Duration,
    last: HashMap<String, Instant>,
    dropped: u64,
}

impl PerKeyLimit {
    fn new(interval: Duration) -> Self {
        Self { interval, last: HashMap::new(), dropped: 0 }
    }

    fn admit(&mut self, key: &str, now: Instant) -> bool {
        match self.last.get(key) {
            Some(at) if now.saturating_duration_since(*at) < self.interval => {
                self.dropped += 1;
                false
            }
            _ => {
                self.last.insert(key.to_string(), now);
                true
            }
        }
    }
}

/// Waits for one process to end, drains its output, records the exit and tells containerd.
pub async fn watch_exit(process: Arc<dyn Process>, events: Arc<EventSink>, oom_reported: Arc<Mutex<HashSet<String>>>) {
    let core = process.core();
    let exit = match process.exit_source() {
        ExitSource::Agent { agent, sandbox } => {
            let waited = agent.wait_process(&core.container_id, core.exec_id.as_deref());
            tokio::pin!(waited);
            let waited = tokio::select! {
                waited = &mut waited => Some(waited),
                // A stalled or dead agent must not hold the exit forever: the pod's processes
                // end with its sandbox. A reply already on its way still gets a moment.
                _ = sandbox.wait() => tokio::time::timeout(SANDBOX_GONE_GRACE, waited).await.ok(),
            };
            match waited {
                Some(Ok(e)) => ExitInfo::from_agent(e.code, e.at_unix_nanos, e.oom_killed),
                Some(Err(e)) => {
                    // Lost contact: end the sandbox, so that "killed" is true of every process.
                    if e.is_transport() {
                        if let Err(end) = crate::process::end_unreachable_pod(&sandbox, &e).await {
                            warn!("end the sandbox: {end}");
                        }
                    }
                    warn!("wait: {e}; reporting the process as killed");
                    ExitInfo::from_agent(128 + 9, 0, false)
                }
                None => {
                    warn!(
                        "the pod's sandbox ended before the agent reported this exit; reporting the process as killed"
                    );
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
    let mut limit = PerKeyLimit::new(OOM_EVENT_INTERVAL);
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
                    if !limit.admit(&event.container_id, Instant::now()) {
                        // Logged at the 1st, 2nd, 4th, 8th... held back: a flood costs a few lines.
                        if limit.dropped.is_power_of_two() {
                            warn!(container = %event.container_id, held_back = limit.dropped, "OOM events faster than one per second per container; held back");
                        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oom_events_are_limited_per_container() {
        let mut limit = PerKeyLimit::new(Duration::from_secs(1));
        let t0 = Instant::now();
        assert!(limit.admit("a", t0));
        assert!(limit.admit("b", t0), "another container is not held back");
        for i in 0..10_000u64 {
            assert!(!limit.admit("a", t0 + Duration::from_micros(i)));
        }
        assert_eq!(limit.dropped, 10_000);
        assert!(limit.admit("a", t0 + Duration::from_secs(1)));
    }
}
