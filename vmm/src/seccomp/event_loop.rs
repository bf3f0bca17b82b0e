//! The event loop (the main thread once the VM is built): device queues, the hybrid vsock's host
//! sockets, virtio-blk file I/O, the balloon's freed pages, termination signals, snapshots, and
//! the orderly exit of the process.

use kvm_bindings::{kvm_clock_data, kvm_irqchip, kvm_pit_state2, KVMIO};
use vmm_sys_util::{ioctl_ior_nr, ioctl_iowr_nr};

use super::{always, arg_in, when, Arg, Syscall};
use crate::devices::virtio::balloon::discard::PUNCH_HOLE_MODE;
use crate::snapshotter::{DIR_FLAGS, DIR_MODE, FILE_FLAGS, FILE_MODE};

ioctl_iowr_nr!(KVM_GET_IRQCHIP, KVMIO, 0x62, kvm_irqchip);
ioctl_ior_nr!(KVM_GET_CLOCK, KVMIO, 0x7c, kvm_clock_data);
ioctl_ior_nr!(KVM_GET_PIT2, KVMIO, 0x9f, kvm_pit_state2);

/// The only socket the event loop creates: a guest-initiated vsock connection's host end.
const NONBLOCKING_STREAM: i32 = libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;

pub(super) fn list() -> Vec<Syscall> {
    vec![
        // The loop itself, and vsock host connections joining and leaving it.
        always(libc::SYS_epoll_wait),
        always(libc::SYS_epoll_ctl),
        // Eventfds (queue notifies, exit, snapshot requests), the signalfd, the vsock sweep timer.
        always(libc::SYS_read),
        // Host side of the vsock: accept host connections, read and write them (std's socket I/O
        // is recvfrom and sendto; sendto only on connected streams, no address), connect to host
        // listeners for guest-initiated connections (a Unix stream socket created non-blocking,
        // so a listener that does not accept never stalls the loop: connect fails with EAGAIN
        // and is retried on the same socket), make each accepted stream non-blocking, half-close
        // a stream when the guest shuts down its sending side, and close it.
        always(libc::SYS_accept4),
        always(libc::SYS_recvfrom),
        when(libc::SYS_sendto, &[&[Arg::Eq(4, 0)]]),
        when(libc::SYS_socket, &[&[Arg::Eq(0, libc::AF_UNIX as u64), Arg::Eq(1, NONBLOCKING_STREAM as u64)]]),
        always(libc::SYS_connect),
        // FIONBIO: vsock streams. A snapshot (the API thread paused the vCPUs and posted it here,
        // so no device works meanwhile) reads the VM-wide irqchip, PIT and kvmclock.
        arg_in(libc::SYS_ioctl, 1, &[libc::FIONBIO, KVM_GET_IRQCHIP(), KVM_GET_PIT2(), KVM_GET_CLOCK()]),
        arg_in(libc::SYS_shutdown, 1, &[libc::SHUT_WR as u64]),
        always(libc::SYS_close),
        // virtio-net: frames are read from and written to the tap (read, and write in common);
        // the rate limiter re-arms its refill timer.
        always(libc::SYS_timerfd_settime),
        // virtio-blk: sector reads and writes (pread64, pwrite64), and flush (fdatasync); the
        // snapshot's memory file is written with pwrite64 too.
        always(libc::SYS_pread64),
        always(libc::SYS_pwrite64),
        always(libc::SYS_fdatasync),
        // virtio-balloon: pages the guest reported free are punched out of the guest memfd
        // (this mode only: it frees, it never allocates or changes the size). Pages of a private
        // mapping go with madvise(MADV_DONTNEED), which every thread has for its allocator.
        when(libc::SYS_fallocate, &[&[Arg::Eq(1, PUNCH_HOLE_MODE as u64)]]),
        // Snapshot files: the directory (created one level deep, owner-only, if missing) is
        // opened read-only; each file is created in it owner-only, never through a symlink
        // (exactly these flags and modes), sized (the memory file's sparse tail) and synced, the
        // old state file removed and both temporary files renamed into place, all relative to
        // the directory's fd; then the directory is synced.
        when(libc::SYS_mkdir, &[&[Arg::Eq(1, u64::from(DIR_MODE))]]),
        when(
            libc::SYS_openat,
            &[&[Arg::Eq(2, DIR_FLAGS as u64)], &[Arg::Eq(2, FILE_FLAGS as u64), Arg::Eq(3, u64::from(FILE_MODE))]],
        ),
        always(libc::SYS_ftruncate),
        always(libc::SYS_fsync),
        when(libc::SYS_unlinkat, &[&[Arg::Eq(2, 0)]]),
        always(libc::SYS_renameat),
        // At exit: remove the sockets the VM bound (API, vsock listener), then end the process.
        always(libc::SYS_unlink),
        always(libc::SYS_exit_group),
    ]
}
