//! What every thread of the VMM process needs, whatever its job: the allocator, locks, log lines
//! and the end of a thread.

use super::{always, arg_in, when, Arg, Syscall};

pub(super) fn list() -> Vec<Syscall> {
    let no_exec = [Arg::NoBits(2, libc::PROT_EXEC as u64)];
    let mut list = vec![
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
    ];
    list.extend(debug_fd_check());
    list
}

/// Debug builds only: std checks that an fd is still open (F_GETFD) before it closes it.
pub(super) fn debug_fd_check() -> Option<Syscall> {
    cfg!(debug_assertions).then(|| arg_in(libc::SYS_fcntl, 1, &[libc::F_GETFD as u64]))
}
