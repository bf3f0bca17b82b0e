//! fd readiness -> net work, on the VMM event loop: the RX queue notify (the guest posted
//! buffers), the TX queue notify, the tap becoming readable (edge-triggered: the device reads
//! until the tap is empty or the guest has no buffers, and an RX notify resumes it) and the
//! rate limiters' refill timers.

use std::os::fd::AsRawFd;

use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;

use super::device::{RXQ, TXQ};
use super::Net;

impl MutEventSubscriber for Net {
    fn init(&mut self, ops: &mut EventOps) {
        let mut fds = vec![
            ("rx queue", Events::new(self.queue_evt(RXQ), EventSet::IN)),
            ("tx queue", Events::new(self.queue_evt(TXQ), EventSet::IN)),
            ("tap", Events::new_raw(self.backend_fd(), EventSet::IN | EventSet::EDGE_TRIGGERED)),
        ];
        for (what, fd) in [("rx limiter", self.rx_limiter.timer_fd()), ("tx limiter", self.tx_limiter.timer_fd())] {
            if let Some(fd) = fd {
                fds.push((what, Events::new_raw(fd, EventSet::IN)));
            }
        }
        for (what, events) in fds {
            if let Err(e) = ops.add(events) {
                tracing::error!(device = %self.name(), what, error = ?e, "net: cannot watch fd");
            }
        }
    }

    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        let fd = events.fd();
        if fd == self.queue_evt(RXQ).as_raw_fd() {
            // Drain the counter; a spurious wakeup finds nothing to do.
            let _ = self.queue_evt(RXQ).read();
            self.process_rx();
        } else if fd == self.queue_evt(TXQ).as_raw_fd() {
            let _ = self.queue_evt(TXQ).read();
            self.process_tx();
        } else if fd == self.backend_fd() {
            self.process_rx();
        } else if Some(fd) == self.rx_limiter.timer_fd() {
            self.rx_limiter.on_timer();
            self.process_rx();
        } else if Some(fd) == self.tx_limiter.timer_fd() {
            self.tx_limiter.on_timer();
            self.process_tx();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::device::test_utils::{net_config, rig_with, Rig};
    use super::super::packet::VnetHeader;
    use super::*;
    use crate::config::{NetRateLimiterConfig, RateLimiterConfig, TokenBucketConfig};
    use crate::devices::virtio::chain::test_utils::F_WRITE;
    use crate::devices::virtio::VirtioDevice;
    use event_manager::{EventManager, SubscriberOps};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    fn frame() -> Vec<u8> {
        let mut v = VnetHeader::default().to_bytes().to_vec();
        v.extend([0xabu8; 60]);
        v
    }

    fn run_until(em: &mut EventManager<Arc<Mutex<Net>>>, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !done() {
            assert!(Instant::now() < deadline, "condition not reached");
            em.run_with_timeout(50).unwrap();
        }
    }

    /// The real event loop moves frames both ways, and a refill timer (1 op per 20 ms here)
    /// releases a rate-limited frame without any guest kick.
    #[test]
    fn event_loop_moves_frames_and_the_refill_timer_releases_limited_ones() {
        let one_per_20ms = TokenBucketConfig { size: 1, one_time_burst: 0, refill_time_ms: 20 };
        let limits = RateLimiterConfig { ops: Some(one_per_20ms), bandwidth: None };
        let cfg = crate::config::NetConfig {
            rate_limiter: Some(NetRateLimiterConfig { rx: Some(limits), tx: None }),
            ..net_config()
        };
        let Rig { dev, mem, mut rx, mut tx, host, .. } = rig_with(&cfg, 0, crate::devices::virtio::VIRTIO_F_VERSION_1);
        assert_eq!(dev.acked_features, crate::devices::virtio::VIRTIO_F_VERSION_1);
        let dev = Arc::new(Mutex::new(dev));
        let mut em: EventManager<Arc<Mutex<Net>>> = EventManager::new().unwrap();
        em.add_subscriber(dev.clone());

        // TX: the guest publishes a frame and notifies.
        use vm_memory::{Bytes, GuestAddress};
        mem.write_slice(&frame(), GuestAddress(0x10000)).unwrap();
        tx.set_desc(&mem, 0, 0x10000, 72, 0, 0);
        tx.publish(&mem, 0);
        dev.lock().unwrap().queue_evt(TXQ).write(1).unwrap();
        run_until(&mut em, || tx.used_idx(&mem) == 1);
        let mut got = [0u8; 128];
        assert_eq!(host.recv(&mut got).unwrap(), 72);

        // RX: two frames from the host, two buffers; the second waits for the refill timer.
        for slot in 0..2u16 {
            rx.set_desc(&mem, slot, 0x40000 + u64::from(slot) * 0x1000, 2048, F_WRITE, 0);
            rx.publish(&mem, slot);
        }
        dev.lock().unwrap().queue_evt(RXQ).write(1).unwrap();
        host.send(&frame()).unwrap();
        host.send(&frame()).unwrap();
        run_until(&mut em, || rx.used_idx(&mem) == 1);
        run_until(&mut em, || rx.used_idx(&mem) == 2);
        assert!(!dev.lock().unwrap().is_broken());
    }
}
