//! The bridge to youki's libcontainer. Create and exec run in the `__libcontainer` helper
//! process (see [`helper`]); start, pause, resume and delete are in-process (no clone) on a
//! blocking thread.

pub mod helper;

use std::{
    os::{
        fd::{AsRawFd, OwnedFd, RawFd},
        unix::process::CommandExt,
    },
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use libcontainer::container::Container;

use crate::{
    error::{AgentError, Result},
    reaper::Reaper,
};
use helper::HelperResult;

/// Generous: create includes cgroup setup and mounts; exceeding it means libcontainer hung.
const HELPER_TIMEOUT: Duration = Duration::from_secs(60);

/// What the container process gets as stdio.
pub enum ChildIo {
    /// stdin, stdout, stderr.
    Pipes([OwnedFd; 3]),
    /// libcontainer connects here and sends the pty master.
    Console(PathBuf),
}

#[derive(Clone)]
pub struct Runtime {
    pub root: PathBuf,
    exe: PathBuf,
    reaper: Reaper,
}

impl Runtime {
    pub fn new(root: PathBuf, reaper: Reaper) -> std::io::Result<Self> {
        std::fs::create_dir_all(&root)?;
        // Resolve now: /proc/self/exe keeps working even if the binary is replaced on disk.
        let exe = std::fs::read_link("/proc/self/exe")?;
        Ok(Self { root, exe, reaper })
    }

    /// Creates container `id` from `bundle`; its helper first enters the namespaces `join` holds
    /// (a pod's own IPC and UTS namespaces, crate::pod_userns), so the container inherits them.
    pub async fn create(
        &self,
        id: &str,
        bundle: &Path,
        io: ChildIo,
        seccomp: Option<&Path>,
        join: &[RawFd],
    ) -> Result<i32> {
        let result = bundle.join("create-result.json");
        let args = vec!["create".into(), "--bundle".into(), bundle.display().to_string()];
        self.run_helper(id, args, seccomp, &result, io, join).await
    }

    /// Execs `process_json` in container `id`; its helper first enters the namespaces `join` holds
    /// (a pod's own IPC and UTS namespaces), and its process the container's user namespace if
    /// `join_user_namespace` (crate::pod_userns).
    pub async fn exec(
        &self,
        id: &str,
        process_json: &Path,
        io: ChildIo,
        seccomp: Option<&Path>,
        join: &[RawFd],
        join_user_namespace: bool,
    ) -> Result<i32> {
        let result = process_json.with_extension("result.json");
        let mut args = vec!["exec".into(), "--process".into(), process_json.display().to_string()];
        if join_user_namespace {
            args.push("--join-user-namespace".into());
        }
        self.run_helper(id, args, seccomp, &result, io, join).await
    }

    async fn run_helper(
        &self,
        id: &str,
        mut args: Vec<String>,
        seccomp: Option<&Path>,
        result: &Path,
        io: ChildIo,
        join: &[RawFd],
    ) -> Result<i32> {
        let _ = std::fs::remove_file(result);
        if let Some(s) = seccomp {
            args.extend(["--seccomp".into(), s.display().to_string()]);
        }
        args.extend([
            "--root".into(),
            self.root.display().to_string(),
            "--id".into(),
            id.into(),
            "--result".into(),
            result.display().to_string(),
        ]);
        let mut cmd = Command::new(&self.exe);
        cmd.arg("__libcontainer").args(&args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::inherit());
        // Keep the fds alive until after spawn.
        let mut high: Vec<OwnedFd> = Vec::new();
        match io {
            ChildIo::Console(path) => {
                cmd.arg("--console-socket").arg(path);
            }
            ChildIo::Pipes(fds) => {
                cmd.arg("--stdio-fds");
                // Move them above 100 first so dup2 onto 3..5 cannot clobber a source.
                for fd in &fds {
                    let dup = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(100))
                        .map_err(|e| AgentError::internal("dup stdio fd", e))?;
                    // SAFETY: fcntl returned a fresh descriptor that we now own.
                    high.push(unsafe { std::os::fd::FromRawFd::from_raw_fd(dup) });
                }
                let raw: Vec<i32> = high.iter().map(|f| f.as_raw_fd()).collect();
                // SAFETY: only dup2 (async-signal-safe) runs between fork and exec.
                unsafe {
                    cmd.pre_exec(move || {
                        for (i, fd) in raw.iter().enumerate() {
                            if libc::dup2(*fd, 3 + i as i32) < 0 {
                                return Err(std::io::Error::last_os_error());
                            }
                        }
                        Ok(())
                    });
                }
            }
        }
        if !join.is_empty() {
            let join = join.to_vec();
            // SAFETY: only setns (a syscall) runs between fork and exec; the descriptors are the
            // caller's, open until spawn returns.
            unsafe {
                cmd.pre_exec(move || {
                    for fd in &join {
                        if libc::setns(*fd, 0) < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    Ok(())
                });
            }
        }
        let child = cmd.spawn().map_err(|e| AgentError::internal("spawn libcontainer helper", e))?;
        drop(high);
        let pid = child.id() as i32;
        // Never `child.wait()`: the reaper owns waitpid.
        let exit = tokio::time::timeout(HELPER_TIMEOUT, self.reaper.watch(pid))
            .await
            .map_err(|_| {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
                AgentError::Timeout(format!("libcontainer helper for {id}"))
            })?
            .map_err(|_| AgentError::Internal("reaper dropped the helper".into()))?;
        let bytes = std::fs::read(result).map_err(|e| {
            AgentError::Internal(format!(
                "libcontainer helper for {id} exited with {} and left no result: {e}",
                exit.code
            ))
        })?;
        match serde_json::from_slice::<HelperResult>(&bytes) {
            Ok(HelperResult::Pid(pid)) => Ok(pid),
            Ok(HelperResult::Error(e)) => Err(AgentError::FailedPrecondition(e)),
            Err(e) => Err(AgentError::internal("helper result", e)),
        }
    }

    async fn with_container<T: Send + 'static>(
        &self,
        id: &str,
        what: &'static str,
        f: impl FnOnce(&mut Container) -> std::result::Result<T, libcontainer::error::LibcontainerError> + Send + 'static,
    ) -> Result<T> {
        let root = self.root.clone();
        let id = id.to_owned();
        tokio::task::spawn_blocking(move || apply(&root, &id, what, f))
            .await
            .map_err(|e| AgentError::internal("blocking task", e))?
    }

    pub async fn start(&self, id: &str) -> Result<()> {
        self.with_container(id, "start", |c| c.start()).await
    }

    pub async fn pause(&self, id: &str) -> Result<()> {
        self.with_container(id, "pause", |c| c.pause()).await
    }

    pub async fn resume(&self, id: &str) -> Result<()> {
        self.with_container(id, "resume", |c| c.resume()).await
    }

    pub async fn delete(&self, id: &str, force: bool) -> Result<()> {
        if !self.root.join(id).exists() {
            return Ok(());
        }
        self.with_container(id, "delete", move |c| c.delete(force)).await
    }

    /// [`Self::delete`] on the calling thread, for an undo step (which runs in `Drop`).
    pub fn delete_blocking(&self, id: &str, force: bool) -> Result<()> {
        if !self.root.join(id).exists() {
            return Ok(());
        }
        apply(&self.root, id, "delete", move |c| c.delete(force))
    }
}

/// Loads container `id` from libcontainer's state under `root` and applies `f` (blocking).
fn apply<T>(
    root: &Path,
    id: &str,
    what: &str,
    f: impl FnOnce(&mut Container) -> std::result::Result<T, libcontainer::error::LibcontainerError>,
) -> Result<T> {
    let mut c =
        Container::load(root.join(id)).map_err(|e| AgentError::Internal(format!("load container {id}: {e}")))?;
    f(&mut c).map_err(|e| AgentError::FailedPrecondition(format!("{what} {id}: {e}")))
}
