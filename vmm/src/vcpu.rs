//! vCPU setup and the per-vCPU thread: KVM_RUN, exit dispatch to the buses, pause/resume, and
//! saving a parked vCPU's state for a snapshot (only the owning thread may touch its `VcpuFd`).

use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use kvm_bindings::{CpuId, Msrs};
use kvm_ioctls::{VcpuExit, VcpuFd};

use crate::arch::{cpuid, msr, regs};
use crate::boot::EntryPoint;
use crate::devices::bus::{lock, Bus};
use crate::exit::{ExitReason, ExitSignal};
use crate::log_throttle::LogThrottle;
use crate::snapshot::kvm::{restore_vcpu, save_vcpu, KvmStateError};
use crate::snapshot::state::VcpuState;

#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("creating vCPU {0}: {1}")]
    Create(u8, kvm_ioctls::Error),
    #[error("configuring vCPU {id} ({what})")]
    Configure { id: u8, what: &'static str, source: kvm_ioctls::Error },
}

/// The run state every vCPU thread follows (the API reports it as is).
pub use bulkhead_vmm_api::api::RunState;

/// A saved vCPU and the MSRs this host would not read.
pub type SavedVcpu = (VcpuState, Vec<u32>);

/// A snapshot's request to the parked vCPUs: each fills its own slot.
struct SaveRequest {
    msrs: Arc<[u32]>,
    results: Vec<Option<Result<SavedVcpu, String>>>,
}

struct Shared {
    state: RunState,
    parked: usize,
    save: Option<SaveRequest>,
}

/// Shared between the vCPU threads and the controller (API).
pub struct VcpuControl {
    shared: Mutex<Shared>,
    cvar: Condvar,
    /// The vCPU threads a pause may kick. Each thread lists itself while it runs (a
    /// [`KickRegistration`]) and leaves before it ends, under this lock, which the kicks hold: a
    /// kick never reaches a thread that has exited (`pthread_kill` on one is undefined behaviour).
    threads: Mutex<Vec<libc::pthread_t>>,
    /// Wall-clock ns of the first KVM_RUN (for the start-latency bench).
    pub first_run_unix_ns: OnceLock<u64>,
}

pub fn kick_signal() -> i32 {
    libc::SIGRTMIN()
}

impl VcpuControl {
    pub fn new() -> Self {
        Self::with_state(RunState::Running)
    }

    /// vCPUs that park as soon as they start: a restored VM waits for `resume`.
    pub fn new_paused() -> Self {
        Self::with_state(RunState::Paused)
    }

    fn with_state(state: RunState) -> Self {
        Self {
            shared: Mutex::new(Shared { state, parked: 0, save: None }),
            cvar: Condvar::new(),
            threads: Mutex::new(Vec::new()),
            first_run_unix_ns: OnceLock::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        lock(&self.shared)
    }

    pub fn state(&self) -> RunState {
        self.lock().state
    }

    /// Lists the calling thread for kicks until the returned guard drops (at the end of the
    /// thread's work, or while it unwinds from a panic).
    pub fn register_current(self: &Arc<Self>) -> KickRegistration {
        // SAFETY: pthread_self has no preconditions and always succeeds.
        let thread = unsafe { libc::pthread_self() };
        lock(&self.threads).push(thread);
        KickRegistration { control: Arc::clone(self), thread }
    }

    /// How many threads a pause would kick now.
    pub fn kickable(&self) -> usize {
        lock(&self.threads).len()
    }

    /// Stops every vCPU outside KVM_RUN. Returns false if they did not all park in time.
    pub fn pause(&self, vcpus: usize, timeout: Duration) -> bool {
        self.lock().state = RunState::Paused;
        let deadline = Instant::now() + timeout;
        while self.lock().parked < vcpus {
            if Instant::now() > deadline {
                return false;
            }
            // A kick can land just before KVM_RUN and be lost, so keep kicking until parked.
            for t in lock(&self.threads).iter() {
                // SAFETY: t is listed, so its thread has not left its work yet and cannot end
                // while we hold the lock (its registration's drop takes it); the signal has a handler.
                unsafe { libc::pthread_kill(*t, kick_signal()) };
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    pub fn resume(&self) {
        self.lock().state = RunState::Running;
        self.cvar.notify_all();
    }

    /// Asks every parked vCPU for its state. Call after a successful [`pause`](Self::pause).
    pub fn save_vcpus(&self, vcpus: usize, msrs: Vec<u32>, timeout: Duration) -> Result<Vec<SavedVcpu>, String> {
        let deadline = Instant::now() + timeout;
        let mut s = self.lock();
        if s.state != RunState::Paused || s.parked < vcpus {
            return Err("vCPUs are not all paused".into());
        }
        s.save = Some(SaveRequest { msrs: msrs.into(), results: (0..vcpus).map(|_| None).collect() });
        self.cvar.notify_all();
        loop {
            let done = s.save.as_ref().is_some_and(|r| r.results.iter().all(Option::is_some));
            if done {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                s.save = None;
                return Err("vCPUs did not report their state in time".into());
            }
            s = self.cvar.wait_timeout(s, left).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
        }
        let results = s.save.take().map(|r| r.results).unwrap_or_default();
        results.into_iter().map(|r| r.unwrap_or_else(|| Err("no state".into()))).collect()
    }

    /// Parks the calling vCPU while the VM is paused, answering save requests meanwhile.
    fn park(&self, id: u8, mut save: impl FnMut(&[u32]) -> Result<SavedVcpu, String>) {
        let mut s = self.lock();
        if s.state != RunState::Paused {
            return;
        }
        s.parked += 1;
        loop {
            if let Some(req) = s.save.as_mut() {
                if let Some(slot @ None) = req.results.get_mut(usize::from(id)) {
                    *slot = Some(save(&req.msrs));
                    self.cvar.notify_all();
                }
            }
            if s.state != RunState::Paused {
                break;
            }
            s = self.cvar.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        s.parked -= 1;
    }
}

/// A vCPU thread's place in the kick list; dropping it takes the thread off.
pub struct KickRegistration {
    control: Arc<VcpuControl>,
    thread: libc::pthread_t,
}

impl Drop for KickRegistration {
    fn drop(&mut self) {
        lock(&self.control.threads).retain(|t| *t != self.thread);
    }
}

impl Default for VcpuControl {
    fn default() -> Self {
        Self::new()
    }
}

/// What every vCPU thread of a VM shares.
#[derive(Clone)]
pub struct VcpuShared {
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    pub exit: Arc<ExitSignal>,
    pub control: Arc<VcpuControl>,
}

/// Which optional state this host and VM have.
#[derive(Debug, Clone, Copy)]
pub struct VcpuFeatures {
    pub irqchip: bool,
    pub xcrs: bool,
}

pub struct Vcpu {
    id: u8,
    fd: VcpuFd,
    features: VcpuFeatures,
    shared: VcpuShared,
    /// KVM_RUN ran at least once, so an I/O exit may still wait for its completion.
    entered: bool,
}

/// What one KVM_RUN came back with.
enum Step {
    Continue,
    /// Interrupted (a kick) or an immediate exit.
    Interrupted,
    Stop(ExitReason),
}

/// Unknown-MMIO warnings, throttled across the vCPUs so a hostile guest cannot flood the log.
static UNKNOWN_MMIO: Mutex<LogThrottle> = Mutex::new(LogThrottle::new());

impl Vcpu {
    pub fn new(fd: VcpuFd, id: u8, features: VcpuFeatures, shared: VcpuShared) -> Self {
        Self { id, fd, features, shared, entered: false }
    }

    /// Boot state: CPUID (KVM's `supported`, filtered), boot MSRs, long mode at `entry`, LAPIC
    /// LINT pins.
    pub fn configure_boot(&self, supported: &CpuId, count: u8, entry: &EntryPoint) -> Result<(), VcpuError> {
        let (id, fd) = (self.id, &self.fd);
        let cfg = |what, source| VcpuError::Configure { id, what, source };
        let mut cpuid = supported.clone();
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
        if self.features.irqchip {
            set_lint(fd).map_err(|e| cfg("lapic", e))?;
        }
        Ok(())
    }

    /// Puts a snapshot's state into this (fresh) vCPU.
    pub fn restore(&self, state: &VcpuState) -> Result<(), KvmStateError> {
        restore_vcpu(&self.fd, state)
    }

    /// Runs until the VM stops; reports why through the exit signal. Call on the vCPU's own
    /// thread: pauses kick it from now until it returns.
    pub fn run(mut self) {
        let shared = self.shared.clone();
        let _kickable = shared.control.register_current();
        loop {
            if shared.control.state() == RunState::Paused {
                self.park();
            }
            if shared.exit.reason().is_some() {
                return;
            }
            if shared.control.first_run_unix_ns.get().is_none() {
                let _ = shared.control.first_run_unix_ns.set(unix_ns());
                tracing::info!(vcpu = self.id, "first KVM_RUN");
            }
            self.entered = true;
            if let Step::Stop(reason) = self.run_once() {
                shared.exit.signal(reason);
                return;
            }
        }
    }

    /// Completes any half-done I/O (so the saved registers are consistent), then parks.
    fn park(&mut self) {
        if self.entered {
            if let Some(reason) = self.complete_pending_io() {
                self.shared.exit.signal(reason);
            }
        }
        let control = self.shared.control.clone();
        let (id, features, fd) = (self.id, self.features, &self.fd);
        control.park(id, |msrs| save_vcpu(fd, id, msrs, features.irqchip, features.xcrs).map_err(|e| e.to_string()));
    }

    /// KVM finishes an in/MMIO-read exit on the next KVM_RUN; with immediate_exit set, that
    /// KVM_RUN completes it and returns at once (Firecracker does the same before saving).
    fn complete_pending_io(&mut self) -> Option<ExitReason> {
        self.fd.set_kvm_immediate_exit(1);
        let mut result = None;
        // A string instruction may need a few more exits to finish; a bound keeps this finite.
        for _ in 0..64 {
            match self.run_once() {
                Step::Interrupted => break,
                Step::Continue => {}
                Step::Stop(reason) => {
                    result = Some(reason);
                    break;
                }
            }
        }
        self.fd.set_kvm_immediate_exit(0);
        result
    }

    fn run_once(&mut self) -> Step {
        let id = self.id;
        let err = |message: String| Step::Stop(ExitReason::VcpuError { vcpu: id, message });
        let (pio, mmio) = (&self.shared.pio, &self.shared.mmio);
        match self.fd.run() {
            Ok(VcpuExit::IoIn(port, data)) => {
                if !pio.read(u64::from(port), data) {
                    data.fill(0xff);
                }
                Step::Continue
            }
            Ok(VcpuExit::IoOut(port, data)) => {
                pio.write(u64::from(port), data);
                Step::Continue
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                if !mmio.read(addr, data) {
                    unknown_mmio(id, "read", addr, data.len());
                    data.fill(0);
                }
                Step::Continue
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                if !mmio.write(addr, data) {
                    unknown_mmio(id, "write", addr, data.len());
                }
                Step::Continue
            }
            Ok(VcpuExit::Hlt) => Step::Stop(ExitReason::GuestHalted),
            Ok(VcpuExit::Shutdown) => Step::Stop(ExitReason::GuestTripleFault),
            Ok(VcpuExit::SystemEvent(kind, _)) => {
                tracing::info!(vcpu = id, kind, "guest system event");
                Step::Stop(ExitReason::GuestReset)
            }
            Ok(VcpuExit::Intr) => Step::Interrupted,
            Ok(VcpuExit::IrqWindowOpen) => Step::Continue,
            Ok(VcpuExit::FailEntry(reason, cpu)) => {
                err(format!("KVM_EXIT_FAIL_ENTRY: hardware reason {reason:#x} on cpu {cpu}"))
            }
            Ok(VcpuExit::InternalError) => {
                let rip = self.fd.get_regs().map(|r| format!("{:#x}", r.rip)).unwrap_or_else(|_| "unknown".into());
                err(format!("KVM_EXIT_INTERNAL_ERROR at rip {rip} (emulation failure or unsupported instruction)"))
            }
            Ok(other) => err(format!("unexpected vCPU exit: {other:?}")),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => Step::Interrupted,
            Err(e) => err(format!("KVM_RUN failed: {e}")),
        }
    }
}

fn unknown_mmio(vcpu: u8, op: &str, addr: u64, len: usize) {
    crate::throttled!(
        *lock(&UNKNOWN_MMIO),
        warn,
        vcpu,
        op,
        addr = format_args!("{addr:#x}"),
        len,
        "guest accessed unknown MMIO address"
    );
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vcpu_thread_leaves_the_kick_list_when_it_ends_even_by_panicking() {
        let c = Arc::new(VcpuControl::new());
        let seen = {
            let c = c.clone();
            std::thread::spawn(move || {
                let _r = c.register_current();
                c.kickable()
            })
        };
        assert_eq!(seen.join().unwrap(), 1, "listed while it runs");
        assert_eq!(c.kickable(), 0, "gone once it returned");
        let c2 = c.clone();
        let panicked = std::thread::spawn(move || {
            let _r = c2.register_current();
            panic!("a vCPU thread panics");
        });
        assert!(panicked.join().is_err());
        assert_eq!(c.kickable(), 0, "gone once it unwound");
        // A pause with every vCPU thread gone kicks nothing and reports the failure in time.
        assert!(!c.pause(1, Duration::from_millis(20)));
    }

    #[test]
    fn a_pause_kicks_a_registered_thread_out_of_a_blocking_call() {
        install_kick_handler().unwrap();
        let c = Arc::new(VcpuControl::new());
        let (tx, rx) = std::sync::mpsc::channel();
        let vcpu = {
            let c = c.clone();
            std::thread::spawn(move || {
                let _r = c.register_current();
                // Unblock the kick signal here (the test harness may block it) and wait in a
                // syscall the kick interrupts, as KVM_RUN would be.
                // SAFETY: plain libc calls on a stack-local sigset.
                unsafe {
                    let mut set: libc::sigset_t = std::mem::zeroed();
                    libc::sigemptyset(&mut set);
                    libc::sigaddset(&mut set, kick_signal());
                    libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
                }
                tx.send(()).unwrap();
                // SAFETY: pause(2) returns on the first handled signal.
                unsafe { libc::pause() };
                c.park(0, |_| Err("no state".into()));
            })
        };
        rx.recv().unwrap();
        assert!(c.pause(1, Duration::from_secs(10)), "the kicked thread parked");
        c.resume();
        vcpu.join().unwrap();
        assert_eq!(c.kickable(), 0);
    }

    #[test]
    fn parked_vcpus_answer_save_requests_until_resumed() {
        let c = Arc::new(VcpuControl::new_paused());
        let parked = {
            let c = c.clone();
            std::thread::spawn(move || {
                c.park(0, |msrs| {
                    let mut s = crate::snapshot::sample::sample_state().vcpus.remove(0);
                    s.msrs.truncate(msrs.len());
                    Ok((s, vec![0x99]))
                })
            })
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while c.lock().parked < 1 {
            assert!(Instant::now() < deadline, "the vCPU never parked");
            std::thread::sleep(Duration::from_millis(1));
        }
        let saved = c.save_vcpus(1, vec![0x10], Duration::from_secs(10)).unwrap();
        assert_eq!((saved.len(), saved[0].1.clone(), saved[0].0.msrs.len()), (1, vec![0x99], 1));
        assert!(c.save_vcpus(2, vec![], Duration::from_millis(10)).is_err(), "only one vCPU is parked");
        c.resume();
        parked.join().unwrap();
        assert_eq!(c.state(), RunState::Running);
        assert!(c.save_vcpus(1, vec![], Duration::from_millis(10)).is_err(), "a running VM cannot be saved");
    }
}
