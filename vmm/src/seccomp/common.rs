//! What every thread of the VMM process needs, whatever its job: the allocator, locks, log lines
//! and the end of a thread.

use super::{always, when, Arg, Syscall};

pub(super) fn list() -> Vec<Syscall> {
    let no_exec = [Arg::NoBits(2, libc::PROT_EXEC as u64)];
    vec![
        // Mutexes, condvars and once-cells (std, tracing) park and wake through futexes.
        always(libc::SYS_futex),
        // The allocator: glibc's malloc grows the heap (brk), maps and trims arenas (mmap,
        // mprotect, munmap, madvise) and moves large blocks (mremap). Never executable memory.
        always(libc::SYS_brk),
        when(libc::SYS_mmap, &[&no_exec]),
        when(libc::SYS_mprotect, &[&no_exec]),
        always(libc::SYS_munmap),
        always(libc::SYS_madvise),
        always(libc::SYS_mremap),
        // Log lines to stderr; eventfd signals (interrupts, queue notifies, the exit signal).
        always(libc::SYS_write),
        // Log timestamps; the vDSO falls back to the syscall on some clock sources.
        always(libc::SYS_clock_gettime),
        // A thread's end: std drops its signal stack, glibc blocks signals and frees the stack.
        always(libc::SYS_sigaltstack),
        always(libc::SYS_rt_sigprocmask),
        always(libc::SYS_exit),
    ]
}

/// Debug builds only: std checks that an fd is still open (F_GETFD) before it closes it. Joins
/// the `fcntl` entry a list already has, if any (a syscall appears once per list).
pub(super) fn add_debug_fd_check(list: &mut Vec<Syscall>) {
    if !cfg!(debug_assertions) {
        return;
    }
    let check = vec![Arg::Eq(1, libc::F_GETFD as u64)];
    match list.iter_mut().find(|s| s.nr == libc::SYS_fcntl) {
        // Allowed with any arguments already.
        Some(fcntl) if fcntl.when.is_empty() => {}
        Some(fcntl) => fcntl.when.push(check),
        None => list.push(Syscall { nr: libc::SYS_fcntl, when: vec![check] }),
    }
}
