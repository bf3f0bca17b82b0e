//! Test-only (debug builds): `BULKHEAD_VMM_SECCOMP_PROBE=<kind>` makes that thread kind call a
//! syscall no list allows right after its filter went in, so tests can see the filter kill.

use super::ThreadKind;

const ENV: &str = "BULKHEAD_VMM_SECCOMP_PROBE";

pub(super) fn after_install(kind: ThreadKind) {
    if std::env::var(ENV).is_ok_and(|v| v == kind.name()) {
        tracing::warn!(thread = kind.name(), "seccomp probe: calling a forbidden syscall (getppid)");
        // SAFETY: getppid takes no arguments and changes nothing; the filter kills us first.
        unsafe { libc::syscall(libc::SYS_getppid) };
        tracing::error!(thread = kind.name(), "seccomp probe survived a forbidden syscall");
    }
}
