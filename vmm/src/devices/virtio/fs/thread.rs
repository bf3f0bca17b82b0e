//! The plumbing of the virtio-fs device's own threads (the backend worker and its watchdog):
//! spawning one that confines itself (its seccomp filter) before it runs, `Mailbox`, a queue
//! between threads, and `Slot`, a one-value hand-over.
//!
//! Everything here waits on a `Mutex` and `Condvar` only, which park and wake through futexes:
//! std's channels may also `sched_yield` under contention, which no seccomp list allows.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a new thread runs first: vmm.rs installs the thread kind's seccomp filter here; unit tests
/// pass `unconfined()`. An error stops the thread before it does anything else.
pub type Confine = Box<dyn FnOnce() -> Result<(), String> + Send>;

/// No confinement (unit tests, which run their threads unfiltered).
pub fn unconfined() -> Confine {
    Box::new(|| Ok(()))
}

/// How long a new thread may take to confine itself (it installs one filter).
const CONFINE_TIMEOUT: Duration = Duration::from_secs(10);

/// Spawns `body` on a thread named `name` once `confine` succeeded there; returns when it did
/// (or with its error, the thread then gone).
pub fn spawn_confined(
    name: String,
    confine: Confine,
    body: impl FnOnce() + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    let confined = Slot::new();
    let report = Arc::clone(&confined);
    let handle = std::thread::Builder::new().name(name.clone()).spawn(move || {
        let res = confine();
        let ok = res.is_ok();
        report.put(res);
        if ok {
            body();
        }
    })?;
    match confined.take_until(Instant::now() + CONFINE_TIMEOUT) {
        Some(Ok(())) => Ok(handle),
        Some(Err(e)) => {
            let _ = handle.join();
            Err(std::io::Error::other(format!("thread {name} could not confine itself: {e}")))
        }
        None => Err(std::io::Error::other(format!("thread {name} did not confine itself in time"))),
    }
}

/// Messages from one thread to another, in order.
pub struct Mailbox<T> {
    state: Mutex<Letters<T>>,
    posted: Condvar,
}

struct Letters<T> {
    queue: VecDeque<T>,
    /// The sender is gone: the receiver stops.
    closed: bool,
}

impl<T> Mailbox<T> {
    pub fn new() -> Arc<Self> {
        Arc::new(Self { state: Mutex::new(Letters { queue: VecDeque::new(), closed: false }), posted: Condvar::new() })
    }

    pub fn post(&self, message: T) {
        self.lock().queue.push_back(message);
        self.posted.notify_all();
    }

    /// Everything posted so far, without waiting.
    pub fn drain(&self) -> Vec<T> {
        self.lock().queue.drain(..).collect()
    }

    /// The next message, waiting for one as long as it takes (this is the receiver's idle
    /// state); None once the mailbox is closed.
    pub fn next(&self) -> Option<T> {
        let mut letters = self.lock();
        loop {
            if letters.closed {
                return None;
            }
            if let Some(m) = letters.queue.pop_front() {
                return Some(m);
            }
            letters = self.posted.wait(letters).unwrap_or_else(|p| p.into_inner());
        }
    }

    pub fn close(&self) {
        self.lock().closed = true;
        self.posted.notify_all();
    }

    fn lock(&self) -> MutexGuard<'_, Letters<T>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One value handed from one thread to another.
pub struct Slot<T> {
    value: Mutex<Option<T>>,
    filled: Condvar,
}

impl<T> Slot<T> {
    pub fn new() -> Arc<Self> {
        Arc::new(Self { value: Mutex::new(None), filled: Condvar::new() })
    }

    pub fn put(&self, value: T) {
        *self.lock() = Some(value);
        self.filled.notify_all();
    }

    /// Waits for the value until `until`; None if it did not come.
    pub fn take_until(&self, until: Instant) -> Option<T> {
        let mut guard = self.lock();
        loop {
            if let Some(v) = guard.take() {
                return Some(v);
            }
            let left = until.checked_duration_since(Instant::now()).filter(|d| !d.is_zero())?;
            guard = self.filled.wait_timeout(guard, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<T>> {
        self.value.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_thread_that_cannot_confine_itself_never_runs_its_body() {
        let ran = Slot::new();
        let r = Arc::clone(&ran);
        let err = spawn_confined("t".into(), Box::new(|| Err("no filter".into())), move || r.put(())).err().unwrap();
        assert!(err.to_string().contains("thread t could not confine itself: no filter"), "{err}");
        assert!(ran.take_until(Instant::now() + Duration::from_millis(50)).is_none());

        let r = Arc::clone(&ran);
        spawn_confined("t".into(), unconfined(), move || r.put(())).unwrap().join().unwrap();
        assert_eq!(ran.take_until(Instant::now()), Some(()));
    }

    #[test]
    fn a_mailbox_keeps_order_and_its_receiver_stops_once_closed() {
        let mailbox: Arc<Mailbox<u32>> = Mailbox::new();
        let receiver = Arc::clone(&mailbox);
        let got = std::thread::spawn(move || std::iter::from_fn(|| receiver.next()).take(3).collect::<Vec<_>>());
        for i in 0..3 {
            mailbox.post(i);
        }
        assert_eq!(got.join().unwrap(), [0, 1, 2]);
        mailbox.post(9);
        assert_eq!(mailbox.drain(), [9]);
        mailbox.close();
        mailbox.post(10);
        assert_eq!(mailbox.next(), None, "closed: nothing more is delivered");
    }

    #[test]
    fn a_slot_waits_only_until_its_deadline() {
        let slot: Arc<Slot<u8>> = Slot::new();
        let start = Instant::now();
        assert_eq!(slot.take_until(start + Duration::from_millis(30)), None);
        assert!(start.elapsed() >= Duration::from_millis(30));
        let s = Arc::clone(&slot);
        std::thread::spawn(move || s.put(7));
        assert_eq!(slot.take_until(Instant::now() + Duration::from_secs(10)), Some(7));
    }
}
