//! The VMM's panic hook (`crash.rs`), in a test process of its own since the hook is global: a
//! panic on any thread is recorded once (bounded, one line), wakes the waiters' eventfd and
//! becomes an exit reason with a non-zero status that wins over an orderly stop.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use bulkhead_vmm::crash;
use bulkhead_vmm::exit::{ExitReason, ExitSignal};

#[test]
fn a_panic_on_any_thread_is_recorded_once_and_wakes_the_waiters() {
    crash::install_hook().unwrap();
    assert!(crash::report().is_none());
    let long = "x".repeat(8 * 1024);
    let first = std::thread::Builder::new().name("vcpu7".into()).spawn(move || panic!("first {long}")).unwrap();
    assert!(first.join().is_err());
    let second = std::thread::Builder::new().name("api".into()).spawn(|| panic!("second")).unwrap();
    assert!(second.join().is_err());

    let report = crash::report().unwrap();
    assert!(report.starts_with("thread vcpu7 panicked at "), "{report}");
    assert!(report.contains("first xxx") && report.len() <= 1024 && !report.contains('\n'), "{report}");

    let mut fds = [libc::pollfd { fd: crash::wake_fd().unwrap(), events: libc::POLLIN, revents: 0 }];
    // SAFETY: one valid pollfd, a bounded wait.
    assert_eq!(unsafe { libc::poll(fds.as_mut_ptr(), 1, 10_000) }, 1, "the wake fd is readable");

    // The event loop stops the VM with it, over an orderly reason that came first.
    let exit = ExitSignal::new().unwrap();
    exit.signal(ExitReason::GuestReset);
    exit.signal(crash::reason().unwrap());
    let reason = exit.reason().unwrap();
    assert!(matches!(&reason, ExitReason::Panicked(r) if r.contains("vcpu7")), "{reason:?}");
    assert_eq!(reason.exit_code(), 1);
    exit.signal(ExitReason::ApiShutdown);
    assert!(matches!(exit.reason(), Some(ExitReason::Panicked(_))), "a later stop does not hide the panic");
}
