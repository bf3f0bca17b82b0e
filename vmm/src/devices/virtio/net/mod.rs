//! virtio-net in userspace on a host tap device (the Firecracker model).
//!
//! `device.rs` speaks virtio (features, MAC/MTU config space, the RX and TX queues),
//! `packet.rs` parses the vnet header and frame chains, `tap.rs` is the host end (an existing
//! tap opened with a vnet header), `rate_limiter.rs` holds the token buckets and
//! `event_handler.rs` turns fd readiness into device work. The device does no ARP, DHCP or
//! filtering: the host side (the shim's tc redirect) owns the network.

pub mod device;
pub mod event_handler;
pub mod packet;
pub mod persist;
pub mod rate_limiter;
pub mod tap;

pub use device::Net;

/// Lets the first few guest-triggered log lines of one kind through, then one in every
/// `EVERY`, so a hostile guest cannot flood the log.
#[derive(Debug, Default)]
pub(crate) struct LogThrottle {
    count: u64,
}

impl LogThrottle {
    const LOUD: u64 = 8;
    const EVERY: u64 = 1000;

    /// Counts one event; true when this one should be logged.
    pub(crate) fn tick(&mut self) -> bool {
        self.count = self.count.saturating_add(1);
        self.count <= Self::LOUD || self.count.is_multiple_of(Self::EVERY)
    }

    pub(crate) fn count(&self) -> u64 {
        self.count
    }
}

#[cfg(test)]
mod tests {
    use super::LogThrottle;

    #[test]
    fn throttle_logs_the_first_few_then_every_thousandth() {
        let mut t = LogThrottle::default();
        let logged = (0..5000).filter(|_| t.tick()).count();
        assert_eq!(logged, 8 + 5);
        assert_eq!(t.count(), 5000);
    }
}
