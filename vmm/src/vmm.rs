//! Runs a built VM: the event loop (device queues, host sockets, signals, snapshots) and the
//! vCPU and API threads, until something stops it. Building the VM is `builder.rs`'s job.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use bulkhead_vmm_api::api::BootReport;
use bulkhead_vmm_api::memory::Mib;
use event_manager::{EventManager, EventOps, Events, MutEventSubscriber, SubscriberOps};
use vmm_sys_util::epoll::EventSet;

use crate::api::{self, ApiEndpoint, VmController};
use crate::builder::Vm;
use crate::crash::PanicWatcher;
use crate::device_manager::Subscriber;
use crate::error::dev_err;
pub use crate::error::VmmError;
use crate::exit::{ExitReason, ExitSignal};
use crate::seccomp::{self, Filters, ThreadKind};
use crate::snapshotter::{self, Snapshotter};
use crate::vcpu::{install_kick_handler, unix_ns};

/// Blocks SIGTERM/SIGINT in the calling thread (and every thread spawned after) and returns a
/// signalfd for them, so signals are handled on the event loop like any other event.
pub fn block_termination_signals() -> std::io::Result<OwnedFd> {
    // SAFETY: plain libc calls on a stack-local sigset; return values are checked.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = libc::signalfd(-1, &set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

/// Wakes the loop when the VM must stop.
struct ExitWatcher(Arc<ExitSignal>);
impl MutEventSubscriber for ExitWatcher {
    fn init(&mut self, ops: &mut EventOps) {
        let _ = ops.add(Events::new(self.0.eventfd(), EventSet::IN));
    }
    fn process(&mut self, _: Events, _: &mut EventOps) {
        let _ = self.0.eventfd().read();
    }
}

/// SIGTERM/SIGINT -> orderly shutdown.
struct SignalWatcher {
    fd: OwnedFd,
    exit: Arc<ExitSignal>,
}
impl MutEventSubscriber for SignalWatcher {
    fn init(&mut self, ops: &mut EventOps) {
        let _ = ops.add(Events::new_raw(self.fd.as_raw_fd(), EventSet::IN));
    }
    fn process(&mut self, _: Events, _: &mut EventOps) {
        // SAFETY: signalfd_siginfo is plain data, valid when zeroed.
        let mut info: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
        // SAFETY: we read at most the struct's size into it, from our own signalfd.
        let n = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                &mut info as *mut _ as *mut libc::c_void,
                std::mem::size_of::<libc::signalfd_siginfo>(),
            )
        };
        if n > 0 {
            tracing::info!(signal = info.ssi_signo, "termination signal; shutting down");
            self.exit.signal(ExitReason::Signal(info.ssi_signo as i32));
        }
    }
}

/// The host sockets the VM binds (vsock listener, API), removed when `run` returns. The event
/// loop removes them rather than a device's Drop, which can run last on a vCPU thread, whose
/// filter has no unlink.
struct BoundSockets(Vec<PathBuf>);

impl Drop for BoundSockets {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Runs `vm` until it stops; returns why. `api` is where the API socket listens, if anywhere.
/// Every thread this starts, and the calling thread once the VM runs, is confined by its kind's
/// filter from `filters`.
pub fn run(
    vm: Vm,
    signal_fd: OwnedFd,
    start_unix_ns: u64,
    filters: &Filters,
    api: Option<ApiEndpoint>,
) -> Result<ExitReason, VmmError> {
    let Vm { fd, mem, irqchip, config, devices, vcpus, exit, control, snapshot_host, restore, boot } = vm;
    let _bound_sockets = BoundSockets(
        config.vsock.iter().map(|v| v.uds_path.clone()).chain(api.as_ref().map(|a| a.path().to_owned())).collect(),
    );
    let mut em: EventManager<Subscriber> = EventManager::new().map_err(|e| VmmError::EventLoop(format!("{e:?}")))?;
    em.add_subscriber(Arc::new(Mutex::new(ExitWatcher(exit.clone()))));
    em.add_subscriber(Arc::new(Mutex::new(SignalWatcher { fd: signal_fd, exit: exit.clone() })));
    em.add_subscriber(Arc::new(Mutex::new(PanicWatcher(exit.clone()))));
    for s in devices.subscribers {
        em.add_subscriber(s);
    }
    let snapshotter = Snapshotter {
        vm: fd.clone(),
        mem: mem.clone(),
        devices: devices.saveable,
        config: config.clone(),
        irqchip,
        host: snapshot_host,
    };
    let (service, snapshots) =
        snapshotter::service(snapshotter, control.clone()).map_err(dev_err("snapshot service"))?;
    em.add_subscriber(service);

    install_kick_handler().map_err(dev_err("vcpu kick signal"))?;
    let boot = boot.map(|mut phases| {
        phases.mark("event loop, snapshot service, kick handler", false);
        BootReport { phases: phases.into_list(), ready_unix_ns: unix_ns() }
    });
    // Listening before any vCPU runs: a guest can say it is ready (a template's console line)
    // before a later bind, and the caller's API request would find no socket.
    if let Some(endpoint) = api {
        let path = endpoint.path().to_owned();
        let controller = VmController {
            control: control.clone(),
            exit: exit.clone(),
            vcpus: config.vcpus,
            mem_mib: Mib::holding(config.mem_bytes),
            irqchip,
            start_unix_ns,
            snapshots: Some(snapshots),
            restore,
            boot,
            balloon: devices.balloon,
        };
        api::spawn(endpoint, controller, filters.api().clone())
            .map_err(dev_err(format!("api socket {}", path.display())))?;
    }
    for (id, vcpu) in vcpus.into_iter().enumerate() {
        let (filter, vcpu_exit) = (filters.vcpu().clone(), exit.clone());
        let handle = std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .spawn(move || match seccomp::install(ThreadKind::Vcpu, &filter) {
                Ok(()) => vcpu.run(),
                Err(e) => vcpu_exit.signal(ExitReason::VcpuError { vcpu: id as u8, message: e.to_string() }),
            })
            .map_err(dev_err("vcpu thread"))?;
        // Detached: the thread lists itself for pause kicks while it runs (`Vcpu::run`).
        drop(handle);
    }
    tracing::debug!(since_start_us = unix_ns().saturating_sub(start_unix_ns) / 1000, "VM running");

    // Every other thread exists now; from here on this thread is the event loop.
    seccomp::install(ThreadKind::EventLoop, filters.event_loop())?;
    loop {
        if let Some(reason) = exit.reason() {
            // Let parked vCPUs see the exit; running ones die with the process.
            control.resume();
            drop(mem);
            return Ok(reason);
        }
        em.run_with_timeout(1000).map_err(|e| VmmError::EventLoop(format!("{e:?}")))?;
    }
}

/// Wall-clock now, for callers that want to report the process start.
pub fn now_unix_ns() -> u64 {
    unix_ns()
}
