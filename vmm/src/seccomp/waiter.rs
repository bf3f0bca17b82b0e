//! The jailed VMM's parent: a single-threaded root process that only waits for the VMM, relays
//! SIGTERM/SIGINT to it and exits with its status. It reads no input at all.

use super::{always, when, Arg, Syscall};

pub(super) fn list(child: libc::pid_t) -> Vec<Syscall> {
    let to_child = Arg::Eq(0, child as u64);
    let mut list = vec![
        // Wait (bounded) for SIGTERM/SIGINT/SIGCHLD, forward the first two (to the VMM only),
        // reap the VMM.
        always(libc::SYS_rt_sigtimedwait),
        when(
            libc::SYS_kill,
            &[&[to_child, Arg::Eq(1, libc::SIGTERM as u64)], &[to_child, Arg::Eq(1, libc::SIGINT as u64)]],
        ),
        always(libc::SYS_wait4),
        // Log lines (formatting allocates; timestamps may need the clock syscall).
        always(libc::SYS_write),
        always(libc::SYS_brk),
        when(libc::SYS_mmap, &[&[Arg::NoBits(2, libc::PROT_EXEC as u64)]]),
        always(libc::SYS_munmap),
        always(libc::SYS_clock_gettime),
        // Close the pipe end the VMM watched, drop std's signal stack (and unmap it, above),
        // and exit with the VMM's status.
        always(libc::SYS_close),
        always(libc::SYS_sigaltstack),
        always(libc::SYS_exit_group),
    ];
    super::common::add_debug_fd_check(&mut list);
    list
}
