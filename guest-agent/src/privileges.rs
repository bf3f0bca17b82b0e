//! Namespace mode: the capabilities the agent keeps, and the ones a container may ask for.
//!
//! Without a VM the agent's capabilities are capabilities over the host's kernel. Once in its
//! minimal root, before any thread exists, the agent ([`confine`]) cuts its bounding set to
//! [`kept`] (no process it starts, container or helper, can ever hold more; a root `exec`
//! regains exactly the bounding set) and sets its own effective and permitted sets to the same,
//! with inheritable and ambient empty. Capabilities are per thread, which is why this happens
//! before the runtime starts any.
//!
//! [`kept`] is containerd's default container set ([`CONTAINER`]) plus what only the agent uses
//! ([`AGENT_ONLY`]). A container, or an exec, naming any other capability, or one of
//! [`AGENT_ONLY`], is refused with that capability named ([`check_container`]): a privileged
//! container too, since it asks for all of them.
//!
//! `no_new_privs` is not set on the agent: it is inherited by every descendant and can never be
//! cleared, so every container would lose its setuid and file-capability binaries (`su`,
//! `ping` on older images), which Kubernetes allows unless a container sets
//! `allowPrivilegeEscalation: false`; that setting reaches libcontainer as the spec's
//! `noNewPrivileges`, which it sets on the container's process, as do execs under a seccomp
//! profile (crate::spec). The agent itself gains nothing from it: it executes only its own
//! binary (the `__libcontainer` helper), and no setuid or file-capability binary can lift a
//! process above the bounding set.

use std::collections::BTreeSet;

use caps::{CapSet, Capability as Cap, CapsHashSet};
use libcontainer::capabilities::CapabilityExt;
use oci_spec::runtime::LinuxCapabilities;

use crate::error::{AgentError, Result};

/// containerd's (and Docker's) default capabilities of a container: every one a container may
/// have on this backend.
pub const CONTAINER: [Cap; 14] = [
    Cap::CAP_CHOWN,
    Cap::CAP_DAC_OVERRIDE,
    Cap::CAP_FSETID,
    Cap::CAP_FOWNER,
    Cap::CAP_MKNOD,
    Cap::CAP_NET_RAW,
    Cap::CAP_SETGID,
    Cap::CAP_SETUID,
    Cap::CAP_SETFCAP,
    Cap::CAP_SETPCAP,
    Cap::CAP_NET_BIND_SERVICE,
    Cap::CAP_SYS_CHROOT,
    Cap::CAP_KILL,
    Cap::CAP_AUDIT_WRITE,
];

/// What the agent keeps for itself and never gives a container:
/// - CAP_SYS_ADMIN: mounts, pivot_root, new namespaces, sethostname; libcontainer needs it to
///   build every container. In the host's user namespace it is as good as host root;
/// - CAP_SYS_PTRACE: libcontainer opens `/proc/<pid>/ns/*` of a container's init to exec into
///   it, which the kernel allows across users (a container running as non-root) only with it.
///   A container holding it could attach to such an exec while it still has CAP_SYS_ADMIN.
pub const AGENT_ONLY: [Cap; 2] = [Cap::CAP_SYS_ADMIN, Cap::CAP_SYS_PTRACE];

/// The capabilities a confined agent keeps: [`CONTAINER`] and [`AGENT_ONLY`].
pub fn kept() -> CapsHashSet {
    CONTAINER.iter().chain(AGENT_ONLY.iter()).copied().collect()
}

/// `set` as the kernel prints it in /proc/<pid>/status (`CapEff` etc.).
pub fn mask(set: &CapsHashSet) -> u64 {
    set.iter().fold(0, |m, c| m | c.bitmask())
}

/// Why the capability drop failed.
#[derive(Debug, thiserror::Error)]
pub enum PrivilegeError {
    #[error("{what}: {source}")]
    Caps { what: String, source: caps::errors::CapsError },
    #[error("capabilities after the drop: {set} is {have:#x}, should be {want:#x}")]
    Mismatch { set: &'static str, have: u64, want: u64 },
}

fn caps_err(what: impl Into<String>) -> impl FnOnce(caps::errors::CapsError) -> PrivilegeError {
    let what = what.into();
    move |source| PrivilegeError::Caps { what, source }
}

/// Drops this thread's (single-threaded: the process's) capabilities to [`kept`] (module docs).
/// A kept capability the host never gave is simply absent. Returns the set now held.
pub fn confine() -> std::result::Result<CapsHashSet, PrivilegeError> {
    let kept = kept();
    // The bounding set first: dropping from it takes CAP_SETPCAP in the effective set.
    for cap in caps::read(None, CapSet::Bounding).map_err(caps_err("read the bounding set"))? {
        if !kept.contains(&cap) {
            caps::drop(None, CapSet::Bounding, cap).map_err(caps_err(format!("drop {cap} from the bounding set")))?;
        }
    }
    let held: CapsHashSet = caps::read(None, CapSet::Permitted)
        .map_err(caps_err("read the permitted set"))?
        .intersection(&kept)
        .copied()
        .collect();
    caps::clear(None, CapSet::Ambient).map_err(caps_err("clear the ambient set"))?;
    caps::clear(None, CapSet::Inheritable).map_err(caps_err("clear the inheritable set"))?;
    // Effective before permitted: effective must stay within permitted at every step.
    caps::set(None, CapSet::Effective, &held).map_err(caps_err("set the effective set"))?;
    caps::set(None, CapSet::Permitted, &held).map_err(caps_err("set the permitted set"))?;
    let want = mask(&held);
    for (set, name) in [(CapSet::Effective, "CapEff"), (CapSet::Permitted, "CapPrm"), (CapSet::Bounding, "CapBnd")] {
        let have = mask(&caps::read(None, set).map_err(caps_err(format!("read back {name}")))?);
        // The bounding set may keep a capability the permitted set never had; never more.
        let fits = if name == "CapBnd" { have & !mask(&kept) == 0 } else { have == want };
        if !fits {
            return Err(PrivilegeError::Mismatch { set: name, have, want });
        }
    }
    Ok(held)
}

/// Refuses a container's (or an exec's) process whose capabilities, in any of its five sets,
/// name one outside [`CONTAINER`], naming every such capability.
pub fn check_container(process_caps: Option<&LinuxCapabilities>, what: &str) -> Result<()> {
    let Some(c) = process_caps else { return Ok(()) };
    let sets = [c.bounding(), c.effective(), c.inheritable(), c.permitted(), c.ambient()];
    let refused: BTreeSet<String> = sets
        .into_iter()
        .flatten()
        .flatten()
        .map(|cap| cap.to_cap())
        .filter(|cap| !CONTAINER.contains(cap))
        .map(|cap| cap.to_string())
        .collect();
    if refused.is_empty() {
        return Ok(());
    }
    let names: Vec<String> = refused.into_iter().collect();
    Err(AgentError::InvalidArgument(format!(
        "{what} asks for {}, which the namespace backend gives no container: without a VM it would act on the \
         host's kernel (privileged containers are refused for the same reason); a container may have only \
         containerd's default capabilities",
        names.join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps_json(json: serde_json::Value) -> LinuxCapabilities {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn the_kept_set_is_containerds_default_plus_sys_admin_and_sys_ptrace() {
        let kept = kept();
        assert_eq!(kept.len(), 16);
        // What the READMEs state as the agent's CapEff.
        assert_eq!(mask(&kept), 0xa82c_25fb);
        // Docker's well-known default mask, for the container part.
        assert_eq!(mask(&CONTAINER.iter().copied().collect()), 0xa804_25fb);
        for dangerous in [Cap::CAP_SYS_MODULE, Cap::CAP_NET_ADMIN, Cap::CAP_DAC_READ_SEARCH, Cap::CAP_SYS_RAWIO] {
            assert!(!kept.contains(&dangerous), "{dangerous} is dropped");
        }
    }

    #[test]
    fn containers_get_the_default_set_and_nothing_more() {
        let default = caps_json(serde_json::json!({
            "bounding": ["CAP_CHOWN", "CAP_KILL", "CAP_NET_RAW"],
            "effective": ["CAP_CHOWN", "CAP_KILL"],
            "permitted": ["CAP_CHOWN", "CAP_KILL"],
        }));
        check_container(Some(&default), "container c1").unwrap();
        check_container(None, "container c1").unwrap();

        let admin = caps_json(serde_json::json!({
            "bounding": ["CAP_CHOWN", "CAP_SYS_ADMIN", "CAP_NET_ADMIN"],
            "effective": ["CAP_CHOWN"],
        }));
        let err = check_container(Some(&admin), "container c2").unwrap_err().to_string();
        assert!(err.contains("container c2 asks for CAP_NET_ADMIN, CAP_SYS_ADMIN"), "{err}");
        // The agent's own capabilities are no exception, in whichever set they are asked for.
        let ptrace = caps_json(serde_json::json!({"ambient": ["CAP_SYS_PTRACE"]}));
        let err = check_container(Some(&ptrace), "exec e1").unwrap_err().to_string();
        assert!(err.contains("CAP_SYS_PTRACE"), "{err}");
    }

    #[test]
    fn a_privileged_container_is_refused_naming_what_it_asks_for() {
        let all: Vec<String> = caps::all().into_iter().map(|c| c.to_string()).collect();
        let privileged = caps_json(serde_json::json!({"bounding": all, "effective": all, "permitted": all}));
        let err = check_container(Some(&privileged), "container p").unwrap_err().to_string();
        assert!(err.contains("CAP_SYS_MODULE") && err.contains("CAP_SYS_ADMIN"), "{err}");
        assert!(!err.contains("CAP_CHOWN"), "allowed capabilities are not named: {err}");
    }
}
