//! A virtio-fs device's backend thread (`fsN-backend`): connects to the vhost-user backend
//! (virtiofsd) and runs every exchange with it (handshake, guest memory and vrings, vring stop),
//! handing over file descriptors with SCM_RIGHTS. It parses only the backend's replies, through
//! the `vhost` crate.

use super::{always, arg_in, when, Arg, Syscall};

pub(super) fn list() -> Vec<Syscall> {
    let stream = (libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK) as u64;
    vec![
        // The connection: a non-blocking Unix stream socket (so a full backlog cannot block),
        // connected to the backend's socket path, then made blocking for the exchanges.
        when(libc::SYS_socket, &[&[Arg::Eq(0, libc::AF_UNIX as u64), Arg::Eq(1, stream), Arg::Eq(2, 0)]]),
        always(libc::SYS_connect),
        arg_in(libc::SYS_ioctl, 1, &[libc::FIONBIO]),
        // vhost-user messages: sent with the memfd, kick and call eventfds attached
        // (vmm-sys-util passes MSG_NOSIGNAL), replies received without flags.
        when(libc::SYS_sendmsg, &[&[Arg::Eq(2, libc::MSG_NOSIGNAL as u64)]]),
        when(libc::SYS_recvmsg, &[&[Arg::Eq(2, 0)]]),
        // A second handle on the connection for the event loop's hang-up watch (std's
        // try_clone); in debug builds std also checks fds before closing them (F_GETFD).
        arg_in(libc::SYS_fcntl, 1, &[libc::F_DUPFD_CLOEXEC as u64]),
        // A failed attempt, a dropped connection, a file descriptor a backend sent unasked.
        always(libc::SYS_close),
        // Pause between connection attempts while the backend's socket is not there yet.
        always(libc::SYS_clock_nanosleep),
    ]
}
