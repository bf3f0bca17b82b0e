//! fd readiness -> virtio-fs work, on the VMM event loop: the driver's kicks and the backend's
//! calls move requests and replies through the relay, the backend thread's reports move the
//! device, and the backend connection is watched for hang-up.

use std::os::fd::AsRawFd;

use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;

use super::device::WatchUpdate;
use super::Fs;

/// Hang-up and errors only: the connection's data belongs to the backend thread's exchanges.
fn watch_events(sock: &impl AsRawFd) -> Events {
    Events::new(sock, EventSet::READ_HANG_UP)
}

impl Fs {
    /// Moves the hang-up watch as a report says.
    fn update_watch(&mut self, update: WatchUpdate, ops: &mut EventOps) {
        let next = match update {
            WatchUpdate::Keep => return,
            WatchUpdate::Watch(w) => Some(w),
            WatchUpdate::Unwatch => None,
        };
        if let Some(old) = self.watch.take() {
            if let Err(e) = ops.remove(watch_events(&old.sock)) {
                tracing::warn!(device = %self.name(), error = ?e, "cannot stop watching a backend connection");
            }
        }
        let Some(new) = next else { return };
        match ops.add(watch_events(&new.sock)) {
            Ok(()) => self.watch = Some(new),
            Err(e) => tracing::warn!(device = %self.name(), error = ?e,
                "cannot watch the backend connection; its hang-up will show at the next exchange"),
        }
    }
}

impl MutEventSubscriber for Fs {
    fn init(&mut self, ops: &mut EventOps) {
        for (i, kick) in self.queue_evts.iter().enumerate() {
            if let Err(e) = ops.add(Events::with_data(kick, i as u32, EventSet::IN)) {
                tracing::error!(device = %self.name(), queue = i, error = ?e, "cannot watch the driver's kick eventfd");
            }
        }
        for (i, call) in self.call_evts.iter().enumerate() {
            if let Err(e) = ops.add(Events::with_data(call, i as u32, EventSet::IN)) {
                tracing::error!(device = %self.name(), queue = i, error = ?e, "cannot watch the backend's call eventfd");
            }
        }
        if let Err(e) = ops.add(Events::new(self.worker.reports_evt(), EventSet::IN)) {
            tracing::error!(device = %self.name(), error = ?e, "cannot watch the backend thread's reports");
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let fd = events.fd();
        if fd == self.worker.reports_evt().as_raw_fd() {
            let _ = self.worker.reports_evt().read();
            for report in self.worker.take_reports() {
                let update = self.apply(report);
                self.update_watch(update, ops);
            }
        } else if let Some(q) = self.queue_evts.iter().position(|e| e.as_raw_fd() == fd) {
            // Drain the counter; one pass takes every chain posted so far.
            let _ = self.queue_evts[q].read();
            self.driver_kicked(q);
        } else if let Some(q) = self.call_evts.iter().position(|e| e.as_raw_fd() == fd) {
            let _ = self.call_evts[q].read();
            self.backend_used(q);
        } else if let Some(id) = self.watch.as_ref().filter(|w| w.sock.as_raw_fd() == fd).map(|w| w.id) {
            self.update_watch(WatchUpdate::Unwatch, ops);
            self.backend_hung_up(id);
        }
    }
}
