//! The guest's serial console log (written by the VMM, content from the guest, so hostile):
//! its last lines, bounded and made printable, for errors; and a bounded copy kept in the pod's
//! log directory when the pod's own state is removed after a failed start. The file sits in a
//! directory the VMM's uid can write, so it is only ever opened by [`open_log`].

use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Bytes of the log's end searched for what an error quotes.
const TAIL_BYTES: u64 = 16 * 1024;
/// Lines an error quotes at most.
const TAIL_LINES: usize = 12;
/// Characters of one quoted line at most.
const LINE_CHARS: usize = 240;
/// How the guest kernel says it panicked; the lines up to it say why, the call trace after it
/// does not.
const PANIC: &str = "Kernel panic - not syncing";
/// Bytes of the log's end kept in the pod's log directory.
const KEEP_BYTES: u64 = 1 << 20;
/// The kept copy's name in the pod's log directory.
pub const KEPT_NAME: &str = "bulkhead-vm-console.log";

/// Opens a file the VMM wrote (the serial log, a template's snapshot) for reading as root
/// without letting the VMM's uid (which owns its directory) steer the read elsewhere or block
/// it: a symlink in its place is not followed (O_NOFOLLOW), a FIFO opens at once (O_NONBLOCK),
/// and anything but a regular file with a single link (a FIFO, a hard link to another file) is
/// refused; reads are then made blocking again.
pub fn open_log(path: &Path) -> std::io::Result<std::fs::File> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let refused = |why: String| {
        std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: {why}: refused", path.display()))
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => refused("a symbolic link".into()),
            _ => e,
        })?;
    let meta = file.metadata()?;
    if !meta.is_file() || meta.nlink() != 1 {
        let kind = if meta.is_file() { "a regular file" } else { "not a regular file" };
        return Err(refused(format!("{kind} with {} links", meta.nlink())));
    }
    let flags = OFlag::from_bits_truncate(fcntl(&file, FcntlArg::F_GETFL)?);
    fcntl(&file, FcntlArg::F_SETFL(flags - OFlag::O_NONBLOCK))?;
    Ok(file)
}

/// The last `max` bytes of `path` (empty if it cannot be read).
pub fn last_bytes(path: &Path, max: u64) -> Vec<u8> {
    let Ok(mut file) = open_log(path) else { return Vec::new() };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    if file.seek(SeekFrom::Start(len.saturating_sub(max))).is_err() {
        return Vec::new();
    }
    let mut bytes = Vec::new();
    let _ = file.take(max).read_to_end(&mut bytes);
    bytes
}

/// The console's last lines on one line: `, last lines: «a | b»`, or `, which is empty`. When
/// the guest kernel panicked, the lines up to the panic instead (what /init said before it died
/// is there, not in the call trace that follows).
pub fn tail(path: &Path) -> String {
    let bytes = last_bytes(path, TAIL_BYTES);
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<String> = text
        .lines()
        .map(|l| l.chars().take(LINE_CHARS).map(|c| if c.is_control() { '\u{FFFD}' } else { c }).collect::<String>())
        .map(|l| l.trim().to_string())
        .filter(|l| !l.is_empty())
        .collect();
    if lines.is_empty() {
        return ", which is empty".into();
    }
    match lines.iter().rposition(|l| l.contains(PANIC)) {
        Some(at) => {
            let shown = &lines[(at + 1).saturating_sub(TAIL_LINES)..=at];
            format!(", the guest kernel panicked; its lines up to the panic: «{}»", shown.join(" | "))
        }
        None => {
            let shown = &lines[lines.len().saturating_sub(TAIL_LINES)..];
            format!(", last lines: «{}»", shown.join(" | "))
        }
    }
}

/// Copies the console's last `KEEP_BYTES` into `log_dir`; returns where, if it could.
pub fn keep(path: &Path, log_dir: &Path) -> Option<PathBuf> {
    if !log_dir.is_dir() {
        return None;
    }
    let kept = log_dir.join(KEPT_NAME);
    std::fs::write(&kept, last_bytes(path, KEEP_BYTES)).ok()?;
    Some(kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tail_is_bounded_and_printable() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("console.log");
        assert_eq!(tail(&log), ", which is empty");
        let mut text = "x".repeat(100_000);
        for i in 0..40 {
            text.push_str(&format!("\nline {i}"));
        }
        text.push_str("\n\u{1b}[31mred\u{7}\n\n");
        std::fs::write(&log, text).unwrap();
        let t = tail(&log);
        assert!(t.starts_with(", last lines: «line 29 | "), "{t}");
        assert!(t.ends_with("| \u{FFFD}[31mred\u{FFFD}»"), "{t}");
        assert!(t.len() < 400, "{}", t.len());
        // Hostile bytes that are not UTF-8, and endless lines, stay bounded too.
        std::fs::write(&log, vec![0xff; 100_000]).unwrap();
        assert!(tail(&log).len() < 3 * LINE_CHARS + 100);
        std::fs::write(&log, "y\n".repeat(50_000)).unwrap();
        assert!(tail(&log).len() < TAIL_LINES * (LINE_CHARS * 3 + 3) + 100);
    }

    #[test]
    fn links_and_fifos_in_the_logs_place_are_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("shadow");
        std::fs::write(&secret, "root:secret\n").unwrap();
        let log = dir.path().join("console.log");
        std::os::unix::fs::symlink(&secret, &log).unwrap();
        assert_eq!(tail(&log), ", which is empty");
        let logs = dir.path().join("pod-logs");
        std::fs::create_dir(&logs).unwrap();
        assert_eq!(keep(&log, &logs), Some(logs.join(KEPT_NAME)));
        assert!(std::fs::read(logs.join(KEPT_NAME)).unwrap().is_empty(), "the link's target is not copied");
        std::fs::remove_file(&log).unwrap();
        std::fs::hard_link(&secret, &log).unwrap();
        assert!(open_log(&log).is_err(), "a hard link to another file");
        std::fs::remove_file(&log).unwrap();
        nix::unistd::mkfifo(&log, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert!(open_log(&log).is_err(), "a FIFO, which would block the reader");
    }

    #[test]
    fn a_panic_is_quoted_with_what_came_before_it_not_the_call_trace() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("console.log");
        let mut text = String::from("[ 1.0] Run /init as init process\nagent: fatal: no shared fs\n");
        text.push_str("[ 1.1] Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000100\n");
        for i in 0..30 {
            text.push_str(&format!("[ 1.2] trace {i}\n"));
        }
        text.push_str("[ 2.0] Rebooting in 1 seconds..\n");
        std::fs::write(&log, text).unwrap();
        let t = tail(&log);
        assert!(t.contains("the guest kernel panicked"), "{t}");
        assert!(t.contains("agent: fatal: no shared fs | [ 1.1] Kernel panic"), "{t}");
        assert!(!t.contains("trace"), "{t}");
    }

    #[test]
    fn a_kept_copy_holds_the_end_of_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("console.log");
        let mut text = vec![b'a'; KEEP_BYTES as usize];
        text.extend_from_slice(b"the end\n");
        std::fs::write(&log, &text).unwrap();
        let logs = dir.path().join("pod-logs");
        assert_eq!(keep(&log, &logs), None, "no log directory, no copy");
        std::fs::create_dir(&logs).unwrap();
        let kept = keep(&log, &logs).unwrap();
        let copy = std::fs::read(&kept).unwrap();
        assert_eq!(copy.len() as u64, KEEP_BYTES);
        assert!(copy.ends_with(b"the end\n"));
    }
}
