//! Namespace mode: the agent serves from a user namespace of its own, so the CAP_SYS_ADMIN that
//! libcontainer needs is not CAP_SYS_ADMIN over the host's kernel.
//!
//! Once the first run is in its minimal root (still host root, single-threaded), it clones a
//! child into new user, mount, PID, UTS and IPC namespaces ([`FLAGS`]) and writes the child's
//! id maps from outside ([`ID_MAP`]: every id but the last onto itself). The child mounts a
//! /proc of its PID namespace and executes the agent again; the first run only passes on the
//! signals that ask it to stop ([`FORWARDED`]: the shim's SIGTERM must reach the agent, which then
//! destroys the sandbox), waits for it and exits with its status ([`relay_exit`]).
//!
//! What that buys, with the map's ids still the host's own:
//! - the kernel grants capabilities over objects its user namespace owns: the pod's mount, PID,
//!   UTS, IPC (and the containers') namespaces. Anything checked against the host's namespace
//!   is refused: mounting a block device or a new cgroup hierarchy, mknod of a device node,
//!   loading modules or BPF, writing release_agent, host-wide sysctls;
//! - the minimal root was built outside and copied in, so its mounts are locked: the agent can
//!   neither unmount one to see below it nor clear its read-only, nosuid, nodev or noexec flag;
//! - files keep their owners, so the containers' rootfs and volumes need no id shifting, and a
//!   file's mode still decides (which is why the root holds so little, and the cgroup tree is
//!   read-only but for the pod's own subtree: `minimal_root`).
//!
//! The map leaves out id 4294967294 on purpose: libcontainer recognises a user namespace by a map
//! that stops short of 4294967295 ids, and only then binds the containers' device nodes instead
//! of making them (mknod is refused here), and tolerates the cgroup writes it cannot make.
//!
//! On cgroup v1 libcgroups also writes each container's `devices.allow` and `devices.deny`,
//! which the kernel allows only with CAP_SYS_ADMIN over the host's user namespace; the agent
//! stubs them out (`crate::cgroup_v1_devices`), which costs nothing here: no container can make
//! a device node, and every rootfs and volume is nodev (the shim's `namespace_mounts`).

use std::convert::Infallible;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};

use anyhow::Context;
use nix::sched::CloneFlags;
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::Pid;

/// The namespaces the serving agent gets: a user namespace that owns the rest.
pub const FLAGS: CloneFlags = CloneFlags::CLONE_NEWUSER
    .union(CloneFlags::CLONE_NEWNS)
    .union(CloneFlags::CLONE_NEWPID)
    .union(CloneFlags::CLONE_NEWUTS)
    .union(CloneFlags::CLONE_NEWIPC);

/// `uid_map` and `gid_map` of the agent's user namespace (module docs).
pub const ID_MAP: &str = "0 0 4294967294\n";

/// The child's stack: it only waits, mounts /proc and executes.
const STACK: usize = 256 * 1024;

/// What the first run passes on to the serving agent rather than die of.
const FORWARDED: [nix::sys::signal::Signal; 4] = {
    use nix::sys::signal::Signal::*;
    [SIGTERM, SIGINT, SIGHUP, SIGQUIT]
};
/// The serving agent's pid, once cloned; 0 before.
static SERVING: AtomicI32 = AtomicI32::new(0);
/// A forwarded signal that came before the clone: sent on once the pid is known.
static EARLY: AtomicI32 = AtomicI32::new(0);

extern "C" fn forward(signal: libc::c_int) {
    let pid = SERVING.load(Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill(2) is async-signal-safe; the pid is our unreaped child's.
        unsafe { libc::kill(pid, signal) };
    } else {
        EARLY.store(signal, Ordering::SeqCst);
    }
}

/// Installs [`forward`] for each of [`FORWARDED`].
fn forward_signals() -> anyhow::Result<()> {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet};
    let action = SigAction::new(SigHandler::Handler(forward), SaFlags::SA_RESTART, SigSet::empty());
    for signal in FORWARDED {
        // SAFETY: the handler only loads, stores and calls kill(2), all async-signal-safe.
        unsafe { sigaction(signal, &action) }.with_context(|| format!("handle {signal}"))?;
    }
    Ok(())
}

/// Clones the serving agent into its namespaces, maps its ids, and waits for it; never returns
/// unless the clone or the maps fail. `exec` runs in the child once its ids are mapped: it executes
/// the agent and returns only the error. `listener` is closed here once the child has its copy.
pub fn serve_from_child(exec: impl FnOnce() -> anyhow::Error, listener: Option<i32>) -> anyhow::Result<Infallible> {
    let (ready_r, ready_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).context("pipe")?;
    let mut exec = Some(exec);
    let ready_w_raw = ready_w.as_raw_fd();
    let child = move || -> isize {
        // The write end is the parent's: EOF on the read end says the maps are written (or the
        // parent is gone, and this namespace's PID 1 would be killed with it anyway).
        let _ = nix::unistd::close(ready_w_raw);
        let mut byte = [0u8; 1];
        if !matches!(nix::unistd::read(&ready_r, &mut byte), Ok(1)) {
            eprintln!("bulkhead-agent: the first run did not map this user namespace's ids");
            return 125;
        }
        // SAFETY: prctl with PR_SET_PDEATHSIG only sets a flag on this process.
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) };
        use nix::mount::MsFlags as F;
        if let Err(e) = nix::mount::mount(
            Some("proc"),
            "/proc",
            Some("proc"),
            F::MS_NOSUID | F::MS_NODEV | F::MS_NOEXEC,
            None::<&str>,
        ) {
            eprintln!("bulkhead-agent: mount /proc of the agent's PID namespace: {e}");
            return 125;
        }
        let Some(exec) = exec.take() else { return 125 };
        eprintln!("bulkhead-agent: {:#}", exec());
        127
    };
    // Before the clone, so no stop request finds the first run without its handler (the child's
    // copy of it is gone at its exec).
    forward_signals()?;
    let mut stack = vec![0u8; STACK];
    // SAFETY: single-threaded (the first run starts no thread); the child has a copy of this
    // address space and only makes syscalls before it executes.
    let pid =
        unsafe { nix::sched::clone(Box::new(child), &mut stack, FLAGS, Some(libc::SIGCHLD)) }.map_err(clone_refused)?;
    if let Some(fd) = listener {
        let _ = nix::unistd::close(fd);
    }
    let mapped = write_maps(pid);
    let ready = std::fs::File::from(ready_w);
    if let Err(e) = mapped {
        // The child sees EOF without the byte and exits; its status is not the error to report.
        drop(ready);
        let _ = waitpid(pid, None);
        return Err(e);
    }
    std::io::Write::write_all(&mut &ready, b"1").context("tell the agent its ids are mapped")?;
    drop(ready);
    SERVING.store(pid.as_raw(), Ordering::SeqCst);
    let early = EARLY.swap(0, Ordering::SeqCst);
    if early != 0 {
        // SAFETY: kill(2) on our unreaped child.
        unsafe { libc::kill(pid.as_raw(), early) };
    }
    tracing::info!(
        pid = pid.as_raw(),
        id_map = ID_MAP.trim_end(),
        "namespace mode: the agent serves from a user namespace of its own; this process waits for it"
    );
    std::process::exit(relay_exit(pid))
}

/// The clone's error, with what to check for the two ways a node refuses root a user namespace.
/// Root is not subject to the knobs for unprivileged user namespaces: what refuses it is the
/// count limit (ENOSPC: `user.max_user_namespaces`, 0 on some hardened images) or a seccomp
/// filter or security module around the runtime (EPERM).
fn clone_refused(e: nix::errno::Errno) -> anyhow::Error {
    let hint = match e {
        nix::errno::Errno::ENOSPC => "; the node allows no user namespace: raise sysctl user.max_user_namespaces",
        nix::errno::Errno::EPERM => "; a seccomp filter or security module around the runtime refuses it",
        _ => "",
    };
    anyhow::anyhow!("clone the agent into a user namespace of its own: {e}{hint}")
}

/// Enables every controller the hierarchy has in each cgroup from the root down to the pod's
/// (`pod`, absolute in the hierarchy), as libcgroups does for a container's ancestors, and best
/// effort as it does: from the user namespace the tree above the pod is read-only
/// (`minimal_root::ServesFrom`), and without them the containers' cgroups would have no memory or
/// pids files to write their limits to.
pub fn enable_controllers_down_to(root: &Path, pod: &Path) {
    let controllers = match std::fs::read_to_string(root.join("cgroup.controllers")) {
        Ok(list) => list.split_whitespace().map(|c| format!("+{c}")).collect::<Vec<_>>(),
        Err(e) => {
            tracing::warn!(error = %e, "the cgroup root's controllers: none enabled for the pod");
            return;
        }
    };
    let mut dir = root.to_path_buf();
    let mut dirs = vec![dir.clone()];
    for part in pod.components().filter(|c| matches!(c, std::path::Component::Normal(_))) {
        dir.push(part);
        dirs.push(dir.clone());
    }
    for dir in dirs {
        for controller in &controllers {
            if let Err(e) = std::fs::write(dir.join("cgroup.subtree_control"), controller) {
                tracing::debug!(dir = %dir.display(), controller, error = %e, "not enabled");
            }
        }
    }
}

/// Whether this process serves from such a user namespace: its uid map is [`ID_MAP`].
pub fn serving_in_one() -> anyhow::Result<bool> {
    let map = std::fs::read_to_string("/proc/self/uid_map").context("read /proc/self/uid_map")?;
    Ok(is_the_map(&map))
}

fn is_the_map(uid_map: &str) -> bool {
    let words = |s: &str| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    words(uid_map) == words(ID_MAP)
}

fn write_maps(pid: Pid) -> anyhow::Result<()> {
    for file in ["uid_map", "gid_map"] {
        let path = format!("/proc/{pid}/{file}");
        std::fs::write(&path, ID_MAP).with_context(|| format!("write {path}"))?;
    }
    Ok(())
}

/// Waits for `pid` and returns the exit code that says how it ended (128 + signal if killed).
fn relay_exit(pid: Pid) -> i32 {
    loop {
        match waitpid(pid, None) {
            Ok(WaitStatus::Exited(_, code)) => return code,
            Ok(WaitStatus::Signaled(_, sig, _)) => return 128 + sig as i32,
            Ok(_) | Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                eprintln!("bulkhead-agent: wait for the serving agent: {e}");
                return 125;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_map_is_the_hosts_ids_but_reads_as_a_user_namespace() {
        let fields: Vec<u64> = ID_MAP.split_whitespace().map(|f| f.parse().unwrap()).collect();
        assert_eq!(fields[..2], [0, 0], "ids keep their host values: no rootfs needs shifting");
        // libcontainer's test for "in a user namespace": the map does not span 4294967295 ids.
        assert!(!ID_MAP.contains("4294967295"));
        assert_eq!(fields[2], u64::from(u32::MAX) - 1);
        assert!(FLAGS.contains(CloneFlags::CLONE_NEWUSER | CloneFlags::CLONE_NEWPID));
        assert!(!FLAGS.contains(CloneFlags::CLONE_NEWNET), "the pod's network namespace stays the agent's");
        assert!(
            !FLAGS.contains(CloneFlags::CLONE_NEWCGROUP),
            "moving a container's init needs the pod's cgroup in view"
        );
        assert!(is_the_map("         0          0 4294967294\n"));
        assert!(!is_the_map("         0          0 4294967295\n"), "the host's own map");
        assert!(!is_the_map("0 100000 65536\n"));
    }

    #[test]
    fn a_refused_clone_says_what_to_check() {
        let text = |e| clone_refused(e).to_string();
        assert!(
            text(nix::errno::Errno::ENOSPC).contains("user.max_user_namespaces"),
            "{}",
            text(nix::errno::Errno::ENOSPC)
        );
        assert!(text(nix::errno::Errno::EPERM).contains("seccomp filter or security module"));
        let other = text(nix::errno::Errno::ENOMEM);
        assert!(other.contains("ENOMEM") && !other.contains("; "), "no hint for another error: {other}");
    }

    #[test]
    fn controllers_are_enabled_from_the_root_down_to_the_pod() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        std::fs::create_dir_all(root.path().join("kubepods/pod1")).unwrap();
        enable_controllers_down_to(root.path(), Path::new("/kubepods/pod1"));
        // A regular file keeps the last write: each directory was written, the last controller last.
        for dir in ["", "kubepods", "kubepods/pod1"] {
            let written = std::fs::read_to_string(root.path().join(dir).join("cgroup.subtree_control")).unwrap();
            assert_eq!(written, "+pids", "{dir}");
        }
        // A missing directory or list is skipped, not fatal.
        enable_controllers_down_to(root.path(), Path::new("/gone/pod2"));
        enable_controllers_down_to(&root.path().join("nowhere"), Path::new("/kubepods/pod1"));
    }
}
