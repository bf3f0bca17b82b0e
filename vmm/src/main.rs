//! `bulkhead-vmm --config <file.json>`: boots one microVM and serves it until it stops.
//! `bulkhead-vmm --probe`: says whether this host runs ordinary guests, and exits.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;

use bulkhead_vmm::config::VmConfig;
use bulkhead_vmm::seccomp::Filters;
use bulkhead_vmm::vmm;

#[derive(Parser)]
#[command(name = "bulkhead-vmm", about = "bulkhead's microVM monitor")]
struct Args {
    /// VM configuration (JSON).
    #[arg(long, required_unless_present = "probe")]
    config: Option<PathBuf>,
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
    // Before any thread exists, so every thread inherits the blocked mask.
    let signal_fd = vmm::block_termination_signals().context("blocking termination signals")?;
    let cfg = VmConfig::from_file(&path).and_then(|c| c.validate()).context("invalid VM config")?;
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
