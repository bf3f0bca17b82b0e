//! Timing a VMM's start, step by step, for the API's `info` (`boot.phases`, `restore.phases`)
//! and the benches that split a cold start: `main` marks arguments, filters, config and jail;
//! the builder marks host kernel work it only waits on (`host: true`: KVM ioctls, the boot images'
//! copy into guest memory) apart from its own work. One timer runs from
//! `main` to the moment the vCPU threads start, so the phases add up to that span.

use std::time::{Duration, Instant};

use bulkhead_vmm_api::api::Phase;

/// A running list of timed steps: each [`Phases::mark`] ends the step begun at the previous one.
#[derive(Debug, Clone)]
pub struct Phases {
    list: Vec<Phase>,
    last: Instant,
}

impl Phases {
    /// Starts the first step now.
    pub fn start() -> Self {
        Self { list: Vec::new(), last: Instant::now() }
    }

    /// Ends the current step, naming it; `host` when it was host kernel work (KVM ioctls).
    pub fn mark(&mut self, name: &str, host: bool) {
        let now = Instant::now();
        self.list.push(Phase { name: name.into(), us: (now - self.last).as_micros() as u64, host });
        self.last = now;
    }

    /// Ends the current step as two: `host_part` of it, spent in host kernel calls made along the
    /// way (named `host_name`), and the rest as the VMM's own work (named `name`).
    pub fn mark_split(&mut self, name: &str, host_name: &str, host_part: Duration) {
        let now = Instant::now();
        let all = (now - self.last).as_micros() as u64;
        let host = (host_part.as_micros() as u64).min(all);
        self.list.push(Phase { name: name.into(), us: all - host, host: false });
        self.list.push(Phase { name: host_name.into(), us: host, host: true });
        self.last = now;
    }

    /// Starts the next step now without recording the time since the last mark (a wait that is
    /// not part of the start, such as a prepared VMM's wait for `restore`).
    pub fn restart(&mut self) {
        self.last = Instant::now();
    }

    pub fn list(&self) -> &[Phase] {
        &self.list
    }

    pub fn into_list(self) -> Vec<Phase> {
        self.list
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_mark_ends_the_step_since_the_previous_one() {
        let mut p = Phases::start();
        std::thread::sleep(std::time::Duration::from_millis(2));
        p.mark("a", false);
        p.restart();
        p.mark("b", true);
        let list = p.into_list();
        assert_eq!(list.len(), 2);
        assert!(list[0].us >= 2000 && !list[0].host, "{list:?}");
        assert!(list[1].us < 2000 && list[1].host && list[1].name == "b", "{list:?}");
    }

    #[test]
    fn a_split_step_puts_its_host_part_apart_and_never_more_than_the_step() {
        let mut p = Phases::start();
        std::thread::sleep(std::time::Duration::from_millis(3));
        p.mark_split("load", "copy", Duration::from_millis(1));
        p.mark_split("again", "too long", Duration::from_secs(60));
        let list = p.into_list();
        assert_eq!(list.len(), 4, "{list:?}");
        assert!(!list[0].host && list[0].us >= 2000 && list[0].name == "load", "{list:?}");
        assert!(list[1].host && list[1].us == 1000 && list[1].name == "copy", "{list:?}");
        assert!(list[2].us == 0 && list[3].host && list[3].name == "too long", "{list:?}");
    }
}
