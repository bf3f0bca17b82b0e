//! Throttling for log lines a guest can cause at will (a bad register write, a malformed chain,
//! a refused connection...): every such line goes through a [`LogThrottle`], one per kind of
//! event and per device, so a hostile guest cannot flood the host's log or disk.
//!
//! A throttle lets [`LogThrottle::BURST`] lines through per [`LogThrottle::WINDOW`] and counts
//! the rest; each line that does go out carries the running `count` of events of its kind and how
//! many were `suppressed` since the previous line, so nothing is lost from the log's arithmetic.
//! Host-caused and one-off lines (startup, exit, a snapshot) are not throttled.

use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct LogThrottle {
    count: u64,
    /// Events not logged since the last line that was.
    pending: u64,
    /// What `pending` was when the last line went out.
    suppressed: u64,
    window_start: Option<Instant>,
    in_window: u32,
}

impl LogThrottle {
    /// Lines let through per window.
    pub const BURST: u32 = 8;
    pub const WINDOW: Duration = Duration::from_secs(10);

    pub const fn new() -> Self {
        Self { count: 0, pending: 0, suppressed: 0, window_start: None, in_window: 0 }
    }

    /// Counts one event; true when this one should be logged.
    pub fn tick(&mut self) -> bool {
        self.tick_at(Instant::now())
    }

    fn tick_at(&mut self, now: Instant) -> bool {
        self.count = self.count.saturating_add(1);
        let fresh = self.window_start.is_none_or(|start| now.saturating_duration_since(start) >= Self::WINDOW);
        if fresh {
            self.window_start = Some(now);
            self.in_window = 0;
        }
        if self.in_window >= Self::BURST {
            self.pending = self.pending.saturating_add(1);
            return false;
        }
        self.in_window += 1;
        self.suppressed = std::mem::take(&mut self.pending);
        true
    }

    /// Events of this kind so far, logged or not.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Events that were not logged between the previous line and the one being logged now.
    pub fn suppressed(&self) -> u64 {
        self.suppressed
    }
}

impl Default for LogThrottle {
    fn default() -> Self {
        Self::new()
    }
}

/// `throttled!(throttle, warn, fields.., "message")`: logs through `tracing` at the given level
/// if `throttle` (a `LogThrottle` place) lets this event through, adding `count` and
/// `suppressed` fields.
#[macro_export]
macro_rules! throttled {
    ($throttle:expr, $level:ident, $($arg:tt)+) => {{
        let throttle: &mut $crate::log_throttle::LogThrottle = &mut $throttle;
        if throttle.tick() {
            let (count, suppressed) = (throttle.count(), throttle.suppressed());
            tracing::$level!(count, suppressed, $($arg)+);
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_per_window_goes_out_and_the_rest_is_counted() {
        let mut t = LogThrottle::new();
        let start = Instant::now();
        let logged = (0..5000).filter(|_| t.tick_at(start)).count();
        assert_eq!(logged, LogThrottle::BURST as usize);
        assert_eq!((t.count(), t.suppressed()), (5000, 0));

        // A later window lets another burst through; its first line names what was held back.
        let later = start + LogThrottle::WINDOW;
        assert!(t.tick_at(later));
        assert_eq!((t.count(), t.suppressed()), (5001, 5000 - u64::from(LogThrottle::BURST)));
        assert!(t.tick_at(later));
        assert_eq!(t.suppressed(), 0);
        let logged = (0..100).filter(|_| t.tick_at(later + Duration::from_secs(1))).count();
        assert_eq!(logged, LogThrottle::BURST as usize - 2);
    }

    #[test]
    fn the_macro_logs_only_what_the_throttle_lets_through() {
        let mut t = LogThrottle::new();
        for i in 0..100u32 {
            throttled!(t, warn, i, "test line");
        }
        assert_eq!(t.count(), 100);
    }
}
