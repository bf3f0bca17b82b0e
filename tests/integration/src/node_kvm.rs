//! In the emulated node only: telling the emulator's faults from ours. QEMU's TCG emulation of AMD-V sometimes
//! leaves one of a guest's vCPUs with an instruction pointer that is an address in the node's own KVM module, so
//! the node's KVM emulates that one instruction again and again (about 25 000 times a second) and the guest stops
//! (tests/node/README.md). Nothing in a guest or in bulkhead-vmm can point a vCPU there: our guest kernel has no
//! modules, and the VMM sets a vCPU's registers only at boot and restore.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

const TRACING: &str = "/sys/kernel/tracing";
const EMULATE_EVENT: &str = "events/kvm/kvm_emulate_insn/enable";
/// How long KVM's instruction emulation is traced.
const TRACE_FOR: Duration = Duration::from_millis(200);

/// Whether this runs in the emulated node (`tests/node/node.py` sets it).
pub fn in_emulated_node() -> bool {
    std::env::var("BULKHEAD_IN_NODE").is_ok_and(|v| v == "1")
}

/// A vCPU stuck in the node's KVM emulator at a node-kernel address, as one line ("vcpu0-1257 at
/// 0xffffffffc06c313c, svm_vcpu_run+0x1c [kvm_amd]"), or `None`: outside the node, or when no vCPU of any VM
/// there is emulating at an address of one of the node's modules during a fifth of a second. Tests in the node
/// run one at a time, so the VMs there are the current test's.
pub fn emulator_fault() -> Result<Option<String>> {
    if !in_emulated_node() {
        return Ok(None);
    }
    let trace = trace_emulation().context("tracing the node's KVM instruction emulation")?;
    let kallsyms = std::fs::read_to_string("/proc/kallsyms").context("/proc/kallsyms")?;
    let symbols = module_symbols(&kallsyms);
    Ok(emulated_rips(&trace)
        .into_iter()
        .find_map(|(thread, rip)| module_symbol(&symbols, rip).map(|sym| format!("{thread} at {rip:#x}, {sym}"))))
}

/// Looks for [`emulator_fault`] every few seconds while a test attempt runs (in the node only), and keeps the first
/// it finds: a guest stopped by the emulator at boot is gone by the time its RunPodSandbox fails (the shim ends a
/// VM whose agent never answered), so a look at the failure alone would miss it. Stops when dropped.
pub struct FaultWatch {
    seen: Arc<Mutex<Option<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// How often the watch looks (each look traces for [`TRACE_FOR`]).
const WATCH_EVERY: Duration = Duration::from_secs(3);

impl FaultWatch {
    pub fn start() -> Self {
        let seen = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = in_emulated_node().then(|| {
            let (seen, stop) = (seen.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(Some(fault)) = emulator_fault() {
                        seen.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(fault);
                    }
                    let next = Instant::now() + WATCH_EVERY;
                    while !stop.load(Ordering::Relaxed) && Instant::now() < next {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            })
        });
        Self { seen, stop, thread }
    }

    /// `error`, marked as the emulated node's when the watch saw a stuck vCPU, or [`classify`] finds one now.
    pub fn classify(&self, error: anyhow::Error) -> anyhow::Error {
        match self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            Some(fault) => error.context(EmulatorFault(fault)),
            None => classify(error),
        }
    }
}

impl Drop for FaultWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What marks a test attempt's error as the emulated node's ([`classify`]).
#[derive(Debug, thiserror::Error)]
#[error("the emulated node stopped the guest: {0}")]
pub struct EmulatorFault(pub String);

/// `error`, marked as the emulated node's when a vCPU is stuck as [`emulator_fault`] finds. Call it while the
/// failed attempt's VM still runs (before its environment is dropped).
pub fn classify(error: anyhow::Error) -> anyhow::Error {
    match emulator_fault() {
        Ok(Some(fault)) => error.context(EmulatorFault(fault)),
        Ok(None) => error,
        Err(e) => error.context(format!("looking for the emulated node's vCPU fault failed: {e:#}")),
    }
}

/// Runs `attempt`, and once more when its error was the emulated node's ([`classify`]), printing the `RETRIED:`
/// line that the run's summary repeats and counts. Any other failure, and a second one, is the test's.
pub async fn retry_emulator_fault<F, Fut>(what: &str, attempt: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<()>>,
{
    retry_reporting(what, attempt, |line| println!("{line}")).await
}

/// [`retry_emulator_fault`], saying the `RETRIED:` line through `report` (unit tests keep it off the run's output,
/// whose summary counts such lines).
async fn retry_reporting<F, Fut>(what: &str, mut attempt: F, report: impl Fn(&str)) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<()>>,
{
    match attempt().await {
        Err(e) if e.downcast_ref::<EmulatorFault>().is_some() => {
            report(&format!("RETRIED: {what}, after the emulated node's vCPU fault: {}", crate::cri::one_line(&e)));
            attempt().await
        }
        other => other,
    }
}

fn trace_emulation() -> Result<String> {
    let path = |p: &str| format!("{TRACING}/{p}");
    std::fs::write(path("trace"), "")?;
    std::fs::write(path(EMULATE_EVENT), "1")?;
    std::thread::sleep(TRACE_FOR);
    let off = std::fs::write(path(EMULATE_EVENT), "0");
    let trace = std::fs::read_to_string(path("trace"))?;
    off?;
    Ok(trace)
}

/// (thread, guest RIP) of each `kvm_emulate_insn` line, once each:
/// `vcpu0-1257 [000] ..... 223.772101: kvm_emulate_insn: 0:ffffffffc06c313c: (prot64)`.
fn emulated_rips(trace: &str) -> BTreeSet<(String, u64)> {
    trace
        .lines()
        .filter_map(|line| {
            let thread = line.split_whitespace().next()?;
            let rest = line.split("kvm_emulate_insn: ").nth(1)?;
            let rip = rest.split(':').nth(1)?;
            Some((thread.to_string(), u64::from_str_radix(rip.trim(), 16).ok()?))
        })
        .collect()
}

/// The node's module symbols, by address: `ffffffffc06c3000 t svm_vcpu_run [kvm_amd]`.
fn module_symbols(kallsyms: &str) -> Vec<(u64, String)> {
    let mut symbols: Vec<(u64, String)> = kallsyms
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let addr = u64::from_str_radix(words.next()?, 16).ok()?;
            let name = words.nth(1)?;
            let module = words.next()?.strip_prefix('[')?.strip_suffix(']')?;
            (addr != 0).then(|| (addr, format!("{name} [{module}]")))
        })
        .collect();
    symbols.sort();
    symbols
}

/// The module symbol `rip` is in (at most 64 KiB past its start), as `name+0xoff [module]`.
fn module_symbol(symbols: &[(u64, String)], rip: u64) -> Option<String> {
    let i = symbols.partition_point(|(addr, _)| *addr <= rip).checked_sub(1)?;
    let (addr, name) = &symbols[i];
    let off = rip - addr;
    (off < 1 << 16).then(|| {
        let (sym, module) = name.split_once(' ').unwrap_or((name, ""));
        format!("{sym}+{off:#x} {module}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const KALLSYMS: &str = "\
ffffffff81000000 T _stext
ffffffff81003e00 t native_write_msr
ffffffffc06c3000 t svm_vcpu_run\t[kvm_amd]
ffffffffc06c4000 t svm_handle_exit\t[kvm_amd]
ffffffffc0a00000 T kvm_emulate_instruction\t[kvm]
0000000000000000 t hidden\t[kvm]
";

    #[test]
    fn a_rip_in_a_node_module_is_named_and_one_in_a_kernel_image_is_not() {
        let symbols = module_symbols(KALLSYMS);
        assert_eq!(symbols.len(), 3, "{symbols:?}");
        assert_eq!(module_symbol(&symbols, 0xffffffffc06c313c).as_deref(), Some("svm_vcpu_run+0x13c [kvm_amd]"));
        // Our guest kernel's own text overlaps the node kernel's range, never its modules'.
        assert_eq!(module_symbol(&symbols, 0xffffffff81003eff), None);
        // Far past the last module symbol.
        assert_eq!(module_symbol(&symbols, 0xffffffffc0b00000), None);
    }

    #[tokio::test]
    async fn only_a_failure_marked_as_the_emulators_is_tried_again_and_only_once() {
        let calls = std::cell::Cell::new(0);
        let fault = || {
            calls.set(calls.get() + 1);
            async { Err(anyhow::anyhow!("exec timed out").context(EmulatorFault("vcpu0-1 at 0x1".into()))) }
        };
        let said = std::cell::RefCell::new(Vec::<String>::new());
        let report = |line: &str| said.borrow_mut().push(line.to_string());
        let err = retry_reporting("t", fault, report).await.unwrap_err();
        assert_eq!(calls.get(), 2);
        assert!(format!("{err:#}").contains("exec timed out"), "{err:#}");
        assert_eq!(
            said.take(),
            vec!["RETRIED: t, after the emulated node's vCPU fault: the emulated node stopped the guest: vcpu0-1 at 0x1: \
                  exec timed out"]
        );

        calls.set(0);
        let plain = || {
            calls.set(calls.get() + 1);
            async { Err(anyhow::anyhow!("wrong nproc")) }
        };
        assert!(retry_reporting("t", plain, report).await.is_err());
        assert_eq!(calls.get(), 1);
        assert!(said.borrow().is_empty(), "a plain failure is not retried: {:?}", said.borrow());

        calls.set(0);
        let once = || {
            calls.set(calls.get() + 1);
            let n = calls.get();
            async move {
                if n == 1 {
                    Err(anyhow::anyhow!("stuck").context(EmulatorFault("vcpu0-1 at 0x1".into())))
                } else {
                    Ok(())
                }
            }
        };
        retry_reporting("t", once, report).await.unwrap();
        assert_eq!(calls.get(), 2);
        assert_eq!(said.borrow().len(), 1);
    }

    #[test]
    fn outside_the_node_nothing_is_the_emulators() {
        assert!(!in_emulated_node(), "unit tests run on the host");
        assert!(emulator_fault().unwrap().is_none());
        assert!(classify(anyhow::anyhow!("x")).downcast_ref::<EmulatorFault>().is_none());
        let watch = FaultWatch::start();
        assert!(watch.thread.is_none(), "no watch outside the node");
        assert!(watch.classify(anyhow::anyhow!("x")).downcast_ref::<EmulatorFault>().is_none());
    }

    #[test]
    fn what_the_watch_saw_marks_a_later_failure() {
        let watch = FaultWatch::start();
        *watch.seen.lock().unwrap() = Some("vcpu1-9 at 0xffffffffc067013c, __svm_vcpu_run+0x9c [kvm_amd]".into());
        let err = watch.classify(anyhow::anyhow!("the agent did not answer within 45s"));
        assert!(err.downcast_ref::<EmulatorFault>().is_some(), "{err:#}");
        assert!(format!("{err:#}").contains("__svm_vcpu_run+0x9c"), "{err:#}");
    }

    #[test]
    fn emulated_rips_are_read_from_trace_lines_and_malformed_ones_skipped() {
        let trace = "\
# tracer: nop
           vcpu0-1257    [000] .....   223.772101: kvm_emulate_insn: 0:ffffffffc06c313c: (prot64)
           vcpu0-1257    [000] .....   223.772146: kvm_emulate_insn: 0:ffffffffc06c313c: (prot64)
           vcpu1-1258    [001] .....   223.772150: kvm_emulate_insn: 0:ffffffff81003eff:0f 30 (prot64)
           vcpu1-1258    [001] .....   223.772151: kvm_emulate_insn: garbage
           vcpu1-1258    [001] .....   223.772152: kvm_exit: reason npf rip 0x1
";
        let rips = emulated_rips(trace);
        assert_eq!(
            rips.into_iter().collect::<Vec<_>>(),
            vec![("vcpu0-1257".to_string(), 0xffffffffc06c313c), ("vcpu1-1258".to_string(), 0xffffffff81003eff)]
        );
    }
}
