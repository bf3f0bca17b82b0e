//! The process side of the jail: inherited fds, the network namespace, the mount and PID
//! namespaces, the fork, the waiter that stays behind, and the child's tie to it.

use std::os::fd::{AsFd, OwnedFd, RawFd};
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sched::{setns, unshare, CloneFlags};
use nix::sys::signal::{kill, SigSet, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{fork, pipe2, ForkResult, Pid};

use super::error::{sys, JailError};

/// Closes every fd above stderr but `keep`. Called before the jail opens anything, so all of them
/// are inherited (`keep` lists the few the VMM made itself before, such as the panic hook's
/// eventfd) and neither the waiter nor the VMM keeps one.
pub fn close_inherited_fds(keep: &[RawFd]) -> Result<(), JailError> {
    let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map_err(sys("list /proc/self/fd"))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|fd| *fd > 2 && !keep.contains(fd))
        .collect();
    // The listing's own fd is among them and already closed: EBADF is fine.
    for fd in fds {
        // SAFETY: nothing in this process owns these fds (they were inherited); closing them
        // before anything else opens a file cannot pull an fd from under a live owner.
        unsafe { libc::close(fd) };
    }
    Ok(())
}

pub fn join_netns(path: &Path) -> Result<(), JailError> {
    let ns = nix::fcntl::open(path, OFlag::O_RDONLY | OFlag::O_CLOEXEC, nix::sys::stat::Mode::empty())
        .map_err(sys(format!("open network namespace {}", path.display())))?;
    setns(&ns, CloneFlags::CLONE_NEWNET).map_err(sys(format!("join network namespace {}", path.display())))?;
    tracing::debug!(netns = %path.display(), "joined the pod network namespace");
    Ok(())
}

fn waiter_signals() -> SigSet {
    let mut set = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGCHLD] {
        set.add(s);
    }
    set
}

pub enum Forked {
    /// The waiter. `parent_end` must stay open while it lives: the child watches it.
    Parent {
        child: Pid,
        parent_end: OwnedFd,
    },
    Child(ParentWatch),
}

/// New mount and PID namespaces, then fork: the child is PID 1 of the new PID namespace.
pub fn unshare_and_fork() -> Result<Forked, JailError> {
    // Blocked before the fork so none is lost: the waiter takes them with sigtimedwait, the VMM
    // (which unblocks SIGCHLD) through its signalfd.
    waiter_signals().thread_block().map_err(sys("block SIGTERM/SIGINT/SIGCHLD"))?;
    unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWPID).map_err(sys("unshare mount and PID namespaces"))?;
    let (child_end, parent_end) = pipe2(OFlag::O_CLOEXEC).map_err(sys("pipe"))?;
    // SAFETY: the process is single-threaded (checked before), so the child may run any code.
    match unsafe { fork() }.map_err(sys("fork"))? {
        ForkResult::Parent { child } => {
            drop(child_end);
            Ok(Forked::Parent { child, parent_end })
        }
        ForkResult::Child => {
            drop(parent_end);
            let mut chld = SigSet::empty();
            chld.add(Signal::SIGCHLD);
            chld.thread_unblock().map_err(sys("unblock SIGCHLD"))?;
            Ok(Forked::Child(ParentWatch(child_end)))
        }
    }
}

/// The child's end of a pipe whose other end only the waiter holds: it hangs up when the waiter
/// dies.
pub struct ParentWatch(OwnedFd);

impl ParentWatch {
    /// SIGKILL this process when the waiter dies, and fail if it already has (then the signal
    /// would never come).
    pub fn arm(&self) -> Result<(), JailError> {
        nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(sys("set the parent-death signal"))?;
        let mut fds = [PollFd::new(self.0.as_fd(), PollFlags::POLLIN)];
        poll(&mut fds, PollTimeout::ZERO).map_err(sys("poll the waiter pipe"))?;
        if fds[0].revents().is_some_and(|r| r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR)) {
            return Err(JailError::ParentGone);
        }
        Ok(())
    }
}

/// The waiter: forwards SIGTERM/SIGINT to the VMM and returns its status as an exit code (its
/// code, or 128+signal). Bounded waits; it ends when the VMM does.
pub fn wait_for_vmm(child: Pid) -> Result<i32, JailError> {
    let set = waiter_signals();
    let timeout = libc::timespec { tv_sec: 1, tv_nsec: 0 };
    loop {
        match waitpid(child, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(_, code)) => {
                tracing::info!(vmm_pid = child.as_raw(), code, "jailed VMM exited");
                return Ok(code);
            }
            Ok(WaitStatus::Signaled(_, signal, _)) => {
                tracing::warn!(vmm_pid = child.as_raw(), ?signal, "jailed VMM killed by a signal");
                return Ok(128 + signal as i32);
            }
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => return Err(sys("wait for the jailed VMM")(e)),
        }
        // SAFETY: `set` is a valid sigset; a null siginfo pointer is allowed; timeout is valid.
        let signo = unsafe { libc::sigtimedwait(set.as_ref(), std::ptr::null_mut(), &timeout) };
        if let Ok(signal @ (Signal::SIGTERM | Signal::SIGINT)) = Signal::try_from(signo) {
            tracing::info!(vmm_pid = child.as_raw(), ?signal, "forwarding signal to the jailed VMM");
            if let Err(e) = kill(child, signal) {
                tracing::warn!(vmm_pid = child.as_raw(), error = %e, "cannot forward signal");
            }
        }
    }
}
