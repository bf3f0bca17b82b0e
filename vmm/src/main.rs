//! `bulkhead-vmm --config <file.json>`: boots one microVM and serves it until it stops.
//! `bulkhead-vmm --restore <dir> --restore-config <file.json>`: restores a snapshot, paused until
//! the API's `resume`.
//! `bulkhead-vmm --prepare <dir> --api-socket <sock>`: does the host-heavy half of a restore
//! now and the rest on the API's `restore` request (a pool of these per template).
//! Each takes `--jail <jail.json>` to confine itself first (chroot, namespaces, cgroup, non-root
//! uid); every path in the other documents is then a path inside the chroot.
//! `bulkhead-vmm --probe`: says whether this host runs ordinary guests, and exits.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Parser;

use bulkhead_vmm::api::{self, bind_api_socket, prepared_info, ApiEndpoint, PreparedApi, PreparedEvent};
use bulkhead_vmm::builder;
use bulkhead_vmm::config::VmConfig;
use bulkhead_vmm::crash;
use bulkhead_vmm::exit::ExitReason;
use bulkhead_vmm::jail::{self, Jailed};
use bulkhead_vmm::phases::Phases;
use bulkhead_vmm::seccomp::{self, Filters, ThreadKind};
use bulkhead_vmm::snapshot::SnapshotFiles;
use bulkhead_vmm::vmm;
use bulkhead_vmm_api::api::{encode_line, Response};
use bulkhead_vmm_api::command_line::{Start, VmmCommand};
use bulkhead_vmm_api::jail::JailConfig;
use bulkhead_vmm_api::memory::Mib;
use bulkhead_vmm_api::restore::{restored_config, RestoreConfig};

#[derive(Parser)]
#[command(name = "bulkhead-vmm", version, about = "bulkhead's microVM monitor")]
struct Args {
    /// VM configuration (JSON).
    #[arg(long, required_unless_present_any = ["probe", "restore", "prepare"], conflicts_with_all = ["restore", "prepare"])]
    config: Option<PathBuf>,
    /// Restore the snapshot in this directory; the VM waits paused for the API's `resume`.
    #[arg(long, conflicts_with = "prepare", requires = "restore_config")]
    restore: Option<PathBuf>,
    /// The restored run's own settings (JSON: `RestoreConfig`).
    #[arg(long)]
    restore_config: Option<PathBuf>,
    /// Prepare a restore of the snapshot in this directory and wait for the API's `restore`.
    #[arg(long, requires = "api_socket")]
    prepare: Option<PathBuf>,
    /// The API socket of a prepared VMM.
    #[arg(long)]
    api_socket: Option<PathBuf>,
    /// Jail the VMM first, as described by this JSON document (`JailConfig`); paths in the VM
    /// config, the restore config, the snapshot directory and the API socket are then paths
    /// inside the jail's chroot.
    #[arg(long)]
    jail: Option<PathBuf>,
    /// Print the host probe (vmx, svm, pvm, unknown or absent) as JSON and exit: 0 when ordinary
    /// guests run here, 3 when they do not.
    #[arg(long, conflicts_with_all = ["config", "restore", "prepare", "jail"])]
    probe: bool,
    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
}

fn main() {
    let start = vmm::now_unix_ns();
    let mut phases = Phases::start();
    let args = Args::parse();
    if args.probe {
        std::process::exit(probe());
    }
    phases.mark("parse arguments", false);
    init_logging(args.log_json);
    if let Err(e) = crash::install_hook() {
        eprintln!("bulkhead-vmm: error: cannot install the panic hook: {e}");
        std::process::exit(1);
    }
    phases.mark("logging, panic hook", false);
    // A panic on this thread (the event loop, once the VM runs) unwinds to here; other threads'
    // panics stop the VM through the event loop (`crash.rs`).
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(args, start, phases))) {
        Ok(Ok(code)) => std::process::exit(code),
        Ok(Err(e)) => {
            tracing::error!("{e:#}");
            eprintln!("bulkhead-vmm: error: {e:#}");
            std::process::exit(1);
        }
        Err(_) => {
            let why = crash::report().unwrap_or("the main thread panicked");
            tracing::error!(reason = why, "VM failed");
            eprintln!("bulkhead-vmm: VM failed: {why}");
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

/// What to run, with the documents read on the host side (before the jail).
enum Mode {
    Boot(VmConfig),
    Restore { dir: PathBuf, run: RestoreConfig },
    Prepare { dir: PathBuf, api: PathBuf },
}

impl Args {
    /// The typed command line the shim wrote (clap parses it for `--help` and its messages;
    /// `tests::clap_reads_every_typed_command_line` keeps the two spellings one).
    fn command(&self) -> anyhow::Result<VmmCommand> {
        let start = if let Some(snapshot) = &self.prepare {
            let api_socket = self.api_socket.clone().context("--prepare needs --api-socket")?;
            Start::Prepare { snapshot: snapshot.clone(), api_socket }
        } else if let Some(snapshot) = &self.restore {
            let restore_config = self.restore_config.clone().context("--restore needs --restore-config")?;
            Start::Restore { snapshot: snapshot.clone(), restore_config }
        } else {
            Start::Boot { config: self.config.clone().context("--config is required")? }
        };
        Ok(VmmCommand { start, jail: self.jail.clone(), log_json: self.log_json })
    }
}

fn mode(start: &Start) -> anyhow::Result<Mode> {
    Ok(match start {
        Start::Prepare { snapshot, api_socket } => Mode::Prepare { dir: snapshot.clone(), api: api_socket.clone() },
        Start::Restore { snapshot, restore_config } => {
            let run = RestoreConfig::from_file(restore_config).context("invalid restore config")?;
            Mode::Restore { dir: snapshot.clone(), run }
        }
        Start::Boot { config } => Mode::Boot(VmConfig::from_file(config).context("invalid VM config")?),
    })
}

fn run(args: Args, start: u64, mut phases: Phases) -> anyhow::Result<i32> {
    let filters = Filters::compile().context("building the seccomp filters")?;
    phases.mark("seccomp filters", false);
    let command = args.command()?;
    // Read on the host side; the paths inside are checked once jailed, where they must resolve.
    let mode = mode(&command.start)?;
    phases.mark("read config", false);
    // A snapshot's files are root's alone (the shim's template store): opened before the jail
    // drops privileges, by their paths inside it.
    let snapshot_dir = match &mode {
        Mode::Boot(_) => None,
        Mode::Restore { dir, .. } | Mode::Prepare { dir, .. } => Some(dir.clone()),
    };
    let open_snapshot = || snapshot_dir.as_deref().map(SnapshotFiles::open).transpose();
    let mut snapshot = match &command.jail {
        Some(jail_path) => {
            let jail = JailConfig::from_file(jail_path).context("invalid jail config")?;
            phases.mark("read jail config", false);
            match jail::enter(&jail, &mut phases, open_snapshot).context("cannot jail the VMM")? {
                Jailed::Exited(code) => return Ok(code),
                Jailed::Vmm(opened) => opened,
            }
        }
        None => open_snapshot().context("open the snapshot")?,
    };
    // Everything the VMM makes from here on (API and vsock sockets, the serial log, snapshot
    // files) is its own uid's alone, whatever umask it was started with: the shim reads them as
    // root. After the jail, whose mount points and device node other ids must reach.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    // Before any thread exists, so every thread inherits the blocked mask.
    let signal_fd = vmm::block_termination_signals().context("blocking termination signals")?;
    phases.mark("umask, signal mask", false);
    let reason = match mode {
        Mode::Boot(doc) => {
            let cfg = doc.validate().context("invalid VM config")?;
            phases.mark("check config", false);
            let api = cfg.api_socket.clone().map(ApiEndpoint::Bind);
            let vm = builder::boot(cfg, &filters, phases).context("VM failed to start")?;
            vmm::run(vm, signal_fd, start, &filters, api).context("VM failed")?
        }
        Mode::Restore { dir, run } => {
            run.validate().context("invalid restore config")?;
            let api = run.api_socket.clone().context(
                "a restored VM is controlled (resumed, stopped) through its API: the restore config needs api_socket",
            )?;
            let files = snapshot.take().context("the snapshot was not opened")?;
            let vm = builder::prepare(files, phases)
                .and_then(|p| p.restore(&run, &filters))
                .with_context(|| format!("cannot restore the snapshot in {}", dir.display()))?;
            tracing::info!(dir = %dir.display(), "VM restored; {}", restored_state(&run));
            vmm::run(vm, signal_fd, start, &filters, Some(ApiEndpoint::Bind(api))).context("VM failed")?
        }
        Mode::Prepare { dir, api } => {
            let files = snapshot.take().context("the snapshot was not opened")?;
            match prepared(&dir, files, &api, signal_fd, start, &filters, phases)? {
                Some(reason) => reason,
                None => return Ok(1),
            }
        }
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

/// A prepared VMM: the API thread (filtered) answers until a `restore` fits the snapshot; this
/// thread checks the run's paths, restores and runs. `None` when the restore itself failed (the
/// prepared state is spent; the client got the error).
fn prepared(
    dir: &Path,
    files: SnapshotFiles,
    api_path: &Path,
    signal_fd: OwnedFd,
    start: u64,
    filters: &Filters,
    phases: Phases,
) -> anyhow::Result<Option<ExitReason>> {
    let prepared =
        builder::prepare(files, phases).with_context(|| format!("cannot prepare the snapshot in {}", dir.display()))?;
    let listener = bind_api_socket(api_path).with_context(|| format!("api socket {}", api_path.display()))?;
    let info = prepared_info(
        prepared.vcpus(),
        Mib::holding(prepared.mem_bytes()),
        prepared.irqchip(),
        start,
        prepared.report(),
    );
    let saved = prepared.saved_config().clone();
    let check = move |run: &RestoreConfig| restored_config(&saved, run).map(drop).map_err(|e| e.to_string());
    let filter = filters.api().clone();
    let confine = Box::new(move || seccomp::install(ThreadKind::Api, &filter).map_err(|e| e.to_string()));
    let api = api::spawn_prepared(listener, info, check, confine).context("prepared API thread")?;
    tracing::info!(dir = %dir.display(), "snapshot prepared; waiting for `restore`");
    let (run, requested) = match wait_for_restore(&api, &signal_fd)? {
        Waited::Stop(reason) => {
            let _ = std::fs::remove_file(api_path);
            return Ok(Some(reason));
        }
        Waited::Restore { config, requested_unix_ns } => (config, requested_unix_ns),
    };
    let handover = api.handover().map_err(anyhow::Error::msg)?;
    let mut client = handover.client;
    let mut vm = match prepared.restore(&run, filters) {
        Ok(vm) => vm,
        Err(e) => {
            // The whole chain: which device refused its state, and why.
            let msg = format!("restore failed: {:#}", anyhow::Error::new(e));
            let _ = std::io::Write::write_all(&mut client, &encode_line(&Response::error(msg.clone())));
            let _ = std::fs::remove_file(api_path);
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
    tracing::info!("VM restored; {}", restored_state(&run));
    let endpoint = ApiEndpoint::Bound { path: api_path.to_owned(), listener: handover.listener, client };
    Ok(Some(vmm::run(vm, signal_fd, start, filters, Some(endpoint)).context("VM failed")?))
}

fn restored_state(run: &RestoreConfig) -> &'static str {
    if run.resume {
        "running (the restore config said resume)"
    } else {
        "paused until `resume`"
    }
}

enum Waited {
    Restore { config: RestoreConfig, requested_unix_ns: u64 },
    Stop(ExitReason),
}

/// Waits for the prepared API thread's restore (checking its paths here: the API thread may not
/// touch files), `shutdown`, or SIGTERM/SIGINT.
fn wait_for_restore(api: &PreparedApi, signal_fd: &OwnedFd) -> anyhow::Result<Waited> {
    loop {
        let mut fds = [
            libc::pollfd { fd: api.wake_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: signal_fd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            // The API thread panicked (-1: no hook, poll skips it).
            libc::pollfd { fd: crash::wake_fd().unwrap_or(-1), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: fds is a valid array of pollfd for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e).context("waiting for `restore`");
        }
        if fds[1].revents != 0 {
            tracing::info!("termination signal while prepared; shutting down");
            return Ok(Waited::Stop(ExitReason::Signal(libc::SIGTERM)));
        }
        if let Some(reason) = crash::reason() {
            return Ok(Waited::Stop(reason));
        }
        for event in api.events() {
            match event {
                PreparedEvent::Restore { config, requested_unix_ns, verdict } => match config.validate() {
                    Ok(()) => {
                        verdict.put(Ok(()));
                        return Ok(Waited::Restore { config, requested_unix_ns });
                    }
                    Err(e) => verdict.put(Err(e.to_string())),
                },
                PreparedEvent::Shutdown => return Ok(Waited::Stop(ExitReason::ApiShutdown)),
                PreparedEvent::Failed(e) => anyhow::bail!("prepared API thread: {e}"),
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_vmm_api::command_line::Invocation;

    /// Every command line the shim can write is one clap reads, to the same command.
    #[test]
    fn clap_reads_every_typed_command_line() {
        for start in bulkhead_vmm_api::command_line::every_start_form() {
            for jail in [None, Some(PathBuf::from("/a/jail.json"))] {
                let typed = VmmCommand { start: start.clone(), jail, log_json: true };
                let words = typed.to_args();
                let args = Args::try_parse_from(std::iter::once("bulkhead-vmm".to_string()).chain(words.clone()))
                    .unwrap_or_else(|e| panic!("{words:?}: {e}"));
                assert_eq!(args.command().unwrap(), typed, "{words:?}");
            }
        }
        let probe = Args::try_parse_from(["bulkhead-vmm", "--probe"]).unwrap();
        assert!(probe.probe);
        assert_eq!(VmmCommand::parse(&["--probe".to_string()]), Ok(Invocation::Probe));
    }
}
