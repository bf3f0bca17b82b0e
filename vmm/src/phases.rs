//! Timing a VMM's start, step by step, for the API's `info` (`boot.phases`, `restore.phases`)
//! and the benches that split a cold start: `main` marks arguments, filters, config and jail;
//! the builder marks its KVM ioctls (`kvm: true`) apart from its own work. One timer runs from
//! `main` to the moment the vCPU threads start, so the phases add up to that span.

use std::time::Instant;

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

    /// Ends the current step, naming it; `kvm` when it was host KVM ioctls.
    pub fn mark(&mut self, name: &str, kvm: bool) {
        let now = Instant::now();
        self.list.push(Phase { name: name.into(), us: (now - self.last).as_micros() as u64, kvm });
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
        assert!(list[0].us >= 2000 && !list[0].kvm, "{list:?}");
        assert!(list[1].us < 2000 && list[1].kvm && list[1].name == "b", "{list:?}");
    }
}
