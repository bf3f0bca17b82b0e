//! Queue notifies -> balloon work, on the VMM event loop thread. The loop is also where the pages
//! are given back, so `fallocate` (punch hole) is on the event loop's seccomp list.

use std::os::fd::AsRawFd;

use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;

use super::Balloon;

impl MutEventSubscriber for Balloon {
    fn init(&mut self, ops: &mut EventOps) {
        for (queue, evt) in self.queue_evts().iter().enumerate() {
            if let Err(e) = ops.add(Events::new(evt, EventSet::IN)) {
                tracing::error!(device = "balloon", queue, error = ?e, "cannot watch queue event");
            }
        }
    }

    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        let fd = events.fd();
        let Some(queue) = self.queue_evts().iter().position(|e| e.as_raw_fd() == fd) else { return };
        // Drain the counter; a spurious wakeup finds an empty queue.
        let _ = self.queue_evts()[queue].read();
        self.process_queue(queue);
    }
}

#[cfg(test)]
mod tests {
    use super::super::device::tests::rig;
    use super::super::device::REPORTQ;
    use crate::devices::virtio::chain::test_utils::F_WRITE;
    use event_manager::{EventManager, SubscriberOps};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    /// The real event loop serves a report the guest notified, and comes back by itself for
    /// chains beyond one pass.
    #[test]
    fn the_event_loop_serves_reports_across_passes() {
        let mut r = rig(true);
        // Published without processing: the notify below is what the loop sees.
        let chains = super::super::device::MAX_CHAINS_PER_PASS as u16 + 3;
        for head in 0..chains {
            r.report.set_desc(&r.mem, head, (1 << 20) + u64::from(head) * 0x1000, 0x1000, F_WRITE, 0);
            r.report.publish(&r.mem, head);
        }
        let (mem, tq) = (r.mem.clone(), r.report);
        let dev = Arc::new(Mutex::new(r.dev));
        let mut em: EventManager<Arc<Mutex<super::Balloon>>> = EventManager::new().unwrap();
        em.add_subscriber(dev.clone());
        dev.lock().unwrap().queue_evts()[REPORTQ].write(1).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while tq.used_idx(&mem) != chains {
            assert!(Instant::now() < deadline, "served {} of {chains}", tq.used_idx(&mem));
            em.run_with_timeout(50).unwrap();
        }
        assert_eq!(dev.lock().unwrap().counters().reports, u64::from(chains));
    }
}
