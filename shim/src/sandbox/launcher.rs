//! The namespace trampoline: `containerd-shim-bulkhead-v2 __bulkhead-ns-launch ...`.
//!
//! The shim is multi-threaded (tokio), and `unshare(CLONE_NEWNS)`/`setns` want a single
//! thread, while a new PID namespace only applies to children. So the shim re-executes
//! itself as this small launcher, which, still single-threaded:
//! 1. joins the sandbox's cgroup (best effort: the agent is then accounted to the pod) and the
//!    pod network namespace (if the spec names one);
//! 2. unshares UTS, IPC and PID namespaces;
//! 3. forks: the child (PID 1 of the new PID namespace) unshares a mount namespace and makes
//!    every mount in it a slave of the host's (a recursive `MS_SLAVE`, not private: the pod's
//!    mounts stay out of the host, while the container mounts the shim makes later in the pod's
//!    shared `rootfs/` still travel in, see `namespace_mounts.rs`), mounts a fresh `/proc`, asks
//!    for SIGKILL if the launcher dies, and execs the agent, which then moves into a minimal
//!    root of its own (guest-agent README);
//! 4. waits for the agent and exits with its status (128+signal if signalled).
//!
//! The launcher itself stays in the host's mount namespace: it mounts nothing, and a copy of the
//! host's mounts held by it for the pod's lifetime would receive every other pod's container
//! mounts too.
//!
//! No user namespace here: the agent clones itself into one of its own once its
//! minimal root is built (guest-agent README, "The agent's user namespace"), which it must
//! build as host root (a sysfs for the pod's network namespace, the /dev nodes).

use std::ffi::CString;
use std::os::fd::AsFd;

use nix::mount::{mount, MsFlags};
use nix::sched::{setns, unshare, CloneFlags};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{execv, fork, ForkResult};

/// First argument that selects launcher mode.
pub const LAUNCH_ARG: &str = "__bulkhead-ns-launch";

/// Arguments of the launcher, after [`LAUNCH_ARG`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchArgs {
    /// Network namespace to join; `None` keeps the current one (host network pods).
    pub netns: Option<String>,
    /// The sandbox's cgroup (path inside each hierarchy) to join before forking the agent.
    pub cgroup: Option<String>,
    /// The agent's OOM score adjustment, set before forking it ([`set_oom_score_adj`]).
    pub oom_score_adj: Option<i32>,
    /// The agent binary and its arguments.
    pub command: Vec<String>,
}

impl LaunchArgs {
    /// Renders the arguments the shim passes after [`LAUNCH_ARG`].
    pub fn to_args(&self) -> Vec<String> {
        let dash = || "-".to_string();
        let mut args = vec![
            "--netns".to_string(),
            self.netns.clone().unwrap_or_else(dash),
            "--cgroup".to_string(),
            self.cgroup.clone().unwrap_or_else(dash),
            "--oom-score-adj".to_string(),
            self.oom_score_adj.map(|a| a.to_string()).unwrap_or_else(dash),
            "--".to_string(),
        ];
        args.extend(self.command.iter().cloned());
        args
    }

    /// Parses what [`LaunchArgs::to_args`] produced.
    pub fn parse(args: &[String]) -> Result<Self, String> {
        match args {
            [flag, netns, cg_flag, cgroup, oom_flag, oom, sep, command @ ..]
                if flag == "--netns" && cg_flag == "--cgroup" && oom_flag == "--oom-score-adj" && sep == "--" =>
            {
                if command.is_empty() {
                    return Err("launcher: no command after --".into());
                }
                let netns = (netns != "-").then(|| netns.clone());
                let cgroup = (cgroup != "-").then(|| cgroup.clone());
                let oom_score_adj = match oom.as_str() {
                    "-" => None,
                    n => Some(
                        n.parse::<i32>()
                            .ok()
                            .filter(|a| (-1000..=1000).contains(a))
                            .ok_or_else(|| format!("launcher: --oom-score-adj {n} is not in -1000..=1000"))?,
                    ),
                };
                Ok(Self { netns, cgroup, oom_score_adj, command: command.to_vec() })
            }
            _ => {
                Err("launcher: usage: --netns <path|-> --cgroup <path|-> --oom-score-adj <n|-> -- <agent> [args...]"
                    .into())
            }
        }
    }
}

/// Runs the launcher if argv asks for it; returns the exit code to use.
pub fn maybe_run_launcher() -> Option<i32> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) != Some(LAUNCH_ARG) {
        return None;
    }
    let code = match LaunchArgs::parse(&args[2..]) {
        Ok(launch) => match launch_and_wait(&launch) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("bulkhead namespace launcher: {e}");
                125
            }
        },
        Err(e) => {
            eprintln!("{e}");
            125
        }
    };
    Some(code)
}

/// Sets this process's OOM score adjustment, which the agent inherits. Written by root with
/// CAP_SYS_RESOURCE, it is also the floor below which the agent, which lacks that capability,
/// cannot go: kubelet gives the sandbox -998 and every container more (-997 for Guaranteed
/// pods, up to 1000), so the agent can give each container what its spec asks, as runc does. With
/// the floor it would otherwise inherit from the shim, a container asking for less failed to start
/// (measured in the cgroup v2 node).
fn set_oom_score_adj(adj: i32) -> Result<(), String> {
    std::fs::write("/proc/self/oom_score_adj", adj.to_string()).map_err(|e| format!("oom_score_adj {adj}: {e}"))
}

fn launch_and_wait(launch: &LaunchArgs) -> Result<i32, String> {
    if let Some(adj) = launch.oom_score_adj {
        set_oom_score_adj(adj)?;
    }
    if let Some(cgroup) = &launch.cgroup {
        // Best effort: a pod whose accounting misses the agent still runs.
        for problem in super::cgroups::join(std::path::Path::new(cgroup), std::process::id()) {
            eprintln!("bulkhead namespace launcher: {problem}");
        }
    }
    if let Some(netns) = &launch.netns {
        let file = std::fs::File::open(netns).map_err(|e| format!("open netns {netns}: {e}"))?;
        setns(file.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|e| format!("join netns {netns}: {e}"))?;
    }
    unshare(CloneFlags::CLONE_NEWUTS | CloneFlags::CLONE_NEWIPC | CloneFlags::CLONE_NEWPID)
        .map_err(|e| format!("unshare uts/ipc/pid namespaces: {e}"))?;
    // Prepare everything exec needs before fork, so the child only makes syscalls.
    let program = CString::new(launch.command[0].clone()).map_err(|_| "agent path has a NUL byte")?;
    let argv = launch
        .command
        .iter()
        .map(|a| CString::new(a.as_str()).map_err(|_| "agent argument has a NUL byte"))
        .collect::<Result<Vec<_>, _>>()?;

    // SAFETY: the launcher is single-threaded (it runs before any runtime starts).
    match unsafe { fork() }.map_err(|e| format!("fork: {e}"))? {
        ForkResult::Child => {
            let code = child_exec(&program, &argv);
            // Only reached when exec failed.
            std::process::exit(code);
        }
        ForkResult::Parent { child } => loop {
            match waitpid(child, None) {
                Ok(WaitStatus::Exited(_, code)) => return Ok(code),
                Ok(WaitStatus::Signaled(_, sig, _)) => return Ok(128 + sig as i32),
                Ok(_) => continue,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(format!("wait for agent: {e}")),
            }
        },
    }
}

fn child_exec(program: &CString, argv: &[CString]) -> i32 {
    // SAFETY: prctl with PR_SET_PDEATHSIG only sets a flag on this process.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0);
    }
    if let Err(e) = unshare(CloneFlags::CLONE_NEWNS) {
        eprintln!("bulkhead namespace launcher: unshare a mount namespace: {e}");
        return 125;
    }
    // Slave, not private: mounts made in the pod's shared directories later must still arrive.
    if let Err(e) = mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_SLAVE, None::<&str>) {
        eprintln!("bulkhead namespace launcher: make / rslave: {e}");
        return 125;
    }
    if let Err(e) = mount(
        Some("proc"),
        "/proc",
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    ) {
        eprintln!("bulkhead namespace launcher: mount /proc: {e}");
        return 125;
    }
    let err = execv(program, argv).unwrap_err();
    eprintln!("bulkhead namespace launcher: exec {program:?}: {err}");
    127
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_round_trip() {
        let launch = LaunchArgs {
            netns: Some("/var/run/netns/cni-1".into()),
            cgroup: Some("/kubepods/pod1/sb1".into()),
            oom_score_adj: Some(-998),
            command: vec!["/bin/agent".into(), "--mode".into(), "namespace".into()],
        };
        assert_eq!(LaunchArgs::parse(&launch.to_args()).unwrap(), launch);
        let host = LaunchArgs { netns: None, cgroup: None, oom_score_adj: None, command: vec!["/bin/agent".into()] };
        assert_eq!(LaunchArgs::parse(&host.to_args()).unwrap(), host);
    }

    #[test]
    fn malformed_args_are_refused() {
        assert!(LaunchArgs::parse(&[]).is_err());
        let no_command: Vec<String> =
            ["--netns", "-", "--cgroup", "-", "--oom-score-adj", "-", "--"].map(String::from).to_vec();
        assert!(LaunchArgs::parse(&no_command).is_err());
        for bad in ["1001", "-1001", "x", ""] {
            let args: Vec<String> =
                ["--netns", "-", "--cgroup", "-", "--oom-score-adj", bad, "--", "a"].map(String::from).to_vec();
            let err = LaunchArgs::parse(&args).unwrap_err();
            assert!(err.contains("--oom-score-adj"), "{bad:?}: {err}");
        }
        assert!(LaunchArgs::parse(&["--netns".into(), "-".into(), "--".into(), "a".into()]).is_err());
        assert!(LaunchArgs::parse(&["--x".into(), "-".into(), "--".into(), "a".into()]).is_err());
    }
}
