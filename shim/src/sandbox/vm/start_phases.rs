//! How long each phase of a pod VM's start took, logged once when the agent answers: what an
//! operator reads to see why a pod started slowly, and what the CRI warm-start bench reports.
//!
//! The line is `VM started start=<warm|cold> total_ms=<ms> phases=<name>=<ms>ms ...`, phases in
//! the order they ran: `template` (finding or building the template; next to nothing where the
//! config boots cold), `launch` (layout, network, virtiofsd and the VMM spawned), `restore` (the VMM
//! restoring until its API answers, then resumed; warm only), `restore_refused` (a template the
//! VMM would not take, before the cold boot), `agent` (until the agent answered Version).

use std::fmt;
use std::time::{Duration, Instant};

use tracing::info;

/// At most this many phases are recorded (a start has at most five).
const MAX_PHASES: usize = 8;

pub struct StartPhases {
    began: Instant,
    last: Instant,
    phases: Vec<(&'static str, Duration)>,
}

impl StartPhases {
    pub fn begin() -> Self {
        let now = Instant::now();
        Self { began: now, last: now, phases: Vec::new() }
    }

    /// Ends `phase` now: it ran since the previous mark (or the beginning).
    pub fn mark(&mut self, phase: &'static str) {
        let now = Instant::now();
        if self.phases.len() < MAX_PHASES {
            self.phases.push((phase, now - self.last));
        }
        self.last = now;
    }

    /// Whether the VM came from a template: the last restore was not refused.
    fn warm(&self) -> bool {
        self.phases.iter().rev().find(|(name, _)| name.starts_with("restore")).is_some_and(|(n, _)| *n == "restore")
    }

    pub fn log(&self) {
        let total_ms = ms(self.last - self.began);
        let start = if self.warm() { "warm" } else { "cold" };
        info!(start, total_ms, phases = %self, "VM started");
    }
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

impl fmt::Display for StartPhases {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (name, took)) in self.phases.iter().enumerate() {
            let sep = if i == 0 { "" } else { " " };
            write!(f, "{sep}{name}={:.3}ms", ms(*took))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_are_listed_in_order_with_their_times() {
        let mut p = StartPhases::begin();
        for name in ["template", "launch", "restore", "agent"] {
            p.mark(name);
        }
        let text = p.to_string();
        let names: Vec<&str> = text.split(' ').filter_map(|kv| kv.split('=').next()).collect();
        assert_eq!(names, ["template", "launch", "restore", "agent"]);
        assert!(text.split(' ').all(|kv| kv.ends_with("ms")), "{text}");
        assert!(p.warm());
    }

    #[test]
    fn a_refused_restore_then_a_boot_is_a_cold_start() {
        let mut p = StartPhases::begin();
        for name in ["template", "launch", "restore_refused", "launch", "agent"] {
            p.mark(name);
        }
        assert!(!p.warm());
        let mut cold = StartPhases::begin();
        cold.mark("launch");
        cold.mark("agent");
        assert!(!cold.warm());
    }

    #[test]
    fn a_runaway_caller_cannot_grow_the_list() {
        let mut p = StartPhases::begin();
        for _ in 0..100 {
            p.mark("launch");
        }
        assert_eq!(p.phases.len(), MAX_PHASES);
    }
}
