//! Bounds every exchange with a vhost-user backend in time. The `vhost` crate retries a
//! timed-out or interrupted socket call forever, so socket timeouts cannot bound a silent
//! backend: at the deadline the watchdog shuts the connection's socket down, which wakes the
//! blocked call with an error.
//!
//! One long-lived thread per device (named `<device>-watchdog`, with its own small seccomp
//! filter), armed and disarmed around each exchange: a seccomp-filtered process cannot start a
//! thread per exchange.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use nix::sys::socket::Shutdown;

use crate::thread::{spawn_confined_later, Confine, Unconfirmed};

enum Watch {
    Idle,
    /// An exchange on socket `fd` must be over at `at`. The fd stays open while armed: `bound`
    /// borrows its socket for as long as the exchange runs, and disarms before it returns.
    Armed {
        fd: RawFd,
        at: Instant,
    },
    /// The deadline passed; the socket is shut down.
    Fired,
    Closed,
}

struct Shared {
    watch: Mutex<Watch>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Watch> {
        self.watch.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set(&self, next: Watch) -> Watch {
        let prev = std::mem::replace(&mut *self.lock(), next);
        self.changed.notify_all();
        prev
    }

    fn run(&self) {
        let mut watch = self.lock();
        loop {
            match *watch {
                Watch::Closed => return,
                Watch::Armed { fd, at } => match at.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => {
                        watch = self.changed.wait_timeout(watch, left).unwrap_or_else(|p| p.into_inner()).0;
                    }
                    _ => {
                        // The step that waits reports the timeout; a socket already gone is fine.
                        let _ = nix::sys::socket::shutdown(fd, Shutdown::Both);
                        *watch = Watch::Fired;
                    }
                },
                Watch::Idle | Watch::Fired => watch = self.changed.wait(watch).unwrap_or_else(|p| p.into_inner()),
            }
        }
    }
}

pub struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts the watchdog thread `name`, confined by `confine` (confirmed with `unconfirmed`).
    pub fn spawn(name: String, confine: Confine, unconfirmed: &Unconfirmed) -> std::io::Result<Self> {
        let shared = Arc::new(Shared { watch: Mutex::new(Watch::Idle), changed: Condvar::new() });
        let watcher = Arc::clone(&shared);
        let thread = spawn_confined_later(name, confine, unconfirmed, move || watcher.run())?;
        Ok(Self { shared, thread: Some(thread) })
    }

    /// Runs `exchange` on `sock`; if it is still running at `at`, the socket is shut down (it is
    /// unusable from then on). Returns the exchange's result and whether the deadline passed.
    pub fn bound<T>(&self, sock: &impl AsRawFd, at: Instant, exchange: impl FnOnce() -> T) -> (T, bool) {
        self.shared.set(Watch::Armed { fd: sock.as_raw_fd(), at });
        let res = exchange();
        let fired = matches!(self.shared.set(Watch::Idle), Watch::Fired);
        (res, fired)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.set(Watch::Closed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::thread::unconfined;
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    #[test]
    fn a_blocked_read_is_woken_at_the_deadline_and_a_quick_one_is_left_alone() {
        let dog = Watchdog::spawn("test-watchdog".into(), unconfined(), &Default::default()).unwrap();
        let (ours, theirs) = UnixStream::pair().unwrap();
        let start = Instant::now();
        let (n, fired) = dog.bound(&ours, start + Duration::from_millis(100), || (&ours).read(&mut [0u8; 4]).ok());
        assert_eq!((n, fired), (Some(0), true), "shut down: the read sees end of file");
        assert!(start.elapsed() >= Duration::from_millis(100));

        drop(theirs);

        let (ours, mut theirs) = UnixStream::pair().unwrap();
        std::io::Write::write_all(&mut theirs, b"ok").unwrap();
        let deadline = Instant::now() + Duration::from_millis(50);
        let (n, fired) = dog.bound(&ours, deadline, || (&ours).read(&mut [0u8; 4]).ok());
        assert_eq!((n, fired), (Some(2), false));
        // Disarmed: the socket outlives that deadline untouched.
        std::thread::sleep(Duration::from_millis(100));
        std::io::Write::write_all(&mut theirs, b"!").unwrap();
        assert_eq!((&ours).read(&mut [0u8; 4]).unwrap(), 1);
    }
}
