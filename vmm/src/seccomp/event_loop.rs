//! The event loop (the main thread once the VM is built): device queues, the hybrid vsock's host
//! sockets, virtio-blk file I/O, termination signals, and the orderly exit of the process.

use super::{always, arg_in, when, Arg, Syscall};

pub(super) fn list() -> Vec<Syscall> {
    vec![
        // The loop itself, and vsock host connections joining and leaving it.
        always(libc::SYS_epoll_wait),
        always(libc::SYS_epoll_ctl),
        // Eventfds (queue notifies, exit), the signalfd, the vsock sweep timer.
        always(libc::SYS_read),
        // Host side of the vsock: accept host connections, read and write them (std's socket I/O
        // is recvfrom and sendto; sendto only on connected streams, no address), connect to host
        // listeners for guest-initiated connections (Unix only), make each stream non-blocking,
        // half-close it when the guest shuts down its sending side, and close it.
        always(libc::SYS_accept4),
        always(libc::SYS_recvfrom),
        when(libc::SYS_sendto, &[&[Arg::Eq(4, 0)]]),
        arg_in(libc::SYS_socket, 0, &[libc::AF_UNIX as u64]),
        always(libc::SYS_connect),
        arg_in(libc::SYS_ioctl, 1, &[libc::FIONBIO]),
        arg_in(libc::SYS_shutdown, 1, &[libc::SHUT_WR as u64]),
        always(libc::SYS_close),
        // virtio-net: frames are read from and written to the tap (read, and write in common);
        // the rate limiter re-arms its refill timer.
        always(libc::SYS_timerfd_settime),
        // virtio-blk: sector reads and writes, and flush.
        always(libc::SYS_pread64),
        always(libc::SYS_pwrite64),
        always(libc::SYS_fdatasync),
        // At exit: remove the sockets the VM bound (API, vsock listener), then end the process.
        always(libc::SYS_unlink),
        always(libc::SYS_exit_group),
    ]
}
