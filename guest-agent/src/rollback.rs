//! Undo on drop for operations of several steps. Each step that changes the world registers how
//! to undo it; if the operation ends early (an error return, or its future dropped), dropping
//! the [`Rollback`] undoes what was registered, newest first. On success the operation calls
//! [`Rollback::disarm`] and everything stays.

use std::fmt::Display;

type Undo<'a> = Box<dyn FnOnce() -> Result<(), String> + Send + 'a>;

#[derive(Default)]
pub struct Rollback<'a> {
    /// What each step did (for the log) and how to undo it, oldest first.
    steps: Vec<(String, Undo<'a>)>,
}

impl<'a> Rollback<'a> {
    /// Registers the undo of a step that has just succeeded.
    pub fn push<E: Display>(&mut self, what: impl Into<String>, undo: impl FnOnce() -> Result<(), E> + Send + 'a) {
        self.steps.push((what.into(), Box::new(move || undo().map_err(|e| e.to_string()))));
    }

    /// The operation succeeded: keep everything it did.
    pub fn disarm(mut self) {
        self.steps.clear();
    }
}

impl Drop for Rollback<'_> {
    fn drop(&mut self) {
        let steps = std::mem::take(&mut self.steps);
        if steps.is_empty() {
            return;
        }
        let undo_all = move || {
            for (what, undo) in steps.into_iter().rev() {
                // One failed undo must not keep the others from running.
                if let Err(e) = undo() {
                    tracing::warn!(step = %what, error = %e, "undo failed");
                }
            }
        };
        // Undo steps block (unmount, rm -r, libcontainer's delete); on a multi-thread runtime
        // this worker's other tasks move to another thread meanwhile.
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(undo_all),
            _ => undo_all(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// Three steps whose undos record their name; the second undo fails.
    fn three_steps<'a>(log: &'a Mutex<Vec<&'static str>>) -> Rollback<'a> {
        let mut r = Rollback::default();
        for name in ["first", "second", "third"] {
            r.push(name, move || {
                log.lock().unwrap().push(name);
                if name == "second" {
                    Err("busy")
                } else {
                    Ok(())
                }
            });
        }
        r
    }

    #[test]
    fn drop_undoes_newest_first_and_past_a_failed_step() {
        let log = Mutex::new(Vec::new());
        drop(three_steps(&log));
        assert_eq!(*log.lock().unwrap(), ["third", "second", "first"]);
    }

    #[test]
    fn disarm_keeps_everything() {
        let log = Mutex::new(Vec::new());
        three_steps(&log).disarm();
        assert!(log.lock().unwrap().is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn drop_inside_a_multi_thread_runtime_undoes_in_place() {
        let log = Mutex::new(Vec::new());
        drop(three_steps(&log));
        assert_eq!(log.lock().unwrap().len(), 3);
    }

    #[tokio::test]
    async fn drop_inside_a_current_thread_runtime_undoes_in_place() {
        let log = Mutex::new(Vec::new());
        drop(three_steps(&log));
        assert_eq!(log.lock().unwrap().len(), 3);
    }
}
