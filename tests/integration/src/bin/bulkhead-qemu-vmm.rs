//! `bulkhead-qemu-vmm`: the test-only QEMU stand-in for `bulkhead-vmm` (see
//! `bulkhead_integration::standin`). Started by the shim exactly as the VMM is
//! (`--config vm.json --jail jail.json`); runs `vhost-device-vsock` and QEMU as children that die
//! with it, and exits when QEMU does (0 when the guest powers off or resets, as the VMM), or 0
//! after SIGTERM/SIGINT or an API `shutdown` stops the VM. A QEMU still running
//! [`EXIT_AFTER_SHUTDOWN`] after its guest shut down or reset is killed, and the stand-in exits 0
//! as the VMM would have. Never shipped: `make image` and the
//! installer name their artifacts one by one, and this is not one of them.

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use bulkhead_integration::standin::shutdown_watch::{self, Watched};
use bulkhead_integration::standin::{api, cgroup, qemu, qmp::Qmp, vsock_gate, Plan};
use bulkhead_vmm_api::command_line::{Invocation, Start, VmmCommand};
use nix::sys::signal::{SigSet, Signal};

/// How long `vhost-device-vsock` may take to create its vhost-user socket.
const BACKEND_READY: Duration = Duration::from_secs(10);
/// How long the guest's vsock driver may take to come up before the stand-in stops waiting.
const VSOCK_READY: Duration = Duration::from_secs(300);
/// How long QEMU gets to quit after an orderly stop before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(3);
/// How long QEMU gets to exit after its guest shut down or reset before it is killed (see
/// `standin::shutdown_watch`); it takes well under a second.
const EXIT_AFTER_SHUTDOWN: Duration = Duration::from_secs(5);
/// How long the events monitor may take to appear after QEMU starts.
const EVENTS_READY: Duration = Duration::from_secs(30);
/// The signal the shutdown watch raises in the stand-in when QEMU has not exited in time.
const LATE_EXIT: Signal = Signal::SIGUSR1;

fn main() -> ExitCode {
    match run() {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("bulkhead-qemu-vmm: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// The VMM's command line ([`VmmCommand`]), of which the stand-in takes only a jailed boot:
/// `--config <vm.json> --jail <jail.json>`.
fn parse_args(args: &[String]) -> Result<(PathBuf, PathBuf)> {
    const USAGE: &str = "the QEMU stand-in takes only --config <vm.json> --jail <jail.json>";
    match VmmCommand::parse(args).map_err(|e| anyhow!("{e}; {USAGE}"))? {
        Invocation::Run(VmmCommand { start: Start::Boot { config }, jail: Some(jail), .. }) => Ok((config, jail)),
        Invocation::Probe => bail!("{USAGE}, not --probe"),
        Invocation::Run(other) => bail!("{USAGE}, not {:?}", other.to_args()),
    }
}

fn vhost_device_vsock() -> PathBuf {
    if let Some(path) = std::env::var_os("BULKHEAD_VHOST_VSOCK") {
        return path.into();
    }
    let cache = std::env::var_os("BULKHEAD_CACHE").unwrap_or_else(|| "/var/cache/bulkhead".into());
    PathBuf::from(cache).join("bin/vhost-device-vsock")
}

/// `command` as a child that dies with this process and takes signals normally (the signal mask
/// this process blocks is inherited across exec).
fn spawn(mut command: Command, what: &str) -> Result<Child> {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: between fork and exec only async-signal-safe calls with valid arguments: an empty
    // signal set, prctl with integers, getppid and _exit.
    unsafe {
        command.pre_exec(move || {
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent died before the death signal was armed.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    command.spawn().with_context(|| format!("start {what}"))
}

fn remove_stale(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("remove {}", path.display()))
        }
        _ => Ok(()),
    }
}

fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code).unwrap_or(1),
        (None, Some(sig)) => u8::try_from(128 + sig).unwrap_or(1),
        _ => 1,
    }
}

fn kill(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

fn run() -> Result<u8> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (config, jail) = parse_args(&args)?;
    let plan = Plan::load(&config, &jail).map_err(|e| anyhow!(e))?;
    let start_unix_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0);
    // Blocked before any thread or child exists; the main thread takes them with sigwait.
    let mut signals = SigSet::empty();
    for sig in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGCHLD, LATE_EXIT] {
        signals.add(sig);
    }
    signals.thread_block().context("block signals")?;

    // The pod's cgroup and network namespace, as the VMM's jail joins them; children inherit both.
    if let Some(cg) = &plan.cgroup {
        cgroup::join(cg).with_context(|| format!("join the pod's cgroup {}", cg.display()))?;
    }
    if let Some(netns) = &plan.netns {
        let file = std::fs::File::open(netns).with_context(|| format!("open {}", netns.display()))?;
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
            .with_context(|| format!("join the network namespace {}", netns.display()))?;
    }
    for dir in &plan.writable_dirs {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }

    let mut backend = None;
    if let Some(vsock) = &plan.vsock {
        let socket = plan.vhost_vsock_socket();
        for stale in [&socket, &vsock.uds_path, &plan.vsock_private_socket()] {
            remove_stale(stale)?;
        }
        let mut command = Command::new(vhost_device_vsock());
        command.arg("--vm").arg(format!(
            "guest-cid={},socket={},uds-path={}",
            vsock.guest_cid,
            socket.display(),
            plan.vsock_private_socket().display()
        ));
        let mut child = spawn(command, "vhost-device-vsock (make setup builds it)")?;
        let deadline = Instant::now() + BACKEND_READY;
        while !socket.exists() {
            if let Some(status) = child.try_wait()? {
                bail!("vhost-device-vsock exited before it served {}: {status}", socket.display());
            }
            if Instant::now() >= deadline {
                kill(&mut child);
                bail!("vhost-device-vsock did not create {} within {BACKEND_READY:?}", socket.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        backend = Some(child);
    }

    let (qmp, events) = (plan.qmp_socket(), plan.qmp_events_socket());
    remove_stale(&qmp)?;
    remove_stale(&events)?;
    let mut command = Command::new(qemu::QEMU);
    command.args(qemu::args(&plan, &qmp, &events, backend.as_ref().map(|_| plan.vhost_vsock_socket()).as_deref()));
    let mut vm = match spawn(command, "qemu-system-x86_64 (make setup installs qemu-system-x86)") {
        Ok(vm) => vm,
        Err(e) => {
            if let Some(b) = backend.as_mut() {
                kill(b);
            }
            return Err(e);
        }
    };
    std::thread::Builder::new().name("shutdown-watch".into()).spawn(move || {
        // The signal is blocked in every thread, so only the main thread's sigwait takes it.
        let late = || {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::this(), LATE_EXIT);
        };
        if let Watched::NoMonitor(why) = shutdown_watch::watch(&events, EVENTS_READY, EXIT_AFTER_SHUTDOWN, late) {
            eprintln!("bulkhead-qemu-vmm: no shutdown watch: {why}");
        }
    })?;
    if let Some(vsock) = &plan.vsock {
        let gate = vsock_gate::Gate {
            qmp: qmp.clone(),
            private: plan.vsock_private_socket(),
            public: vsock.uds_path.clone(),
            console: plan.console.clone(),
            deadline: VSOCK_READY,
        };
        std::thread::Builder::new().name("vsock-gate".into()).spawn(move || match gate.run() {
            Ok(after) => {
                eprintln!("bulkhead-qemu-vmm: the guest's vsock driver is ready and the agent listens after {after:?}")
            }
            Err(e) => eprintln!("bulkhead-qemu-vmm: {e}"),
        })?;
    }
    if let Some(path) = &plan.api_socket {
        let shape = api::Shape { vcpus: plan.vcpus, mem_mib: plan.mem_mib, start_unix_ns };
        api::Api { qmp: qmp.clone(), shape, balloon_target: Default::default() }
            .spawn(api::bind(path).with_context(|| format!("bind {}", path.display()))?)?;
    }

    loop {
        let signal = signals.wait().context("sigwait")?;
        if signal == Signal::SIGCHLD {
            if let Some(status) = vm.try_wait()? {
                if let Some(b) = backend.as_mut() {
                    kill(b);
                }
                eprintln!("bulkhead-qemu-vmm: QEMU exited: {status}");
                return Ok(exit_code(status));
            }
            if let Some(b) = backend.as_mut() {
                if let Some(status) = b.try_wait()? {
                    kill(&mut vm);
                    bail!("vhost-device-vsock exited while the VM ran ({status}); the VM was stopped");
                }
            }
            continue;
        }
        if signal == LATE_EXIT {
            if let Some(status) = vm.try_wait()? {
                eprintln!("bulkhead-qemu-vmm: QEMU exited: {status}");
            } else {
                kill(&mut vm);
                eprintln!(
                    "bulkhead-qemu-vmm: QEMU did not exit within {EXIT_AFTER_SHUTDOWN:?} of its guest's shutdown; killed"
                );
            }
            if let Some(b) = backend.as_mut() {
                kill(b);
            }
            return Ok(0);
        }
        // SIGTERM, SIGINT or an API shutdown: stop the VM in order, then by force.
        if let Err(e) = Qmp::connect(&qmp, STOP_GRACE).and_then(|mut q| q.execute("quit")) {
            eprintln!("bulkhead-qemu-vmm: QMP quit: {e}; killing QEMU");
        }
        let deadline = Instant::now() + STOP_GRACE;
        while vm.try_wait()?.is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        kill(&mut vm);
        if let Some(b) = backend.as_mut() {
            kill(b);
        }
        return Ok(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_the_vmms() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            parse_args(&args(&["--config", "/a/vm.json", "--jail", "/a/jail.json"])).unwrap(),
            (PathBuf::from("/a/vm.json"), PathBuf::from("/a/jail.json"))
        );
        assert!(parse_args(&args(&["--probe"])).unwrap_err().to_string().contains("--probe"));
        assert!(parse_args(&args(&["--config", "/a/vm.json"])).is_err());
        assert!(parse_args(&args(&["--config"])).is_err());
    }
}
