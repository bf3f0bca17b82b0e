//! `bulkhead-ctl`: the operator's view of the bulkhead pods on a node. It reads the shim's own
//! config (with the shim's parser) and the shims' per-pod state directories; it never talks to
//! a shim's Task API, so it works the same whether containerd is healthy or not.
//!
//! Commands (each with `--json`, one JSON document on stdout; errors exit 1 and say why):
//! - [`ps`]: the node's sandboxes;
//! - [`console`]: a pod's guest console log (`-f` follows it until the pod is removed);
//! - [`agent`]: a health check over the same dial and version handshake the shim uses;
//! - [`doctor`]: host probe, containerd's view of the handler, the shim config, the artifacts;
//! - [`metrics`]: every pod's metrics as one exposition, once or served on `--listen`;
//! - [`template`]: the snapshot template cache (`ls`, `build`, `rm`).

pub mod agent;
pub mod console;
pub mod doctor;
mod error;
pub mod metrics;
pub mod pods;
pub mod ps;
pub mod template;

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand};

use crate::config::Config;
pub use error::{CtlError, Outcome};

#[derive(Parser, Debug)]
#[command(name = "bulkhead-ctl", version, about = "Inspect and debug the bulkhead pods of this node")]
struct Cli {
    /// The shim config (default: $BULKHEAD_CONFIG, else /opt/bulkhead/current/config.toml if it
    /// exists, else /etc/bulkhead/config.toml; `doctor` asks containerd first).
    #[arg(long, global = true, env = "BULKHEAD_CONFIG")]
    config: Option<PathBuf>,
    /// One JSON document on stdout instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The node's sandboxes: pod, backend, state, PIDs, uptime, memory.
    Ps,
    /// A pod's guest console log.
    Console {
        /// Pod id (or a unique prefix), or pod name.
        pod: String,
        /// Keep printing new output until the pod is removed.
        #[arg(short, long)]
        follow: bool,
    },
    /// Checks that a pod's agent answers the shim's handshake.
    Agent {
        /// Pod id (or a unique prefix), or pod name.
        pod: String,
    },
    /// Checks the host, containerd, the shim config and the artifacts, one line each.
    Doctor {
        /// containerd's CRI socket.
        #[arg(long, default_value = "/run/containerd/containerd.sock")]
        containerd_socket: PathBuf,
        /// The RuntimeClass handler name in containerd's CRI config.
        #[arg(long, default_value = "bulkhead")]
        handler: String,
    },
    /// Every pod's metrics with pod and namespace labels, once, or served on `--listen`.
    Metrics {
        /// Serve `GET /metrics` on this TCP address (e.g. 0.0.0.0:9464) instead of printing once.
        #[arg(long)]
        listen: Option<String>,
        /// The shims' state_dir, instead of the config's: the exporter then reads no config, only
        /// `<state_dir>/.metrics`, and runs as an unprivileged user in the metrics group.
        #[arg(long)]
        state_dir: Option<std::path::PathBuf>,
    },
    /// The snapshot template cache of warm pods.
    Template {
        #[command(subcommand)]
        command: TemplateCommand,
    },
}

#[derive(Subcommand, Debug)]
enum TemplateCommand {
    /// Every template, checked as a pod's lookup checks it; builds in progress; unusable entries.
    Ls,
    /// Builds the template of a VM shape now (the config's default shape unless given), unless a
    /// usable one is there; waits for a build of the same key already under way.
    Build {
        /// vCPUs of the VM (default: the config's `vm.vcpus`).
        #[arg(long)]
        vcpus: Option<u8>,
        /// Guest memory in MiB (default: the config's `vm.memory_mib`).
        #[arg(long)]
        memory_mib: Option<u64>,
        /// A NIC of this MTU, for pods with a network (repeat for more NICs; none: the template
        /// of host-network pods). Pods use a template whose NICs match their CNI interfaces'.
        #[arg(long = "nic-mtu")]
        nic_mtus: Vec<u16>,
    },
    /// Collects templates now, as a pass before each build does: those of other node files
    /// (after an update), those unused for `vm.template_max_idle_days`, then the least recently
    /// used beyond `vm.template_max_count` / `vm.template_max_size`.
    Gc,
    /// Removes templates (a pod then builds or boots cold); waits for a build of the same key.
    Rm {
        /// Template keys, or unique prefixes of them.
        keys: Vec<String>,
        /// Every template.
        #[arg(long)]
        all: bool,
    },
}

/// The config path to read when none was given: the one the shim reads without a `ConfigPath`.
pub fn default_config_path() -> PathBuf {
    crate::config::config_path(None)
}

fn load_config(explicit: Option<&Path>) -> Result<Config, CtlError> {
    let path = explicit.map(Path::to_path_buf).unwrap_or_else(default_config_path);
    Ok(Config::load(&path)?)
}

/// Entry point of the `bulkhead-ctl` binary; returns the exit code.
pub fn main() -> i32 {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => return fail(cli.json, &format!("tokio runtime: {e}")),
    };
    let json = cli.json;
    match runtime.block_on(run(cli)) {
        Ok(Some(outcome)) => {
            let mut out = std::io::stdout().lock();
            let printed = if json {
                writeln!(out, "{}", serde_json::to_string_pretty(&outcome.json).unwrap_or_default())
            } else {
                write!(out, "{}", outcome.text)
            };
            if printed.is_err() {
                return 1;
            }
            i32::from(!outcome.ok)
        }
        Ok(None) => 0,
        Err(e) => fail(json, &e.to_string()),
    }
}

fn fail(json: bool, message: &str) -> i32 {
    if json {
        println!("{}", serde_json::json!({ "error": message }));
    }
    eprintln!("bulkhead-ctl: error: {message}");
    1
}

/// Runs one command; streaming commands (`console -f`, `metrics --listen`) print as they go and
/// return `None`.
async fn run(cli: Cli) -> Result<Option<Outcome>, CtlError> {
    let explicit = cli.config.as_deref();
    match cli.command {
        Command::Ps => Ok(Some(ps::run(&load_config(explicit)?.state_dir)?)),
        Command::Console { pod, follow: false } => Ok(Some(console::show(&load_config(explicit)?.state_dir, &pod)?)),
        Command::Console { pod, follow: true } => {
            console::follow(&load_config(explicit)?.state_dir, &pod, cli.json).await?;
            Ok(None)
        }
        Command::Agent { pod } => Ok(Some(agent::run(&load_config(explicit)?, &pod).await?)),
        Command::Doctor { containerd_socket, handler } => {
            Ok(Some(doctor::run(explicit, &containerd_socket, &handler).await))
        }
        Command::Metrics { listen, state_dir } => {
            let state_dir = match state_dir {
                Some(dir) => dir,
                None => load_config(explicit)?.state_dir,
            };
            match listen {
                None => {
                    let text = metrics::gather(&state_dir).await;
                    Ok(Some(Outcome { json: serde_json::json!({ "exposition": text }), text, ok: true }))
                }
                Some(addr) => {
                    metrics::serve(state_dir, &addr).await?;
                    Ok(None)
                }
            }
        }
        Command::Template { command: TemplateCommand::Ls } => Ok(Some(template::ls(&load_config(explicit)?)?)),
        Command::Template { command: TemplateCommand::Build { vcpus, memory_mib, nic_mtus } } => {
            Ok(Some(template::build(load_config(explicit)?, vcpus, memory_mib, &nic_mtus).await?))
        }
        Command::Template { command: TemplateCommand::Gc } => Ok(Some(template::gc(&load_config(explicit)?)?)),
        Command::Template { command: TemplateCommand::Rm { keys, all } } => {
            Ok(Some(template::rm(&load_config(explicit)?, &keys, all).await?))
        }
    }
}
