//! The only place that calls `waitpid`. The agent is PID 1 (or a child subreaper), so every
//! orphan in the sandbox ends up here: container inits and execs (whose libcontainer helper
//! parent exits right after creating them), helpers themselves, and stray zombies.
//!
//! Nothing else in the agent may wait on children (no `tokio::process`, no `Child::wait`):
//! a second waiter would steal exit statuses. Callers register interest with [`Reaper::watch`];
//! an exit that nobody has claimed yet is parked (bounded) so a late `watch` still gets it.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use nix::{
    sys::wait::{waitpid, WaitPidFlag, WaitStatus},
    unistd::Pid,
};
use tokio::sync::oneshot;

/// How many unclaimed exits are kept for late watchers.
const UNCLAIMED_MAX: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitInfo {
    /// Exit status, or 128+signal for a killed process (containerd's convention).
    pub code: i32,
    /// Terminating signal, 0 if the process exited.
    pub signal: i32,
    pub at: SystemTime,
}

impl ExitInfo {
    fn from_status(status: WaitStatus) -> Option<(i32, Self)> {
        let at = SystemTime::now();
        match status {
            WaitStatus::Exited(pid, code) => Some((pid.as_raw(), ExitInfo { code, signal: 0, at })),
            WaitStatus::Signaled(pid, sig, _) => {
                Some((pid.as_raw(), ExitInfo { code: 128 + sig as i32, signal: sig as i32, at }))
            }
            _ => None,
        }
    }
}

#[derive(Default)]
struct Inner {
    waiters: HashMap<i32, oneshot::Sender<ExitInfo>>,
    unclaimed: HashMap<i32, ExitInfo>,
    order: VecDeque<i32>,
}

#[derive(Clone, Default)]
pub struct Reaper {
    inner: Arc<Mutex<Inner>>,
}

impl Reaper {
    /// Starts the reaping task. Must be called inside the tokio runtime, before any child
    /// is spawned.
    pub fn start() -> std::io::Result<Self> {
        let reaper = Reaper::default();
        let mut sigchld = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child())?;
        let r = reaper.clone();
        tokio::spawn(async move {
            loop {
                // The tick is a safety net for coalesced or missed signals.
                let _ = tokio::time::timeout(Duration::from_secs(1), sigchld.recv()).await;
                r.reap_all();
            }
        });
        Ok(reaper)
    }

    /// Returns a receiver that resolves when `pid` exits (immediately if it already did).
    pub fn watch(&self, pid: i32) -> oneshot::Receiver<ExitInfo> {
        let (tx, rx) = oneshot::channel();
        let mut inner = self.lock();
        if let Some(info) = inner.unclaimed.remove(&pid) {
            inner.order.retain(|p| *p != pid);
            let _ = tx.send(info);
        } else {
            inner.waiters.insert(pid, tx);
        }
        drop(inner);
        // The child may have exited between spawn and watch with its SIGCHLD already handled.
        self.reap_all();
        rx
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A poisoned lock only means another thread panicked mid-update of plain maps.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn reap_all(&self) {
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(_) => return,
                Ok(status) => {
                    if let Some((pid, info)) = ExitInfo::from_status(status) {
                        self.deliver(pid, info);
                    }
                }
            }
        }
    }

    fn deliver(&self, pid: i32, info: ExitInfo) {
        let mut inner = self.lock();
        if let Some(tx) = inner.waiters.remove(&pid) {
            let _ = tx.send(info);
            return;
        }
        tracing::debug!(pid, code = info.code, "reaped unwatched child");
        inner.unclaimed.insert(pid, info);
        inner.order.push_back(pid);
        while inner.order.len() > UNCLAIMED_MAX {
            if let Some(old) = inner.order.pop_front() {
                inner.unclaimed.remove(&old);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The reaper is the waiter here, by design; `Child::wait` would race it.
    #[allow(clippy::zombie_processes)]
    #[tokio::test]
    async fn delivers_exit_to_late_and_early_watchers() {
        let reaper = Reaper::start().unwrap();
        let early = std::process::Command::new("/bin/sh").args(["-c", "exit 3"]).spawn().unwrap();
        let rx = reaper.watch(early.id() as i32);
        let info = tokio::time::timeout(Duration::from_secs(10), rx).await.unwrap().unwrap();
        assert_eq!((info.code, info.signal), (3, 0));

        let killed = std::process::Command::new("/bin/sleep").arg("100").spawn().unwrap();
        let pid = killed.id() as i32;
        nix::sys::signal::kill(Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM).unwrap();
        // Give the reaper time to park the exit before anyone watches.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let info = tokio::time::timeout(Duration::from_secs(10), reaper.watch(pid)).await.unwrap().unwrap();
        assert_eq!((info.code, info.signal), (128 + 15, 15));
    }
}
