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
        /// The exec's process enters its container's user namespace (a hostUsers: false pod's)
        /// last ([`enter_user_namespace`]).
        #[arg(long)]
        join_user_namespace: bool,
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
        HelperCmd::Exec { common, process, join_user_namespace } => {
            let r = exec(&common, process, join_user_namespace);
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

fn builder(c: &Common, join_user_namespace: bool) -> Result<ContainerBuilder, String> {
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
    let mut filters = Vec::new();
    if let Some(path) = &c.seccomp {
        let bytes = std::fs::read(path).map_err(|e| format!("read {}: {e}", path.display()))?;
        if bytes.len() > crate::seccomp::MAX_FILTERS * (4 + crate::seccomp::MAX_INSNS * 8) {
            return Err("compiled seccomp file too large".into());
        }
        filters = crate::seccomp::decode(&bytes).map_err(|e| e.to_string())?;
    }
    if !filters.is_empty() || join_user_namespace {
        b = b.with_executor(WorkloadExecutor { filters: std::sync::Arc::new(filters), join_user_namespace });
    }
    Ok(b)
}

/// Enters the container's user namespace if asked, installs the container's seccomp
/// filters, then runs the workload as libcontainer would. Runs in the container's process after
/// libcontainer set its ids and capabilities and no_new_privs.
#[derive(Clone)]
struct WorkloadExecutor {
    filters: std::sync::Arc<Vec<seccompiler::BpfProgram>>,
    join_user_namespace: bool,
}

impl Executor for WorkloadExecutor {
    fn exec(&self, spec: &Spec) -> Result<(), ExecutorError> {
        if self.join_user_namespace {
            enter_user_namespace(spec).map_err(|e| ExecutorError::Other(format!("pod user namespace: {e}")))?;
        }
        for f in self.filters.iter() {
            seccompiler::apply_filter(f).map_err(|e| ExecutorError::Other(format!("seccomp: {e}")))?;
        }
        DefaultExecutor {}.exec(spec)
    }

    fn validate(&self, spec: &Spec) -> Result<(), ExecutorValidationError> {
        DefaultExecutor {}.validate(spec)
    }
}

/// Moves an exec's process into its container's user namespace (a hostUsers: false pod's),
/// which libcontainer 0.7 never joins an exec to (crate::pod_userns): the process is still in the
/// agent's user namespace as the pod's owner, which may enter it, and already in the container's
/// PID and mount namespaces, where /proc/1 is the container's init (a container of such a pod
/// has a PID namespace of its own). Entering gives it every
/// capability there and resets its bounding set, so the spec's user and capabilities are set
/// again inside: bounding and inheritable first (with CAP_SETPCAP), then the ids (caps kept
/// across them), then effective, permitted and ambient.
fn enter_user_namespace(spec: &Spec) -> Result<(), String> {
    use caps::{CapSet, CapsHashSet};
    use libcontainer::capabilities::CapabilityExt;
    use nix::unistd::{Gid, Uid};
    let ns = std::fs::File::open("/proc/1/ns/user").map_err(|e| format!("open the init's: {e}"))?;
    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWUSER).map_err(|e| format!("setns: {e}"))?;
    let process = spec.process().as_ref().ok_or("the spec has no process")?;
    let wanted = process.capabilities().as_ref();
    let set_of = |pick: fn(&oci_spec::runtime::LinuxCapabilities) -> &Option<oci_spec::runtime::Capabilities>| {
        wanted.and_then(|c| pick(c).as_ref()).map(|s| s.iter().map(|c| c.to_cap()).collect()).unwrap_or_default()
    };
    let (bounding, inheritable, permitted, effective, ambient): (
        CapsHashSet,
        CapsHashSet,
        CapsHashSet,
        CapsHashSet,
        CapsHashSet,
    ) = (
        set_of(|c| c.bounding()),
        set_of(|c| c.inheritable()),
        set_of(|c| c.permitted()),
        set_of(|c| c.effective()),
        set_of(|c| c.ambient()),
    );
    fn err(what: &'static str) -> impl Fn(caps::errors::CapsError) -> String {
        move |e| format!("{what}: {e}")
    }
    for cap in caps::all() {
        if !bounding.contains(&cap) {
            caps::drop(None, CapSet::Bounding, cap).map_err(err("drop from the bounding set"))?;
        }
    }
    caps::set(None, CapSet::Inheritable, &inheritable).map_err(err("inheritable"))?;
    let user = process.user();
    // SAFETY: prctl with PR_SET_KEEPCAPS only sets a flag of this thread.
    unsafe { libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0) };
    let groups: Vec<Gid> = user.additional_gids().iter().flatten().map(|g| Gid::from_raw(*g)).collect();
    nix::unistd::setgroups(&groups).map_err(|e| format!("setgroups: {e}"))?;
    let (gid, uid) = (Gid::from_raw(user.gid()), Uid::from_raw(user.uid()));
    nix::unistd::setresgid(gid, gid, gid).map_err(|e| format!("setresgid {gid}: {e}"))?;
    nix::unistd::setresuid(uid, uid, uid).map_err(|e| format!("setresuid {uid}: {e}"))?;
    // SAFETY: as above.
    unsafe { libc::prctl(libc::PR_SET_KEEPCAPS, 0, 0, 0, 0) };
    // Effective first: it must stay within permitted at every step.
    caps::set(None, CapSet::Effective, &effective).map_err(err("effective"))?;
    caps::set(None, CapSet::Permitted, &permitted).map_err(err("permitted"))?;
    for cap in &ambient {
        caps::raise(None, CapSet::Ambient, *cap).map_err(err("ambient"))?;
    }
    Ok(())
}

fn create(c: &Common, bundle: PathBuf) -> Result<i32, String> {
    let container = builder(c, false)?
        .validate_id()
        .map_err(|e| e.to_string())?
        .as_init(bundle)
        .with_systemd(false)
        .with_detach(true)
        .build()
        .map_err(|e| format!("libcontainer create: {e}"))?;
    container.pid().map(|p| p.as_raw()).ok_or_else(|| "libcontainer create returned no pid".to_owned())
}

fn exec(c: &Common, process: PathBuf, join_user_namespace: bool) -> Result<i32, String> {
    let pid = builder(c, join_user_namespace)?
        .as_tenant()
        .with_process(Some(process))
        .with_detach(true)
        .build()
        .map_err(|e| format!("libcontainer exec: {e}"))?;
    Ok(pid.as_raw())
}
