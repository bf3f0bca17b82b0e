//! `bulkhead-vmm --config <file.json>`: boots one microVM and serves it until it stops.
//! `bulkhead-vmm --restore <dir> [--restore-config <file.json>]`: restores a snapshot, paused
//! until the API's `resume`.
//! `bulkhead-vmm --prepare <dir> --api-socket <sock>`: does the host-heavy half of a restore
//! now and the rest on the API's `restore` request (a pool of these per template).
//! `bulkhead-vmm --probe`: says whether this host runs ordinary guests, and exits.

use std::os::fd::OwnedFd;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;

use bulkhead_vmm::api::{await_restore, bind_api_socket, prepared_info, ApiEndpoint, PreparedOutcome};
use bulkhead_vmm::builder;
use bulkhead_vmm::config::VmConfig;
use bulkhead_vmm::vmm;
use bulkhead_vmm_api::api::{encode_line, Response};
use bulkhead_vmm_api::restore::RestoreConfig;

#[derive(Parser)]
#[command(name = "bulkhead-vmm", about = "bulkhead's microVM monitor")]
struct Args {
    /// VM configuration (JSON).
    #[arg(long, required_unless_present_any = ["probe", "restore", "prepare"], conflicts_with_all = ["restore", "prepare"])]
    config: Option<PathBuf>,
    /// Restore the snapshot in this directory; the VM waits paused for the API's `resume`.
    #[arg(long, conflicts_with = "prepare", requires = "restore_config")]
    restore: Option<PathBuf>,
    /// The restored run's own settings (JSON: api_socket, serial_log, vsock_uds_path, block).
    #[arg(long)]
    restore_config: Option<PathBuf>,
    /// Prepare a restore of the snapshot in this directory and wait for the API's `restore`.
    #[arg(long, requires = "api_socket")]
    prepare: Option<PathBuf>,
    /// The API socket of a prepared VMM.
    #[arg(long)]
    api_socket: Option<PathBuf>,
    /// Print the host probe (vmx, svm, pvm, unknown or absent) as JSON and exit: 0 when ordinary
    /// guests run here, 3 when they do not.
    #[arg(long, conflicts_with_all = ["config", "restore", "prepare"])]
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
    // Before any thread exists, so every thread inherits the blocked mask.
    let signal_fd = vmm::block_termination_signals().context("blocking termination signals")?;
    let reason = if let Some(dir) = &args.prepare {
        let api = args.api_socket.as_ref().context("--prepare needs --api-socket")?;
        match prepared(dir, api, signal_fd, start)? {
            Some(reason) => reason,
            None => return Ok(1),
        }
    } else if let Some(dir) = &args.restore {
        let path = args.restore_config.as_ref().context("--restore needs --restore-config")?;
        let run =
            RestoreConfig::from_file(path).and_then(|c| c.validate().map(|_| c)).context("invalid restore config")?;
        let api =
            run.api_socket.clone().context("a restored VM waits for `resume`: the restore config needs api_socket")?;
        let vm = builder::prepare(dir)
            .and_then(|p| p.restore(&run))
            .with_context(|| format!("cannot restore the snapshot in {}", dir.display()))?;
        tracing::info!(dir = %dir.display(), "VM restored; paused until `resume`");
        vmm::run(vm, signal_fd, start, Some(ApiEndpoint::Bind(api))).context("VM failed")?
    } else {
        let path = args.config.context("--config is required")?;
        let cfg = VmConfig::from_file(&path).and_then(|c| c.validate()).context("invalid VM config")?;
        let api = cfg.api_socket.clone().map(ApiEndpoint::Bind);
        let vm = builder::boot(cfg, start).context("VM failed to start")?;
        vmm::run(vm, signal_fd, start, api).context("VM failed to start")?
    };
    let code = reason.exit_code();
    if code == 0 {
        tracing::info!(?reason, "VM stopped");
    } else {
        tracing::error!(?reason, "VM failed");
        eprintln!("bulkhead-vmm: VM failed: {reason:?}");
    }
    Ok(code)
}

/// A prepared VMM: restores on request and runs; `None` when the restore itself failed (the
/// prepared state is spent; the client got the error).
fn prepared(
    dir: &std::path::Path,
    api: &std::path::Path,
    signal_fd: OwnedFd,
    start: u64,
) -> anyhow::Result<Option<bulkhead_vmm::exit::ExitReason>> {
    let prepared =
        builder::prepare(dir).with_context(|| format!("cannot prepare the snapshot in {}", dir.display()))?;
    let listener = bind_api_socket(api).with_context(|| format!("api socket {}", api.display()))?;
    let info =
        prepared_info(prepared.vcpus(), prepared.mem_bytes() >> 20, prepared.irqchip(), start, prepared.report());
    tracing::info!(dir = %dir.display(), "snapshot prepared; waiting for `restore`");
    let outcome = await_restore(&listener, &signal_fd, &info, |run| {
        run.validate().map_err(|e| e.to_string())?;
        prepared.check_run(run).map_err(|e| e.to_string())
    })
    .context("prepared API socket")?;
    let (run, mut client, requested) = match outcome {
        PreparedOutcome::Stop(reason) => {
            let _ = std::fs::remove_file(api);
            return Ok(Some(reason));
        }
        PreparedOutcome::Restore { config, client, requested_unix_ns } => (config, client, requested_unix_ns),
    };
    let mut vm = match prepared.restore(&run) {
        Ok(vm) => vm,
        Err(e) => {
            let msg = format!("restore failed: {e:#}");
            let _ = std::io::Write::write_all(&mut client, &encode_line(&Response::error(msg.clone())));
            let _ = std::fs::remove_file(api);
            tracing::error!("{msg}");
            eprintln!("bulkhead-vmm: error: {msg}");
            return Ok(None);
        }
    };
    if let Some(r) = vm.restore.as_mut() {
        r.requested_unix_ns = Some(requested);
    }
    let report = Response { restore: vm.restore.clone(), ..Response::ok() };
    std::io::Write::write_all(&mut client, &encode_line(&report)).context("answering `restore`")?;
    tracing::info!("VM restored; paused until `resume`");
    let endpoint = ApiEndpoint::Bound { path: api.to_owned(), listener, client };
    Ok(Some(vmm::run(vm, signal_fd, start, Some(endpoint)).context("VM failed")?))
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
