//! `bulkhead-vmm --config <file.json> [--jail <jail.json>]`: boots one microVM and serves it until
//! it stops; with `--jail`, confines itself first (chroot, namespaces, cgroup, non-root uid).
//! `bulkhead-vmm --probe`: says whether this host runs ordinary guests, and exits.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;

use bulkhead_vmm::config::VmConfig;
use bulkhead_vmm::jail::{self, Jailed};
use bulkhead_vmm::seccomp::Filters;
use bulkhead_vmm::vmm;
use bulkhead_vmm_api::jail::JailConfig;

#[derive(Parser)]
#[command(name = "bulkhead-vmm", version, about = "bulkhead's microVM monitor")]
struct Args {
    /// VM configuration (JSON).
    #[arg(long, required_unless_present = "probe")]
    config: Option<PathBuf>,
    /// Jail the VMM first, as described by this JSON document (`JailConfig`); paths in the VM
    /// config are then paths inside the jail's chroot.
    #[arg(long, requires = "config")]
    jail: Option<PathBuf>,
    /// Print the host probe (vmx, svm, pvm, unknown or absent) as JSON and exit: 0 when ordinary
    /// guests run here, 3 when they do not.
    #[arg(long, conflicts_with = "config")]
    probe: bool,
    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
}

fn main() {
    let start = vmm::now_unix_ns();
    let args = Args::parse();
    if args.probe {
        std::process::exit(probe());
    }
    init_logging(args.log_json);
    log_panics_without_backtrace();
    match run(args, start) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("bulkhead-vmm: error: {e:#}");
            std::process::exit(1);
        }
    }
}

/// The shared host probe, plus whether this process can open /dev/kvm at all.
fn probe() -> i32 {
    let kind = bulkhead_vmm_api::probe::KvmKind::probe();
    let ordinary = kind.ordinary_guests();
    let device = bulkhead_vmm_api::probe::kvm_device_usable();
    let report = serde_json::json!({
        "kvm": kind.name(),
        "ordinary_guests": ordinary.is_ok(),
        "reason": ordinary.as_ref().err(),
        "kvm_device_usable": device.is_ok(),
        "kvm_device_error": device.as_ref().err(),
    });
    println!("{report}");
    if ordinary.is_ok() && device.is_ok() {
        0
    } else {
        3
    }
}

fn run(args: Args, start: u64) -> anyhow::Result<i32> {
    let filters = Filters::compile().context("building the seccomp filters")?;
    let path = args.config.context("--config is required")?;
    // Read on the host side; the paths inside are checked once jailed, where they must resolve.
    let doc = VmConfig::from_file(&path).context("invalid VM config")?;
    if let Some(jail_path) = &args.jail {
        let jail = JailConfig::from_file(jail_path).context("invalid jail config")?;
        if let Jailed::Exited(code) = jail::enter(&jail).context("cannot jail the VMM")? {
            return Ok(code);
        }
    }
    // Before any thread exists, so every thread inherits the blocked mask.
    let signal_fd = vmm::block_termination_signals().context("blocking termination signals")?;
    let cfg = doc.validate().context("invalid VM config")?;
    let reason = vmm::run(cfg, signal_fd, start, &filters).context("VM failed to start")?;
    let code = reason.exit_code();
    if code == 0 {
        tracing::info!(?reason, "VM stopped");
    } else {
        tracing::error!(?reason, "VM failed");
        eprintln!("bulkhead-vmm: VM failed: {reason:?}");
    }
    Ok(code)
}

/// Panics are logged without a backtrace: capturing one reads the binary from disk, which the
/// seccomp filters forbid, so the default hook would turn a panic into SIGSYS.
fn log_panics_without_backtrace() {
    std::panic::set_hook(Box::new(|info| {
        let thread = std::thread::current();
        tracing::error!(thread = thread.name().unwrap_or("unnamed"), "thread panicked: {info}");
    }));
}

fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("BULKHEAD_VMM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}
