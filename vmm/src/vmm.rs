//! Builds the VM from a validated config (KVM, memory, devices, boot, vCPUs) and runs the event
//! loop until something stops it.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use event_manager::{EventManager, EventOps, Events, MutEventSubscriber, SubscriberOps};
use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Kvm, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::api::{self, VmController};
use crate::boot;
use crate::config::ValidConfig;
use crate::devices::bus::{Bus, BusDevice};
use crate::devices::legacy::i8042::{ResetTrigger, I8042, I8042_PORT, I8042_PORT_LEN};
use crate::devices::legacy::serial::{CappedWriter, SerialDevice, SERIAL_LOG_LIMIT, SERIAL_PORT, SERIAL_PORT_LEN};
use crate::devices::legacy::EventFdTrigger;
use crate::devices::virtio::block::Block;
use crate::devices::virtio::fs::thread::Confine;
use crate::devices::virtio::fs::{BackendThreads, Fs};
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::net::Net;
use crate::devices::virtio::vsock::Vsock;
use crate::devices::virtio::{IrqTrigger, VirtioDevice};
use crate::exit::{ExitReason, ExitSignal};
use crate::layout;
use crate::memory::create_guest_memory;
use crate::seccomp::{self, Filters, ThreadKind};
use crate::vcpu::{install_kick_handler, unix_ns, Vcpu, VcpuControl};

#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    #[error("cannot open /dev/kvm: {0}")]
    Kvm(kvm_ioctls::Error),
    #[error("KVM setup failed ({what})")]
    KvmSetup { what: &'static str, source: kvm_ioctls::Error },
    #[error(transparent)]
    Memory(#[from] crate::memory::MemoryError),
    #[error(transparent)]
    Boot(#[from] crate::boot::BootError),
    #[error(transparent)]
    Vcpu(#[from] crate::vcpu::VcpuError),
    #[error("device {what}")]
    Device { what: String, source: std::io::Error },
    #[error("net device on tap {tap}")]
    Net { tap: String, source: crate::devices::virtio::net::device::NetError },
    #[error("bus")]
    Bus(#[from] crate::devices::bus::BusError),
    #[error("event loop: {0}")]
    EventLoop(String),
    #[error(transparent)]
    Seccomp(#[from] crate::seccomp::SeccompError),
}

fn dev_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmmError {
    let what = what.into();
    move |source| VmmError::Device { what, source }
}

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

type Subscriber = Arc<Mutex<dyn MutEventSubscriber + Send>>;

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

fn register_memory(vm: &VmFd, mem: &GuestMemoryMmap) -> Result<(), VmmError> {
    for (slot, region) in mem.iter().enumerate() {
        let host = mem
            .get_host_address(region.start_addr())
            .map_err(|_| VmmError::KvmSetup { what: "host address", source: kvm_ioctls::Error::new(libc::EFAULT) })?;
        let r = kvm_userspace_memory_region {
            slot: slot as u32,
            flags: 0,
            guest_phys_addr: region.start_addr().0,
            memory_size: region.len(),
            userspace_addr: host as u64,
        };
        // SAFETY: the mapping lives as long as `mem`, which outlives the VM (held until exit).
        unsafe { vm.set_user_memory_region(r) }
            .map_err(|source| VmmError::KvmSetup { what: "memory region", source })?;
    }
    Ok(())
}

/// An interrupt line: an irqfd on `gsi` when the irqchip exists, a plain eventfd otherwise
/// (test guests poll and never take interrupts).
fn irq_line(vm: &VmFd, irqchip: bool, gsi: u32) -> Result<EventFd, VmmError> {
    let evt = EventFd::new(libc::EFD_NONBLOCK).map_err(dev_err("irq eventfd"))?;
    if irqchip {
        vm.register_irqfd(&evt, gsi).map_err(|source| VmmError::KvmSetup { what: "irqfd", source })?;
    }
    Ok(evt)
}

/// In-kernel PIC/IOAPIC/LAPIC and PIT where the host offers them.
fn create_irqchip(vm: &VmFd) -> bool {
    match vm.create_irq_chip() {
        Ok(()) => {
            let pit = kvm_pit_config { flags: KVM_PIT_SPEAKER_DUMMY, ..Default::default() };
            if let Err(e) = vm.create_pit2(pit) {
                tracing::warn!(error = %e, "no in-kernel PIT");
            }
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, "no in-kernel irqchip; devices will not raise interrupts");
            false
        }
    }
}

/// Everything the guest can reach: port I/O and MMIO buses, plus the event-loop side of devices.
struct Devices {
    pio: Bus,
    mmio: Bus,
    subscribers: Vec<Subscriber>,
    /// (base, size, gsi) of each virtio-mmio device, for the kernel cmdline.
    cmdline_devices: Vec<(u64, u64, u32)>,
}

/// What a new thread of `kind` runs first: installing its filter.
fn confine(kind: ThreadKind, program: &seccompiler::BpfProgram) -> Confine {
    let program = program.clone();
    Box::new(move || seccomp::install(kind, &program).map_err(|e| e.to_string()))
}

/// Builds the devices. virtio-fs devices start their backend threads here (filtered), as no
/// thread can be started once the filters are in.
fn build_devices(
    cfg: &ValidConfig,
    vm: &VmFd,
    irqchip: bool,
    mem: &GuestMemoryMmap,
    exit: &Arc<ExitSignal>,
    filters: &Filters,
) -> Result<Devices, VmmError> {
    let mut pio = Bus::new();
    let mut mmio = Bus::new();
    let mut subscribers: Vec<Subscriber> = Vec::new();

    // Legacy devices.
    let serial_out: Box<dyn Write + Send> = match &cfg.serial_log {
        Some(p) => Box::new(CappedWriter::new(
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(dev_err(format!("serial log {}", p.display())))?,
            SERIAL_LOG_LIMIT,
        )),
        None => Box::new(std::io::sink()),
    };
    let serial_irq = EventFdTrigger(irq_line(vm, irqchip, layout::SERIAL_IRQ)?);
    pio.insert(Arc::new(Mutex::new(SerialDevice::new(serial_irq, serial_out))), SERIAL_PORT, SERIAL_PORT_LEN)?;
    let reset_exit = exit.clone();
    let i8042 = I8042::new(ResetTrigger(Box::new(move || {
        tracing::info!("guest reset through i8042");
        reset_exit.signal(ExitReason::GuestReset);
    })));
    pio.insert(Arc::new(Mutex::new(i8042)), I8042_PORT, I8042_PORT_LEN)?;

    // Virtio devices, one MMIO slot each: block devices first, then vsock, then net.
    let mut virtio: Vec<(String, Arc<Mutex<dyn VirtioDevice>>)> = Vec::new();
    for (i, b) in cfg.block.iter().enumerate() {
        let blk = Arc::new(Mutex::new(Block::new(b, i).map_err(dev_err(format!("block {}", b.path.display())))?));
        subscribers.push(blk.clone());
        virtio.push((format!("blk{i}"), blk));
    }
    if let Some(v) = &cfg.vsock {
        let vsock = Arc::new(Mutex::new(
            Vsock::new(v.guest_cid, &v.uds_path).map_err(dev_err(format!("vsock {}", v.uds_path.display())))?,
        ));
        subscribers.push(vsock.clone());
        virtio.push(("vsock".to_string(), vsock));
    }
    for (i, f) in cfg.fs.iter().enumerate() {
        let threads = BackendThreads {
            worker: confine(ThreadKind::FsBackend, filters.fs_backend()),
            watchdog: confine(ThreadKind::FsWatchdog, filters.fs_watchdog()),
        };
        let fs = Arc::new(Mutex::new(Fs::new(f, i, threads).map_err(dev_err(format!("fs {}", f.tag)))?));
        subscribers.push(fs.clone());
        virtio.push((format!("fs{i}"), fs));
    }
    for (i, n) in cfg.net.iter().enumerate() {
        let net = Arc::new(Mutex::new(Net::new(n, i).map_err(|e| VmmError::Net { tap: n.tap.clone(), source: e })?));
        subscribers.push(net.clone());
        virtio.push((format!("net{i}"), net));
    }
    let mut cmdline_devices = Vec::new();
    for (i, (name, dev)) in virtio.into_iter().enumerate() {
        let base = layout::virtio_mmio_addr(i);
        let gsi = layout::VIRTIO_IRQ_BASE + i as u32;
        let irq = IrqTrigger::new(irq_line(vm, irqchip, gsi)?);
        let transport = MmioTransport::new(name.clone(), mem.clone(), dev, irq).map_err(dev_err(name))?;
        let transport: Arc<Mutex<dyn BusDevice>> = Arc::new(Mutex::new(transport));
        mmio.insert(transport, base, layout::VIRTIO_MMIO_SIZE)?;
        cmdline_devices.push((base, layout::VIRTIO_MMIO_SIZE, gsi));
    }

    Ok(Devices { pio, mmio, subscribers, cmdline_devices })
}

/// Builds and runs the VM. Returns why it stopped. Every thread it starts, and the calling thread
/// once the VM is built, runs under its kind's filter from `filters`.
pub fn run(
    cfg: ValidConfig,
    signal_fd: OwnedFd,
    start_unix_ns: u64,
    filters: &Filters,
) -> Result<ExitReason, VmmError> {
    tracing::debug!(since_start_us = unix_ns().saturating_sub(start_unix_ns) / 1000, "building the VM");
    let kvm = Kvm::new().map_err(VmmError::Kvm)?;
    let vm = Arc::new(kvm.create_vm().map_err(|source| VmmError::KvmSetup { what: "create vm", source })?);
    vm.set_tss_address(layout::TSS_ADDRESS).map_err(|source| VmmError::KvmSetup { what: "tss address", source })?;
    let mem = create_guest_memory(cfg.mem_bytes)?;
    // The first memslot costs milliseconds on some hosts (PVM); overlap it with device setup.
    let registration = {
        let (vm, mem) = (vm.clone(), mem.clone());
        std::thread::Builder::new()
            .name("memslots".into())
            .spawn(move || register_memory(&vm, &mem))
            .map_err(dev_err("memslot thread"))?
    };

    let irqchip = create_irqchip(&vm);

    tracing::debug!(irqchip, "vm created");
    let exit = Arc::new(ExitSignal::new().map_err(dev_err("exit eventfd"))?);
    let control = Arc::new(VcpuControl::new());
    let _bound_sockets =
        BoundSockets(cfg.vsock.iter().map(|v| v.uds_path.clone()).chain(cfg.api_socket.clone()).collect());
    let Devices { pio, mmio, subscribers, cmdline_devices } = build_devices(&cfg, &vm, irqchip, &mem, &exit, filters)?;

    let entry = boot::load(&mem, &cfg.boot, cfg.mem_bytes, &cmdline_devices, cfg.vcpus)?;
    tracing::debug!(?entry, irqchip, "guest loaded");

    let pio = Arc::new(pio);
    let mmio = Arc::new(mmio);
    let mut vcpus = Vec::new();
    for id in 0..cfg.vcpus {
        vcpus.push(Vcpu::new(
            &kvm,
            &vm,
            id,
            cfg.vcpus,
            &entry,
            irqchip,
            pio.clone(),
            mmio.clone(),
            exit.clone(),
            control.clone(),
        )?);
    }

    registration.join().map_err(|_| VmmError::EventLoop("memslot registration thread panicked".into()))??;
    tracing::debug!("vcpus configured, guest memory registered");
    let mut em: EventManager<Subscriber> = EventManager::new().map_err(|e| VmmError::EventLoop(format!("{e:?}")))?;
    em.add_subscriber(Arc::new(Mutex::new(ExitWatcher(exit.clone()))));
    em.add_subscriber(Arc::new(Mutex::new(SignalWatcher { fd: signal_fd, exit: exit.clone() })));
    for s in subscribers {
        em.add_subscriber(s);
    }
    install_kick_handler().map_err(dev_err("vcpu kick signal"))?;
    for (id, vcpu) in vcpus.into_iter().enumerate() {
        let (filter, vcpu_exit) = (filters.vcpu().clone(), exit.clone());
        let handle = std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .spawn(move || match seccomp::install(ThreadKind::Vcpu, &filter) {
                Ok(()) => vcpu.run(),
                Err(e) => vcpu_exit.signal(ExitReason::VcpuError { vcpu: id as u8, message: e.to_string() }),
            })
            .map_err(dev_err("vcpu thread"))?;
        control.register_thread(std::os::unix::thread::JoinHandleExt::as_pthread_t(&handle));
    }
    if let Some(path) = &cfg.api_socket {
        let controller = VmController {
            control: control.clone(),
            exit: exit.clone(),
            vcpus: cfg.vcpus,
            mem_mib: cfg.mem_bytes >> 20,
            irqchip,
            start_unix_ns,
        };
        let filter = filters.api().clone();
        api::spawn(path, controller, filter).map_err(dev_err(format!("api socket {}", path.display())))?;
    }

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
