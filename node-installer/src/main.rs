//! Binary edge of the node installer: flags/env, logging, signals. The work is in the library.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use bulkhead_node_installer::failpoint::FailPoints;
use bulkhead_node_installer::installer::{Installer, Outcome, Settings, WhileInUse, GC_GRACE};
use bulkhead_node_installer::kube::{InCluster, NodeApi};
use bulkhead_node_installer::node_paths::NodePaths;
use bulkhead_node_installer::probe;
use bulkhead_node_installer::restart::CommandRestarter;
use bulkhead_node_installer::templates::{self, Templates};
// Boolean environment variables take 1/0, true/false, yes/no, on/off: `BULKHEAD_FORCE_UNINSTALL=1` must work.
use clap::builder::BoolishValueParser;
use clap::{Parser, Subcommand, ValueEnum};
use tokio::signal::unix::{signal, SignalKind};

#[derive(Parser, Debug)]
#[command(name = "bulkhead-node-installer", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Where the host's `/` is mounted in this container.
    #[arg(long, env = "BULKHEAD_HOST_ROOT", default_value = "/host", global = true)]
    host_root: PathBuf,
    /// The same tree as containerd sees it (`/` on a node; a scratch dir in tests).
    #[arg(long, env = "BULKHEAD_VIEW_ROOT", default_value = "/", global = true)]
    view_root: PathBuf,
    /// Artifact directory inside the image.
    #[arg(long, env = "BULKHEAD_ARTIFACTS", default_value = "/opt/bulkhead-artifacts", global = true)]
    artifacts: PathBuf,
    /// Version directory name under /opt/bulkhead.
    #[arg(long = "artifact-version", env = "BULKHEAD_VERSION", default_value = env!("CARGO_PKG_VERSION"), global = true)]
    artifact_version: String,
    /// containerd's main config (host path).
    #[arg(long, env = "BULKHEAD_CONTAINERD_CONFIG", default_value = "/etc/containerd/config.toml", global = true)]
    containerd_config: PathBuf,
    /// containerd's CRI socket (host path).
    #[arg(long, env = "BULKHEAD_CONTAINERD_SOCKET", default_value = "/run/containerd/containerd.sock", global = true)]
    containerd_socket: PathBuf,
    /// Command that restarts the node's containerd (split on whitespace).
    #[arg(long, env = "BULKHEAD_RESTART_COMMAND", default_value = "systemctl restart containerd", global = true)]
    restart_command: String,
    /// This node's name (downward API); the only Node the installer touches.
    #[arg(long, env = "NODE_NAME", global = true)]
    node_name: Option<String>,
    /// Run without the Kubernetes API (no label, no taint).
    #[arg(long, env = "BULKHEAD_NO_KUBE", global = true, value_parser = BoolishValueParser::new())]
    no_kube: bool,
    /// Startup taint (e.g. Karpenter's) to remove once the node is ready.
    #[arg(long, env = "BULKHEAD_STARTUP_TAINT", global = true)]
    startup_taint: Option<String>,
    /// The shipped guest kernel is PVM-aware: accept PVM hosts.
    #[arg(long, env = "BULKHEAD_ALLOW_PVM", global = true, value_parser = BoolishValueParser::new())]
    allow_pvm: bool,
    /// How long to wait for containerd to report the handler.
    #[arg(long, env = "BULKHEAD_CRI_TIMEOUT_SECS", default_value_t = 90, global = true)]
    cri_timeout_secs: u64,
    /// An old version is collected only this long after `current` switched away from it (and once nothing runs
    /// from it).
    #[arg(long, env = "BULKHEAD_GC_GRACE_SECS", default_value_t = GC_GRACE.as_secs(), global = true)]
    gc_grace_secs: u64,
    #[arg(long, env = "BULKHEAD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Json, global = true)]
    log_format: LogFormat,
    /// Snapshot templates to build once the node is ready, for pods that start warm (`vm.start`):
    /// comma-separated `default` or `<vCPUs>x<MiB>`, each with `/<MTU>` per NIC of pod-network
    /// pods, e.g. `default,default/9001`. Empty: none.
    #[arg(long, env = "BULKHEAD_PREBUILD_TEMPLATES", default_value = "", global = true)]
    prebuild_templates: String,
    /// Prefix that runs a command on the host, for the template builds (split on whitespace; empty:
    /// run them in this container), e.g. `nsenter --target 1 --mount --uts --ipc --net --pid --`.
    #[arg(long, env = "BULKHEAD_HOST_EXEC", default_value = "", global = true)]
    host_exec: String,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// DaemonSet mode: install, keep converging (and collecting old versions), leave the node wired on SIGTERM.
    Run {
        /// Re-check (and repair) the install this often.
        #[arg(long, env = "BULKHEAD_RESYNC_SECS", default_value_t = 300)]
        resync_secs: u64,
        /// What SIGTERM does. `keep`, because a DaemonSet rolling update terminates the old pod: an uninstall
        /// then would unwire the node under its running pods. `uninstall` is for removing bulkhead.
        #[arg(long, env = "BULKHEAD_ON_SIGTERM", value_enum, default_value_t = OnSigterm::Keep)]
        on_sigterm: OnSigterm,
        /// With `--on-sigterm uninstall`: uninstall even while bulkhead pods run.
        #[arg(long, env = "BULKHEAD_FORCE_UNINSTALL", value_parser = BoolishValueParser::new())]
        force_uninstall: bool,
    },
    /// Install once and exit.
    Install,
    /// Uninstall once and exit; refuses while bulkhead pods run on the node.
    Uninstall {
        /// Uninstall even while bulkhead pods run (they keep running but can start no new container).
        #[arg(long, env = "BULKHEAD_FORCE_UNINSTALL", value_parser = BoolishValueParser::new())]
        force: bool,
    },
    /// Print the host probe verdict and exit (0 capable, 2 refused).
    Probe,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Json,
    Text,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OnSigterm {
    Uninstall,
    Keep,
}

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Json => b.json().flatten_event(true).init(),
        LogFormat::Text => b.init(),
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    init_logs(cli.log_format);
    let mut layout = NodePaths::new(&cli.host_root, &cli.view_root);
    layout.containerd_config = cli.containerd_config.clone();
    let settings = Settings {
        layout,
        artifacts_dir: cli.artifacts.clone(),
        version: cli.artifact_version.clone(),
        containerd_socket: cli.containerd_socket.clone(),
        startup_taint: cli.startup_taint.clone().filter(|t| !t.is_empty()),
        allow_pvm: cli.allow_pvm,
        cri_timeout: Duration::from_secs(cli.cri_timeout_secs),
        gc_grace: Duration::from_secs(cli.gc_grace_secs),
        templates: Templates {
            shapes: templates::parse_shapes(&cli.prebuild_templates)?,
            host_exec: cli.host_exec.split_whitespace().map(str::to_string).collect(),
            timeout: templates::BUILD_TIMEOUT,
        },
    };
    if let Command::Probe = cli.command {
        let v = probe::verdict(&settings.layout.host_root, settings.allow_pvm);
        tracing::info!(verdict = ?v, "probe");
        std::process::exit(if matches!(v, probe::Verdict::Capable { .. }) { 0 } else { 2 });
    }
    let restarter = CommandRestarter::parse(&cli.restart_command)?;
    let api: Option<InCluster> = if cli.no_kube { None } else { Some(InCluster::from_env()?) };
    let node = match (&api, &cli.node_name) {
        (Some(_), Some(n)) if !n.is_empty() => Some(n.clone()),
        (Some(_), _) => anyhow::bail!("NODE_NAME is required (set it from spec.nodeName), or pass --no-kube"),
        (None, _) => None,
    };
    let installer = Installer {
        settings,
        restarter: &restarter,
        nodes: api.as_ref().zip(node).map(|(a, n)| (a as &dyn NodeApi, n)),
        fail: FailPoints::from_env(),
    };
    match cli.command {
        Command::Install => {
            let report = installer.install().await.context("install")?;
            if let Outcome::Refused { reason } = &report.outcome {
                tracing::warn!(reason = %reason, "install refused");
            }
            Ok(())
        }
        Command::Uninstall { force } => installer.uninstall_with(policy(force)).await.context("uninstall"),
        Command::Run { resync_secs, on_sigterm, force_uninstall } => {
            run(&installer, Duration::from_secs(resync_secs), on_sigterm, policy(force_uninstall)).await
        }
        Command::Probe => Ok(()),
    }
}

fn policy(force: bool) -> WhileInUse {
    if force {
        WhileInUse::Force
    } else {
        WhileInUse::Refuse
    }
}

/// Converge now and every `resync`; retry failures with backoff; on SIGTERM keep (or uninstall) and exit.
async fn run(installer: &Installer<'_>, resync: Duration, on_sigterm: OnSigterm, policy: WhileInUse) -> Result<()> {
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
    let mut backoff = Duration::from_secs(5);
    loop {
        // A signal cancels an install in progress: every step is idempotent and survives interruption, and
        // uninstall must start within the pod's grace period.
        let result = tokio::select! {
            r = installer.install() => r,
            _ = term.recv() => break,
            _ = int.recv() => break,
        };
        let wait = match result {
            Ok(report) => {
                backoff = Duration::from_secs(5);
                tracing::info!(outcome = ?report.outcome, restarted = report.restarted, "converged; next check in {resync:?}");
                resync
            }
            Err(e) => {
                tracing::error!(error = %e, "install failed; retrying in {backoff:?}");
                let w = backoff;
                backoff = (backoff * 2).min(Duration::from_secs(300));
                w
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
    }
    tracing::info!(?on_sigterm, "termination signal received");
    match on_sigterm {
        OnSigterm::Uninstall => installer.uninstall_with(policy).await.context("uninstall on SIGTERM"),
        OnSigterm::Keep => {
            tracing::info!("leaving the node wired (BULKHEAD_ON_SIGTERM=keep); the next installer pod takes over");
            Ok(())
        }
    }
}
