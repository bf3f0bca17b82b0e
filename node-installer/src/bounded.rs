//! Running a host command with a deadline: a command still running then is killed and counts as
//! failed, so a hung `systemctl` or template build cannot hold the installer, and the node, forever.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Output kept per stream; the rest is read and dropped, so the child never blocks on a full pipe.
const KEPT_OUTPUT: usize = 16 * 1024;

#[derive(Debug)]
pub struct Finished {
    pub status: ExitStatus,
    /// Empty unless captured.
    pub stdout: String,
    pub stderr: String,
}

/// Runs `argv` until it exits or `timeout` passes. With `capture`, its output is returned (the
/// first [`KEPT_OUTPUT`] bytes of each stream); otherwise it goes where the installer's goes.
pub fn run(argv: &[String], timeout: Duration, capture: bool) -> Result<Finished, String> {
    let (program, args) = argv.split_first().ok_or("empty command")?;
    let output = || if capture { Stdio::piped() } else { Stdio::inherit() };
    // A group of its own, so a timeout ends what it started too (nsenter --pid forks).
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(output())
        .stderr(output())
        .process_group(0)
        .spawn()
        .map_err(|e| format!("{argv:?}: {e}"))?;
    let stdout = child.stdout.take().map(keep_start);
    let stderr = child.stderr.take().map(keep_start);
    // On a timeout the readers are left to end with the pipes.
    let status = wait(&mut child, timeout).map_err(|e| format!("{argv:?} {e}"))?;
    let text = |reader: Option<std::thread::JoinHandle<String>>| reader.and_then(|r| r.join().ok()).unwrap_or_default();
    Ok(Finished { status, stdout: text(stdout), stderr: text(stderr) })
}

fn wait(child: &mut Child, timeout: Duration) -> Result<ExitStatus, String> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Ok(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) => {
                if let Ok(pid) = i32::try_from(child.id()) {
                    // SAFETY: signals the process group this child leads; it is not reaped yet, so
                    // the id is still its own.
                    unsafe { libc::kill(-pid, libc::SIGKILL) };
                }
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("did not finish within {timeout:?}"));
            }
            Err(e) => return Err(format!("wait: {e}")),
        }
    }
}

/// Reads `pipe` to its end on a thread of its own, keeping the start.
fn keep_start(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let (mut kept, mut buf) = (Vec::new(), [0u8; 4096]);
        while let Ok(n @ 1..) = pipe.read(&mut buf) {
            let room = KEPT_OUTPUT.saturating_sub(kept.len());
            kept.extend_from_slice(&buf[..n.min(room)]);
        }
        String::from_utf8_lossy(&kept).into_owned()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(args: &[&str]) -> Vec<String> {
        args.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn output_is_captured_and_bounded() {
        let done = run(
            &argv(&["sh", "-c", "echo out; echo err >&2; head -c 100000 /dev/zero"]),
            Duration::from_secs(10),
            true,
        )
        .unwrap();
        assert!(done.status.success());
        assert!(done.stdout.starts_with("out\n") && done.stdout.len() == KEPT_OUTPUT, "{}", done.stdout.len());
        assert_eq!(done.stderr, "err\n");
        assert!(!run(&argv(&["false"]), Duration::from_secs(10), false).unwrap().status.success());
    }

    #[test]
    fn a_hung_command_is_killed_at_its_timeout() {
        let started = Instant::now();
        let err = run(&argv(&["sleep", "30"]), Duration::from_millis(300), true).unwrap_err();
        assert!(err.contains("did not finish within"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(run(&[], Duration::from_secs(1), false).unwrap_err().contains("empty command"));
        assert!(run(&argv(&["/nonexistent/cmd"]), Duration::from_secs(1), false).is_err());
    }
}
