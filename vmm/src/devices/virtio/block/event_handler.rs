//! Queue-notify eventfd -> request processing, on the VMM event loop thread.

use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;

use super::Block;

impl MutEventSubscriber for Block {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(self.queue_evt(), EventSet::IN)) {
            tracing::error!(device = %self.name(), error = ?e, "cannot register queue event");
        }
    }

    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        if events.fd() == std::os::fd::AsRawFd::as_raw_fd(self.queue_evt()) {
            // Drain the counter; a spurious wakeup just finds an empty queue.
            let _ = self.queue_evt().read();
            self.process_queue();
        }
    }
}
