//! What both backends do with the host process that carries a sandbox (the namespace
//! launcher, the jailed VMM, virtiofsd): spawn it so it cannot outlive the shim, relay its log
//! lines, watch its exit, dial the agent behind it while noticing an early exit, and find it
//! again after a shim crash (pid file checked against `/proc/<pid>/cmdline`).
//!
//! Boundaries: no knowledge of what the child is; callers build the command and decide what an
//! exit means.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::sync::watch;
use tracing::{info, warn, Instrument};

use super::SandboxError;
use crate::agent::{AgentClient, Timeouts};
use crate::exit::ExitInfo;
use crate::logrelay::{self, Component, ConsoleLog, LastWords, Source};

/// Where a child's output goes: the shim log, tagged with the pod and component, and optionally
/// the pod's console log too.
#[derive(Clone)]
pub struct LogTo {
    pub pod: String,
    pub component: Component,
    pub console: Option<ConsoleLog>,
}

/// How long a retried dial waits for one attempt at most.
const DIAL_ATTEMPT: Duration = Duration::from_secs(1);
/// Pause between dial attempts.
const DIAL_RETRY: Duration = Duration::from_millis(5);
/// Largest pid file accepted.
const MAX_PID_FILE: u64 = 64;
/// How long an exit waits for the child's stderr to be read to its end, so that its last words
/// are known when the exit is seen (a grandchild holding the pipe open must not delay it more).
const LAST_WORDS_WAIT: Duration = Duration::from_millis(500);

/// A started child: its pid, its exit once it happened (status, 128+signal if signalled), and
/// the last lines it wrote to stderr.
#[derive(Clone)]
pub struct Supervised {
    pub pid: u32,
    pub exited: watch::Receiver<Option<ExitInfo>>,
    pub last_words: LastWords,
}

impl std::fmt::Debug for Supervised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervised").field("pid", &self.pid).field("exited", &self.exit()).finish_non_exhaustive()
    }
}

impl Supervised {
    /// ": it said '<last lines>'" for an error message, or "" if it wrote nothing to stderr.
    pub fn said(&self) -> String {
        self.last_words.text().map(|t| format!(": it said '{t}'")).unwrap_or_default()
    }

    /// The exit, if the child has exited.
    pub fn exit(&self) -> Option<ExitInfo> {
        *self.exited.borrow()
    }

    /// Resolves when the child has exited.
    pub async fn wait(&self) -> ExitInfo {
        let mut rx = self.exited.clone();
        loop {
            if let Some(exit) = *rx.borrow_and_update() {
                return exit;
            }
            if rx.changed().await.is_err() {
                return ExitInfo::from_agent(255, 0, false);
            }
        }
    }

    /// Sends `signal`; a child already gone is not an error.
    pub fn signal(&self, signal: Signal) -> Result<(), SandboxError> {
        if self.exit().is_some() {
            return Ok(());
        }
        match kill(Pid::from_raw(self.pid as i32), signal) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
            Err(source) => Err(SandboxError::Sys { what: format!("signal {signal} to pid {}", self.pid), source }),
        }
    }

    /// SIGTERM, up to `grace` for the child to exit, then SIGKILL and up to `KILL_WAIT` more.
    /// Returns whether it exited.
    pub async fn stop(&self, grace: Duration) -> bool {
        const KILL_WAIT: Duration = Duration::from_secs(5);
        if self.exit().is_some() {
            return true;
        }
        if !grace.is_zero() {
            let _ = self.signal(Signal::SIGTERM);
            if tokio::time::timeout(grace, self.wait()).await.is_ok() {
                return true;
            }
        }
        let _ = self.signal(Signal::SIGKILL);
        tokio::time::timeout(KILL_WAIT, self.wait()).await.is_ok()
    }
}

/// Spawns `command` as a supervised child named `what` (for logs): stdin from /dev/null, its
/// stdout/stderr relayed as `log` says (bounded and rate-limited by [`logrelay`]), in its own
/// process group (a signal aimed at the
/// shim's group is not the pod's), and SIGKILLed by the kernel if the shim dies. Its tasks log
/// under `span`.
pub fn spawn(
    mut command: tokio::process::Command,
    what: &'static str,
    span: &tracing::Span,
    log: LogTo,
) -> Result<Supervised, SandboxError> {
    command
        // Log lines are relayed into the shim log: plain text, no colour codes.
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    // SAFETY: the closure only calls prctl, which is async-signal-safe. The parent-death signal
    // follows the spawning thread, a runtime worker that lives as long as the shim.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = command.spawn().map_err(|source| SandboxError::Io { what: format!("spawn {what}"), source })?;
    let pid = child.id().unwrap_or_default();
    let source = |stream| Source { pod: log.pod.clone(), component: log.component, stream };
    if let Some(pipe) = child.stdout.take() {
        tokio::spawn(logrelay::relay(pipe, source("stdout"), log.console.clone(), None).instrument(span.clone()));
    }
    let last_words = LastWords::default();
    let stderr = child.stderr.take().map(|pipe| {
        let relay = logrelay::relay(pipe, source("stderr"), log.console.clone(), Some(last_words.clone()));
        tokio::spawn(relay.instrument(span.clone()))
    });
    let (exit_tx, exit_rx) = watch::channel(None);
    tokio::spawn(
        async move {
            let status = child.wait().await;
            if let Some(stderr) = stderr {
                let _ = tokio::time::timeout(LAST_WORDS_WAIT, stderr).await;
            }
            let exit = match status {
                Ok(status) => {
                    let code = status
                        .code()
                        .map(|c| c as u32)
                        .or_else(|| status.signal().map(|s| 128 + s as u32))
                        .unwrap_or(255);
                    ExitInfo::from_agent(code, 0, false)
                }
                Err(e) => {
                    warn!(child = what, "wait: {e}");
                    ExitInfo::from_agent(255, 0, false)
                }
            };
            info!(child = what, pid, status = exit.status, "exited");
            exit_tx.send_replace(Some(exit));
        }
        .instrument(span.clone()),
    );
    Ok(Supervised { pid, exited: exit_rx, last_words })
}

/// Why the agent could not be reached.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DialFailure {
    #[error("it exited with status {status} before the agent answered{said} (last dial: {last})")]
    Exited { status: u32, said: String, last: String },
    #[error("the agent did not answer within {waited:?} at {socket} (last dial: {last})")]
    NoAnswer { waited: Duration, socket: PathBuf, last: String },
}

/// Dials the agent behind `socket` (CONNECT handshake, then the version check) until it
/// answers, `child` exits, or `timeouts.connect` passes.
pub async fn dial_agent(socket: &Path, timeouts: Timeouts, child: &Supervised) -> Result<AgentClient, DialFailure> {
    let deadline = Instant::now() + timeouts.connect;
    let mut last = String::from("socket never appeared");
    loop {
        if let Some(exit) = child.exit() {
            return Err(DialFailure::Exited { status: exit.status, said: child.said(), last });
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if socket.exists() {
            let attempt = Timeouts { connect: left.min(DIAL_ATTEMPT), rpc: timeouts.rpc.min(left.max(DIAL_ATTEMPT)) };
            let mut exited = child.exited.clone();
            tokio::select! {
                dialled = AgentClient::connect(socket, attempt) => match dialled {
                    // The attempt's short deadlines were for this dial only: the client keeps the
                    // configured ones for its life (each exec's stream dial, every RPC).
                    Ok(agent) => return Ok(agent.with_timeouts(timeouts)),
                    Err(e) => last = e.to_string(),
                },
                // An exit ends a pending attempt at once instead of at its timeout.
                _ = exited.wait_for(Option::is_some) => {}
            }
        }
        if Instant::now() >= deadline {
            return Err(DialFailure::NoAnswer { waited: timeouts.connect, socket: socket.to_owned(), last });
        }
        let mut exited = child.exited.clone();
        tokio::select! {
            _ = tokio::time::sleep(DIAL_RETRY) => {}
            _ = exited.wait_for(Option::is_some) => {}
        }
    }
}

/// Records a child's pid so that `delete` after a shim crash finds it.
pub fn write_pid_file(path: &Path, pid: u32) -> Result<(), SandboxError> {
    std::fs::write(path, pid.to_string())
        .map_err(|source| SandboxError::Io { what: format!("write {}", path.display()), source })
}

fn read_pid_file(path: &Path) -> Option<i32> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path).ok()?.take(MAX_PID_FILE).read_to_string(&mut text).ok()?;
    text.trim().parse::<i32>().ok().filter(|pid| *pid > 1)
}

/// Whether process `pid` runs with every one of `args` as a whole argument: the guard against
/// pid reuse after a crash (by anyone, another pod's child included).
pub fn cmdline_has(pid: i32, args: &[&str]) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|cmdline| {
            let have: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            !args.is_empty() && args.iter().all(|want| have.contains(&want.as_bytes()))
        })
        .unwrap_or(false)
}

/// Kills the process recorded in `pid_file` if it still is ours (its command line has every one
/// of `args`), and waits a bounded time for it to go. For cleanup after a shim crash.
pub async fn kill_recorded(pid_file: &Path, args: &[&str]) {
    let Some(pid) = read_pid_file(pid_file) else { return };
    if !cmdline_has(pid, args) {
        return;
    }
    let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    // It may be someone else's zombie to reap: a zombie has an empty command line.
    for _ in 0..200 {
        if !cmdline_has(pid, args) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    warn!(pid, pid_file = %pid_file.display(), "recorded process did not go after SIGKILL");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span() -> tracing::Span {
        tracing::Span::none()
    }

    fn log() -> LogTo {
        LogTo { pod: "test-pod".into(), component: Component::Agent, console: None }
    }

    #[test]
    fn only_matching_command_lines_are_ours() {
        let me = std::process::id() as i32;
        let own: Vec<String> = std::env::args().collect();
        assert!(cmdline_has(me, &[own[0].as_str()]));
        assert!(!cmdline_has(me, &[own[0].as_str(), "--surely-not-an-argument"]));
        assert!(!cmdline_has(me, &[]), "no arguments never match");
        assert!(!cmdline_has(i32::MAX, &["x"]));
    }

    #[test]
    fn pid_files_are_bounded_and_never_name_init() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.pid");
        write_pid_file(&path, 1234).unwrap();
        assert_eq!(read_pid_file(&path), Some(1234));
        std::fs::write(&path, "1").unwrap();
        assert_eq!(read_pid_file(&path), None);
        std::fs::write(&path, "9".repeat(1000)).unwrap();
        assert_eq!(read_pid_file(&path), None);
        assert_eq!(read_pid_file(&dir.path().join("missing")), None);
    }

    #[tokio::test]
    async fn exit_status_and_signals_are_seen() {
        let mut cmd = tokio::process::Command::new("/bin/sh");
        cmd.args(["-c", "echo to-the-log; exit 7"]);
        let child = spawn(cmd, "test child", &span(), log()).unwrap();
        assert_eq!(child.wait().await.status, 7);

        let mut cmd = tokio::process::Command::new("/bin/sleep");
        cmd.arg("30");
        let child = spawn(cmd, "sleeper", &span(), log()).unwrap();
        assert!(child.stop(Duration::from_secs(5)).await);
        assert_eq!(child.exit().unwrap().status, 128 + libc::SIGTERM as u32);
    }

    #[tokio::test]
    async fn a_stubborn_child_is_killed_after_the_grace() {
        let mut cmd = tokio::process::Command::new("/bin/sh");
        cmd.args(["-c", "trap '' TERM; while true; do sleep 0.05; done"]);
        let child = spawn(cmd, "stubborn", &span(), log()).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let started = Instant::now();
        assert!(child.stop(Duration::from_millis(200)).await);
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(child.exit().unwrap().status, 128 + libc::SIGKILL as u32);
    }

    #[tokio::test]
    async fn dialling_notices_an_early_exit_and_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("a.sock");
        let timeouts = Timeouts { connect: Duration::from_secs(30), rpc: Duration::from_secs(1) };
        let mut cmd = tokio::process::Command::new("/bin/sh");
        cmd.args(["-c", "sleep 0.2; echo 'starting' >&2; echo 'error: cannot open the tap' >&2; exit 3"]);
        let child = spawn(cmd, "early exit", &span(), log()).unwrap();
        let started = Instant::now();
        let err = dial_agent(&socket, timeouts, &child).await.err().unwrap();
        assert!(matches!(err, DialFailure::Exited { status: 3, .. }), "{err}");
        // Its own reason reaches the error that containerd and kubelet show.
        assert!(err.to_string().contains("it said 'starting | error: cannot open the tap'"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(10), "noticed at once, not at the timeout");

        // A listener that never answers the handshake: the deadline ends the wait.
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let mut cmd = tokio::process::Command::new("/bin/sleep");
        cmd.arg("30");
        let child = spawn(cmd, "silent", &span(), log()).unwrap();
        let timeouts = Timeouts { connect: Duration::from_millis(300), rpc: Duration::from_secs(1) };
        let started = Instant::now();
        let err = dial_agent(&socket, timeouts, &child).await.err().unwrap();
        assert!(matches!(err, DialFailure::NoAnswer { .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
        assert!(child.stop(Duration::ZERO).await);
    }

    #[tokio::test]
    async fn recorded_processes_are_killed_only_when_they_match() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("child.pid");
        let marker = format!("bulkhead-test-{}", std::process::id());
        let mut cmd = tokio::process::Command::new("/bin/sh");
        cmd.args(["-c", "sleep 30; true", &marker]);
        let child = spawn(cmd, "recorded", &span(), log()).unwrap();
        write_pid_file(&pid_file, child.pid).unwrap();
        kill_recorded(&pid_file, &["-c", "not-the-marker"]).await;
        assert!(child.exit().is_none(), "a process that does not match is left alone");
        kill_recorded(&pid_file, &["-c", &marker]).await;
        let exit = tokio::time::timeout(Duration::from_secs(5), child.wait()).await.unwrap();
        assert_eq!(exit.status, 128 + libc::SIGKILL as u32);
    }
}
