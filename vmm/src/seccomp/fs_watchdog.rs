//! A virtio-fs device's watchdog thread (`fsN-watchdog`): sleeps until an exchange's deadline
//! and, if the exchange still runs, shuts its socket down. Nothing else.

use super::{arg_in, Syscall};

pub(super) fn list() -> Vec<Syscall> {
    vec![
        // End a backend exchange that outlived its deadline (both directions; the socket is
        // unusable from then on).
        arg_in(libc::SYS_shutdown, 1, &[libc::SHUT_RDWR as u64]),
    ]
}
