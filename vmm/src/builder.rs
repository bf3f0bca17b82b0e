//! Building a VM: the KVM VM, guest memory, devices and vCPUs, ready for `vmm::run`. A boot
//! builds them from a config and loads the guest; a restore builds the same things around a
//! snapshot's memory and state. Restoring is split in two so a VMM can do the host-heavy half
//! (`prepare`: KVM VM, memory slots, irqchip, vCPU fds) ahead of time and the rest
//! (`Prepared::restore`: per-run devices and guest state) when a pod asks. The devices are the
//! device manager's (`device_manager/`): the builder hands it the VM and memory and gets the buses
//! back. Both run on the main thread before any seccomp filter, as no thread can start later.

use std::sync::Arc;

use bulkhead_vmm_api::api::RestoreReport;
use bulkhead_vmm_api::restore::{restored_config, RestoreConfig};
use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use crate::boot;
use crate::config::ValidConfig;
use crate::device_manager::{DeviceContext, DeviceManager};
use crate::error::{dev_err, VmmError};
use crate::exit::ExitSignal;
use crate::guest_layout;
use crate::memory::{create_guest_memory, map_snapshot_memory};
use crate::phases::Phases;
use crate::seccomp::Filters;
use crate::snapshot::cpu::HostCpu;
use crate::snapshot::state::VmState;
use crate::snapshot::{file, kvm as kvm_state, SnapshotFiles, MEMORY_FILE, STATE_FILE};
use crate::snapshotter::SnapshotHost;
use crate::thread::Unconfirmed;
use crate::vcpu::{unix_ns, Vcpu, VcpuControl, VcpuFeatures, VcpuShared};

/// A built VM, ready to run.
pub struct Vm {
    pub fd: Arc<VmFd>,
    pub mem: GuestMemoryMmap,
    pub irqchip: bool,
    /// What the VM was built from (a snapshot records it).
    pub config: ValidConfig,
    pub devices: DeviceManager,
    pub vcpus: Vec<Vcpu>,
    pub exit: Arc<ExitSignal>,
    pub control: Arc<VcpuControl>,
    /// What a snapshot of this VM records about the host, or why it cannot take one.
    pub snapshot_host: Result<SnapshotHost, String>,
    /// For a restored VM: how the restore went.
    pub restore: Option<RestoreReport>,
    /// For a booted VM: its start so far, which `vmm::run` ends when it starts the vCPUs.
    pub boot: Option<Phases>,
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

fn create_vm(kvm: &Kvm) -> Result<Arc<VmFd>, VmmError> {
    let vm = kvm.create_vm().map_err(|source| VmmError::KvmSetup { what: "create vm", source })?;
    vm.set_tss_address(guest_layout::TSS_ADDRESS)
        .map_err(|source| VmmError::KvmSetup { what: "tss address", source })?;
    Ok(Arc::new(vm))
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
/// the devices start. `phases`: the start so far (from `main`), which goes on here.
pub fn boot(cfg: ValidConfig, filters: &Filters, mut phases: Phases) -> Result<Vm, VmmError> {
    let kvm = Kvm::new().map_err(VmmError::Kvm)?;
    phases.mark("open /dev/kvm", true);
    let vm = create_vm(&kvm)?;
    phases.mark("KVM_CREATE_VM, KVM_SET_TSS_ADDR", true);
    let mem = create_guest_memory(cfg.mem_bytes)?;
    phases.mark("guest memory (memfd, mmap)", false);
    // Before the irqchip, as a restore does: once an in-kernel irqchip exists, KVM's first
    // KVM_SET_USER_MEMORY_REGION here took 6-7 ms (and a KVM_CREATE_IRQCHIP racing it waited as
    // long); before it, well under 1 ms.
    register_memory(&vm, &mem)?;
    phases.mark("KVM_SET_USER_MEMORY_REGION", true);
    let irqchip = create_irqchip(&vm);
    phases.mark("KVM_CREATE_IRQCHIP, KVM_CREATE_PIT2", true);
    let exit = Arc::new(ExitSignal::new().map_err(dev_err("exit eventfd"))?);
    let control = Arc::new(VcpuControl::new());
    // Device threads confine themselves while the rest is built; confirmed below.
    let threads = Unconfirmed::default();
    let ctx = DeviceContext { vm: &vm, irqchip, mem: &mem, exit: &exit, filters, threads: &threads };
    let devices = DeviceManager::build(&cfg, &ctx, None)?;
    phases.mark("devices (with KVM_IRQFD, KVM_IOEVENTFD)", false);

    let loaded = boot::load(&mem, &cfg.boot, cfg.mem_bytes, &devices.cmdline_devices, cfg.vcpus)?;
    phases.mark_split(
        "load guest (kernel, initramfs, boot data)",
        "guest image pages: the memfd's page allocation and copy (sendfile)",
        loaded.image_copy,
    );
    let entry = loaded.entry;
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
    phases.mark("KVM_GET_SUPPORTED_CPUID", true);
    let mut vcpus = Vec::new();
    for id in 0..cfg.vcpus {
        let fd = vm.create_vcpu(u64::from(id)).map_err(|e| crate::vcpu::VcpuError::Create(id, e))?;
        let vcpu = Vcpu::new(fd, id, features, shared.clone());
        vcpu.configure_boot(&supported, cfg.vcpus, &entry)?;
        vcpus.push(vcpu);
    }
    phases.mark("KVM_CREATE_VCPU, vCPU registers, CPUID, MSRs, LAPIC", true);
    let snapshot_host = snapshot_host(&kvm, HostCpu::from_entries(supported.as_slice()));
    phases.mark("host probe for snapshots (KVM_GET_MSR_INDEX_LIST)", true);
    threads.confirm_all().map_err(dev_err("device threads"))?;
    phases.mark("device threads confined (wait)", false);
    tracing::debug!("vcpus configured");
    Ok(Vm {
        fd: vm,
        mem,
        irqchip,
        config: cfg,
        devices,
        vcpus,
        exit,
        control,
        snapshot_host,
        restore: None,
        boot: Some(phases),
    })
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

/// Reads the snapshot in `files` (opened by the caller: as root, before the jail's privilege
/// drop) and does every host step that does not depend on the run.
/// `phases`: the start so far (from `main`), which goes on here.
pub fn prepare(files: SnapshotFiles, mut phases: Phases) -> Result<Prepared, VmmError> {
    let SnapshotFiles { dir, state, memory } = files;
    let kvm = Kvm::new().map_err(VmmError::Kvm)?;
    kvm_state::check_xsave_size(&kvm)?;
    let host = HostCpu::probe(&kvm).map_err(|source| VmmError::KvmSetup { what: "supported cpuid", source })?;
    phases.mark("open /dev/kvm, host CPU fingerprint", true);
    let snapshot_err = |source| VmmError::Snapshot { dir: dir.display().to_string(), source };
    let state =
        file::read_file(state, &dir.join(STATE_FILE), (&host.description, &host.fingerprint)).map_err(snapshot_err)?;
    phases.mark("read and check state file", false);
    let vm = create_vm(&kvm)?;
    phases.mark("KVM_CREATE_VM", true);
    // Private even with virtio-fs: its backend sees only the relay's region, not guest memory.
    let mem = map_snapshot_memory(memory, &dir.join(MEMORY_FILE), state.mem_file_bytes)?;
    phases.mark("map memory file (MAP_PRIVATE)", false);
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
        RestoreReport { phases: self.phases.list().to_vec(), requested_unix_ns: None, ready_unix_ns: 0 }
    }

    /// The config the snapshot was taken with (a run's settings are checked against it).
    pub fn saved_config(&self) -> &ValidConfig {
        &self.state.config
    }

    /// Builds this run's devices and puts the guest state back. The VM starts paused, unless
    /// the run says `resume`. `filters`: the seccomp filters of the threads the devices start.
    pub fn restore(mut self, run: &RestoreConfig, filters: &Filters) -> Result<Vm, VmmError> {
        // A prepared VMM waited for this request; that wait is not part of the restore.
        self.phases.restart();
        let cfg = restored_config(&self.state.config, run)?;
        let irqchip = self.state.vm.irqchip.is_some();
        let exit = Arc::new(ExitSignal::new().map_err(dev_err("exit eventfd"))?);
        let control = Arc::new(if run.resume { VcpuControl::new() } else { VcpuControl::new_paused() });
        let threads = Unconfirmed::default();
        let ctx = DeviceContext { vm: &self.vm, irqchip, mem: &self.mem, exit: &exit, filters, threads: &threads };
        let devices = DeviceManager::build(&cfg, &ctx, Some(&self.state.devices))?;
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
        // After the irqchip: restoring it would drop an interrupt raised before.
        devices.saveable.tell_restored_changes();
        self.phases.mark("vCPU, irqchip, PIT and clock state", true);
        threads.confirm_all().map_err(dev_err("device threads"))?;
        self.phases.mark("device threads confined (wait)", false);
        let report =
            RestoreReport { phases: self.phases.into_list(), requested_unix_ns: None, ready_unix_ns: unix_ns() };
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
            boot: None,
        })
    }
}
