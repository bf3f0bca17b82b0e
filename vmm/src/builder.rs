//! Building a VM: the KVM VM, guest memory, devices and vCPUs, ready for `vmm::run`. A boot
//! builds them from a config and loads the guest; a restore builds the same things around a
//! snapshot's memory and state. Restoring is split in two so a VMM can do the host-heavy half
//! (`prepare`: KVM VM, memory slots, irqchip, vCPU fds) ahead of time and the rest
//! (`Prepared::restore`: per-run devices and guest state) when a pod asks. Both run on the main
//! thread before any seccomp filter: the per-run files, sockets and taps are opened here, and
//! the virtio-fs backend threads are started (confined) here, as no thread can start later.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bulkhead_vmm_api::api::{RestorePhase, RestoreReport};
use bulkhead_vmm_api::restore::{restored_config, RestoreConfig, RestoreMismatch};
use event_manager::MutEventSubscriber;
use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::boot;
use crate::config::ValidConfig;
use crate::devices::bus::{Bus, BusDevice};
use crate::devices::legacy::i8042::{ResetTrigger, I8042, I8042_PORT, I8042_PORT_LEN};
use crate::devices::legacy::persist::{I8042ConstructorArgs, SerialConstructorArgs};
use crate::devices::legacy::serial::{CappedWriter, SerialDevice, SERIAL_LOG_LIMIT, SERIAL_PORT, SERIAL_PORT_LEN};
use crate::devices::legacy::EventFdTrigger;
use crate::devices::persist::{
    DevicesState, SaveableDevices, SaveableSlot, VirtioDeviceState, VirtioHandle, VirtioSlotState,
};
use crate::devices::virtio::balloon::persist::BalloonConstructorArgs;
use crate::devices::virtio::balloon::Balloon;
use crate::devices::virtio::block::persist::BlockConstructorArgs;
use crate::devices::virtio::block::Block;
use crate::devices::virtio::fs::persist::FsConstructorArgs;
use crate::devices::virtio::fs::{BackendThreads, Fs};
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::net::persist::NetConstructorArgs;
use crate::devices::virtio::net::tap::Tap;
use crate::devices::virtio::net::Net;
use crate::devices::virtio::persist::MmioTransportConstructorArgs;
use crate::devices::virtio::vsock::persist::VsockConstructorArgs;
use crate::devices::virtio::vsock::Vsock;
use crate::devices::virtio::{IrqTrigger, VirtioDevice};
use crate::exit::{ExitReason, ExitSignal};
use crate::layout;
use crate::memory::{copy_snapshot_memory, create_guest_memory, map_snapshot_memory};
use crate::persist::Persist;
use crate::seccomp::{self, Filters, ThreadKind};
use crate::snapshot::cpu::HostCpu;
use crate::snapshot::state::VmState;
use crate::snapshot::{file, kvm as kvm_state, MEMORY_FILE, STATE_FILE};
use crate::snapshotter::SnapshotHost;
use crate::thread::Confine;
use crate::vcpu::{unix_ns, Vcpu, VcpuControl, VcpuFeatures, VcpuShared};

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
    #[error("snapshot {dir}")]
    Snapshot { dir: String, source: file::ReadError },
    #[error(transparent)]
    KvmState(#[from] kvm_state::KvmStateError),
    #[error("restoring {what}: {reason}")]
    Restore { what: String, reason: String },
    #[error(transparent)]
    RunConfig(#[from] RestoreMismatch),
    #[error(transparent)]
    Seccomp(#[from] crate::seccomp::SeccompError),
}

pub(crate) fn dev_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmmError {
    let what = what.into();
    move |source| VmmError::Device { what, source }
}

fn restore_err(what: impl Into<String>) -> impl FnOnce(String) -> VmmError {
    let what = what.into();
    move |reason| VmmError::Restore { what, reason }
}

pub type Subscriber = Arc<Mutex<dyn MutEventSubscriber + Send>>;

/// A built VM, ready to run.
pub struct Vm {
    pub fd: Arc<VmFd>,
    pub mem: GuestMemoryMmap,
    pub irqchip: bool,
    /// What the VM was built from (a snapshot records it).
    pub config: ValidConfig,
    pub devices: Devices,
    pub vcpus: Vec<Vcpu>,
    pub exit: Arc<ExitSignal>,
    pub control: Arc<VcpuControl>,
    /// What a snapshot of this VM records about the host, or why it cannot take one.
    pub snapshot_host: Result<SnapshotHost, String>,
    /// For a restored VM: how the restore went.
    pub restore: Option<RestoreReport>,
}

/// Everything the guest can reach: port I/O and MMIO buses, plus the event-loop side of devices.
pub struct Devices {
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    pub subscribers: Vec<Subscriber>,
    /// (base, size, gsi) of each virtio-mmio device, for the kernel cmdline.
    pub cmdline_devices: Vec<CmdlineDevice>,
    /// The devices as a snapshot saves them.
    pub saveable: SaveableDevices,
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

/// An interrupt line: an irqfd on `gsi` when the irqchip exists, a plain eventfd otherwise
/// (test guests poll and never take interrupts).
fn irq_line(vm: &VmFd, irqchip: bool, gsi: u32) -> Result<EventFd, VmmError> {
    let evt = EventFd::new(libc::EFD_NONBLOCK).map_err(dev_err("irq eventfd"))?;
    if irqchip {
        vm.register_irqfd(&evt, gsi).map_err(|source| VmmError::KvmSetup { what: "irqfd", source })?;
    }
    Ok(evt)
}

fn create_vm(kvm: &Kvm) -> Result<Arc<VmFd>, VmmError> {
    let vm = kvm.create_vm().map_err(|source| VmmError::KvmSetup { what: "create vm", source })?;
    vm.set_tss_address(layout::TSS_ADDRESS).map_err(|source| VmmError::KvmSetup { what: "tss address", source })?;
    Ok(Arc::new(vm))
}

/// The virtio-mmio slots of a VM being built: each device gets the next slot, its interrupt and,
/// on a restore, the state saved for that slot.
struct VirtioSlots<'a> {
    saved: Option<&'a [VirtioSlotState]>,
    built: Vec<BuiltSlot<'a>>,
}

struct BuiltSlot<'a> {
    slot: Slot<'a>,
    device: Arc<Mutex<dyn VirtioDevice>>,
    handle: VirtioHandle,
}

/// (base, size, gsi) of a virtio-mmio device, for the kernel cmdline.
type CmdlineDevice = (u64, u64, u32);

/// The slots on the bus: what a snapshot saves and what the cmdline announces.
struct Attached {
    saveable: Vec<SaveableSlot>,
    cmdline_devices: Vec<CmdlineDevice>,
}

struct Slot<'a> {
    name: String,
    irq: IrqTrigger,
    saved: Option<&'a VirtioSlotState>,
}

impl<'a> Slot<'a> {
    /// The slot's saved device state, if restoring; an error if the snapshot put another kind
    /// of device here.
    fn saved_as<T>(&self, pick: fn(&VirtioDeviceState) -> Option<&T>) -> Result<Option<&'a T>, VmmError> {
        match self.saved {
            None => Ok(None),
            Some(s) => pick(&s.device).map(Some).ok_or_else(|| VmmError::Restore {
                what: self.name.clone(),
                reason: "the snapshot has another kind of device in this slot".into(),
            }),
        }
    }

    fn irq(&self) -> IrqTrigger {
        self.irq.clone()
    }
}

impl<'a> VirtioSlots<'a> {
    fn new(saved: Option<&'a [VirtioSlotState]>) -> Self {
        Self { saved, built: Vec::new() }
    }

    fn next(&self, name: String) -> Result<Slot<'a>, VmmError> {
        let index = self.built.len();
        let saved = match self.saved {
            None => None,
            Some(list) => match list.get(index) {
                Some(s) if s.name == name => Some(s),
                Some(s) => {
                    let reason = format!("virtio slot {index} holds {} in the snapshot", s.name);
                    return Err(VmmError::Restore { what: name, reason });
                }
                None => return Err(VmmError::Restore { what: name, reason: "the snapshot has no such device".into() }),
            },
        };
        let irq = IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).map_err(dev_err("irq eventfd"))?);
        Ok(Slot { name, irq, saved })
    }

    fn push(&mut self, slot: Slot<'a>, device: Arc<Mutex<dyn VirtioDevice>>, handle: VirtioHandle) {
        self.built.push(BuiltSlot { slot, device, handle });
    }

    /// Puts every device on the MMIO bus behind a transport (fresh or restored) and wires its
    /// interrupt to its GSI.
    fn attach(self, vm: &VmFd, irqchip: bool, mem: &GuestMemoryMmap, mmio: &mut Bus) -> Result<Attached, VmmError> {
        if let Some(list) = self.saved {
            if let Some(extra) = list.get(self.built.len()) {
                let reason = "the snapshot has this device but the run does not".to_string();
                return Err(VmmError::Restore { what: extra.name.clone(), reason });
            }
        }
        let mut saveable = Vec::new();
        let mut cmdline_devices = Vec::new();
        for (i, BuiltSlot { slot, device, handle }) in self.built.into_iter().enumerate() {
            let base = layout::virtio_mmio_addr(i);
            let gsi = layout::VIRTIO_IRQ_BASE + i as u32;
            if irqchip {
                vm.register_irqfd(slot.irq.eventfd(), gsi)
                    .map_err(|source| VmmError::KvmSetup { what: "irqfd", source })?;
            }
            let transport = match slot.saved {
                None => MmioTransport::new(slot.name.clone(), mem.clone(), device, slot.irq)
                    .map_err(dev_err(slot.name.clone()))?,
                Some(s) => {
                    let args = MmioTransportConstructorArgs {
                        name: slot.name.clone(),
                        mem: mem.clone(),
                        device,
                        irq: slot.irq,
                    };
                    MmioTransport::restore(args, &s.transport).map_err(|e| VmmError::Restore {
                        what: format!("{} transport", slot.name),
                        reason: e.to_string(),
                    })?
                }
            };
            let transport = Arc::new(Mutex::new(transport));
            let on_bus: Arc<Mutex<dyn BusDevice>> = transport.clone();
            mmio.insert(on_bus, base, layout::VIRTIO_MMIO_SIZE)?;
            cmdline_devices.push((base, layout::VIRTIO_MMIO_SIZE, gsi));
            saveable.push(SaveableSlot { name: slot.name, transport, device: handle });
        }
        Ok(Attached { saveable, cmdline_devices })
    }
}

/// What a new thread of `kind` runs first: installing its filter.
fn confine(kind: ThreadKind, program: &seccompiler::BpfProgram) -> Confine {
    let program = program.clone();
    Box::new(move || seccomp::install(kind, &program).map_err(|e| e.to_string()))
}

/// Builds every device; from `saved` state when restoring. virtio-fs devices start their
/// backend threads here (filtered), as no thread can be started once the filters are in.
fn build_devices(
    cfg: &ValidConfig,
    vm: &VmFd,
    irqchip: bool,
    mem: &GuestMemoryMmap,
    exit: &Arc<ExitSignal>,
    saved: Option<&DevicesState>,
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
    let serial = match saved {
        None => SerialDevice::new(serial_irq, serial_out),
        Some(s) => SerialDevice::restore(SerialConstructorArgs { irq: serial_irq, out: serial_out }, &s.serial)
            .map_err(|e| restore_err("serial")(e.to_string()))?,
    };
    let serial = Arc::new(Mutex::new(serial));
    pio.insert(serial.clone(), SERIAL_PORT, SERIAL_PORT_LEN)?;
    let reset_exit = exit.clone();
    let on_reset = ResetTrigger(Box::new(move || {
        tracing::info!("guest reset through i8042");
        reset_exit.signal(ExitReason::GuestReset);
    }));
    let i8042 = match saved {
        None => I8042::new(on_reset),
        Some(s) => I8042::restore(I8042ConstructorArgs { on_reset }, &s.i8042)
            .map_err(|e| restore_err("i8042")(e.to_string()))?,
    };
    let i8042 = Arc::new(Mutex::new(i8042));
    pio.insert(i8042.clone(), I8042_PORT, I8042_PORT_LEN)?;
    #[cfg(debug_assertions)]
    if let Some((port, watcher)) = crate::crash::probe::devices().map_err(dev_err("panic probe"))? {
        pio.insert(port, crate::crash::probe::PROBE_PORT, 1)?;
        subscribers.push(watcher);
    }

    // Virtio devices, one MMIO slot each: block devices first, then vsock, fs, net, balloon.
    let mut virtio = VirtioSlots::new(saved.map(|s| s.virtio.as_slice()));
    for (i, b) in cfg.block.iter().enumerate() {
        let slot = virtio.next(format!("blk{i}"))?;
        let blk = match slot.saved_as(VirtioDeviceState::block)? {
            None => Block::new(b, i).map_err(dev_err(format!("block {}", b.path.display())))?,
            Some(s) => {
                let args = BlockConstructorArgs { cfg: b.clone(), index: i, mem: mem.clone(), irq: slot.irq() };
                Block::restore(args, s).map_err(|e| restore_err(slot.name.clone())(e.to_string()))?
            }
        };
        let blk = Arc::new(Mutex::new(blk));
        subscribers.push(blk.clone());
        virtio.push(slot, blk.clone(), VirtioHandle::Block(blk));
    }
    if let Some(v) = &cfg.vsock {
        let slot = virtio.next("vsock".to_string())?;
        let vsock = match slot.saved_as(VirtioDeviceState::vsock)? {
            None => Vsock::new(v.guest_cid, &v.uds_path).map_err(dev_err(format!("vsock {}", v.uds_path.display())))?,
            Some(s) => {
                let args = VsockConstructorArgs { uds_path: v.uds_path.clone(), mem: mem.clone(), irq: slot.irq() };
                Vsock::restore(args, s).map_err(|e| restore_err("vsock")(e.to_string()))?
            }
        };
        let vsock = Arc::new(Mutex::new(vsock));
        subscribers.push(vsock.clone());
        virtio.push(slot, vsock.clone(), VirtioHandle::Vsock(vsock));
    }
    for (i, f) in cfg.fs.iter().enumerate() {
        let slot = virtio.next(format!("fs{i}"))?;
        let threads = BackendThreads {
            worker: confine(ThreadKind::FsBackend, filters.fs_backend()),
            watchdog: confine(ThreadKind::FsWatchdog, filters.fs_watchdog()),
        };
        let fs = match slot.saved_as(VirtioDeviceState::fs)? {
            None => Fs::new(f, i, threads).map_err(dev_err(format!("fs {}", f.tag)))?,
            Some(s) => {
                let args = FsConstructorArgs { cfg: f.clone(), index: i, threads, mem: mem.clone(), irq: slot.irq() };
                Fs::restore(args, s).map_err(|e| restore_err(slot.name.clone())(e.to_string()))?
            }
        };
        let fs = Arc::new(Mutex::new(fs));
        subscribers.push(fs.clone());
        virtio.push(slot, fs.clone(), VirtioHandle::Fs(fs));
    }
    for (i, n) in cfg.net.iter().enumerate() {
        let slot = virtio.next(format!("net{i}"))?;
        let net_err = |source| VmmError::Net { tap: n.tap.clone(), source };
        let net = match slot.saved_as(VirtioDeviceState::net)? {
            None => Net::new(n, i).map_err(net_err)?,
            Some(s) => {
                let tap = Tap::open(&n.tap).map_err(|e| net_err(e.into()))?;
                let args = NetConstructorArgs {
                    index: i,
                    tap: n.tap.clone(),
                    backend: Box::new(tap),
                    rate_limiter: n.rate_limiter.clone(),
                    mem: mem.clone(),
                    irq: slot.irq(),
                };
                Net::restore(args, s).map_err(|e| restore_err(slot.name.clone())(e.to_string()))?
            }
        };
        let net = Arc::new(Mutex::new(net));
        subscribers.push(net.clone());
        virtio.push(slot, net.clone(), VirtioHandle::Net(net));
    }
    if let Some(b) = &cfg.balloon {
        let slot = virtio.next("balloon".to_string())?;
        let balloon = match slot.saved_as(VirtioDeviceState::balloon)? {
            None => Balloon::new(b).map_err(dev_err("balloon"))?,
            Some(s) => {
                let args = BalloonConstructorArgs { cfg: *b, mem: mem.clone(), irq: slot.irq() };
                Balloon::restore(args, s).map_err(|e| restore_err("balloon")(e.to_string()))?
            }
        };
        let balloon = Arc::new(Mutex::new(balloon));
        subscribers.push(balloon.clone());
        virtio.push(slot, balloon.clone(), VirtioHandle::Balloon(balloon));
    }
    let Attached { saveable: virtio, cmdline_devices } = virtio.attach(vm, irqchip, mem, &mut mmio)?;

    let saveable = SaveableDevices { serial, i8042, virtio };
    Ok(Devices { pio: Arc::new(pio), mmio: Arc::new(mmio), subscribers, cmdline_devices, saveable })
}

fn vcpu_features(kvm: &Kvm, irqchip: bool) -> VcpuFeatures {
    VcpuFeatures { irqchip, xcrs: kvm_state::has_xcrs(kvm) }
}

/// What a snapshot of a VM built here records about the host (probed now: the event loop that
/// takes snapshots has no `/dev/kvm` ioctls), or why this host cannot snapshot.
fn snapshot_host(kvm: &Kvm, cpu: HostCpu) -> Result<SnapshotHost, String> {
    SnapshotHost::probe(kvm, cpu).map_err(|e| {
        tracing::warn!(error = %e, "this VM cannot be snapshotted here");
        e.to_string()
    })
}

/// Builds a VM from a config and loads its guest. `filters`: the seccomp filters of the threads
/// the devices start.
pub fn boot(cfg: ValidConfig, start_unix_ns: u64, filters: &Filters) -> Result<Vm, VmmError> {
    tracing::debug!(since_start_us = unix_ns().saturating_sub(start_unix_ns) / 1000, "building the VM");
    let kvm = Kvm::new().map_err(VmmError::Kvm)?;
    let vm = create_vm(&kvm)?;
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
    let devices = build_devices(&cfg, &vm, irqchip, &mem, &exit, None, filters)?;

    let entry = boot::load(&mem, &cfg.boot, cfg.mem_bytes, &devices.cmdline_devices, cfg.vcpus)?;
    tracing::debug!(?entry, irqchip, "guest loaded");

    let shared = VcpuShared {
        pio: devices.pio.clone(),
        mmio: devices.mmio.clone(),
        exit: exit.clone(),
        control: control.clone(),
    };
    let features = vcpu_features(&kvm, irqchip);
    let supported = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(|source| VmmError::KvmSetup { what: "supported cpuid", source })?;
    let mut vcpus = Vec::new();
    for id in 0..cfg.vcpus {
        let fd = vm.create_vcpu(u64::from(id)).map_err(|e| crate::vcpu::VcpuError::Create(id, e))?;
        let vcpu = Vcpu::new(fd, id, features, shared.clone());
        vcpu.configure_boot(&supported, cfg.vcpus, &entry)?;
        vcpus.push(vcpu);
    }
    let snapshot_host = snapshot_host(&kvm, HostCpu::from_entries(supported.as_slice()));
    registration.join().map_err(|_| VmmError::EventLoop("memslot registration thread panicked".into()))??;
    tracing::debug!("vcpus configured, guest memory registered");
    Ok(Vm { fd: vm, mem, irqchip, config: cfg, devices, vcpus, exit, control, snapshot_host, restore: None })
}

/// Times the steps of a restore.
struct Phases {
    list: Vec<RestorePhase>,
    last: Instant,
}

impl Phases {
    fn new() -> Self {
        Self { list: Vec::new(), last: Instant::now() }
    }

    /// Ends the current step.
    fn mark(&mut self, name: &str, kvm: bool) {
        let now = Instant::now();
        self.list.push(RestorePhase { name: name.into(), us: (now - self.last).as_micros() as u64, kvm });
        self.last = now;
    }
}

/// A snapshot with the host-heavy half of its restore done: state read and checked, memory
/// mapped and registered, irqchip and vCPUs created.
pub struct Prepared {
    kvm: Kvm,
    snapshot_host: Result<SnapshotHost, String>,
    vm: Arc<VmFd>,
    mem: GuestMemoryMmap,
    state: VmState,
    vcpu_fds: Vec<VcpuFd>,
    phases: Phases,
}

/// Reads the snapshot in `dir` and does every host step that does not depend on the run.
pub fn prepare(dir: &Path) -> Result<Prepared, VmmError> {
    let mut phases = Phases::new();
    let kvm = Kvm::new().map_err(VmmError::Kvm)?;
    kvm_state::check_xsave_size(&kvm)?;
    let host = HostCpu::probe(&kvm).map_err(|source| VmmError::KvmSetup { what: "supported cpuid", source })?;
    phases.mark("open /dev/kvm, host CPU fingerprint", true);
    let snapshot_err = |source| VmmError::Snapshot { dir: dir.display().to_string(), source };
    let state = file::read(&dir.join(STATE_FILE), (&host.description, &host.fingerprint)).map_err(snapshot_err)?;
    phases.mark("read and check state file", false);
    let vm = create_vm(&kvm)?;
    phases.mark("KVM_CREATE_VM", true);
    let mem = if state.config.fs.is_empty() {
        let mem = map_snapshot_memory(&dir.join(MEMORY_FILE), state.mem_file_bytes)?;
        phases.mark("map memory file (MAP_PRIVATE)", false);
        mem
    } else {
        // A vhost-user backend maps guest memory shared: it needs a memfd, not a private map.
        let mem = copy_snapshot_memory(&dir.join(MEMORY_FILE), state.mem_file_bytes)?;
        phases.mark("copy memory file into a memfd (virtio-fs)", false);
        mem
    };
    register_memory(&vm, &mem)?;
    phases.mark("KVM_SET_USER_MEMORY_REGION", true);
    if state.vm.irqchip.is_some() {
        vm.create_irq_chip().map_err(|source| VmmError::KvmSetup { what: "irqchip", source })?;
    }
    if state.vm.pit.is_some() {
        let pit = kvm_pit_config { flags: KVM_PIT_SPEAKER_DUMMY, ..Default::default() };
        vm.create_pit2(pit).map_err(|source| VmmError::KvmSetup { what: "PIT", source })?;
    }
    let mut vcpu_fds = Vec::new();
    for id in 0..state.config.vcpus {
        vcpu_fds.push(vm.create_vcpu(u64::from(id)).map_err(|e| crate::vcpu::VcpuError::Create(id, e))?);
    }
    phases.mark("KVM_CREATE_IRQCHIP, KVM_CREATE_PIT2, KVM_CREATE_VCPU", true);
    let snapshot_host = snapshot_host(&kvm, host);
    Ok(Prepared { kvm, snapshot_host, vm, mem, state, vcpu_fds, phases })
}

impl Prepared {
    pub fn vcpus(&self) -> u8 {
        self.state.config.vcpus
    }

    pub fn mem_bytes(&self) -> u64 {
        self.state.config.mem_bytes
    }

    pub fn irqchip(&self) -> bool {
        self.state.vm.irqchip.is_some()
    }

    /// The prepare steps so far, for the report of a VMM still waiting.
    pub fn report(&self) -> RestoreReport {
        RestoreReport { phases: self.phases.list.clone(), requested_unix_ns: None, ready_unix_ns: 0 }
    }

    /// The config the snapshot was taken with (a run's settings are checked against it).
    pub fn saved_config(&self) -> &ValidConfig {
        &self.state.config
    }

    /// Builds this run's devices and puts the guest state back. The VM starts paused.
    /// `filters`: the seccomp filters of the threads the devices start.
    pub fn restore(mut self, run: &RestoreConfig, filters: &Filters) -> Result<Vm, VmmError> {
        self.phases.last = Instant::now();
        let cfg = restored_config(&self.state.config, run)?;
        let irqchip = self.state.vm.irqchip.is_some();
        let exit = Arc::new(ExitSignal::new().map_err(dev_err("exit eventfd"))?);
        let control = Arc::new(VcpuControl::new_paused());
        let devices = build_devices(&cfg, &self.vm, irqchip, &self.mem, &exit, Some(&self.state.devices), filters)?;
        self.phases.mark("devices from saved state (with KVM_IRQFD)", false);
        let shared = VcpuShared {
            pio: devices.pio.clone(),
            mmio: devices.mmio.clone(),
            exit: exit.clone(),
            control: control.clone(),
        };
        let features = vcpu_features(&self.kvm, irqchip);
        let mut vcpus = Vec::new();
        for (fd, state) in self.vcpu_fds.into_iter().zip(&self.state.vcpus) {
            let vcpu = Vcpu::new(fd, state.id, features, shared.clone());
            vcpu.restore(state)?;
            vcpus.push(vcpu);
        }
        kvm_state::restore_vm(&self.vm, &self.state.vm)?;
        self.phases.mark("vCPU, irqchip, PIT and clock state", true);
        let report = RestoreReport { phases: self.phases.list, requested_unix_ns: None, ready_unix_ns: unix_ns() };
        Ok(Vm {
            fd: self.vm,
            mem: self.mem,
            irqchip,
            config: cfg,
            devices,
            vcpus,
            exit,
            control,
            snapshot_host: self.snapshot_host,
            restore: Some(report),
        })
    }
}
