//! The API thread parses requests from outside the VM, so it gets the smallest list: its own
//! epoll loop over the listener and its clients, and what pause/resume/info/shutdown do. Work
//! that needs more is handed over through a futex and an eventfd write (both in `common`): a
//! snapshot to the event loop (after this thread paused the vCPUs), a `--prepare`d VMM's
//! restore to the main thread. A prepared VMM's API thread blocks in accept4 instead of epoll.

use super::{always, when, Arg, Syscall};

pub(super) fn list() -> Vec<Syscall> {
    let sol = Arg::Eq(1, libc::SOL_SOCKET as u64);
    vec![
        // The server's own loop over the listener and its clients.
        always(libc::SYS_epoll_wait),
        always(libc::SYS_epoll_ctl),
        // Clients: accept, bound their I/O in time, read requests and answer (std's socket I/O is
        // recvfrom and sendto; sendto only on the connected stream, no address), close.
        always(libc::SYS_accept4),
        when(
            libc::SYS_setsockopt,
            &[&[sol, Arg::Eq(2, libc::SO_RCVTIMEO as u64)], &[sol, Arg::Eq(2, libc::SO_SNDTIMEO as u64)]],
        ),
        always(libc::SYS_recvfrom),
        when(libc::SYS_sendto, &[&[Arg::Eq(4, 0)]]),
        always(libc::SYS_close),
        // Pause kicks each vCPU thread out of KVM_RUN: glibc's pthread_kill is getpid + tgkill
        // (and rt_sigprocmask, in the common list); it re-kicks every 2 ms until all are parked.
        always(libc::SYS_getpid),
        always(libc::SYS_tgkill),
        always(libc::SYS_clock_nanosleep),
    ]
}
