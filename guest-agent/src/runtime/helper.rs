//! The `__libcontainer` helper: one libcontainer create or exec in a fresh, single-threaded
//! process. libcontainer clones and runs Rust code in the children; doing that from the
//! multi-threaded agent risks children inheriting a lock held by another thread. The helper
//! exits right after, so the container process is re-parented to the agent (PID 1 /
//! subreaper), whose reaper then sees its exit.
//!
//! Interface: stdio for the container on fds 3,4,5 (unless a console socket is used), the
//! outcome as JSON in the `--result` file: `{"pid": N}` or `{"error": "..."}`.

use std::{
    os::fd::{FromRawFd, OwnedFd},
    path::PathBuf,
    process::ExitCode,
};

use clap::{Args, Subcommand};
use libcontainer::{
    container::builder::ContainerBuilder,
    oci_spec::runtime::Spec,
    syscall::syscall::SyscallType,
    workload::{default::DefaultExecutor, Executor, ExecutorError, ExecutorValidationError},
};
use serde::{Deserialize, Serialize};

#[derive(Debug, Args)]
pub struct HelperOp {
    #[command(subcommand)]
    pub cmd: HelperCmd,
}

#[derive(Debug, Args)]
pub struct Common {
    #[arg(long)]
    pub root: PathBuf,
    #[arg(long)]
    pub id: String,
    #[arg(long)]
    pub result: PathBuf,
    #[arg(long)]
    pub console_socket: Option<PathBuf>,
    /// Container stdio is on fds 3 (stdin), 4 (stdout), 5 (stderr).
    #[arg(long)]
    pub stdio_fds: bool,
    /// Compiled seccomp filters (crate::seccomp::encode) to install right before execve.
    #[arg(long)]
    pub seccomp: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum HelperCmd {
    Create {
        #[command(flatten)]
        common: Common,
        #[arg(long)]
        bundle: PathBuf,
    },
    Exec {
        #[command(flatten)]
        common: Common,
        #[arg(long)]
        process: PathBuf,
    },
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HelperResult {
    Pid(i32),
    Error(String),
}

pub fn main(op: HelperOp) -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BULKHEAD_HELPER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let (common, outcome) = match op.cmd {
        HelperCmd::Create { common, bundle } => {
            let r = create(&common, bundle);
            (common, r)
        }
        HelperCmd::Exec { common, process } => {
            let r = exec(&common, process);
            (common, r)
        }
    };
    let (result, code) = match outcome {
        Ok(pid) => (HelperResult::Pid(pid), ExitCode::SUCCESS),
        Err(e) => (HelperResult::Error(e), ExitCode::FAILURE),
    };
    let json = serde_json::to_vec(&result).unwrap_or_else(|_| b"{\"error\":\"encode\"}".to_vec());
    if let Err(e) = std::fs::write(&common.result, json) {
        eprintln!("bulkhead-agent helper: writing result: {e}");
        return ExitCode::FAILURE;
    }
    code
}

fn builder(c: &Common) -> Result<ContainerBuilder, String> {
    let mut b = ContainerBuilder::new(c.id.clone(), SyscallType::Linux)
        .with_root_path(&c.root)
        .map_err(|e| e.to_string())?
        .with_console_socket(c.console_socket.as_ref());
    if c.stdio_fds {
        // SAFETY: the agent placed exactly these three descriptors here for us (pre_exec
        // dup2) and nothing else in this process owns them.
        let (i, o, e) = unsafe { (OwnedFd::from_raw_fd(3), OwnedFd::from_raw_fd(4), OwnedFd::from_raw_fd(5)) };
        b = b.with_stdin(i).with_stdout(o).with_stderr(e);
    }
    if let Some(path) = &c.seccomp {
        let bytes = std::fs::read(path).map_err(|e| format!("read {}: {e}", path.display()))?;
        if bytes.len() > crate::seccomp::MAX_FILTERS * (4 + crate::seccomp::MAX_INSNS * 8) {
            return Err("compiled seccomp file too large".into());
        }
        let filters = crate::seccomp::decode(&bytes).map_err(|e| e.to_string())?;
        b = b.with_executor(SeccompExecutor { filters: std::sync::Arc::new(filters) });
    }
    Ok(b)
}

/// Installs the container's seccomp filters, then runs the workload as libcontainer would.
/// Runs in the container init after capabilities are dropped and no_new_privs is set.
#[derive(Clone)]
struct SeccompExecutor {
    filters: std::sync::Arc<Vec<seccompiler::BpfProgram>>,
}

impl Executor for SeccompExecutor {
    fn exec(&self, spec: &Spec) -> Result<(), ExecutorError> {
        for f in self.filters.iter() {
            seccompiler::apply_filter(f).map_err(|e| ExecutorError::Other(format!("seccomp: {e}")))?;
        }
        DefaultExecutor {}.exec(spec)
    }

    fn validate(&self, spec: &Spec) -> Result<(), ExecutorValidationError> {
        DefaultExecutor {}.validate(spec)
    }
}

fn create(c: &Common, bundle: PathBuf) -> Result<i32, String> {
    let container = builder(c)?
        .validate_id()
        .map_err(|e| e.to_string())?
        .as_init(bundle)
        .with_systemd(false)
        .with_detach(true)
        .build()
        .map_err(|e| format!("libcontainer create: {e}"))?;
    container.pid().map(|p| p.as_raw()).ok_or_else(|| "libcontainer create returned no pid".to_owned())
}

fn exec(c: &Common, process: PathBuf) -> Result<i32, String> {
    let pid = builder(c)?
        .as_tenant()
        .with_process(Some(process))
        .with_detach(true)
        .build()
        .map_err(|e| format!("libcontainer exec: {e}"))?;
    Ok(pid.as_raw())
}
