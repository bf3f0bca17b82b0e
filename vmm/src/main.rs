//! `bulkhead-vmm --config <file.json>`: boots one microVM and serves it until it stops.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;

use bulkhead_vmm::config::VmConfig;
use bulkhead_vmm::vmm;

#[derive(Parser)]
#[command(name = "bulkhead-vmm", about = "bulkhead's microVM monitor")]
struct Args {
    /// VM configuration (JSON).
    #[arg(long)]
    config: PathBuf,
    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
}

fn main() {
    let start = vmm::now_unix_ns();
    let args = Args::parse();
    init_logging(args.log_json);
    match run(args, start) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("bulkhead-vmm: error: {e:#}");
            std::process::exit(1);
        }
    }
}

fn run(args: Args, start: u64) -> anyhow::Result<i32> {
    // Before any thread exists, so every thread inherits the blocked mask.
    let signal_fd = vmm::block_termination_signals().context("blocking termination signals")?;
    let cfg = VmConfig::from_file(&args.config).and_then(|c| c.validate()).context("invalid VM config")?;
    let reason = vmm::run(cfg, signal_fd, start).context("VM failed to start")?;
    let code = reason.exit_code();
    if code == 0 {
        tracing::info!(?reason, "VM stopped");
    } else {
        tracing::error!(?reason, "VM failed");
        eprintln!("bulkhead-vmm: VM failed: {reason:?}");
    }
    Ok(code)
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
