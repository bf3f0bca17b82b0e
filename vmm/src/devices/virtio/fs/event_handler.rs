//! fd readiness -> virtio-fs work, on the VMM event loop: the backend's call eventfds become
//! VRING interrupts, and the backend connection is watched for hang-up. Kicks are not watched
//! here: the backend reads them itself.

use std::os::fd::AsRawFd;

use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;

use super::device::Watch;
use super::Fs;

/// Hang-up and errors only: the connection's data belongs to the frontend's exchanges.
fn watch_events(sock: &impl AsRawFd) -> Events {
    Events::new(sock, EventSet::READ_HANG_UP)
}

impl Fs {
    /// Puts the watch on the current connection (and off a gone one).
    fn sync_watch(&mut self, ops: &mut EventOps) {
        let current = self.backend_id();
        if self.watch.as_ref().map(|w| w.id) == current {
            return;
        }
        if let Some(old) = self.watch.take() {
            if let Err(e) = ops.remove(watch_events(&old.sock)) {
                tracing::warn!(device = %self.name(), error = ?e, "cannot stop watching a backend connection");
            }
        }
        let (Some(id), Some(sock)) = (current, self.backend_socket()) else { return };
        let res = sock.map_err(|e| format!("{e}")).and_then(|sock| {
            ops.add(watch_events(&sock)).map_err(|e| format!("{e:?}"))?;
            Ok(sock)
        });
        match res {
            Ok(sock) => self.watch = Some(Watch { id, sock }),
            Err(e) => tracing::warn!(device = %self.name(), error = %e,
                "cannot watch the backend connection; its hang-up will show at the next exchange"),
        }
    }
}

impl MutEventSubscriber for Fs {
    fn init(&mut self, ops: &mut EventOps) {
        for (i, call) in self.call_evts.iter().enumerate() {
            if let Err(e) = ops.add(Events::with_data(call, i as u32, EventSet::IN)) {
                tracing::error!(device = %self.name(), queue = i, error = ?e, "cannot watch the backend's call eventfd");
            }
        }
        if let Err(e) = ops.add(Events::new(&self.conn_evt, EventSet::IN)) {
            tracing::error!(device = %self.name(), error = ?e, "cannot watch backend connection changes");
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let fd = events.fd();
        if fd == self.conn_evt.as_raw_fd() {
            let _ = self.conn_evt.read();
        } else if let Some(call) = self.call_evts.iter().find(|e| e.as_raw_fd() == fd) {
            // Drain the counter; one interrupt covers every buffer used so far.
            let _ = call.read();
            self.backend_used_buffers();
        } else if self.watch.as_ref().is_some_and(|w| w.sock.as_raw_fd() == fd && Some(w.id) == self.backend_id()) {
            self.backend_hung_up();
        }
        self.sync_watch(ops);
    }
}
