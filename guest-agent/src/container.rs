//! A container and its processes: the lifecycle state machine and exit bookkeeping.

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{Arc, Mutex, Weak},
};

use tokio::sync::watch;

use crate::{
    cgroup_v1_devices::DevicesStub,
    cgroups::Cgroup,
    error::{AgentError, Result},
    reaper::{ExitInfo, Reaper},
    stdio::ProcessIo,
};

/// Container lifecycle. Transitions live in [`ContainerState::next`] only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContainerState {
    Created,
    Running,
    Paused,
    Stopped,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    Start,
    Pause,
    Resume,
    InitExited,
}

impl ContainerState {
    pub fn next(self, ev: Event) -> Option<ContainerState> {
        use ContainerState::*;
        match (self, ev) {
            (Created, Event::Start) => Some(Running),
            (Running, Event::Pause) => Some(Paused),
            (Paused, Event::Resume) => Some(Running),
            (_, Event::InitExited) => Some(Stopped),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ContainerState::Created => "created",
            ContainerState::Running => "running",
            ContainerState::Paused => "paused",
            ContainerState::Stopped => "stopped",
        }
    }
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitRecord {
    pub info: ExitInfo,
    pub oom_killed: bool,
}

pub struct Process {
    pub pid: i32,
    pub io: ProcessIo,
    exit: watch::Receiver<Option<ExitRecord>>,
}

impl Process {
    pub fn exited(&self) -> Option<ExitRecord> {
        *self.exit.borrow()
    }

    pub async fn wait(&self) -> ExitRecord {
        let mut rx = self.exit.clone();
        loop {
            if let Some(r) = *rx.borrow_and_update() {
                return r;
            }
            if rx.changed().await.is_err() {
                // The exit watcher is gone without a result: report the process as lost.
                return ExitRecord {
                    info: ExitInfo { code: 255, signal: 0, at: std::time::SystemTime::now() },
                    oom_killed: false,
                };
            }
        }
    }
}

pub struct Container {
    pub id: String,
    pub bundle: PathBuf,
    pub cgroup: Cgroup,
    /// Mounts the agent made under the rootfs; undone at removal.
    pub rootfs_mounts: Vec<PathBuf>,
    /// Its devices cgroup's stub (cgroup v1 in the agent's user namespace); lifted at removal.
    pub devices_stub: Option<DevicesStub>,
    state: Mutex<ContainerState>,
    pub init: Arc<Process>,
    execs: Mutex<HashMap<String, Arc<Process>>>,
    /// OOM-kill counter when the container was created.
    oom_baseline: u64,
    monitor: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for Container {
    fn drop(&mut self) {
        if let Some(h) = self.monitor.lock().unwrap_or_else(|p| p.into_inner()).take() {
            h.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub struct NewContainer {
    pub id: String,
    pub bundle: PathBuf,
    pub cgroup: Cgroup,
    pub rootfs_mounts: Vec<PathBuf>,
    pub devices_stub: Option<DevicesStub>,
    pub init_pid: i32,
    pub init_io: ProcessIo,
}

impl Container {
    /// Builds the container and starts watching its init process.
    pub fn new(n: NewContainer, reaper: &Reaper) -> Arc<Self> {
        let oom_baseline = n.cgroup.oom_kill_count().unwrap_or(0);
        let (tx, rx) = watch::channel(None);
        let c = Arc::new(Container {
            id: n.id,
            bundle: n.bundle,
            cgroup: n.cgroup,
            rootfs_mounts: n.rootfs_mounts,
            devices_stub: n.devices_stub,
            state: Mutex::new(ContainerState::Created),
            init: Arc::new(Process { pid: n.init_pid, io: n.init_io, exit: rx }),
            execs: Mutex::new(HashMap::new()),
            oom_baseline,
            monitor: Mutex::new(None),
        });
        spawn_exit_watch(Arc::downgrade(&c), n.init_pid, tx, reaper, true);
        c
    }

    pub fn state(&self) -> ContainerState {
        *lock(&self.state)
    }

    /// Applies `ev`, or explains why the container is in the wrong state for it.
    pub fn transition(&self, ev: Event) -> Result<ContainerState> {
        let mut s = lock(&self.state);
        match s.next(ev) {
            Some(n) => {
                *s = n;
                Ok(n)
            }
            None => {
                Err(AgentError::FailedPrecondition(format!("container {} is {}; cannot {:?}", self.id, s.name(), ev)))
            }
        }
    }

    /// Checks `ev` would be legal without applying it (for operations that must do work
    /// before the transition).
    pub fn check(&self, ev: Event) -> Result<()> {
        let s = self.state();
        s.next(ev).map(|_| ()).ok_or_else(|| {
            AgentError::FailedPrecondition(format!("container {} is {}; cannot {:?}", self.id, s.name(), ev))
        })
    }

    pub fn set_monitor(&self, h: tokio::task::JoinHandle<()>) {
        *lock(&self.monitor) = Some(h);
    }

    pub fn process(&self, exec_id: &str) -> Result<Arc<Process>> {
        if exec_id.is_empty() {
            return Ok(self.init.clone());
        }
        lock(&self.execs)
            .get(exec_id)
            .cloned()
            .ok_or_else(|| AgentError::NotFound(format!("exec {exec_id} in container {}", self.id)))
    }

    pub fn has_exec(&self, exec_id: &str) -> bool {
        lock(&self.execs).contains_key(exec_id)
    }

    pub fn add_exec(self: &Arc<Self>, exec_id: &str, pid: i32, io: ProcessIo, reaper: &Reaper) {
        let (tx, rx) = watch::channel(None);
        let p = Arc::new(Process { pid, io, exit: rx });
        let mut execs = lock(&self.execs);
        prune_execs(&mut execs, std::time::SystemTime::now());
        execs.insert(exec_id.to_owned(), p);
        drop(execs);
        spawn_exit_watch(Arc::downgrade(self), pid, tx, reaper, false);
    }

    pub fn oom_baseline(&self) -> u64 {
        self.oom_baseline
    }
}

/// Exited execs are kept for WaitProcess for [`EXEC_KEEP`], so exec-heavy containers (probes
/// every few seconds) do not grow the agent without bound; at most [`EXEC_MAX_EXITED`] are
/// kept regardless of age.
const EXEC_KEEP: std::time::Duration = std::time::Duration::from_secs(300);
const EXEC_MAX_EXITED: usize = 256;

fn prune_execs(execs: &mut HashMap<String, Arc<Process>>, now: std::time::SystemTime) {
    execs.retain(|_, p| p.exited().is_none_or(|r| now.duration_since(r.info.at).unwrap_or_default() < EXEC_KEEP));
    let mut exited: Vec<(std::time::SystemTime, String)> =
        execs.iter().filter_map(|(id, p)| p.exited().map(|r| (r.info.at, id.clone()))).collect();
    if exited.len() > EXEC_MAX_EXITED {
        exited.sort();
        for (_, id) in exited.iter().take(exited.len() - EXEC_MAX_EXITED) {
            execs.remove(id);
        }
    }
}

fn spawn_exit_watch(
    c: Weak<Container>,
    pid: i32,
    tx: watch::Sender<Option<ExitRecord>>,
    reaper: &Reaper,
    is_init: bool,
) {
    let oom_before = c.upgrade().and_then(|c| c.cgroup.oom_kill_count()).unwrap_or(0);
    let rx = reaper.watch(pid);
    tokio::spawn(async move {
        let Ok(info) = rx.await else { return };
        let oom_killed = c.upgrade().and_then(|c| c.cgroup.oom_kill_count()).is_some_and(|n| n > oom_before);
        tracing::info!(pid, code = info.code, signal = info.signal, oom_killed, "process exited");
        if is_init {
            if let Some(c) = c.upgrade() {
                let _ = c.transition(Event::InitExited);
            }
        }
        let _ = tx.send(Some(ExitRecord { info, oom_killed }));
    });
}

#[cfg(test)]
mod tests {
    use super::ContainerState::*;
    use super::*;

    fn exited_process(at: std::time::SystemTime) -> Arc<Process> {
        let (_tx, rx) =
            watch::channel(Some(ExitRecord { info: ExitInfo { code: 0, signal: 0, at }, oom_killed: false }));
        let (r, w) = tokio::io::duplex(8);
        let _ = w;
        Arc::new(Process {
            pid: 1,
            io: ProcessIo::Pipes {
                stdin: None,
                stdout: crate::stdio::OutputStream::spawn(
                    r,
                    crate::stdio::PumpOpts { backlog: 8, stall: std::time::Duration::from_secs(1) },
                    "t".into(),
                ),
                stderr: crate::stdio::OutputStream::spawn(
                    tokio::io::empty(),
                    crate::stdio::PumpOpts { backlog: 8, stall: std::time::Duration::from_secs(1) },
                    "t".into(),
                ),
            },
            exit: rx,
        })
    }

    #[tokio::test]
    async fn exited_execs_are_pruned_by_age_and_count() {
        let now = std::time::SystemTime::now();
        let mut execs = HashMap::new();
        execs.insert("old".to_owned(), exited_process(now - EXEC_KEEP - std::time::Duration::from_secs(1)));
        execs.insert("fresh".to_owned(), exited_process(now));
        prune_execs(&mut execs, now);
        assert!(execs.contains_key("fresh") && !execs.contains_key("old"));
        for i in 0..EXEC_MAX_EXITED + 5 {
            execs.insert(format!("e{i}"), exited_process(now));
        }
        prune_execs(&mut execs, now);
        assert_eq!(execs.len(), EXEC_MAX_EXITED);
    }

    #[test]
    fn lifecycle_transitions() {
        assert_eq!(Created.next(Event::Start), Some(Running));
        assert_eq!(Running.next(Event::Pause), Some(Paused));
        assert_eq!(Paused.next(Event::Resume), Some(Running));
        assert_eq!(Running.next(Event::Start), None);
        assert_eq!(Stopped.next(Event::Start), None);
        assert_eq!(Created.next(Event::Pause), None);
        assert_eq!(Paused.next(Event::InitExited), Some(Stopped));
    }
}
