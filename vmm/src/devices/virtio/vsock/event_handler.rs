//! fd readiness -> vsock work: queue notifies, the host listener, host connections and a
//! periodic timer that expires stuck handshakes.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;

use super::device::{EVQ, RXQ, TXQ};
use super::unix::FdOp;
use super::Vsock;
use crate::devices::virtio::DeviceState;

const SWEEP_PERIOD: Duration = Duration::from_millis(500);

fn conn_events(fd: i32) -> Events {
    Events::new_raw(fd, EventSet::IN | EventSet::OUT | EventSet::EDGE_TRIGGERED | EventSet::READ_HANG_UP)
}

impl Vsock {
    fn apply_fd_ops(&mut self, ops: &mut EventOps) {
        for op in self.muxer.take_fd_ops() {
            let res = match op {
                FdOp::Add(fd) => ops.add(conn_events(fd)),
                FdOp::Remove(fd) => ops.remove(conn_events(fd)),
            };
            if let Err(e) = res {
                tracing::warn!(?op, error = ?e, "vsock: epoll update failed");
            }
        }
        self.muxer.bury();
    }
}

impl MutEventSubscriber for Vsock {
    fn init(&mut self, ops: &mut EventOps) {
        for q in [RXQ, TXQ, EVQ] {
            if let Err(e) = ops.add(Events::with_data(self.queue_evt(q), q as u32, EventSet::IN)) {
                tracing::error!(queue = q, error = ?e, "vsock: cannot watch queue event");
            }
        }
        if let Err(e) = ops.add(Events::new_raw(self.muxer.listener_fd(), EventSet::IN)) {
            tracing::error!(error = ?e, "vsock: cannot watch the host socket");
        }
        match self.sweep_timer() {
            Ok(fd) => {
                if let Err(e) = ops.add(Events::new_raw(fd, EventSet::IN)) {
                    tracing::error!(error = ?e, "vsock: cannot watch the sweep timer");
                }
            }
            Err(e) => tracing::error!(error = %e, "vsock: no sweep timer; stuck handshakes will linger"),
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let fd = events.fd();
        let set = events.event_set();
        if fd == self.queue_evt(RXQ).as_raw_fd() {
            let _ = self.queue_evt(RXQ).read();
        } else if fd == self.queue_evt(TXQ).as_raw_fd() {
            let _ = self.queue_evt(TXQ).read();
            self.process_tx();
        } else if fd == self.queue_evt(EVQ).as_raw_fd() {
            let _ = self.queue_evt(EVQ).read();
            self.process_events();
        } else if fd == self.muxer.listener_fd() {
            self.muxer.accept();
        } else if Some(fd) == self.timer_fd() {
            self.drain_timer();
            self.muxer.sweep(Instant::now());
        } else {
            let hup = set.intersects(EventSet::HANG_UP | EventSet::READ_HANG_UP | EventSet::ERROR);
            self.muxer.on_fd_event(fd, set.contains(EventSet::IN) || hup, set.contains(EventSet::OUT));
        }
        // Whatever happened may have produced packets for the guest.
        if matches!(self.state, DeviceState::Active(_)) {
            self.process_rx();
        }
        self.apply_fd_ops(ops);
    }
}

impl Vsock {
    fn sweep_timer(&mut self) -> std::io::Result<i32> {
        let mut t = vmm_sys_util::timerfd::TimerFd::new()?;
        t.reset(SWEEP_PERIOD, Some(SWEEP_PERIOD))?;
        let fd = t.as_raw_fd();
        self.timer = Some(t);
        Ok(fd)
    }

    fn timer_fd(&self) -> Option<i32> {
        self.timer.as_ref().map(|t| t.as_raw_fd())
    }

    fn drain_timer(&mut self) {
        if let Some(t) = &mut self.timer {
            let _ = t.wait();
        }
    }
}
