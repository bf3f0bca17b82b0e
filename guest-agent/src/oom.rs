//! OOM events: a bounded ring with sequence numbers, served by long poll (GetOomEvent).
//! A consumer passes the last seq it saw, so a reconnecting or duplicated consumer loses
//! nothing that is still in the ring.

use std::{
    collections::VecDeque,
    sync::Mutex,
    time::{Duration, SystemTime},
};

use tokio::sync::Notify;

pub const RING: usize = 1024;
/// The longest a single GetOomEvent may wait.
pub const MAX_WAIT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OomEvent {
    pub seq: u64,
    pub container_id: String,
    pub at: SystemTime,
}

#[derive(Default)]
pub struct OomEvents {
    ring: Mutex<(u64, VecDeque<OomEvent>)>,
    notify: Notify,
}

impl OomEvents {
    pub fn publish(&self, container_id: &str) {
        let mut g = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        g.0 += 1;
        let ev = OomEvent { seq: g.0, container_id: container_id.to_owned(), at: SystemTime::now() };
        tracing::warn!(container = container_id, seq = ev.seq, "OOM kill");
        g.1.push_back(ev);
        while g.1.len() > RING {
            g.1.pop_front();
        }
        drop(g);
        self.notify.notify_waiters();
    }

    fn first_after(&self, after: u64) -> Option<OomEvent> {
        let g = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        g.1.iter().find(|e| e.seq > after).cloned()
    }

    /// The first event with `seq > after`, waiting up to `wait` (capped at [`MAX_WAIT`]).
    pub async fn next_after(&self, after: u64, wait: Duration) -> Option<OomEvent> {
        let deadline = tokio::time::Instant::now() + wait.min(MAX_WAIT);
        loop {
            // Register before checking, so a publish in between is not missed.
            let notified = self.notify.notified();
            if let Some(ev) = self.first_after(after) {
                return Some(ev);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn long_poll_sees_events_in_order_and_times_out() {
        let ev = std::sync::Arc::new(OomEvents::default());
        assert_eq!(ev.next_after(0, Duration::from_millis(10)).await, None);
        let e2 = ev.clone();
        let waiter = tokio::spawn(async move { e2.next_after(0, Duration::from_secs(30)).await });
        tokio::task::yield_now().await;
        ev.publish("a");
        ev.publish("b");
        let first = waiter.await.unwrap().unwrap();
        assert_eq!((first.seq, first.container_id.as_str()), (1, "a"));
        let second = ev.next_after(1, Duration::ZERO).await.unwrap();
        assert_eq!((second.seq, second.container_id.as_str()), (2, "b"));
        assert_eq!(ev.next_after(2, Duration::ZERO).await, None);
    }

    #[test]
    fn ring_is_bounded() {
        let ev = OomEvents::default();
        for _ in 0..RING + 10 {
            ev.publish("x");
        }
        assert_eq!(ev.first_after(0).unwrap().seq, 11);
    }
}
