//! Token-bucket rate limiting of one direction of a net device (Firecracker's model): a
//! bandwidth bucket counts bytes, an operations bucket counts frames. Off by default.
//!
//! Buckets refill continuously with elapsed time; the arithmetic takes `now` as a parameter so
//! it is tested with a fake clock. When a frame is refused, the limiter arms a timer fd for the
//! moment enough tokens will be back; the device retries when the event loop sees it fire.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use vmm_sys_util::timerfd::TimerFd;

use crate::config::{RateLimiterConfig, TokenBucketConfig};

/// Shortest refill wait, so a nearly-refilled bucket cannot spin the event loop.
const MIN_WAIT: Duration = Duration::from_millis(1);

/// `size` tokens that refill completely in `refill_ns`, plus a one-time burst spent first. A
/// full bucket lets any single request through, going into debt if it is larger than the
/// bucket, so a frame bigger than the bucket is slowed down rather than stuck forever.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBucket {
    size: u64,
    refill_ns: u64,
    /// Below zero while a request larger than the bucket is being paid off.
    budget: i128,
    burst: u64,
    /// When `budget` was last brought up to date.
    last: Duration,
}

impl TokenBucket {
    /// A full bucket as of `now`. The config was validated: `size` and the refill time are > 0.
    pub fn new(cfg: &TokenBucketConfig, now: Duration) -> Self {
        Self {
            size: cfg.size.max(1),
            refill_ns: cfg.refill_time_ms.max(1).saturating_mul(1_000_000),
            budget: i128::from(cfg.size.max(1)),
            burst: cfg.one_time_burst,
            last: now,
        }
    }

    /// Adds the tokens earned since the last refill. Only whole tokens are added; the time that
    /// earned a fraction of one is kept for the next call.
    fn refill(&mut self, now: Duration) {
        let elapsed = now.saturating_sub(self.last).as_nanos();
        let (size, refill_ns) = (u128::from(self.size), u128::from(self.refill_ns));
        let missing = (i128::from(self.size) - self.budget).max(0) as u128;
        let earned = elapsed.saturating_mul(size) / refill_ns;
        if earned >= missing {
            self.budget = i128::from(self.size);
            self.last = now;
        } else {
            self.budget += earned as i128;
            // Ceiling division: never hand out the same nanosecond twice.
            let used_ns = (earned * refill_ns).div_ceil(size);
            self.last += Duration::from_nanos(used_ns as u64);
        }
    }

    fn can_take(&self, n: u64) -> bool {
        let available = i128::from(self.burst) + self.budget.max(0);
        i128::from(n) <= available || self.budget >= i128::from(self.size)
    }

    fn take(&mut self, n: u64) {
        let from_burst = n.min(self.burst);
        self.burst -= from_burst;
        self.budget -= i128::from(n - from_burst);
    }

    /// Time until `n` tokens can be taken (zero if they can now).
    fn wait_for(&self, n: u64, now: Duration) -> Duration {
        if self.can_take(n) {
            return Duration::ZERO;
        }
        // Either enough for `n` (after the burst) or a full bucket, whichever comes first.
        let target = i128::from(n.saturating_sub(self.burst).min(self.size));
        let deficit = (target - self.budget).max(0) as u128;
        let ns = (deficit * u128::from(self.refill_ns)).div_ceil(u128::from(self.size));
        let since_refill = now.saturating_sub(self.last).as_nanos();
        Duration::from_nanos(ns.saturating_sub(since_refill).min(u128::from(u64::MAX)) as u64)
    }

    pub fn budget(&self) -> i128 {
        self.budget
    }

    pub fn burst(&self) -> u64 {
        self.burst
    }
}

/// Both buckets of one direction plus the refill timer.
#[derive(Debug)]
pub struct RateLimiter {
    bandwidth: Option<TokenBucket>,
    ops: Option<TokenBucket>,
    epoch: Instant,
    /// Present only when some bucket is configured.
    timer: Option<TimerFd>,
    /// Set when a frame was refused; cleared when the timer fires.
    blocked: bool,
}

impl RateLimiter {
    /// A limiter for `cfg`; `None` (or no buckets) means unlimited, with no timer.
    pub fn new(cfg: Option<&RateLimiterConfig>) -> io::Result<Self> {
        let (bandwidth, ops) = cfg.map_or((None, None), |c| (c.bandwidth, c.ops));
        let timer = if bandwidth.is_some() || ops.is_some() { Some(nonblocking_timer()?) } else { None };
        let now = Duration::ZERO;
        Ok(Self {
            bandwidth: bandwidth.map(|b| TokenBucket::new(&b, now)),
            ops: ops.map(|b| TokenBucket::new(&b, now)),
            epoch: Instant::now(),
            timer,
            blocked: false,
        })
    }

    pub fn unlimited() -> Self {
        Self { bandwidth: None, ops: None, epoch: Instant::now(), timer: None, blocked: false }
    }

    pub fn timer_fd(&self) -> Option<RawFd> {
        self.timer.as_ref().map(|t| t.as_raw_fd())
    }

    pub fn is_blocked(&self) -> bool {
        self.blocked
    }

    /// Accounts one frame of `bytes`, or refuses it and arms the refill timer; after a refusal
    /// every frame is refused until [`RateLimiter::on_timer`].
    pub fn consume(&mut self, bytes: u64) -> bool {
        if self.blocked {
            return false;
        }
        match self.consume_at(bytes, self.epoch.elapsed()) {
            Ok(()) => true,
            Err(wait) => {
                self.blocked = true;
                if let Some(t) = &mut self.timer {
                    if let Err(e) = t.reset(wait.max(MIN_WAIT), None) {
                        // Without the timer nothing would unblock us: stay unlimited instead.
                        tracing::error!(error = %e, "net rate limiter: cannot arm the refill timer; limiting is off");
                        self.blocked = false;
                        self.bandwidth = None;
                        self.ops = None;
                        return true;
                    }
                }
                false
            }
        }
    }

    /// The bucket arithmetic at time `now` (since this limiter's epoch): takes one op and
    /// `bytes` bytes from both buckets, or neither and says how long to wait.
    pub fn consume_at(&mut self, bytes: u64, now: Duration) -> Result<(), Duration> {
        for b in [&mut self.bandwidth, &mut self.ops].into_iter().flatten() {
            b.refill(now);
        }
        let bw_ok = self.bandwidth.as_ref().is_none_or(|b| b.can_take(bytes));
        let ops_ok = self.ops.as_ref().is_none_or(|b| b.can_take(1));
        if bw_ok && ops_ok {
            if let Some(b) = &mut self.bandwidth {
                b.take(bytes);
            }
            if let Some(b) = &mut self.ops {
                b.take(1);
            }
            return Ok(());
        }
        let bw_wait = self.bandwidth.as_ref().map_or(Duration::ZERO, |b| b.wait_for(bytes, now));
        let ops_wait = self.ops.as_ref().map_or(Duration::ZERO, |b| b.wait_for(1, now));
        Err(bw_wait.max(ops_wait))
    }

    /// The refill timer fired: frames may flow again.
    pub fn on_timer(&mut self) {
        if let Some(t) = &mut self.timer {
            // Non-blocking: a spurious wakeup finds nothing to read.
            let _ = t.wait();
        }
        self.blocked = false;
    }

    pub fn bandwidth(&self) -> Option<&TokenBucket> {
        self.bandwidth.as_ref()
    }

    pub fn ops(&self) -> Option<&TokenBucket> {
        self.ops.as_ref()
    }
}

/// A timer fd whose read never blocks the event loop, even after a spurious wakeup.
fn nonblocking_timer() -> io::Result<TimerFd> {
    let t = TimerFd::new()?;
    let fd = t.as_raw_fd();
    // SAFETY: F_GETFL/F_SETFL on a timer fd we own; return values are checked.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    fn bucket(size: u64, one_time_burst: u64, refill_time_ms: u64) -> TokenBucket {
        TokenBucket::new(&TokenBucketConfig { size, one_time_burst, refill_time_ms }, Duration::ZERO)
    }

    #[test]
    fn bucket_starts_full_and_refills_linearly() {
        let mut b = bucket(1000, 0, 1000);
        assert!(b.can_take(1000));
        b.take(1000);
        assert!(!b.can_take(1));
        b.refill(ms(250));
        assert_eq!(b.budget(), 250);
        b.refill(ms(250));
        assert_eq!(b.budget(), 250, "no time passed, no tokens");
        b.refill(ms(10_000));
        assert_eq!(b.budget(), 1000, "never above the size");
    }

    #[test]
    fn fractional_tokens_carry_over() {
        // One token per 3 ms: at 5 ms one token is earned and 2 ms of credit stay for later.
        let mut b = bucket(10, 0, 30);
        b.take(10);
        b.refill(ms(5));
        assert_eq!(b.budget(), 1);
        b.refill(ms(6));
        assert_eq!(b.budget(), 2, "the 2 ms left over plus 1 ms earn the next token");
    }

    #[test]
    fn one_time_burst_is_spent_first_and_never_refills() {
        let mut b = bucket(100, 50, 1000);
        b.take(120);
        assert_eq!((b.burst(), b.budget()), (0, 30));
        b.refill(ms(5000));
        assert_eq!((b.burst(), b.budget()), (0, 100));
    }

    #[test]
    fn oversized_request_passes_a_full_bucket_and_is_paid_off() {
        let mut b = bucket(1000, 0, 1000);
        assert!(b.can_take(5000), "a full bucket lets one oversized frame through");
        b.take(5000);
        assert_eq!(b.budget(), -4000);
        assert_eq!(b.wait_for(1, Duration::ZERO), ms(4001));
        b.refill(ms(4000));
        assert!(!b.can_take(1));
        b.refill(ms(5000));
        assert!(b.can_take(5000), "full again after paying the debt");
    }

    #[test]
    fn limiter_takes_from_both_buckets_or_neither() {
        let cfg = RateLimiterConfig {
            bandwidth: Some(TokenBucketConfig { size: 3000, one_time_burst: 0, refill_time_ms: 1000 }),
            ops: Some(TokenBucketConfig { size: 2, one_time_burst: 0, refill_time_ms: 1000 }),
        };
        let mut l = RateLimiter::new(Some(&cfg)).unwrap();
        assert!(l.timer_fd().is_some());
        let t0 = Duration::ZERO;
        assert_eq!(l.consume_at(1000, t0), Ok(()));
        assert_eq!(l.consume_at(1000, t0), Ok(()));
        // Bytes are left but the ops bucket is empty; one op comes back after 500 ms.
        assert_eq!(l.consume_at(1000, t0), Err(ms(500)));
        assert_eq!(l.bandwidth().unwrap().budget(), 1000, "a refused frame takes no bytes");
        assert_eq!(l.consume_at(1000, ms(500)), Ok(()));
        // Both short now: 600 more bytes need 200 ms, the next op 500 ms; the longer wait wins.
        assert_eq!(l.bandwidth().unwrap().wait_for(2100, ms(500)), ms(200));
        assert_eq!(l.consume_at(2100, ms(500)), Err(ms(500)));
        assert_eq!(l.consume_at(2100, ms(1000)), Ok(()));
    }

    #[test]
    fn refusal_blocks_until_the_timer_fires() {
        let cfg = RateLimiterConfig {
            ops: Some(TokenBucketConfig { size: 1, one_time_burst: 0, refill_time_ms: 3_600_000 }),
            bandwidth: None,
        };
        let mut l = RateLimiter::new(Some(&cfg)).unwrap();
        assert!(l.consume(100));
        assert!(!l.consume(100));
        assert!(l.is_blocked());
        l.on_timer();
        assert!(!l.is_blocked(), "the timer unblocks (a spurious wakeup just retries)");
        assert!(!l.consume(100), "still no tokens for an hour");
    }

    #[test]
    fn unlimited_never_refuses_and_has_no_timer() {
        let mut l = RateLimiter::new(None).unwrap();
        assert!(l.timer_fd().is_none());
        assert!((0..10_000).all(|_| l.consume(65_550)));
        let mut empty = RateLimiter::new(Some(&RateLimiterConfig::default())).unwrap();
        assert!(empty.timer_fd().is_none());
        assert_eq!(empty.consume_at(u64::MAX, Duration::MAX), Ok(()));
    }
}
