//! Relays the output of a pod's helper processes into the shim's log stream (the `log` FIFO that
//! containerd copies into its own log): one event per line, each carrying the pod id and the
//! component (`agent`, `vmm`, `virtiofsd`), so a line found in containerd's log names its pod.
//! Optionally the raw bytes also go to the pod's console log (`bulkhead-ctl console`).
//!
//! The output may be guest-triggered (a VMM echoes what the guest makes it say), so every relay:
//! - cuts lines at [`MAX_LINE`] bytes;
//! - logs at most [`LINES_PER_SECOND`] lines per second and then one line saying how many it
//!   suppressed (the console log keeps them all);
//! - caps the console log at [`CONSOLE_MAX`] bytes, keeping one older file (`console.log.1`).
//!
//! Wiring, for a backend that spawns a helper (the `vm` backend: `bulkhead-vmm`, `virtiofsd`):
//! spawn it with `stdout`/`stderr` piped, then for each pipe
//! `tokio::spawn(logrelay::relay(pipe, Source { pod, component: Component::Vmm, stream: "stderr" }, None))`.

use std::collections::VecDeque;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt};
use tracing::{info, warn};

/// Longest line relayed as one event; the rest of a longer line follows as further lines.
pub const MAX_LINE: usize = 4096;
/// Lines per second one relay may put into the shim log.
pub const LINES_PER_SECOND: u32 = 100;
/// Size at which the console log is rotated.
pub const CONSOLE_MAX: u64 = 4 << 20;

/// Which helper a line comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Component {
    Agent,
    Vmm,
    Virtiofsd,
}

impl Component {
    pub fn name(self) -> &'static str {
        match self {
            Component::Agent => "agent",
            Component::Vmm => "vmm",
            Component::Virtiofsd => "virtiofsd",
        }
    }
}

/// Where a relayed pipe comes from.
#[derive(Debug, Clone)]
pub struct Source {
    pub pod: String,
    pub component: Component,
    /// `stdout` or `stderr`.
    pub stream: &'static str,
}

/// The pod's console log file, shared by the relays that write to it.
#[derive(Clone)]
pub struct ConsoleLog(Arc<Mutex<ConsoleFile>>);

struct ConsoleFile {
    path: PathBuf,
    file: std::fs::File,
    written: u64,
    max: u64,
}

impl ConsoleLog {
    /// Creates (or truncates) the console log at `path`.
    pub fn create(path: &Path) -> std::io::Result<Self> {
        Self::with_limit(path, CONSOLE_MAX)
    }

    fn with_limit(path: &Path, max: u64) -> std::io::Result<Self> {
        let file = std::fs::File::create(path)?;
        Ok(Self(Arc::new(Mutex::new(ConsoleFile { path: path.into(), file, written: 0, max }))))
    }

    fn append(&self, bytes: &[u8]) {
        let mut c = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if c.written + bytes.len() as u64 > c.max {
            let old = c.path.with_extension("log.1");
            let reopened = std::fs::rename(&c.path, &old).and_then(|()| std::fs::File::create(&c.path));
            match reopened {
                Ok(file) => {
                    c.file = file;
                    c.written = 0;
                }
                // The pod directory is gone (the pod is being removed): nothing left to keep.
                Err(_) => return,
            }
        }
        if c.file.write_all(bytes).is_ok() {
            c.written += bytes.len() as u64;
        }
    }
}

/// The last few lines a helper wrote, kept so that an early exit can be reported with the
/// helper's own reason ("its last words") in the error that reaches containerd and kubelet,
/// not only in the shim log. Bounded: [`LAST_WORDS_LINES`] lines of at most
/// [`LAST_WORDS_LINE`] bytes each.
#[derive(Clone, Default)]
pub struct LastWords(Arc<Mutex<VecDeque<String>>>);

/// Lines kept by [`LastWords`].
pub const LAST_WORDS_LINES: usize = 3;
/// Longest line kept by [`LastWords`], in bytes; longer ones are cut.
pub const LAST_WORDS_LINE: usize = 512;

impl LastWords {
    fn push(&self, line: &str) {
        let mut cut = line.len().min(LAST_WORDS_LINE);
        while !line.is_char_boundary(cut) {
            cut -= 1;
        }
        let mut lines = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if lines.len() == LAST_WORDS_LINES {
            lines.pop_front();
        }
        lines.push_back(line[..cut].to_owned());
    }

    /// The kept lines joined with " | ", or `None` if the helper said nothing.
    pub fn text(&self) -> Option<String> {
        let lines = self.0.lock().unwrap_or_else(|p| p.into_inner());
        (!lines.is_empty()).then(|| lines.iter().map(String::as_str).collect::<Vec<_>>().join(" | "))
    }
}

/// Fixed one-second windows of at most [`LINES_PER_SECOND`] lines.
struct Throttle {
    window: Instant,
    lines: u32,
    suppressed: u64,
}

impl Throttle {
    fn new() -> Self {
        Self { window: Instant::now(), lines: 0, suppressed: 0 }
    }

    /// Whether this line may be logged; when a new window opens, first reports what the last
    /// ones suppressed.
    fn admit(&mut self, source: &Source) -> bool {
        if self.window.elapsed() >= Duration::from_secs(1) {
            self.flush(source);
            self.window = Instant::now();
            self.lines = 0;
        }
        if self.lines < LINES_PER_SECOND {
            self.lines += 1;
            true
        } else {
            self.suppressed += 1;
            false
        }
    }

    fn flush(&mut self, source: &Source) {
        if self.suppressed > 0 {
            warn!(
                pod = %source.pod,
                component = source.component.name(),
                stream = source.stream,
                suppressed = self.suppressed,
                "output lines suppressed (more than {LINES_PER_SECOND} per second)"
            );
            self.suppressed = 0;
        }
    }
}

fn emit(source: &Source, throttle: &mut Throttle, kept: Option<&LastWords>, line: &[u8]) {
    let text = String::from_utf8_lossy(line);
    let text = text.trim_end_matches('\r');
    if text.trim().is_empty() {
        return;
    }
    if let Some(kept) = kept {
        kept.push(text);
    }
    if throttle.admit(source) {
        info!(pod = %source.pod, component = source.component.name(), stream = source.stream, "{text}");
    }
}

/// Relays `pipe` until it ends (the process exited or closed it), keeping its last lines in
/// `kept` when given.
pub async fn relay(
    mut pipe: impl AsyncRead + Unpin,
    source: Source,
    console: Option<ConsoleLog>,
    kept: Option<LastWords>,
) {
    let mut throttle = Throttle::new();
    let mut pending: Vec<u8> = Vec::with_capacity(MAX_LINE);
    let mut buf = vec![0u8; 8192];
    loop {
        let n = match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(console) = &console {
            console.append(&buf[..n]);
        }
        for &b in &buf[..n] {
            if b == b'\n' {
                emit(&source, &mut throttle, kept.as_ref(), &pending);
                pending.clear();
            } else {
                pending.push(b);
                if pending.len() >= MAX_LINE {
                    emit(&source, &mut throttle, kept.as_ref(), &pending);
                    pending.clear();
                }
            }
        }
    }
    emit(&source, &mut throttle, kept.as_ref(), &pending);
    throttle.flush(&source);
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// Collects what the relay logs, as the shim's formatter writes it.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn source() -> Source {
        Source { pod: "pod-1234".into(), component: Component::Vmm, stream: "stderr" }
    }

    async fn relay_captured(input: Vec<u8>, console: Option<ConsoleLog>) -> String {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .with_max_level(tracing::Level::INFO)
            .finish();
        let _guard = tracing::subscriber::set_default(subscriber);
        let (mut w, r) = tokio::io::duplex(1 << 16);
        let feeder = tokio::spawn(async move {
            w.write_all(&input).await.unwrap();
        });
        relay(r, source(), console, None).await;
        feeder.await.unwrap();
        let out = captured.0.lock().unwrap().clone();
        String::from_utf8(out).unwrap()
    }

    #[tokio::test(flavor = "current_thread")]
    async fn lines_carry_pod_and_component_and_reach_the_console() {
        let dir = tempfile::tempdir().unwrap();
        let console = ConsoleLog::create(&dir.path().join("console.log")).unwrap();
        let log = relay_captured(b"virtiofsd: starting\r\nsecond line\npartial".to_vec(), Some(console)).await;
        let lines: Vec<&str> = log.lines().collect();
        assert_eq!(lines.len(), 3, "{log}");
        for line in &lines {
            assert!(line.contains("pod=pod-1234") && line.contains("component=\"vmm\""), "{line}");
        }
        assert!(lines[0].contains("virtiofsd: starting") && !lines[0].contains('\r'));
        assert!(lines[2].contains("partial"));
        let text = std::fs::read_to_string(dir.path().join("console.log")).unwrap();
        assert_eq!(text, "virtiofsd: starting\r\nsecond line\npartial");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn long_lines_are_cut_and_floods_are_throttled() {
        let mut input = vec![b'x'; MAX_LINE * 2 + 10];
        input.push(b'\n');
        for i in 0..(LINES_PER_SECOND * 3) {
            input.extend_from_slice(format!("flood {i}\n").as_bytes());
        }
        let log = relay_captured(input, None).await;
        let relayed = log.lines().filter(|l| l.contains("component=\"vmm\"") && !l.contains("suppressed")).count();
        assert_eq!(relayed, LINES_PER_SECOND as usize, "three cut pieces and the rest of the first second");
        assert!(log.lines().all(|l| l.len() < MAX_LINE + 200), "no line longer than the cut");
        let expected = (LINES_PER_SECOND * 3 + 3 - LINES_PER_SECOND) as usize;
        assert!(log.contains(&format!("suppressed={expected}")), "{log}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_last_lines_are_kept_bounded_for_the_error() {
        let kept = LastWords::default();
        assert_eq!(kept.text(), None);
        let mut input = Vec::new();
        for i in 0..10 {
            input.extend_from_slice(format!("line {i}\n\n").as_bytes());
        }
        input.extend_from_slice("é".repeat(LAST_WORDS_LINE).as_bytes());
        let (mut w, r) = tokio::io::duplex(1 << 16);
        w.write_all(&input).await.unwrap();
        drop(w);
        relay(r, source(), None, Some(kept.clone())).await;
        let text = kept.text().unwrap();
        let parts: Vec<&str> = text.split(" | ").collect();
        assert_eq!(parts.len(), LAST_WORDS_LINES, "{text}");
        assert_eq!(&parts[..2], ["line 8", "line 9"], "blank lines are not words");
        assert!(parts[2].len() <= LAST_WORDS_LINE && parts[2].starts_with('é'), "cut on a char boundary");
    }

    #[test]
    fn console_log_rotates_at_its_limit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        let console = ConsoleLog::with_limit(&path, 10).unwrap();
        console.append(b"0123456789");
        console.append(b"abc");
        assert_eq!(std::fs::read(&path).unwrap(), b"abc");
        assert_eq!(std::fs::read(dir.path().join("console.log.1")).unwrap(), b"0123456789");
    }
}
