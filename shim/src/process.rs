//! Processes of a task: one trait, three implementations.
//! - [`ContainerInit`]: a workload container's init process, run by the agent.
//! - [`ExecProcess`]: an exec'd process in a container, run by the agent.
//! - [`SandboxInit`]: the pod sandbox's stand-in for `pause`: the sandbox itself (the
//!   agent is the pod's PID 1, so no pause binary runs; its exit is the sandbox's exit).
//!
//! Each has a [`ProcessCore`] with the lifecycle state machine ([`ProcessState`]), whose
//! transitions all live in [`ProcessState::apply`].

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bulkhead_protocol::agent as pb;
use tokio::sync::watch;

use crate::agent::{AgentClient, AgentClientError};
use crate::error::TaskError;
pub use crate::exit::ExitInfo;
use crate::io::{IoSession, Stdio};
use crate::sandbox::Sandbox;

/// Lifecycle of one process, as containerd sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessState {
    /// Exists but has not started; `pid` is 0 until something exists (an exec before Start).
    Created {
        pid: u32,
    },
    Running {
        pid: u32,
    },
    Paused {
        pid: u32,
    },
    Exited {
        pid: u32,
        exit: ExitInfo,
    },
}

/// What can happen to a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessEvent {
    Started { pid: u32 },
    Paused,
    Resumed,
    Exited(ExitInfo),
}

impl ProcessState {
    /// The one place where transitions are decided.
    pub fn apply(self, event: ProcessEvent) -> Result<ProcessState, TaskError> {
        use ProcessEvent as E;
        use ProcessState as S;
        match (self, event) {
            (S::Created { .. }, E::Started { pid }) => Ok(S::Running { pid }),
            (S::Running { pid }, E::Paused) => Ok(S::Paused { pid }),
            (S::Paused { pid }, E::Resumed) => Ok(S::Running { pid }),
            (S::Running { pid } | S::Paused { pid }, E::Exited(exit)) => Ok(S::Exited { pid, exit }),
            // A process that never started can still be declared dead (sandbox gone).
            (S::Created { pid }, E::Exited(exit)) => Ok(S::Exited { pid, exit }),
            (S::Exited { .. }, E::Exited(_)) => Ok(self),
            (state, event) => {
                Err(TaskError::FailedPrecondition(format!("process is {}, cannot apply {event:?}", state.name())))
            }
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            ProcessState::Created { .. } => "created",
            ProcessState::Running { .. } => "running",
            ProcessState::Paused { .. } => "paused",
            ProcessState::Exited { .. } => "stopped",
        }
    }

    pub fn pid(&self) -> u32 {
        match *self {
            ProcessState::Created { pid }
            | ProcessState::Running { pid }
            | ProcessState::Paused { pid }
            | ProcessState::Exited { pid, .. } => pid,
        }
    }

    pub fn exit(&self) -> Option<ExitInfo> {
        match *self {
            ProcessState::Exited { exit, .. } => Some(exit),
            _ => None,
        }
    }
}

/// What every process has: identity, stdio, state, and a way to wait for the exit.
pub struct ProcessCore {
    pub container_id: String,
    /// `None` for a container's init process.
    pub exec_id: Option<String>,
    pub stdio: Stdio,
    state: Mutex<ProcessState>,
    exited: watch::Sender<Option<ExitInfo>>,
    pub io: tokio::sync::Mutex<IoSession>,
}

impl ProcessCore {
    /// A process not yet created anywhere (an exec before Start).
    pub fn new(container_id: &str, exec_id: Option<&str>, stdio: Stdio) -> Self {
        Self::created(container_id, exec_id, stdio, 0)
    }

    /// A process that exists as `pid` but has not started (runc's created init).
    pub fn created(container_id: &str, exec_id: Option<&str>, stdio: Stdio, pid: u32) -> Self {
        let (exited, _) = watch::channel(None);
        Self {
            container_id: container_id.into(),
            exec_id: exec_id.map(Into::into),
            stdio,
            state: Mutex::new(ProcessState::Created { pid }),
            exited,
            io: tokio::sync::Mutex::new(IoSession::empty()),
        }
    }

    /// The id containerd uses in events: the exec id, or the container id for init.
    pub fn event_id(&self) -> &str {
        self.exec_id.as_deref().unwrap_or(&self.container_id)
    }

    pub fn state(&self) -> ProcessState {
        *self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies `event`; on exit, wakes every waiter.
    pub fn transition(&self, event: ProcessEvent) -> Result<ProcessState, TaskError> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let next = state.apply(event)?;
        *state = next;
        if let ProcessState::Exited { exit, .. } = next {
            self.exited.send_replace(Some(exit));
        }
        Ok(next)
    }

    /// Resolves when the process has exited (immediately if it already has).
    pub async fn wait(&self) -> ExitInfo {
        let mut rx = self.exited.subscribe();
        loop {
            if let Some(exit) = *rx.borrow_and_update() {
                return exit;
            }
            if rx.changed().await.is_err() {
                // The sender lives in self, so this cannot happen while we are borrowed.
                return ExitInfo::from_agent(255, 0, false);
            }
        }
    }

    /// Refuses signals to a process that is not running, as runc's shim does
    /// (containerd maps NotFound to "process already finished").
    pub fn ensure_alive(&self) -> Result<(), TaskError> {
        self.ensure_signallable(false)
    }

    /// Like [`ProcessCore::ensure_alive`], but a created, not yet started process may be
    /// signalled too when something already exists to receive it (a created container's init
    /// waits in the agent; runc allows killing it likewise).
    pub fn ensure_signallable(&self, created_exists: bool) -> Result<(), TaskError> {
        match self.state() {
            ProcessState::Running { .. } | ProcessState::Paused { .. } => Ok(()),
            ProcessState::Created { .. } if created_exists => Ok(()),
            // FailedPrecondition, not NotFound: containerd's WithProcessKill then deletes at
            // once instead of waiting for an exit that never comes (an exec whose start failed).
            ProcessState::Created { .. } => Err(TaskError::FailedPrecondition("process is not started".into())),
            ProcessState::Exited { .. } => Err(TaskError::NotFound("process already finished".into())),
        }
    }
}

/// How to wait for a started process's exit (run by the task's exit watcher).
pub enum ExitSource {
    /// The agent's WaitProcess, which cannot outlive the pod's sandbox.
    Agent {
        agent: Arc<AgentClient>,
        sandbox: Arc<dyn Sandbox>,
    },
    Sandbox(Arc<dyn Sandbox>),
}

#[async_trait]
pub trait Process: Send + Sync {
    fn core(&self) -> &ProcessCore;

    /// Starts the process; returns its pid.
    async fn start(&self) -> Result<u32, TaskError>;

    async fn kill(&self, signal: u32, all: bool) -> Result<(), TaskError>;

    async fn resize_pty(&self, cols: u32, rows: u32) -> Result<(), TaskError>;

    /// Where the exit watcher learns of this process's exit.
    fn exit_source(&self) -> ExitSource;

    /// containerd's CloseIO(stdin).
    async fn close_stdin(&self) -> Result<(), TaskError> {
        self.core().io.lock().await.close_stdin();
        Ok(())
    }
}

/// A signal cannot reach a process because the agent connection failed: the pod's processes
/// are beyond the shim's reach, so the sandbox is ended (its processes die with the agent) and
/// the kill counts as done. Without this a broken or hostile agent leaves a pod that can never
/// be stopped.
pub async fn end_unreachable_pod(sandbox: &Arc<dyn Sandbox>, cause: &AgentClientError) -> Result<(), TaskError> {
    tracing::error!("the agent is unreachable ({cause}); ending the pod's sandbox so its processes stop");
    sandbox.end_unreachable().await?;
    Ok(())
}

/// A workload container's init process.
pub struct ContainerInit {
    pub core: ProcessCore,
    pub agent: Arc<AgentClient>,
    pub sandbox: Arc<dyn Sandbox>,
}

#[async_trait]
impl Process for ContainerInit {
    fn core(&self) -> &ProcessCore {
        &self.core
    }

    async fn start(&self) -> Result<u32, TaskError> {
        let pid = self.agent.start_container(&self.core.container_id).await?;
        self.core.transition(ProcessEvent::Started { pid })?;
        Ok(pid)
    }

    async fn kill(&self, signal: u32, all: bool) -> Result<(), TaskError> {
        self.core.ensure_signallable(true)?;
        match self.agent.signal_process(&self.core.container_id, None, signal, all).await {
            Err(e) if e.is_transport() => end_unreachable_pod(&self.sandbox, &e).await,
            other => Ok(other?),
        }
    }

    async fn resize_pty(&self, cols: u32, rows: u32) -> Result<(), TaskError> {
        self.agent.resize_pty(&self.core.container_id, None, cols, rows).await?;
        Ok(())
    }

    fn exit_source(&self) -> ExitSource {
        ExitSource::Agent { agent: self.agent.clone(), sandbox: self.sandbox.clone() }
    }

    async fn close_stdin(&self) -> Result<(), TaskError> {
        self.core.io.lock().await.close_stdin();
        self.agent.close_stdin(&self.core.container_id, None).await?;
        Ok(())
    }
}

/// A process exec'd into a running container.
pub struct ExecProcess {
    pub core: ProcessCore,
    pub agent: Arc<AgentClient>,
    pub sandbox: Arc<dyn Sandbox>,
    /// The OCI `process` object containerd sent, as JSON.
    pub process_json: Vec<u8>,
}

impl ExecProcess {
    fn exec_id(&self) -> &str {
        self.core.exec_id.as_deref().unwrap_or_default()
    }
}

#[async_trait]
impl Process for ExecProcess {
    fn core(&self) -> &ProcessCore {
        &self.core
    }

    async fn start(&self) -> Result<u32, TaskError> {
        let req = pb::ExecProcessRequest {
            container_id: self.core.container_id.clone(),
            exec_id: self.exec_id().into(),
            process_json: self.process_json.clone(),
            stdio: Some(crate::trans::stdio_config(&self.core.stdio)).into(),
            ..Default::default()
        };
        let pid = self.agent.exec_process(req).await?;
        self.core.transition(ProcessEvent::Started { pid })?;
        Ok(pid)
    }

    async fn kill(&self, signal: u32, _all: bool) -> Result<(), TaskError> {
        self.core.ensure_alive()?;
        match self.agent.signal_process(&self.core.container_id, Some(self.exec_id()), signal, false).await {
            Err(e) if e.is_transport() => end_unreachable_pod(&self.sandbox, &e).await,
            other => Ok(other?),
        }
    }

    async fn resize_pty(&self, cols: u32, rows: u32) -> Result<(), TaskError> {
        self.agent.resize_pty(&self.core.container_id, Some(self.exec_id()), cols, rows).await?;
        Ok(())
    }

    fn exit_source(&self) -> ExitSource {
        ExitSource::Agent { agent: self.agent.clone(), sandbox: self.sandbox.clone() }
    }

    async fn close_stdin(&self) -> Result<(), TaskError> {
        self.core.io.lock().await.close_stdin();
        self.agent.close_stdin(&self.core.container_id, Some(self.exec_id())).await?;
        Ok(())
    }
}

/// The pod sandbox's init: the sandbox itself.
pub struct SandboxInit {
    pub core: ProcessCore,
    pub sandbox: Arc<dyn Sandbox>,
}

#[async_trait]
impl Process for SandboxInit {
    fn core(&self) -> &ProcessCore {
        &self.core
    }

    async fn start(&self) -> Result<u32, TaskError> {
        let pid = self.sandbox.pid();
        self.core.transition(ProcessEvent::Started { pid })?;
        Ok(pid)
    }

    async fn kill(&self, signal: u32, _all: bool) -> Result<(), TaskError> {
        self.core.ensure_signallable(true)?;
        self.sandbox.signal(signal).await?;
        Ok(())
    }

    async fn resize_pty(&self, _cols: u32, _rows: u32) -> Result<(), TaskError> {
        Err(TaskError::FailedPrecondition("the pod sandbox has no terminal".into()))
    }

    fn exit_source(&self) -> ExitSource {
        ExitSource::Sandbox(self.sandbox.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    fn exit(status: u32) -> ExitInfo {
        ExitInfo { status, at: UNIX_EPOCH, oom_killed: false }
    }

    #[test]
    fn lifecycle_transitions() {
        let s = ProcessState::Created { pid: 7 };
        assert_eq!(s.pid(), 7);
        let s = s.apply(ProcessEvent::Started { pid: 7 }).unwrap();
        assert_eq!(s, ProcessState::Running { pid: 7 });
        let s = s.apply(ProcessEvent::Paused).unwrap();
        let s = s.apply(ProcessEvent::Resumed).unwrap();
        let s = s.apply(ProcessEvent::Exited(exit(3))).unwrap();
        assert_eq!(s.exit().unwrap().status, 3);
        assert_eq!(s.pid(), 7);
        assert_eq!(s.name(), "stopped");
    }

    #[test]
    fn invalid_transitions_are_refused() {
        assert!(ProcessState::Created { pid: 0 }.apply(ProcessEvent::Paused).is_err());
        let running = ProcessState::Running { pid: 1 };
        assert!(running.apply(ProcessEvent::Started { pid: 2 }).is_err());
        assert!(running.apply(ProcessEvent::Resumed).is_err());
        let exited = ProcessState::Exited { pid: 1, exit: exit(0) };
        assert!(exited.apply(ProcessEvent::Started { pid: 1 }).is_err());
        // A second exit report keeps the first.
        assert_eq!(exited.apply(ProcessEvent::Exited(exit(9))).unwrap(), exited);
    }

    #[tokio::test]
    async fn waiters_wake_on_exit_and_late_waiters_see_it() {
        let core = Arc::new(ProcessCore::new("c1", None, Stdio::default()));
        core.transition(ProcessEvent::Started { pid: 5 }).unwrap();
        let waiter = {
            let core = core.clone();
            tokio::spawn(async move { core.wait().await })
        };
        tokio::task::yield_now().await;
        core.transition(ProcessEvent::Exited(exit(137))).unwrap();
        assert_eq!(waiter.await.unwrap().status, 137);
        assert_eq!(core.wait().await.status, 137);
    }

    #[test]
    fn signalling_an_exited_process_is_not_found() {
        let core = ProcessCore::new("c1", None, Stdio::default());
        core.transition(ProcessEvent::Started { pid: 5 }).unwrap();
        core.transition(ProcessEvent::Exited(exit(0))).unwrap();
        assert!(matches!(core.ensure_alive(), Err(TaskError::NotFound(_))));
        assert!(matches!(core.ensure_signallable(true), Err(TaskError::NotFound(_))));
        let created = ProcessCore::new("c2", None, Stdio::default());
        assert!(created.ensure_signallable(true).is_ok());
        assert!(matches!(created.ensure_alive(), Err(TaskError::FailedPrecondition(_))));
    }
}
