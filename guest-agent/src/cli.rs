//! Command line: the agent's flags and the hidden libcontainer helper subcommand.

use std::{path::PathBuf, time::Duration};

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(name = "bulkhead-agent", version, about = "bulkhead guest agent (sandbox PID 1)")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub agent: AgentOpts,
    /// Words the kernel passed on: as /init, the agent gets every command-line word the kernel
    /// did not know (`nomodule`, say). They are logged and otherwise ignored, since PID 1 must
    /// not exit over a word of the boot loader's.
    #[arg(hide = true)]
    pub kernel_words: Vec<String>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Internal: one libcontainer operation in a fresh single-threaded process.
    #[command(name = "__libcontainer", hide = true)]
    Libcontainer(crate::runtime::helper::HelperOp),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// PID 1 of a microVM: mounts proc/sys/dev/cgroup/tmp, owns the clock and entropy.
    Guest,
    /// PID 1 of fresh namespaces on a host: the host already provides devices, clock, entropy.
    Namespace,
}

/// Namespace mode: whose network namespace the pod is in. A host-network pod's is the node's,
/// so its `net.*` sysctls would be the node's and are refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PodNetwork {
    /// A network namespace of the pod's own (CNI's), or the VM's.
    Own,
    /// The node's (`hostNetwork: true`).
    Host,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Guest => "guest",
            Mode::Namespace => "namespace",
        }
    }
}

#[derive(Debug, Clone, Args)]
pub struct AgentOpts {
    /// `vsock` (ports from bulkhead-protocol; the VMM answers the CONNECT preamble) or
    /// `unix:<path>` (the agent answers the CONNECT preamble itself).
    #[arg(long, default_value = "vsock")]
    pub listen: Listen,
    #[arg(long, value_enum, default_value = "guest")]
    pub mode: Mode,
    /// Namespace mode: `host` when the pod shares the node's network namespace.
    #[arg(long, value_enum, default_value = "own")]
    pub network: PodNetwork,
    /// Agent state: bundles, libcontainer state, console sockets.
    #[arg(long, default_value = "/run/bulkhead-agent")]
    pub state_dir: PathBuf,
    /// Parent of every container cgroup (absolute, inside the agent's cgroup view).
    #[arg(long, default_value = "/bulkhead")]
    pub cgroup_parent: PathBuf,
    /// A ttrpc frame in progress that makes no progress for this long closes its connection.
    /// As long as the shim's RPC deadline: a frame split across vsock packets waits on the host
    /// (a loaded node, a throttled VMM thread), and cutting it first ends the whole pod. 500 ms
    /// did, in the emulated node.
    #[arg(long, default_value = "10000", value_parser = parse_millis)]
    pub frame_stall_ms: Duration,
    /// An attached stdio reader that accepts no bytes for this long is disconnected, so the
    /// process is never blocked on its output for longer.
    #[arg(long, default_value = "10000", value_parser = parse_millis)]
    pub stream_stall_ms: Duration,
    /// Output kept per stream while no reader is attached (oldest bytes dropped beyond it).
    #[arg(long, default_value = "1048576")]
    pub stream_backlog_bytes: usize,
    /// Log as JSON lines.
    #[arg(long)]
    pub log_json: bool,
    /// Namespace mode: a host directory the agent's minimal root keeps, bound at the same path
    /// (repeatable). Mounts the host makes below it later reach the agent when the host made it
    /// a shared mount (the shim's read-only view of the pod's container mounts). The state dir
    /// is always kept.
    #[arg(long = "share-dir", value_name = "DIR")]
    pub share_dirs: Vec<PathBuf>,
    /// Namespace mode without the minimal root and the capability drop: the agent sees the
    /// host's whole filesystem as full root. Only for the agent's own tests that need the host's
    /// view (configuring links); the shim never passes it.
    #[arg(long)]
    pub unconfined: bool,
    /// Internal: the agent re-executed itself inside its minimal root.
    #[arg(long, hide = true)]
    pub in_minimal_root: bool,
    /// Internal: the Unix listener the agent bound before it entered its minimal root (whose
    /// socket path lies outside that root).
    #[arg(long, hide = true, value_name = "FD")]
    pub listen_fd: Option<i32>,
}

impl AgentOpts {
    /// Whether the agent confines itself: namespace mode unless `--unconfined`. A guest's agent
    /// is confined by its VM.
    pub fn confined(&self) -> bool {
        self.mode == Mode::Namespace && !self.unconfined
    }
}

fn parse_millis(s: &str) -> Result<Duration, String> {
    s.parse::<u64>().map(Duration::from_millis).map_err(|e| format!("{s:?}: {e}"))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    Vsock,
    Unix(PathBuf),
}

impl std::str::FromStr for Listen {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "vsock" {
            return Ok(Listen::Vsock);
        }
        match s.strip_prefix("unix:") {
            Some(p) if !p.is_empty() => Ok(Listen::Unix(PathBuf::from(p))),
            _ => Err(format!("--listen {s:?}: expected `vsock` or `unix:<path>`")),
        }
    }
}

/// Log timestamps as the guest kernel prints its own: seconds since boot (CLOCK_BOOTTIME). In a
/// VM the wall clock is 1970 until SetupSandbox sets it, and the console then reads as one
/// timeline, kernel and agent.
struct SinceBoot;

impl tracing_subscriber::fmt::time::FormatTime for SinceBoot {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        match nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME) {
            Ok(t) => write!(w, "[{:5}.{:06}]", t.tv_sec(), t.tv_nsec() / 1000),
            Err(_) => write!(w, "[    ?.??????]"),
        }
    }
}

pub fn init_tracing(opts: &AgentOpts) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("BULKHEAD_AGENT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,libcontainer=warn,libcgroups=warn"));
    // As PID 1 of a VM, stderr is the serial console: a tty, but one that a file on the host
    // records, so no colour codes there; elsewhere only where a person watches a terminal.
    let ansi = opts.mode != Mode::Guest && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr);
    match (opts.log_json, opts.mode) {
        (true, _) => builder.json().init(),
        (false, Mode::Guest) => builder.with_timer(SinceBoot).init(),
        (false, Mode::Namespace) => builder.init(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_words_of_the_kernel_are_kept_apart_not_refused() {
        let cli = Cli::try_parse_from(["/init", "nomodule", "quiet"]).unwrap();
        assert_eq!(cli.kernel_words, ["nomodule", "quiet"]);
        assert!(cli.command.is_none());
        assert_eq!(cli.agent.mode, Mode::Guest);
        let cli = Cli::try_parse_from(["/init", "--mode", "namespace", "--listen", "unix:/a"]).unwrap();
        assert!(cli.kernel_words.is_empty());
        assert_eq!(cli.agent.mode, Mode::Namespace);
        // Flags are still checked: a typo is an error, not a kernel word.
        assert!(Cli::try_parse_from(["/init", "--mdoe", "guest"]).is_err());
    }

    #[test]
    fn parses_listen() {
        assert_eq!("vsock".parse::<Listen>().unwrap(), Listen::Vsock);
        assert_eq!("unix:/run/a.sock".parse::<Listen>().unwrap(), Listen::Unix("/run/a.sock".into()));
        assert!("unix:".parse::<Listen>().is_err());
        assert!("tcp:1".parse::<Listen>().is_err());
    }
}
