//! `hostUsers: false`, in a VM and in namespace mode alike: the pod's user namespace, and the IPC
//! and UTS namespaces it owns, made once at SetupSandbox and joined by every container of the pod.
//!
//! libcontainer makes a user namespace itself only under systemd's cgroup manager (0.7 forces it
//! for a new one), which the agent does not run; it joins one by path under any manager. So the
//! agent clones a child into a new user namespace, writes its maps from outside (the agent holds
//! CAP_SETUID and CAP_SETGID in the child's parent: the guest's, or its own in namespace mode), lets the child make
//! the pod's IPC and UTS namespaces from inside (so the pod's user namespace owns them, as the
//! pause container's would: a container then may mount its `/dev/mqueue`), and keeps a
//! descriptor of each namespace. The child then exits: the descriptors keep the namespaces.
//!
//! How a container gets them ([`PodUserns::join`], [`PodUserns::inherited`]):
//! - the user namespace by path in its spec, `/proc/<agent>/fd/<n>`, which libcontainer opens
//!   before it leaves the agent's user namespace (the kernel lets a process of the agent's
//!   credentials open another's descriptors);
//! - the IPC and UTS namespaces by inheritance: the libcontainer helper enters them between its
//!   fork and exec, and the spec names neither. By path, libcontainer would open them after
//!   joining the pod's user namespace, as an unprivileged id to which the agent's descriptors
//!   are closed.
//!
//! An exec's helper enters the IPC and UTS namespaces the same way; libcontainer 0.7 joins an exec
//! to its container's other namespaces but never to its user namespace, so the exec's process
//! enters that last, itself (`runtime::helper`).
//!
//! The pod's PID namespace stays the agent's: a container sharing it (`shareProcessNamespace`)
//! could not mount its /proc from the pod's user namespace, so that is refused by name.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;

use nix::sched::CloneFlags;
use oci_spec::runtime::{LinuxIdMapping, LinuxIdMappingBuilder, LinuxNamespace, LinuxNamespaceType, Spec};

use crate::error::{AgentError, Result};
use crate::reaper::Reaper;

/// Mapping lines the agent accepts per map (the kernel takes 340; containerd sends one).
const MAX_LINES: usize = 5;
/// The child's stack: it only reads, unshares, sets the hostname and writes.
const STACK: usize = 64 * 1024;

/// One line of a uid or gid map: `size` ids from `container_id` inside onto `host_id` outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdMap {
    pub container_id: u32,
    pub host_id: u32,
    pub size: u32,
}

/// Checks one map: 1 to [`MAX_LINES`] lines, none empty or wrapping past the last id, and none
/// onto the host's root: a `hostUsers: false` pod must be unprivileged outside.
pub fn validate(what: &str, map: &[IdMap]) -> Result<()> {
    let bad = |why: String| Err(AgentError::InvalidArgument(format!("pod user namespace {what} map: {why}")));
    if map.is_empty() || map.len() > MAX_LINES {
        return bad(format!("{} lines; 1 to {MAX_LINES} are accepted", map.len()));
    }
    for m in map {
        let fits = |start: u32| start.checked_add(m.size - 1).is_some();
        if m.size == 0 || !fits(m.container_id) || !fits(m.host_id) {
            return bad(format!("{} {} {} is empty or runs past the last id", m.container_id, m.host_id, m.size));
        }
        if m.host_id == 0 {
            return bad(format!(
                "{} {} {} maps onto the host's root, which a pod with hostUsers: false must never be",
                m.container_id, m.host_id, m.size
            ));
        }
    }
    Ok(())
}

/// A map as `/proc/<pid>/uid_map` takes it.
fn map_text(map: &[IdMap]) -> String {
    map.iter().map(|m| format!("{} {} {}\n", m.container_id, m.host_id, m.size)).collect()
}

fn oci_map(map: &[IdMap]) -> Vec<LinuxIdMapping> {
    map.iter()
        .filter_map(|m| {
            LinuxIdMappingBuilder::default().container_id(m.container_id).host_id(m.host_id).size(m.size).build().ok()
        })
        .collect()
}

/// The pod's namespaces (module docs), held open for as long as the agent runs.
#[derive(Debug)]
pub struct PodUserns {
    user: OwnedFd,
    ipc: OwnedFd,
    uts: OwnedFd,
    uid: Vec<IdMap>,
    gid: Vec<IdMap>,
}

impl PodUserns {
    /// Makes the pod's user namespace with `uid` and `gid` (validated first), and IPC and UTS
    /// namespaces it owns, the latter with `hostname` (if any).
    pub fn create(uid: &[IdMap], gid: &[IdMap], hostname: &str, reaper: &Reaper) -> Result<Self> {
        validate("uid", uid)?;
        validate("gid", gid)?;
        let internal =
            |what: &str, e: &dyn std::fmt::Display| AgentError::Internal(format!("pod user namespace: {what}: {e}"));
        let (go_r, go_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| internal("pipe", &e))?;
        let (done_r, done_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| internal("pipe", &e))?;
        let hostname = hostname.to_owned();
        let (go_w_raw, done_r_raw) = (go_w.as_raw_fd(), done_r.as_raw_fd());
        // Only syscalls in the child: the agent has threads, and the child a copy of one of them.
        let child = move || -> isize {
            let _ = nix::unistd::close(go_w_raw);
            let _ = nix::unistd::close(done_r_raw);
            let mut byte = [0u8; 1];
            // EOF without the byte: the maps were not written, and the parent gives up.
            if !matches!(nix::unistd::read(&go_r, &mut byte), Ok(1)) {
                return 1;
            }
            if nix::sched::unshare(CloneFlags::CLONE_NEWIPC | CloneFlags::CLONE_NEWUTS).is_err() {
                return 2;
            }
            if !hostname.is_empty() && nix::unistd::sethostname(&hostname).is_err() {
                return 3;
            }
            if nix::unistd::write(&done_w, b"1") != Ok(1) {
                return 4;
            }
            // Until the parent has opened the namespaces and closed its end.
            let _ = nix::unistd::read(&go_r, &mut byte);
            0
        };
        let mut stack = vec![0u8; STACK];
        // SAFETY: the child runs only the syscalls above on its own stack and returns.
        let pid =
            unsafe { nix::sched::clone(Box::new(child), &mut stack, CloneFlags::CLONE_NEWUSER, Some(libc::SIGCHLD)) }
                .map_err(|e| {
                AgentError::FailedPrecondition(format!(
                    "pod user namespace: clone: {e}{}",
                    if e == nix::errno::Errno::ENOSPC {
                        " (the node's user.max_user_namespaces is reached)"
                    } else {
                        ""
                    }
                ))
            })?;
        // The reaper collects the child's exit; nobody needs its status.
        drop(reaper.watch(pid.as_raw()));
        let made = (|| {
            for (file, map) in [("uid_map", uid), ("gid_map", gid)] {
                std::fs::write(format!("/proc/{pid}/{file}"), map_text(map))
                    .map_err(|e| internal(&format!("write {file} {:?}", map_text(map).trim_end()), &e))?;
            }
            let go = std::fs::File::from(go_w.try_clone().map_err(|e| internal("pipe", &e))?);
            std::io::Write::write_all(&mut &go, b"1").map_err(|e| internal("start the child", &e))?;
            let mut byte = [0u8; 1];
            if !matches!(nix::unistd::read(&done_r, &mut byte), Ok(1)) {
                return Err(internal("the child", &"it could not make the pod's IPC and UTS namespaces"));
            }
            let open = |ns: &str| {
                std::fs::File::open(format!("/proc/{pid}/ns/{ns}"))
                    .map(OwnedFd::from)
                    .map_err(|e| internal(&format!("open its {ns} namespace"), &e))
            };
            Ok(Self { user: open("user")?, ipc: open("ipc")?, uts: open("uts")?, uid: uid.to_vec(), gid: gid.to_vec() })
        })();
        // EOF on its pipe ends the child, whatever happened.
        drop(go_w);
        made
    }

    /// Whether these are the maps the namespace was made with.
    pub fn has_maps(&self, uid: &[IdMap], gid: &[IdMap]) -> bool {
        self.uid == uid && self.gid == gid
    }

    /// The namespaces a container's libcontainer helper enters before it executes (module docs):
    /// valid while `self` lives.
    pub fn inherited(&self) -> Vec<RawFd> {
        vec![self.ipc.as_raw_fd(), self.uts.as_raw_fd()]
    }

    /// Puts a container of the pod into the pod's user namespace, whatever its spec said of it
    /// (containerd names the pause container's, which this backend has not), with the pod's maps,
    /// and takes its IPC and UTS namespaces out of the spec: it inherits the pod's (module docs).
    /// A container that shares the agent's PID namespace is refused (module docs).
    pub fn join(&self, spec: &mut Spec, id: &str) -> Result<()> {
        let mut linux = spec.linux().clone().unwrap_or_default();
        let mut namespaces = linux.namespaces().clone().unwrap_or_default();
        if !namespaces.iter().any(|n| n.typ() == LinuxNamespaceType::Pid) {
            return Err(AgentError::Unsupported(format!(
                "container {id} shares the pod's PID namespace (shareProcessNamespace) in a hostUsers: false pod, \
                 which the namespace backend does not support: its /proc could not be mounted from the pod's user \
                 namespace"
            )));
        }
        let pods = [LinuxNamespaceType::User, LinuxNamespaceType::Ipc, LinuxNamespaceType::Uts];
        namespaces.retain(|n| !pods.contains(&n.typ()));
        let mut user = LinuxNamespace::default();
        user.set_typ(LinuxNamespaceType::User);
        user.set_path(Some(PathBuf::from(format!("/proc/{}/fd/{}", std::process::id(), self.user.as_raw_fd()))));
        namespaces.push(user);
        linux.set_namespaces(Some(namespaces));
        linux.set_uid_mappings(Some(oci_map(&self.uid)));
        linux.set_gid_mappings(Some(oci_map(&self.gid)));
        spec.set_linux(Some(linux));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(container_id: u32, host_id: u32, size: u32) -> IdMap {
        IdMap { container_id, host_id, size }
    }

    #[test]
    fn maps_are_checked_before_anything_is_made() {
        assert!(validate("uid", &[m(0, 65536, 65536)]).is_ok());
        assert!(validate("uid", &[m(0, 65536, 1), m(1, 100_000, 1000)]).is_ok());
        for (map, says) in [
            (vec![], "0 lines"),
            (vec![m(0, 65536, 1); 6], "6 lines"),
            (vec![m(0, 65536, 0)], "empty"),
            (vec![m(0, u32::MAX, 2)], "runs past"),
            (vec![m(u32::MAX - 1, 65536, 3)], "runs past"),
            (vec![m(0, 0, 65536)], "host's root"),
        ] {
            let err = validate("gid", &map).unwrap_err().to_string();
            assert!(err.contains("gid map") && err.contains(says), "{map:?}: {err}");
        }
    }

    #[test]
    fn a_map_is_written_as_the_kernel_reads_it() {
        assert_eq!(map_text(&[m(0, 65536, 65536), m(70000, 200000, 5)]), "0 65536 65536\n70000 200000 5\n");
        let oci = oci_map(&[m(0, 65536, 65536)]);
        assert_eq!((oci[0].container_id(), oci[0].host_id(), oci[0].size()), (0, 65536, 65536));
    }
}
