//! Plumbing between the VMM's threads: spawning one that confines itself (its seccomp filter)
//! before it runs (confirmed at once, or later with others: `Unconfirmed`), `Mailbox`, a queue
//! between threads, and `Slot`, a one-value hand-over. The virtio-fs device's backend and
//! watchdog threads, the API thread and the event loop use them.
//!
//! Everything here waits on a `Mutex` and `Condvar` only, which park and wake through futexes:
//! std's channels may also `sched_yield` under contention, which no seccomp list allows.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a new thread runs first: the thread kind's seccomp filter is installed here; unit tests
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
    let (handle, confined) = spawn(name.clone(), confine, body)?;
    match wait_confined(&name, &confined, Instant::now() + CONFINE_TIMEOUT) {
        Ok(()) => Ok(handle),
        Err(e) => {
            let _ = handle.join();
            Err(e)
        }
    }
}

/// Like [`spawn_confined`], but returns at once: the thread's confinement is confirmed later with
/// the others in `unconfirmed` ([`Unconfirmed::confirm_all`]). Either way `body` runs only once
/// `confine` succeeded. Used while a VM is built: its device threads confine themselves while
/// the rest is built, instead of the builder waiting for each in turn.
pub fn spawn_confined_later(
    name: String,
    confine: Confine,
    unconfirmed: &Unconfirmed,
    body: impl FnOnce() + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    let (handle, confined) = spawn(name.clone(), confine, body)?;
    unconfirmed.lock().push((name, confined));
    Ok(handle)
}

type Confined = Arc<Slot<Result<(), String>>>;

fn spawn(
    name: String,
    confine: Confine,
    body: impl FnOnce() + Send + 'static,
) -> std::io::Result<(JoinHandle<()>, Confined)> {
    let confined = Slot::new();
    let report = Arc::clone(&confined);
    let handle = std::thread::Builder::new().name(name).spawn(move || {
        let res = confine();
        let ok = res.is_ok();
        report.put(res);
        if ok {
            body();
        }
    })?;
    Ok((handle, confined))
}

fn wait_confined(name: &str, confined: &Confined, until: Instant) -> std::io::Result<()> {
    match confined.take_until(until) {
        Some(Ok(())) => Ok(()),
        Some(Err(e)) => Err(std::io::Error::other(format!("thread {name} could not confine itself: {e}"))),
        None => Err(std::io::Error::other(format!("thread {name} did not confine itself in time"))),
    }
}

/// Threads started by [`spawn_confined_later`] whose confinement is still to be confirmed.
#[derive(Clone, Default)]
pub struct Unconfirmed(Arc<Mutex<Vec<(String, Confined)>>>);

impl Unconfirmed {
    /// Waits until every thread listed so far confined itself; the first that could not (or did
    /// not in time) is the error. The list is empty afterwards.
    pub fn confirm_all(&self) -> std::io::Result<()> {
        let until = Instant::now() + CONFINE_TIMEOUT;
        let pending: Vec<_> = self.lock().drain(..).collect();
        pending.iter().try_for_each(|(name, confined)| wait_confined(name, confined, until))
    }

    fn lock(&self) -> MutexGuard<'_, Vec<(String, Confined)>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
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
    fn threads_confirmed_later_run_only_once_confined_and_a_failure_surfaces_at_confirmation() {
        let unconfirmed = Unconfirmed::default();
        let ran = Slot::new();
        let r = Arc::clone(&ran);
        let good = spawn_confined_later("good".into(), unconfined(), &unconfirmed, move || r.put(1)).unwrap();
        let r = Arc::clone(&ran);
        let bad =
            spawn_confined_later("bad".into(), Box::new(|| Err("no filter".into())), &unconfirmed, move || r.put(2))
                .unwrap();
        let err = unconfirmed.confirm_all().unwrap_err();
        assert!(err.to_string().contains("thread bad could not confine itself: no filter"), "{err}");
        good.join().unwrap();
        bad.join().unwrap();
        assert_eq!(ran.take_until(Instant::now()), Some(1), "only the confined thread ran its body");
        unconfirmed.confirm_all().unwrap();
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
