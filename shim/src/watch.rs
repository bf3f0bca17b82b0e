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
/// How long the sandbox's own TaskExit waits for its processes' TaskExits: what their watchers
/// may take once the sandbox is gone, and a margin.
const SANDBOX_EXIT_LAST: Duration = Duration::from_secs(5);
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

/// The pod's processes (containers' and execs') whose TaskExit is not published yet. The
/// sandbox's own TaskExit waits for them: containerd treats the sandbox's exit as the pod's end
/// (StopPodSandbox returns once it has handled it), so a container whose exit came after it
/// would still count as running when the pod is removed.
#[derive(Debug)]
pub struct PendingExits {
    count: tokio::sync::watch::Sender<usize>,
}

impl Default for PendingExits {
    fn default() -> Self {
        Self { count: tokio::sync::watch::channel(0).0 }
    }
}

/// One process whose TaskExit is pending; published (or given up) when dropped.
pub struct PendingExit(Arc<PendingExits>);

impl Drop for PendingExit {
    fn drop(&mut self) {
        self.0.count.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl PendingExits {
    /// Counts a started process until the returned guard drops.
    pub fn add(self: &Arc<Self>) -> PendingExit {
        self.count.send_modify(|n| *n += 1);
        PendingExit(self.clone())
    }

    /// Waits until no process's TaskExit is pending, at most `within`; false if some still are.
    pub async fn settled(&self, within: Duration) -> bool {
        let mut rx = self.count.subscribe();
        tokio::time::timeout(within, rx.wait_for(|n| *n == 0)).await.is_ok_and(|r| r.is_ok())
    }
}

/// Waits for one process to end, drains its output, records the exit and tells containerd.
/// `pending` is this process's entry in the pod's `exits` (taken before the process started, so
/// none is missed), held until its TaskExit is out; the sandbox's watcher, which has none, waits
/// for the pod's entries instead.
pub async fn watch_exit(
    process: Arc<dyn Process>,
    events: Arc<EventSink>,
    oom_reported: Arc<Mutex<HashSet<String>>>,
    exits: Arc<PendingExits>,
    pending: Option<PendingExit>,
) {
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
        ExitSource::Sandbox(sandbox) => {
            let exit = sandbox.wait().await;
            if !exits.settled(SANDBOX_EXIT_LAST).await {
                warn!("the pod's processes did not report their exits within {SANDBOX_EXIT_LAST:?}; the sandbox's goes first");
            }
            exit
        }
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
    drop(pending);
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
