//! `bulkhead-ctl console POD [-f]`: the pod's console log: the guest's serial output on the `vm`
//! backend (in the VMM's jail, opened only through `vm::console::open_log`, since the VMM's uid
//! could put a link there), the agent's own output on the `namespace` backend
//! ([`PodPaths::console_log`]). Shows the last [`SHOW_MAX`] bytes; `-f` then prints what follows
//! until the pod is removed (or Ctrl-C), following the log across its rotation.

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use super::error::{io_err, CtlError, Outcome};
use super::pods;
use crate::sandbox::paths::PodPaths;
use crate::sandbox::vm::console::open_log;
use crate::sandbox::vm::pod_dirs::VmLayout;

/// How much of the log a look shows (and `-f` starts with).
const SHOW_MAX: u64 = 1 << 20;
/// How often `-f` looks for more.
const POLL: Duration = Duration::from_millis(200);

/// Where the pod's console is: the VM's serial log when the pod has a VM, else the agent's log.
fn console_path(paths: &PodPaths) -> std::path::PathBuf {
    let serial = VmLayout::new(paths).console_log();
    if std::fs::symlink_metadata(&serial).is_ok() {
        serial
    } else {
        paths.console_log()
    }
}

fn open(paths: &PodPaths, label: &str) -> Result<std::fs::File, CtlError> {
    let path = console_path(paths);
    open_log(&path).map_err(|e| {
        CtlError::Failed(format!(
            "pod {label}: no console log at {} ({e}); the sandbox has not started it",
            path.display()
        ))
    })
}

/// The last `max` bytes of `file`, and whether anything before them was left out.
fn tail(file: &mut std::fs::File, max: u64) -> std::io::Result<(Vec<u8>, bool)> {
    let len = file.metadata()?.len();
    let from = len.saturating_sub(max);
    file.seek(SeekFrom::Start(from))?;
    let mut bytes = Vec::new();
    file.take(max).read_to_end(&mut bytes)?;
    Ok((bytes, from > 0))
}

pub fn show(state_dir: &Path, query: &str) -> Result<Outcome, CtlError> {
    let pod = pods::find(state_dir, query)?;
    let mut file = open(&pod.paths, &pod.label())?;
    let path = console_path(&pod.paths);
    let (bytes, truncated) = tail(&mut file, SHOW_MAX).map_err(io_err(format!("read {}", path.display())))?;
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let json = serde_json::json!({ "pod": pod.id, "path": path, "truncated": truncated, "text": text });
    Ok(Outcome { json, text, ok: true })
}

/// Prints the log and then its growth, as raw bytes or one JSON object per line.
pub async fn follow(state_dir: &Path, query: &str, json: bool) -> Result<(), CtlError> {
    let pod = pods::find(state_dir, query)?;
    let path = console_path(&pod.paths);
    let mut file = open(&pod.paths, &pod.label())?;
    let (first, _) = tail(&mut file, SHOW_MAX).map_err(io_err(format!("read {}", path.display())))?;
    let mut printer = Printer { pod: pod.id.clone(), json, partial: Vec::new() };
    printer.print(&first)?;
    let mut inode = file.metadata().map(|m| m.ino()).unwrap_or_default();
    let mut interrupt =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).map_err(io_err("SIGINT handler"))?;
    loop {
        let mut more = Vec::new();
        file.read_to_end(&mut more).map_err(io_err(format!("read {}", path.display())))?;
        printer.print(&more)?;
        if !pod.paths.dir.exists() {
            break;
        }
        // Rotated: continue from the start of the new file.
        if let Ok(meta) = std::fs::metadata(&path) {
            if meta.ino() != inode {
                if let Ok(reopened) = open_log(&path) {
                    file = reopened;
                    inode = meta.ino();
                    continue;
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(POLL) => {}
            _ = interrupt.recv() => break,
        }
    }
    printer.finish()
}

struct Printer {
    pod: String,
    json: bool,
    /// A JSON line waits for its newline.
    partial: Vec<u8>,
}

impl Printer {
    fn print(&mut self, bytes: &[u8]) -> Result<(), CtlError> {
        let mut out = std::io::stdout().lock();
        let res = if self.json {
            self.partial.extend_from_slice(bytes);
            let mut res = Ok(());
            while let Some(end) = self.partial.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.partial.drain(..=end).collect();
                res = res.and_then(|()| self.json_line(&mut out, &line[..line.len() - 1]));
            }
            res
        } else {
            out.write_all(bytes)
        };
        res.and_then(|()| out.flush()).map_err(io_err("write to stdout"))
    }

    fn json_line(&self, out: &mut impl Write, line: &[u8]) -> std::io::Result<()> {
        let value = serde_json::json!({ "pod": self.pod, "line": String::from_utf8_lossy(line) });
        writeln!(out, "{value}")
    }

    fn finish(mut self) -> Result<(), CtlError> {
        if self.json && !self.partial.is_empty() {
            let rest = std::mem::take(&mut self.partial);
            let mut out = std::io::stdout().lock();
            self.json_line(&mut out, &rest).map_err(io_err("write to stdout"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        std::fs::write(&path, b"0123456789").unwrap();
        let mut f = std::fs::File::open(&path).unwrap();
        assert_eq!(tail(&mut f, 4).unwrap(), (b"6789".to_vec(), true));
        assert_eq!(tail(&mut f, 100).unwrap(), (b"0123456789".to_vec(), false));
    }

    #[test]
    fn a_pod_without_console_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sb1")).unwrap();
        let err = show(dir.path(), "sb1").err().unwrap().to_string();
        assert!(err.contains("no console log at") && err.contains("sb1/console.log"), "{err}");
    }
}
