//! SetupSandbox: the sandbox-wide settings the shim hands the agent.

use std::path::{Component, Path, PathBuf};

use crate::{
    cli::{Mode, PodNetwork},
    error::{AgentError, Result},
    mount::GuestMount,
    syscall::Syscall,
};

#[derive(Debug, Clone, Default)]
pub struct SandboxSettings {
    pub hostname: String,
    pub resolv_conf: Vec<u8>,
    pub sysctls: Vec<(String, String)>,
    pub wall_clock_unix_nanos: i64,
    pub entropy_seed: Vec<u8>,
    pub mounts: Vec<GuestMount>,
    /// The pod's pids limit for the parent of every container cgroup; `None` is unlimited.
    pub pids_limit: Option<u64>,
    /// A hostUsers: false pod's uid and gid maps (crate::pod_userns); both empty: none.
    pub uid_mappings: Vec<crate::pod_userns::IdMap>,
    pub gid_mappings: Vec<crate::pod_userns::IdMap>,
}

const MAX_RESOLV_CONF: usize = 64 << 10;
const MAX_ENTROPY: usize = 4096;

/// Applies the settings. The pod's resolv.conf goes to `pod_dns_file`, which every
/// container's `/etc/resolv.conf` mount is pointed at (crate::dns), and in guest mode also to
/// the guest's own /etc/resolv.conf. In namespace mode the host owns the clock, the entropy pool
/// and its /etc/resolv.conf, so those are skipped and logged. The pod's pids limit goes to
/// `pod_cgroup_dir` (the cgroupfs directory parenting every container) in guest mode; in namespace
/// mode the host's pod cgroup, which holds the agent and all it starts, already enforces it.
pub fn apply_setup(
    s: &SandboxSettings,
    mode: Mode,
    network: PodNetwork,
    sys: &dyn Syscall,
    pod_dns_file: &Path,
    pod_cgroup_dir: &Path,
) -> Result<()> {
    validate(s)?;
    if !s.hostname.is_empty() {
        sys.sethostname(&s.hostname).map_err(|e| AgentError::internal("sethostname", e))?;
    }
    if mode == Mode::Namespace {
        check_namespaced(s.sysctls.iter().map(|(k, _)| k.as_str()), network)?;
    }
    for (key, value) in &s.sysctls {
        let path = sysctl_path(key)?;
        sys.write_file(&path, value.as_bytes())
            .map_err(|e| AgentError::FailedPrecondition(format!("sysctl {key}={value}: {e}")))?;
    }
    for m in &s.mounts {
        sys.mkdir_all(&m.destination).map_err(|e| AgentError::internal("mkdir guest mount point", e))?;
        m.mount_on(sys, &m.destination).map_err(|e| {
            AgentError::FailedPrecondition(format!("mount {} on {}: {e}", m.source, m.destination.display()))
        })?;
    }
    if !s.resolv_conf.is_empty() {
        if let Some(dir) = pod_dns_file.parent() {
            sys.mkdir_all(dir).map_err(|e| AgentError::internal("mkdir for the pod's resolv.conf", e))?;
        }
        sys.write_file(pod_dns_file, &s.resolv_conf)
            .map_err(|e| AgentError::internal("write the pod's resolv.conf", e))?;
    }
    match mode {
        Mode::Guest => {
            if !s.resolv_conf.is_empty() {
                sys.mkdir_all(Path::new("/etc")).map_err(|e| AgentError::internal("mkdir /etc", e))?;
                sys.write_file(Path::new("/etc/resolv.conf"), &s.resolv_conf)
                    .map_err(|e| AgentError::internal("write /etc/resolv.conf", e))?;
            }
            if s.wall_clock_unix_nanos != 0 {
                sys.set_realtime_clock(s.wall_clock_unix_nanos)
                    .map_err(|e| AgentError::internal("clock_settime", e))?;
            }
            if !s.entropy_seed.is_empty() {
                sys.add_entropy(&s.entropy_seed).map_err(|e| AgentError::internal("RNDADDENTROPY", e))?;
            }
            if let Some(limit) = s.pids_limit {
                sys.mkdir_all(pod_cgroup_dir).map_err(|e| AgentError::internal("mkdir the pod's cgroup", e))?;
                sys.write_file(&pod_cgroup_dir.join("pids.max"), limit.to_string().as_bytes())
                    .map_err(|e| AgentError::FailedPrecondition(format!("the pod's pids limit {limit}: {e}")))?;
                tracing::info!(limit, "the pod's pids limit is set");
            }
        }
        Mode::Namespace => {
            tracing::info!(
                pids_limit = ?s.pids_limit,
                "namespace mode: the host provides clock, entropy, its own resolv.conf and the pod's pids limit; \
                 skipped"
            );
        }
    }
    Ok(())
}

fn validate(s: &SandboxSettings) -> Result<()> {
    if s.hostname.len() > 64 {
        return Err(AgentError::InvalidArgument(format!("hostname is {} bytes, the limit is 64", s.hostname.len())));
    }
    if s.resolv_conf.len() > MAX_RESOLV_CONF {
        return Err(AgentError::InvalidArgument(format!(
            "resolv.conf is {} bytes, the limit is {MAX_RESOLV_CONF}",
            s.resolv_conf.len()
        )));
    }
    if s.entropy_seed.len() > MAX_ENTROPY {
        return Err(AgentError::InvalidArgument(format!(
            "entropy seed is {} bytes, the limit is {MAX_ENTROPY}",
            s.entropy_seed.len()
        )));
    }
    for m in &s.mounts {
        if !m.destination.is_absolute() {
            return Err(AgentError::InvalidArgument(format!(
                "guest mount destination {:?} is not absolute",
                m.destination
            )));
        }
    }
    Ok(())
}

/// Whether a sysctl belongs to a namespace the pod has of its own (IPC, network; the set
/// Kubernetes calls namespaced). In namespace mode any other one would change the host's kernel,
/// and so would `net.*` in a pod on the node's network (as kubelet also refuses).
pub fn is_namespaced_sysctl(key: &str, network: PodNetwork) -> bool {
    const IPC: [&str; 8] = [
        "kernel.shm_rmid_forced",
        "kernel.shmmax",
        "kernel.shmall",
        "kernel.shmmni",
        "kernel.msgmax",
        "kernel.msgmnb",
        "kernel.msgmni",
        "kernel.sem",
    ];
    IPC.contains(&key) || key.starts_with("fs.mqueue.") || (key.starts_with("net.") && network == PodNetwork::Own)
}

/// Refuses, naming it, the first sysctl that is not namespaced (namespace mode only: a guest
/// kernel is the pod's own).
pub fn check_namespaced<'a>(keys: impl IntoIterator<Item = &'a str>, network: PodNetwork) -> Result<()> {
    match keys.into_iter().find(|k| !is_namespaced_sysctl(k, network)) {
        Some(key) if key.starts_with("net.") => Err(AgentError::InvalidArgument(format!(
            "sysctl {key} is not allowed with host network: it would change the node's network (namespace backend)"
        ))),
        Some(key) => Err(AgentError::InvalidArgument(format!(
            "sysctl {key} is not namespaced: without a VM it would change the host's kernel (namespace backend)"
        ))),
        None => Ok(()),
    }
}

/// `net.ipv4.ip_forward` -> `/proc/sys/net/ipv4/ip_forward`, refusing anything that could
/// escape /proc/sys.
fn sysctl_path(key: &str) -> Result<PathBuf> {
    let rel = key.replace('.', "/");
    let bad = key.is_empty()
        || key.len() > 256
        || key.split('.').any(|seg| seg.is_empty() || seg.contains('/'))
        || Path::new(&rel).components().any(|c| !matches!(c, Component::Normal(_)));
    if bad {
        return Err(AgentError::InvalidArgument(format!("bad sysctl key {key:?}")));
    }
    Ok(Path::new("/proc/sys").join(rel))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::syscall::test::{Call, RecordingSyscall};

    const POD_DNS: &str = "/run/bulkhead-agent/resolv.conf";

    const POD_CGROUP: &str = "/sys/fs/cgroup/bulkhead";

    fn apply_setup(s: &SandboxSettings, mode: Mode, sys: &dyn Syscall) -> Result<()> {
        super::apply_setup(s, mode, PodNetwork::Own, sys, Path::new(POD_DNS), Path::new(POD_CGROUP))
    }

    fn settings() -> SandboxSettings {
        SandboxSettings {
            hostname: "pod-a".into(),
            resolv_conf: b"nameserver 10.0.0.10\n".to_vec(),
            sysctls: vec![("net.ipv4.ip_forward".into(), "1".into())],
            wall_clock_unix_nanos: 1_700_000_000_123_456_789,
            entropy_seed: vec![7; 32],
            mounts: vec![GuestMount {
                source: "vol0".into(),
                destination: "/run/vol0".into(),
                fstype: "virtiofs".into(),
                options: vec!["ro".into()],
            }],
            pids_limit: Some(1024),
            ..Default::default()
        }
    }

    #[test]
    fn guest_mode_applies_everything() {
        let sys = RecordingSyscall::default();
        apply_setup(&settings(), Mode::Guest, &sys).unwrap();
        let calls = sys.calls();
        assert!(calls.contains(&Call::Hostname("pod-a".into())));
        assert!(calls.contains(&Call::Write("/proc/sys/net/ipv4/ip_forward".into(), b"1".to_vec())));
        assert!(calls.contains(&Call::Write("/etc/resolv.conf".into(), b"nameserver 10.0.0.10\n".to_vec())));
        assert!(calls.contains(&Call::Write(POD_DNS.into(), b"nameserver 10.0.0.10\n".to_vec())));
        assert!(calls.contains(&Call::Clock(1_700_000_000_123_456_789)));
        assert!(calls.contains(&Call::Entropy(32)));
        assert!(calls.contains(&Call::Write(format!("{POD_CGROUP}/pids.max").into(), b"1024".to_vec())));
        assert!(calls.iter().any(|c| matches!(c, Call::Mount { fstype: Some(t), flags, .. }
            if t == "virtiofs" && flags.contains(nix::mount::MsFlags::MS_RDONLY))));
    }

    #[test]
    fn namespace_mode_leaves_host_owned_state_alone() {
        let sys = RecordingSyscall::default();
        apply_setup(&settings(), Mode::Namespace, &sys).unwrap();
        let calls = sys.calls();
        assert!(!calls.iter().any(|c| matches!(c, Call::Clock(_) | Call::Entropy(_))));
        // The host's pod cgroup holds the agent and everything it starts: its limit already applies.
        assert!(!calls.iter().any(|c| matches!(c, Call::Write(p, _) if p.starts_with(POD_CGROUP))));
        assert!(!calls.iter().any(|c| matches!(c, Call::Write(p, _) if p == Path::new("/etc/resolv.conf"))));
        // The containers' copy is written in both modes.
        assert!(calls.contains(&Call::Write(POD_DNS.into(), b"nameserver 10.0.0.10\n".to_vec())));
        assert!(calls.contains(&Call::Hostname("pod-a".into())));
    }

    #[test]
    fn namespace_mode_takes_only_namespaced_sysctls() {
        for key in ["net.ipv4.ip_forward", "kernel.shmmax", "fs.mqueue.msg_max", "kernel.sem"] {
            let s = SandboxSettings { sysctls: vec![(key.into(), "1".into())], ..Default::default() };
            apply_setup(&s, Mode::Namespace, &RecordingSyscall::default()).unwrap();
        }
        for key in ["vm.overcommit_memory", "kernel.panic", "fs.file-max", "kernel.hostname"] {
            let s = SandboxSettings { sysctls: vec![(key.into(), "1".into())], ..Default::default() };
            let sys = RecordingSyscall::default();
            let err = apply_setup(&s, Mode::Namespace, &sys).unwrap_err();
            assert!(err.to_string().contains("not namespaced"), "{key}: {err}");
            assert!(sys.calls().is_empty(), "{key}: nothing applied before the refusal");
            // A guest kernel is the pod's own.
            apply_setup(&s, Mode::Guest, &RecordingSyscall::default()).unwrap();
        }
    }

    #[test]
    fn a_host_network_pod_takes_no_net_sysctls_in_namespace_mode() {
        let s = SandboxSettings { sysctls: vec![("net.ipv4.ip_forward".into(), "1".into())], ..Default::default() };
        let sys = RecordingSyscall::default();
        let host = PodNetwork::Host;
        let err =
            super::apply_setup(&s, Mode::Namespace, host, &sys, Path::new(POD_DNS), Path::new(POD_CGROUP)).unwrap_err();
        assert!(err.to_string().contains("not allowed with host network"), "{err}");
        assert!(sys.calls().is_empty(), "nothing applied before the refusal");
        let ipc = SandboxSettings { sysctls: vec![("kernel.shmmax".into(), "1".into())], ..Default::default() };
        let (dns, cg) = (Path::new(POD_DNS), Path::new(POD_CGROUP));
        super::apply_setup(&ipc, Mode::Namespace, host, &RecordingSyscall::default(), dns, cg).unwrap();
    }

    #[test]
    fn rejects_escaping_sysctls_and_oversized_fields() {
        for key in ["", "..", "net/../../etc", "a..b", "/abs"] {
            let s = SandboxSettings { sysctls: vec![(key.into(), "1".into())], ..Default::default() };
            assert!(
                matches!(
                    apply_setup(&s, Mode::Guest, &RecordingSyscall::default()),
                    Err(AgentError::InvalidArgument(_))
                ),
                "{key:?}"
            );
        }
        let s = SandboxSettings { hostname: "h".repeat(65), ..Default::default() };
        assert!(apply_setup(&s, Mode::Guest, &RecordingSyscall::default()).is_err());
        let s = SandboxSettings {
            mounts: vec![GuestMount { destination: "rel".into(), ..Default::default() }],
            ..Default::default()
        };
        assert!(apply_setup(&s, Mode::Guest, &RecordingSyscall::default()).is_err());
    }
}
