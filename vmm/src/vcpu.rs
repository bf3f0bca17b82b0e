//! vCPU setup and the per-vCPU thread: KVM_RUN, exit dispatch to the buses, pause/resume.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use kvm_bindings::{Msrs, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};

use crate::arch::{cpuid, msr, regs};
use crate::boot::EntryPoint;
use crate::devices::bus::{lock, Bus};
use crate::exit::{ExitReason, ExitSignal};

#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("creating vCPU {0}: {1}")]
    Create(u8, kvm_ioctls::Error),
    #[error("configuring vCPU {id} ({what})")]
    Configure { id: u8, what: &'static str, source: kvm_ioctls::Error },
}

/// The run state every vCPU thread follows (the API reports it as is).
pub use bulkhead_vmm_api::api::RunState;

/// Shared between the vCPU threads and the controller (API).
pub struct VcpuControl {
    state: Mutex<RunState>,
    cvar: Condvar,
    parked: AtomicUsize,
    threads: Mutex<Vec<libc::pthread_t>>,
    /// Wall-clock ns of the first KVM_RUN (for the start-latency bench).
    pub first_run_unix_ns: OnceLock<u64>,
}

pub fn kick_signal() -> i32 {
    libc::SIGRTMIN()
}

impl VcpuControl {
    pub fn new() -> Self {
        Self {
            state: Mutex::new(RunState::Running),
            cvar: Condvar::new(),
            parked: AtomicUsize::new(0),
            threads: Mutex::new(Vec::new()),
            first_run_unix_ns: OnceLock::new(),
        }
    }

    pub fn state(&self) -> RunState {
        *lock(&self.state)
    }

    pub fn register_thread(&self, t: libc::pthread_t) {
        lock(&self.threads).push(t);
    }

    /// Stops every vCPU outside KVM_RUN. Returns false if they did not all park in time.
    pub fn pause(&self, vcpus: usize, timeout: Duration) -> bool {
        *lock(&self.state) = RunState::Paused;
        let deadline = std::time::Instant::now() + timeout;
        while self.parked.load(Ordering::SeqCst) < vcpus {
            if std::time::Instant::now() > deadline {
                return false;
            }
            // A kick can land just before KVM_RUN and be lost, so keep kicking until parked.
            for t in lock(&self.threads).iter() {
                // SAFETY: t is a live vCPU thread of this process; the signal has a handler.
                unsafe { libc::pthread_kill(*t, kick_signal()) };
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }

    pub fn resume(&self) {
        *lock(&self.state) = RunState::Running;
        self.cvar.notify_all();
    }

    fn park_if_paused(&self) {
        let mut s = lock(&self.state);
        if *s == RunState::Paused {
            self.parked.fetch_add(1, Ordering::SeqCst);
            while *s == RunState::Paused {
                s = self.cvar.wait(s).unwrap_or_else(|p| p.into_inner());
            }
            self.parked.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Default for VcpuControl {
    fn default() -> Self {
        Self::new()
    }
}

pub struct Vcpu {
    id: u8,
    fd: VcpuFd,
    pio: Arc<Bus>,
    mmio: Arc<Bus>,
    exit: Arc<ExitSignal>,
    control: Arc<VcpuControl>,
}

/// Unknown-MMIO warnings are rate limited so a hostile guest cannot flood the log.
static UNKNOWN_MMIO: AtomicU64 = AtomicU64::new(0);
const UNKNOWN_MMIO_LOUD: u64 = 32;

impl Vcpu {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        kvm: &Kvm,
        vm: &VmFd,
        id: u8,
        count: u8,
        entry: &EntryPoint,
        irqchip: bool,
        pio: Arc<Bus>,
        mmio: Arc<Bus>,
        exit: Arc<ExitSignal>,
        control: Arc<VcpuControl>,
    ) -> Result<Self, VcpuError> {
        let fd = vm.create_vcpu(u64::from(id)).map_err(|e| VcpuError::Create(id, e))?;
        let cfg = |what, source| VcpuError::Configure { id, what, source };

        let mut cpuid = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).map_err(|e| cfg("get cpuid", e))?;
        cpuid::filter_cpuid(cpuid.as_mut_slice(), id, count);
        fd.set_cpuid2(&cpuid).map_err(|e| cfg("set cpuid", e))?;

        let entries = msr::boot_msr_entries();
        let msrs = Msrs::from_entries(&entries).map_err(|_| cfg("msrs", kvm_ioctls::Error::new(libc::EINVAL)))?;
        let set = fd.set_msrs(&msrs).map_err(|e| cfg("set msrs", e))?;
        if set != entries.len() {
            // Some hosts (PVM) refuse a few boot MSRs; the guest still boots without them.
            tracing::debug!(vcpu = id, set, wanted = entries.len(), "not every boot MSR was accepted");
        }

        let sregs = fd.get_sregs().map_err(|e| cfg("get sregs", e))?;
        fd.set_sregs(&regs::long_mode_sregs(sregs, entry.cr3)).map_err(|e| cfg("set sregs", e))?;
        fd.set_fpu(&regs::boot_fpu()).map_err(|e| cfg("set fpu", e))?;
        fd.set_regs(&regs::boot_regs(entry.rip, entry.rsp, entry.rsi)).map_err(|e| cfg("set regs", e))?;
        if irqchip {
            set_lint(&fd).map_err(|e| cfg("lapic", e))?;
        }
        Ok(Self { id, fd, pio, mmio, exit, control })
    }

    /// Runs until the VM stops; reports why through the exit signal.
    pub fn run(mut self) {
        loop {
            self.control.park_if_paused();
            if self.exit.reason().is_some() {
                return;
            }
            if self.control.first_run_unix_ns.get().is_none() {
                let _ = self.control.first_run_unix_ns.set(unix_ns());
                tracing::info!(vcpu = self.id, "first KVM_RUN");
            }
            if let Some(reason) = self.run_once() {
                self.exit.signal(reason);
                return;
            }
        }
    }

    fn run_once(&mut self) -> Option<ExitReason> {
        let id = self.id;
        let err = |message: String| Some(ExitReason::VcpuError { vcpu: id, message });
        match self.fd.run() {
            Ok(VcpuExit::IoIn(port, data)) => {
                if !self.pio.read(u64::from(port), data) {
                    data.fill(0xff);
                }
                None
            }
            Ok(VcpuExit::IoOut(port, data)) => {
                self.pio.write(u64::from(port), data);
                None
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                if !self.mmio.read(addr, data) {
                    unknown_mmio(id, "read", addr, data.len());
                    data.fill(0);
                }
                None
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                if !self.mmio.write(addr, data) {
                    unknown_mmio(id, "write", addr, data.len());
                }
                None
            }
            Ok(VcpuExit::Hlt) => Some(ExitReason::GuestHalted),
            Ok(VcpuExit::Shutdown) => Some(ExitReason::GuestTripleFault),
            Ok(VcpuExit::SystemEvent(kind, _)) => {
                tracing::info!(vcpu = id, kind, "guest system event");
                Some(ExitReason::GuestReset)
            }
            Ok(VcpuExit::Intr) | Ok(VcpuExit::IrqWindowOpen) => None,
            Ok(VcpuExit::FailEntry(reason, cpu)) => {
                err(format!("KVM_EXIT_FAIL_ENTRY: hardware reason {reason:#x} on cpu {cpu}"))
            }
            Ok(VcpuExit::InternalError) => {
                let rip = self.fd.get_regs().map(|r| format!("{:#x}", r.rip)).unwrap_or_else(|_| "unknown".into());
                err(format!("KVM_EXIT_INTERNAL_ERROR at rip {rip} (emulation failure or unsupported instruction)"))
            }
            Ok(other) => err(format!("unexpected vCPU exit: {other:?}")),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => None,
            Err(e) => err(format!("KVM_RUN failed: {e}")),
        }
    }
}

fn unknown_mmio(vcpu: u8, op: &str, addr: u64, len: usize) {
    let n = UNKNOWN_MMIO.fetch_add(1, Ordering::Relaxed);
    if n < UNKNOWN_MMIO_LOUD || n.is_multiple_of(10_000) {
        tracing::warn!(
            vcpu,
            op,
            addr = format_args!("{addr:#x}"),
            len,
            count = n + 1,
            "guest accessed unknown MMIO address"
        );
    }
}

pub fn unix_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

/// LINT0 = ExtINT (the PIC), LINT1 = NMI, as a BIOS leaves them.
fn set_lint(fd: &VcpuFd) -> Result<(), kvm_ioctls::Error> {
    const APIC_LVT0: usize = 0x350;
    const APIC_LVT1: usize = 0x360;
    const MODE_EXTINT: u32 = 0x7;
    const MODE_NMI: u32 = 0x4;
    let mut lapic = fd.get_lapic()?;
    for (off, mode) in [(APIC_LVT0, MODE_EXTINT), (APIC_LVT1, MODE_NMI)] {
        let bytes: [u8; 4] = std::array::from_fn(|i| lapic.regs[off + i] as u8);
        let v = u32::from_le_bytes(bytes);
        let v = (v & !0x700) | (mode << 8);
        for (i, b) in v.to_le_bytes().iter().enumerate() {
            lapic.regs[off + i] = *b as _;
        }
    }
    fd.set_lapic(&lapic)
}

/// No-op handler: the signal only needs to interrupt KVM_RUN.
extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

pub fn install_kick_handler() -> std::io::Result<()> {
    vmm_sys_util::signal::register_signal_handler(kick_signal(), kick_handler)
        .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
}
