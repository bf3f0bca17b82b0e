//! Seccomp for every VMM thread: one hand-reviewed allow-list per thread kind, compiled with
//! `seccompiler` and installed by each thread on itself before it handles guest or client input.
//! A syscall that is not on the list kills the whole process (SIGSYS), jailed or not.
//!
//! The lists live one module per kind (`vcpu`, `event_loop`, `api`, `fs_backend`, `fs_watchdog`,
//! `waiter`); `common` holds what every thread of the VMM process needs (allocator, locks,
//! logging, thread exit). Each entry says
//! why the thread makes the call; a new device adds its calls, one line each, to the list of the
//! thread that makes them. Filters also check arguments where that is cheap (ioctl numbers, socket
//! domains, no executable memory).
//!
//! Boundaries: this module builds and installs filters; which thread runs what is `vmm.rs`'s,
//! `api.rs`'s and the jail's business.

mod api;
mod common;
mod event_loop;
mod fs_backend;
mod fs_watchdog;
#[cfg(debug_assertions)]
mod probe;
mod vcpu;
mod waiter;

use std::collections::BTreeMap;
use std::fmt;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("building the {kind} seccomp filter: {source}")]
    Build { kind: ThreadKind, source: seccompiler::BackendError },
    #[error("the {kind} allow-list names syscall {nr} twice")]
    Duplicate { kind: ThreadKind, nr: i64 },
    #[error("installing the {kind} seccomp filter: {source}")]
    Install { kind: ThreadKind, source: seccompiler::Error },
}

/// The kinds of threads the VMM runs, each with its own allow-list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadKind {
    /// One per vCPU: KVM_RUN and the port/MMIO dispatch of guest exits.
    Vcpu,
    /// The main thread once the VM is built: device queues, host sockets, signals, exit.
    EventLoop,
    /// The API socket server, which parses requests from outside the VM.
    Api,
    /// One per virtio-fs device: every exchange with its vhost-user backend (virtiofsd).
    FsBackend,
    /// One per virtio-fs device: ends a backend exchange that outlives its deadline.
    FsWatchdog,
    /// The jailed VMM's parent, which only relays signals and the exit status.
    Waiter,
}

impl ThreadKind {
    /// The name logs and the test hook use.
    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::EventLoop => "event_loop",
            ThreadKind::Api => "api",
            ThreadKind::FsBackend => "fs_backend",
            ThreadKind::FsWatchdog => "fs_watchdog",
            ThreadKind::Waiter => "waiter",
        }
    }
}

impl fmt::Display for ThreadKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An argument check: `Eq(index, value)`, or `NoBits(index, mask)` (none of `mask` set). Both
/// compare all 64 bits: stricter than the kernel, which reads only the low half of `int` arguments.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg {
    Eq(u8, u64),
    NoBits(u8, u64),
}

/// One allow-list entry: a syscall, allowed outright or when any one group of argument checks
/// holds (all checks of a group must).
#[derive(Clone)]
pub(crate) struct Syscall {
    nr: i64,
    when: Vec<Vec<Arg>>,
}

/// The syscall with any arguments.
pub(crate) fn always(nr: i64) -> Syscall {
    Syscall { nr, when: Vec::new() }
}

/// The syscall when one of `groups` matches its arguments.
pub(crate) fn when(nr: i64, groups: &[&[Arg]]) -> Syscall {
    Syscall { nr, when: groups.iter().map(|g| g.to_vec()).collect() }
}

/// The syscall when argument `index` is one of `values` (ioctl numbers, socket options...).
pub(crate) fn arg_in(nr: i64, index: u8, values: &[u64]) -> Syscall {
    Syscall { nr, when: values.iter().map(|v| vec![Arg::Eq(index, *v)]).collect() }
}

fn condition(arg: Arg) -> Result<SeccompCondition, seccompiler::BackendError> {
    match arg {
        Arg::Eq(i, v) => SeccompCondition::new(i, SeccompCmpArgLen::Qword, SeccompCmpOp::Eq, v),
        Arg::NoBits(i, mask) => SeccompCondition::new(i, SeccompCmpArgLen::Qword, SeccompCmpOp::MaskedEq(mask), 0),
    }
}

fn compile(kind: ThreadKind, list: Vec<Syscall>) -> Result<BpfProgram, SeccompError> {
    let build = |source| SeccompError::Build { kind, source };
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for sc in list {
        let mut chain = Vec::new();
        for group in sc.when {
            let conds = group.into_iter().map(condition).collect::<Result<Vec<_>, _>>().map_err(build)?;
            chain.push(SeccompRule::new(conds).map_err(build)?);
        }
        if rules.insert(sc.nr, chain).is_some() {
            return Err(SeccompError::Duplicate { kind, nr: sc.nr });
        }
    }
    let filter = SeccompFilter::new(rules, SeccompAction::KillProcess, SeccompAction::Allow, TargetArch::x86_64)
        .map_err(build)?;
    BpfProgram::try_from(filter).map_err(build)
}

/// What every VMM thread needs, then the kind's own calls.
fn with_common(own: Vec<Syscall>) -> Vec<Syscall> {
    let mut list = [common::list(), own].concat();
    common::add_debug_fd_check(&mut list);
    list
}

fn vcpu_list() -> Vec<Syscall> {
    with_common(vcpu::list())
}

fn event_loop_list() -> Vec<Syscall> {
    with_common(event_loop::list())
}

fn api_list() -> Vec<Syscall> {
    with_common(api::list())
}

fn fs_backend_list() -> Vec<Syscall> {
    with_common(fs_backend::list())
}

fn fs_watchdog_list() -> Vec<Syscall> {
    with_common(fs_watchdog::list())
}

/// The VMM threads' compiled filters, built once before any thread starts.
pub struct Filters {
    vcpu: BpfProgram,
    event_loop: BpfProgram,
    api: BpfProgram,
    fs_backend: BpfProgram,
    fs_watchdog: BpfProgram,
}

impl Filters {
    pub fn compile() -> Result<Self, SeccompError> {
        Ok(Self {
            vcpu: compile(ThreadKind::Vcpu, vcpu_list())?,
            event_loop: compile(ThreadKind::EventLoop, event_loop_list())?,
            api: compile(ThreadKind::Api, api_list())?,
            fs_backend: compile(ThreadKind::FsBackend, fs_backend_list())?,
            fs_watchdog: compile(ThreadKind::FsWatchdog, fs_watchdog_list())?,
        })
    }

    pub fn vcpu(&self) -> &BpfProgram {
        &self.vcpu
    }

    pub fn event_loop(&self) -> &BpfProgram {
        &self.event_loop
    }

    pub fn api(&self) -> &BpfProgram {
        &self.api
    }

    pub fn fs_backend(&self) -> &BpfProgram {
        &self.fs_backend
    }

    pub fn fs_watchdog(&self) -> &BpfProgram {
        &self.fs_watchdog
    }
}

/// The waiter's filter: a separate, single-threaded process sharing nothing with the VMM's
/// threads, which may signal only `child`.
pub fn waiter_filter(child: libc::pid_t) -> Result<BpfProgram, SeccompError> {
    compile(ThreadKind::Waiter, waiter::list(child))
}

/// Installs `program` (the filter of `kind`) on the calling thread, for good.
pub fn install(kind: ThreadKind, program: &BpfProgram) -> Result<(), SeccompError> {
    seccompiler::apply_filter(program).map_err(|source| SeccompError::Install { kind, source })?;
    tracing::debug!(thread = kind.name(), instructions = program.len(), "seccomp filter installed");
    #[cfg(debug_assertions)]
    probe::after_install(kind);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lists() -> Vec<(ThreadKind, Vec<Syscall>)> {
        vec![
            (ThreadKind::Vcpu, vcpu_list()),
            (ThreadKind::EventLoop, event_loop_list()),
            (ThreadKind::Api, api_list()),
            (ThreadKind::FsBackend, fs_backend_list()),
            (ThreadKind::FsWatchdog, fs_watchdog_list()),
            (ThreadKind::Waiter, waiter::list(4242)),
        ]
    }

    #[test]
    fn every_list_compiles_without_duplicates() {
        let filters = Filters::compile().unwrap();
        let waiter = waiter_filter(4242).unwrap();
        for program in
            [filters.vcpu(), filters.event_loop(), filters.api(), filters.fs_backend(), filters.fs_watchdog(), &waiter]
        {
            assert!(!program.is_empty());
        }
    }

    #[test]
    fn the_api_thread_reaches_no_file_device_or_new_socket() {
        let sizes: Vec<(ThreadKind, usize)> = lists().into_iter().map(|(k, l)| (k, l.len())).collect();
        println!("allow-list sizes: {sizes:?}");
        assert!(api_list().len() < event_loop_list().len());
        let api: Vec<i64> = api_list().iter().map(|s| s.nr).collect();
        for nr in [
            libc::SYS_ioctl,
            libc::SYS_socket,
            libc::SYS_connect,
            libc::SYS_read,
            libc::SYS_pread64,
            libc::SYS_pwrite64,
            libc::SYS_unlink,
            libc::SYS_exit_group,
            libc::SYS_kill,
            // A snapshot's files are the event loop's.
            libc::SYS_openat,
            libc::SYS_mkdir,
            libc::SYS_renameat,
            libc::SYS_unlinkat,
            libc::SYS_fsync,
            libc::SYS_ftruncate,
        ] {
            assert!(!api.contains(&nr), "the API list allows syscall {nr}");
        }
    }

    #[test]
    fn the_backend_exchange_stays_off_the_vcpu_and_event_loop_lists() {
        let vcpu: Vec<i64> = vcpu_list().iter().map(|s| s.nr).collect();
        let event_loop: Vec<i64> = event_loop_list().iter().map(|s| s.nr).collect();
        for nr in [libc::SYS_socket, libc::SYS_connect, libc::SYS_sendmsg, libc::SYS_recvmsg, libc::SYS_clock_nanosleep]
        {
            assert!(!vcpu.contains(&nr), "the vCPU list allows syscall {nr}");
        }
        for nr in [libc::SYS_sendmsg, libc::SYS_recvmsg] {
            assert!(!event_loop.contains(&nr), "the event-loop list allows syscall {nr}");
        }
        // The watchdog adds one call to what every thread has.
        assert_eq!(fs_watchdog_list().len(), with_common(vec![]).len() + 1);
        let backend: Vec<i64> = fs_backend_list().iter().map(|s| s.nr).collect();
        for nr in [libc::SYS_read, libc::SYS_accept4, libc::SYS_epoll_wait, libc::SYS_exit_group, libc::SYS_unlink] {
            assert!(!backend.contains(&nr), "the fs backend list allows syscall {nr}");
        }
    }

    #[test]
    fn the_debug_fd_check_joins_an_existing_fcntl_entry() {
        let list = fs_backend_list();
        let fcntl: Vec<&Syscall> = list.iter().filter(|s| s.nr == libc::SYS_fcntl).collect();
        assert_eq!(fcntl.len(), 1);
        let groups = if cfg!(debug_assertions) { 2 } else { 1 };
        assert_eq!(fcntl[0].when.len(), groups, "F_DUPFD_CLOEXEC, and F_GETFD in debug builds");
    }

    #[test]
    fn no_list_allows_what_a_vmm_never_needs() {
        for (kind, list) in lists() {
            let nrs: Vec<i64> = list.iter().map(|s| s.nr).collect();
            for forbidden in [
                libc::SYS_execve,
                libc::SYS_execveat,
                libc::SYS_ptrace,
                libc::SYS_mount,
                libc::SYS_open,
                libc::SYS_openat2,
                libc::SYS_creat,
                libc::SYS_clone,
                libc::SYS_clone3,
                libc::SYS_fork,
                libc::SYS_setuid,
                libc::SYS_getppid,
            ] {
                assert!(!nrs.contains(&forbidden), "{kind} allows syscall {forbidden}");
            }
        }
    }

    #[test]
    fn only_the_event_loop_opens_files_and_only_with_the_snapshots_flags() {
        for (kind, list) in lists() {
            let openat: Vec<&Syscall> = list.iter().filter(|s| s.nr == libc::SYS_openat).collect();
            if kind != ThreadKind::EventLoop {
                assert!(openat.is_empty(), "{kind} may open files");
                continue;
            }
            assert_eq!(openat.len(), 1);
            assert_eq!(openat[0].when.len(), 2, "the directory's flags, or the files' flags and mode");
        }
        // The snapshot's state reads are a vCPU's; the VM-wide ones the event loop's.
        let vcpu = vcpu_list();
        let ioctl = vcpu.iter().find(|s| s.nr == libc::SYS_ioctl).unwrap();
        assert_eq!(ioctl.when.len(), 2 + vcpu::snapshot_ioctls().len());
    }

    #[test]
    fn the_event_loop_opens_a_snapshots_files_with_exactly_their_flags() {
        let filters = Filters::compile().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = std::ffi::CString::new(dir.path().join("f").into_os_string().into_encoded_bytes()).unwrap();
        let dir_path = std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes()).unwrap();
        let open = |path: &std::ffi::CString, flags: i32, mode: u32| {
            let (p, f, m) = (path.as_ptr(), libc::c_long::from(flags), libc::c_long::from(mode));
            move || {
                // SAFETY: openat(2) on a valid NUL-terminated path; the fd is left to the child's exit.
                unsafe { libc::syscall(libc::SYS_openat, libc::c_long::from(libc::AT_FDCWD), p, f, m) };
            }
        };
        let cases = [
            (open(&path, crate::snapshotter::FILE_FLAGS, 0o600), false),
            (open(&dir_path, crate::snapshotter::DIR_FLAGS, 0), false),
            (open(&path, crate::snapshotter::FILE_FLAGS, 0o644), true),
            (open(&path, libc::O_RDWR | libc::O_CLOEXEC, 0), true),
            (open(&path, crate::snapshotter::FILE_FLAGS & !libc::O_NOFOLLOW, 0o600), true),
        ];
        for (i, (call, killed)) in cases.into_iter().enumerate() {
            let status = status_of_filtered_child(filters.event_loop(), call, libc::SYS_exit_group);
            if killed {
                assert!(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSYS, "case {i}: {status:#x}");
            } else {
                assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "case {i}: {status:#x}");
            }
        }
    }

    /// Forks a child that installs `program`, runs `call` and ends with the syscall `exit_nr`
    /// (one the filter allows); returns its wait status.
    fn status_of_filtered_child(program: &BpfProgram, call: impl FnOnce(), exit_nr: libc::c_long) -> i32 {
        // SAFETY: the child only makes raw syscalls and exits; it touches no lock or allocator.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            if seccompiler::apply_filter(program).is_err() {
                // SAFETY: plain exit of the forked child.
                unsafe { libc::_exit(2) };
            }
            call();
            // SAFETY: the forked child's only thread ends, and with it the child.
            unsafe { libc::syscall(exit_nr, 0 as libc::c_long) };
        }
        let mut status = 0;
        // SAFETY: pid is our child; status is a valid out pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        status
    }

    #[test]
    fn the_fs_backend_may_open_unix_sockets_only() {
        let filters = Filters::compile().unwrap();
        let stream = libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK;
        for (domain, killed) in [(libc::AF_UNIX, false), (libc::AF_INET, true), (libc::AF_NETLINK, true)] {
            let status = status_of_filtered_child(
                filters.fs_backend(),
                || {
                    // As libc's wrapper does: every argument a full 64-bit register.
                    let (domain, kind) = (libc::c_long::from(domain), libc::c_long::from(stream));
                    // SAFETY: socket(2) with plain integer arguments.
                    unsafe { libc::syscall(libc::SYS_socket, domain, kind, 0 as libc::c_long) };
                },
                libc::SYS_exit,
            );
            if killed {
                assert!(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSYS, "{domain}: {status:#x}");
            } else {
                assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "{domain}: {status:#x}");
            }
        }
    }

    #[test]
    fn the_event_loop_may_only_punch_holes_and_no_other_thread_may_fallocate() {
        for (kind, list) in lists() {
            let fallocate: Vec<&Syscall> = list.iter().filter(|s| s.nr == libc::SYS_fallocate).collect();
            if kind != ThreadKind::EventLoop {
                assert!(fallocate.is_empty(), "{kind} may fallocate");
            } else {
                assert_eq!(fallocate.len(), 1);
                assert_eq!(fallocate[0].when.len(), 1, "one mode");
            }
        }
        let filters = Filters::compile().unwrap();
        let memfd = tempfile::tempfile().unwrap();
        memfd.set_len(1 << 20).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&memfd);
        let punch = crate::devices::virtio::balloon::discard::PUNCH_HOLE_MODE;
        for (mode, killed) in
            [(punch, false), (0, true), (libc::FALLOC_FL_KEEP_SIZE, true), (libc::FALLOC_FL_PUNCH_HOLE, true)]
        {
            let status = status_of_filtered_child(
                filters.event_loop(),
                || {
                    let (fd, mode) = (libc::c_long::from(fd), libc::c_long::from(mode));
                    // SAFETY: fallocate(2) on a temporary file this test owns.
                    unsafe { libc::syscall(libc::SYS_fallocate, fd, mode, 0 as libc::c_long, 4096 as libc::c_long) };
                },
                libc::SYS_exit_group,
            );
            if killed {
                assert!(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSYS, "{mode:#x}: {status:#x}");
            } else {
                assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "{mode:#x}: {status:#x}");
            }
        }
    }

    #[test]
    fn the_event_loop_creates_only_non_blocking_unix_streams() {
        let filters = Filters::compile().unwrap();
        let non_blocking = libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
        for (domain, kind, killed) in [
            (libc::AF_UNIX, non_blocking, false),
            (libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, true),
            (libc::AF_INET, non_blocking, true),
        ] {
            let status = status_of_filtered_child(
                filters.event_loop(),
                || {
                    let (domain, kind) = (libc::c_long::from(domain), libc::c_long::from(kind));
                    // SAFETY: socket(2) with plain integer arguments.
                    unsafe { libc::syscall(libc::SYS_socket, domain, kind, 0 as libc::c_long) };
                },
                libc::SYS_exit_group,
            );
            if killed {
                assert!(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSYS, "{kind:#x}: {status:#x}");
            } else {
                assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "{kind:#x}: {status:#x}");
            }
        }
    }

    #[test]
    fn a_filtered_child_dies_of_sigsys_on_a_forbidden_syscall_and_lives_on_allowed_ones() {
        // SAFETY: getpid has no preconditions.
        let program = waiter_filter(unsafe { libc::getpid() }).unwrap();
        let status = status_of_filtered_child(&program, || {}, libc::SYS_exit_group);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "{status:#x}");
        let status = status_of_filtered_child(
            &program,
            || {
                // SAFETY: no arguments, no side effects.
                unsafe { libc::syscall(libc::SYS_getppid) };
            },
            libc::SYS_exit_group,
        );
        assert!(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSYS, "{status:#x}");
    }
}
