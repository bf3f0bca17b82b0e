//! A panic on any VMM thread ends the VM cleanly instead of wedging it. The hook (installed by
//! `main` before any thread exists) logs the panic, records the first one and wakes whoever
//! waits for the VM to stop: the event loop ([`PanicWatcher`]) or a prepared VMM's main thread
//! (which polls [`wake_fd`]). They stop the VM with [`ExitReason::Panicked`]: exit status 1, the
//! reason on stderr. A panic on the main thread itself unwinds into `main`, which reports it.
//!
//! Why a hook rather than `panic = "abort"`: the profile would apply to every binary of the
//! workspace (the shim and the agent rely on tokio catching a task's panic), and an abort leaves
//! no reason behind. Under seccomp the hook needs only what every thread may do (`write` to
//! stderr and to an eventfd, futexes): no backtrace, since capturing one reads the binary from
//! disk, which the filters forbid. (`tests/crash_hook.rs` tests the hook in a process of its own.)

use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, OnceLock};

use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::exit::{ExitReason, ExitSignal};

/// The first panic's report: which thread, where, what it said (bounded).
static REPORT: OnceLock<String> = OnceLock::new();
/// Written on every panic.
static WAKE: OnceLock<EventFd> = OnceLock::new();
/// A panic message is the VMM's own text, but may quote guest-supplied values.
const MAX_REPORT: usize = 1024;

/// Installs the panic hook. Call once, before any other thread exists.
pub fn install_hook() -> std::io::Result<()> {
    let wake = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)?;
    // A second call keeps the first eventfd; the hook is the same either way.
    let _ = WAKE.set(wake);
    std::panic::set_hook(Box::new(|info| {
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("unnamed");
        tracing::error!(thread = name, "thread panicked: {info}");
        let mut report = format!("thread {name} {info}").replace('\n', " ");
        if report.len() > MAX_REPORT {
            let mut end = MAX_REPORT;
            while !report.is_char_boundary(end) {
                end -= 1;
            }
            report.truncate(end);
        }
        let _ = REPORT.set(report);
        if let Some(wake) = WAKE.get() {
            let _ = wake.write(1);
        }
    }));
    Ok(())
}

/// The first panic of this process, if any thread panicked.
pub fn report() -> Option<&'static str> {
    REPORT.get().map(String::as_str)
}

/// Readable once a thread panicked (none before [`install_hook`]).
pub fn wake_fd() -> Option<RawFd> {
    WAKE.get().map(AsRawFd::as_raw_fd)
}

/// The reason to stop with after a panic.
pub fn reason() -> Option<ExitReason> {
    report().map(|r| ExitReason::Panicked(r.to_owned()))
}

/// On the event loop: a panic on another thread stops the VM.
pub struct PanicWatcher(pub Arc<ExitSignal>);

impl MutEventSubscriber for PanicWatcher {
    fn init(&mut self, ops: &mut EventOps) {
        if let Some(fd) = wake_fd() {
            if let Err(e) = ops.add(Events::new_raw(fd, EventSet::IN)) {
                tracing::error!(error = ?e, "cannot watch for thread panics; a panicked thread would go unnoticed");
            }
        }
    }

    fn process(&mut self, _: Events, _: &mut EventOps) {
        if let Some(wake) = WAKE.get() {
            let _ = wake.read();
        }
        if let Some(reason) = reason() {
            self.0.signal(reason);
        }
    }
}

/// Test hook (debug builds only): `BULKHEAD_VMM_PANIC_PROBE=vcpu|event_loop|api` makes a guest
/// write to port [`PROBE_PORT`] panic the vCPU thread that handles it, or the event loop (the
/// write is handed to it like a queue notify), or makes the API thread panic on its next request.
#[cfg(debug_assertions)]
pub mod probe {
    use std::sync::{Arc, Mutex};

    use event_manager::{EventOps, Events, MutEventSubscriber};
    use vmm_sys_util::epoll::EventSet;
    use vmm_sys_util::eventfd::EventFd;

    use crate::devices::bus::BusDevice;

    const ENV: &str = "BULKHEAD_VMM_PANIC_PROBE";
    /// The probe's I/O port, nowhere near the PC's legacy devices.
    pub const PROBE_PORT: u64 = 0x0bad;

    /// The thread kind the probe panics, if the environment names one.
    fn armed(kind: &str) -> bool {
        std::env::var(ENV).is_ok_and(|v| v == kind)
    }

    /// The probe's port device (on the vCPUs' PIO bus) and its event-loop half.
    pub type ProbeDevices = (Arc<Mutex<ProbePort>>, Arc<Mutex<ProbeWatcher>>);

    /// The probe's devices, when it targets a vCPU or the event loop.
    pub fn devices() -> std::io::Result<Option<ProbeDevices>> {
        if !armed("vcpu") && !armed("event_loop") {
            return Ok(None);
        }
        let evt = EventFd::new(libc::EFD_NONBLOCK)?;
        let watcher = ProbeWatcher(evt.try_clone()?);
        Ok(Some((Arc::new(Mutex::new(ProbePort(evt))), Arc::new(Mutex::new(watcher)))))
    }

    /// On the API thread, before a request is handled.
    pub fn on_api_request() {
        if armed("api") {
            panic!("panic probe: an API request panicked the API thread");
        }
    }

    pub struct ProbePort(EventFd);

    impl BusDevice for ProbePort {
        fn read(&mut self, _: u64, data: &mut [u8]) {
            data.fill(0);
        }

        fn write(&mut self, _: u64, _: &[u8]) {
            if armed("vcpu") {
                panic!("panic probe: a guest write panicked the vCPU thread");
            }
            let _ = self.0.write(1);
        }
    }

    pub struct ProbeWatcher(EventFd);

    impl MutEventSubscriber for ProbeWatcher {
        fn init(&mut self, ops: &mut EventOps) {
            let _ = ops.add(Events::new(&self.0, EventSet::IN));
        }

        fn process(&mut self, _: Events, _: &mut EventOps) {
            let _ = self.0.read();
            panic!("panic probe: a guest request panicked the event loop");
        }
    }
}
