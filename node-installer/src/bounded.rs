//! Running a host command with a deadline: a command still running then is killed and counts as
//! failed, so a hung `systemctl` or template build cannot hold the installer, and the node, forever.
//! A [`Stop`] ends it sooner, gently first: the installer was told to stop, and the command gets
//! SIGTERM and a grace period to clean up after itself.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
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

/// Asks a running command to end: set (from any thread) once the installer must stop.
#[derive(Debug, Clone, Default)]
pub struct Stop(Arc<AtomicBool>);

impl Stop {
    pub fn request(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    pub fn requested(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// A guard that requests the stop when dropped: an async step dropped mid-way (the installer's
    /// SIGTERM cancels it) stops the blocking command it started.
    pub fn on_drop(&self) -> StopOnDrop {
        StopOnDrop(self.clone())
    }
}

pub struct StopOnDrop(Stop);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.request();
    }
}

/// Runs `argv` until it exits or `timeout` passes. With `capture`, its output is returned (the
/// first [`KEPT_OUTPUT`] bytes of each stream); otherwise it goes where the installer's goes.
pub fn run(argv: &[String], timeout: Duration, capture: bool) -> Result<Finished, String> {
    run_stoppable(argv, timeout, capture, &Stop::default(), Duration::ZERO)
}

/// [`run`], and ends sooner once `stop` is requested: SIGTERM to the command's process group,
/// then SIGKILL if it is still there after `grace`. A stopped command counts as failed.
pub fn run_stoppable(
    argv: &[String],
    timeout: Duration,
    capture: bool,
    stop: &Stop,
    grace: Duration,
) -> Result<Finished, String> {
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
    let status = wait(&mut child, timeout, stop, grace).map_err(|e| format!("{argv:?} {e}"))?;
    let text = |reader: Option<std::thread::JoinHandle<String>>| reader.and_then(|r| r.join().ok()).unwrap_or_default();
    Ok(Finished { status, stdout: text(stdout), stderr: text(stderr) })
}

fn wait(child: &mut Child, timeout: Duration, stop: &Stop, grace: Duration) -> Result<ExitStatus, String> {
    let deadline = Instant::now() + timeout;
    // Set once SIGTERM went: by then the deadline is the grace period's end.
    let mut stopping: Option<Instant> = None;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if stopping.is_some() => return Err(format!("stopped on request ({status})")),
            Ok(Some(status)) => return Ok(status),
            Ok(None) if stopping.is_none() && stop.requested() => {
                signal_group(child, libc::SIGTERM);
                stopping = Some(Instant::now() + grace);
            }
            Ok(None) if Instant::now() < stopping.unwrap_or(deadline) => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) => {
                signal_group(child, libc::SIGKILL);
                let _ = child.kill();
                let _ = child.wait();
                return Err(match stopping {
                    Some(_) => format!("stopped on request; killed after {grace:?} without ending"),
                    None => format!("did not finish within {timeout:?}"),
                });
            }
            Err(e) => return Err(format!("wait: {e}")),
        }
    }
}

/// Signals the process group `child` leads (nsenter's child too, and whatever the command forked).
fn signal_group(child: &Child, signal: libc::c_int) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: signals the process group this child leads; it is not reaped yet, so the id is
        // still its own.
        unsafe { libc::kill(-pid, signal) };
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

    /// Requests the stop after `after`, from another thread (as the installer's signal does).
    fn stop_after(after: Duration) -> Stop {
        let stop = Stop::default();
        let later = stop.clone();
        std::thread::spawn(move || {
            std::thread::sleep(after);
            drop(later.on_drop());
        });
        stop
    }

    #[test]
    fn a_stop_sends_sigterm_and_the_command_may_clean_up() {
        let dir = tempfile::tempdir().unwrap();
        let cleaned = dir.path().join("cleaned");
        let script = format!("trap 'echo done > {}; exit 3' TERM; sleep 30 & wait", cleaned.display());
        let started = Instant::now();
        let stop = stop_after(Duration::from_millis(300));
        let err =
            run_stoppable(&argv(&["sh", "-c", &script]), Duration::from_secs(60), true, &stop, Duration::from_secs(20))
                .unwrap_err();
        assert!(err.contains("stopped on request"), "{err}");
        assert_eq!(std::fs::read_to_string(&cleaned).unwrap(), "done\n", "its TERM trap ran");
        assert!(started.elapsed() < Duration::from_secs(15), "{:?}", started.elapsed());
    }

    #[test]
    fn a_command_that_ignores_the_stop_is_killed_after_the_grace() {
        let started = Instant::now();
        let stop = stop_after(Duration::from_millis(200));
        let script = "trap '' TERM; sleep 30";
        let err = run_stoppable(
            &argv(&["sh", "-c", script]),
            Duration::from_secs(60),
            true,
            &stop,
            Duration::from_millis(300),
        )
        .unwrap_err();
        assert!(err.contains("killed after"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(15), "{:?}", started.elapsed());
    }
}
