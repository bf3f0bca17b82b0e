//! The shim's OCI JSON in, what libcontainer runs out: parses the spec, exec process and resource
//! update under a size limit, and rewrites them for this sandbox (rootfs, cgroup path and
//! namespace, terminal, seccomp compiled by the agent). Pure functions: no file or mount is touched here.

use std::path::{Path, PathBuf};

use oci_spec::runtime::{LinuxNamespace, LinuxNamespaceType, LinuxResources, Process, Spec};

use crate::{
    error::{AgentError, Result},
    seccomp::{self, SeccompError},
};

/// Largest OCI spec / process / resources JSON accepted (ttrpc caps the frame at 4 MiB anyway).
const MAX_SPEC_JSON: usize = 1 << 20;

fn bad_json(what: &str, e: impl std::fmt::Display) -> AgentError {
    AgentError::InvalidArgument(format!("malformed {what}: {e}"))
}

fn check_size(what: &str, bytes: &[u8]) -> Result<()> {
    if bytes.len() > MAX_SPEC_JSON {
        return Err(AgentError::InvalidArgument(format!("{what} is {} bytes, limit {MAX_SPEC_JSON}", bytes.len())));
    }
    Ok(())
}

pub fn parse_spec(bytes: &[u8]) -> Result<Spec> {
    check_size("OCI spec", bytes)?;
    serde_json::from_slice(bytes).map_err(|e| bad_json("OCI spec", e))
}

/// Points the spec at this sandbox's rootfs (`rootfs_path`, or else the spec's own root) and
/// cgroup, and sets the terminal the shim asked for. Returns the rootfs path.
pub fn adapt_to_sandbox(spec: &mut Spec, rootfs_path: &str, terminal: bool, cgroup_path: &Path) -> Result<PathBuf> {
    let process =
        spec.process_mut().as_mut().ok_or_else(|| AgentError::InvalidArgument("spec has no process".into()))?;
    if process.args().as_ref().is_none_or(|a| a.is_empty()) {
        return Err(AgentError::InvalidArgument("spec process.args is empty".into()));
    }
    process.set_terminal(Some(terminal));
    let rootfs = if rootfs_path.is_empty() {
        spec.root()
            .as_ref()
            .map(|r| r.path().clone())
            .ok_or_else(|| AgentError::InvalidArgument("no rootfs_path and no spec.root".into()))?
    } else {
        PathBuf::from(rootfs_path)
    };
    if !rootfs.is_absolute() {
        return Err(AgentError::InvalidArgument(format!("rootfs {} must be absolute", rootfs.display())));
    }
    let mut root = spec.root().clone().unwrap_or_default();
    root.set_path(rootfs.clone());
    spec.set_root(Some(root));
    let mut linux = spec.linux().clone().unwrap_or_default();
    linux.set_cgroups_path(Some(cgroup_path.to_path_buf()));
    spec.set_linux(Some(linux));
    Ok(rootfs)
}

/// Gives the container a cgroup namespace of its own if the spec has none, and says whether it
/// did. containerd asks for one only when the *host* is on cgroup v2, but the guest always is:
/// without it `/proc/self/cgroup` shows the agent's path and the spec's `cgroup` mount at
/// /sys/fs/cgroup shows the guest's root (no `memory.max`), so a runtime that sizes itself from
/// its cgroup sees no limit. With it the container sees what runc gives it on a v2 host: `0::/`
/// and its own cgroup's files.
pub fn give_cgroup_namespace(spec: &mut Spec) -> bool {
    let mut linux = spec.linux().clone().unwrap_or_default();
    let mut namespaces = linux.namespaces().clone().unwrap_or_default();
    if namespaces.iter().any(|n| n.typ() == LinuxNamespaceType::Cgroup) {
        return false;
    }
    let mut cgroup = LinuxNamespace::default();
    cgroup.set_typ(LinuxNamespaceType::Cgroup);
    cgroup.set_path(None);
    namespaces.push(cgroup);
    linux.set_namespaces(Some(namespaces));
    spec.set_linux(Some(linux));
    true
}

/// Compiles `linux.seccomp` (if any) and takes it out of the spec: libcontainer is built
/// without libseccomp and would silently ignore it; our executor installs it instead.
pub fn take_seccomp(spec: &mut Spec) -> Result<Option<Vec<u8>>> {
    let Some(mut linux) = spec.linux().clone() else {
        return Ok(None);
    };
    let Some(profile) = linux.seccomp().clone() else {
        return Ok(None);
    };
    let nnp = spec.process().as_ref().and_then(|p| p.no_new_privileges()).unwrap_or(false);
    let (filters, unknown) = seccomp::compile(&profile, nnp).map_err(|e| match e {
        SeccompError::Unsupported(m) => AgentError::Unsupported(format!("seccomp: {m}")),
        SeccompError::Invalid(m) => AgentError::InvalidArgument(format!("seccomp: {m}")),
    })?;
    if unknown > 0 {
        tracing::info!(unknown, "seccomp: syscall names unknown on x86_64 skipped");
    }
    linux.set_seccomp(None);
    spec.set_linux(Some(linux));
    Ok(Some(seccomp::encode(&filters)))
}

/// Parses an exec's OCI process and sets the terminal the shim asked for. Under a container
/// seccomp profile (which covers its execs too) the process gets no_new_privs, which the
/// filters need.
pub fn exec_process(json: &[u8], terminal: bool, under_seccomp: bool) -> Result<Process> {
    check_size("process JSON", json)?;
    let mut process: Process = serde_json::from_slice(json).map_err(|e| bad_json("OCI process", e))?;
    if process.args().as_ref().is_none_or(|a| a.is_empty()) {
        return Err(AgentError::InvalidArgument("process.args is empty".into()));
    }
    process.set_terminal(Some(terminal));
    if under_seccomp {
        process.set_no_new_privileges(Some(true));
    }
    Ok(process)
}

/// The huge page sizes this kernel offers, named as OCI names them ("2MB", "1GB").
pub fn hugepage_sizes() -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/sys/kernel/mm/hugepages") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| {
            let kib: u64 = e.file_name().to_str()?.strip_prefix("hugepages-")?.strip_suffix("kB")?.parse().ok()?;
            Some(match kib {
                k if k % (1 << 20) == 0 => format!("{}GB", k >> 20),
                k if k % (1 << 10) == 0 => format!("{}MB", k >> 10),
                k => format!("{k}KB"),
            })
        })
        .collect()
}

/// Fits `resources`' huge page limits to the sizes this kernel has (`sizes`). kubelet sends a
/// limit for every size the node offers, usually 0; a limit on a size the guest lacks is
/// dropped when it is 0 (it allows nothing, and nothing can be had) and refused otherwise.
/// Returns the sizes dropped.
pub fn fit_hugepage_limits(resources: &mut LinuxResources, sizes: &[String]) -> Result<Vec<String>> {
    let Some(limits) = resources.hugepage_limits().clone() else { return Ok(Vec::new()) };
    let (kept, missing): (Vec<_>, Vec<_>) = limits.into_iter().partition(|l| sizes.contains(l.page_size()));
    if let Some(l) = missing.iter().find(|l| l.limit() > 0) {
        return Err(AgentError::Unsupported(format!(
            "linux.resources.hugepageLimits: a limit of {} bytes of {} pages, a size this kernel does not have \
             (it has {sizes:?})",
            l.limit(),
            l.page_size()
        )));
    }
    resources.set_hugepage_limits(Some(kept));
    Ok(missing.into_iter().map(|l| l.page_size().clone()).collect())
}

/// [`fit_hugepage_limits`] on a spec's resources, logging what was dropped.
pub fn fit_spec_hugepages(spec: &mut Spec, sizes: &[String]) -> Result<()> {
    let Some(mut linux) = spec.linux().clone() else { return Ok(()) };
    let Some(mut resources) = linux.resources().clone() else { return Ok(()) };
    let dropped = fit_hugepage_limits(&mut resources, sizes)?;
    if !dropped.is_empty() {
        tracing::info!(?dropped, "zero huge page limits of sizes this kernel lacks dropped");
    }
    linux.set_resources(Some(resources));
    spec.set_linux(Some(linux));
    Ok(())
}

pub fn parse_resources(json: &[u8]) -> Result<LinuxResources> {
    check_size("resources JSON", json)?;
    serde_json::from_slice(json).map_err(|e| bad_json("linux.resources", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hugepage_limits_of_missing_sizes_are_dropped_when_zero_and_refused_otherwise() {
        let mut r: LinuxResources = serde_json::from_value(serde_json::json!({
            "hugepageLimits": [{"pageSize": "2MB", "limit": 0}, {"pageSize": "1GB", "limit": 0}]
        }))
        .unwrap();
        let dropped = fit_hugepage_limits(&mut r, &["2MB".to_string()]).unwrap();
        assert_eq!(dropped, ["1GB"]);
        let kept: Vec<_> = r.hugepage_limits().clone().unwrap().iter().map(|l| l.page_size().clone()).collect();
        assert_eq!(kept, ["2MB"]);

        let mut r: LinuxResources =
            serde_json::from_value(serde_json::json!({"hugepageLimits": [{"pageSize": "1GB", "limit": 1073741824}]}))
                .unwrap();
        let err = fit_hugepage_limits(&mut r, &["2MB".to_string()]).unwrap_err().to_string();
        assert!(err.contains("1GB") && err.contains("hugepageLimits"), "{err}");

        let mut r = LinuxResources::default();
        assert!(fit_hugepage_limits(&mut r, &[]).unwrap().is_empty());
        assert!(r.hugepage_limits().is_none(), "no limits stay no limits");
    }

    fn spec(json: serde_json::Value) -> Spec {
        parse_spec(&serde_json::to_vec(&json).unwrap()).unwrap()
    }

    fn minimal() -> serde_json::Value {
        serde_json::json!({
            "ociVersion": "1.0.2",
            "process": {"args": ["sh"], "cwd": "/", "user": {"uid": 0, "gid": 0}},
            "root": {"path": "/bundle/rootfs", "readonly": true},
        })
    }

    #[test]
    fn adapt_points_the_spec_at_the_sandbox() {
        let mut s = spec(minimal());
        let rootfs = adapt_to_sandbox(&mut s, "/run/c1/rootfs", true, Path::new("/bulkhead/c1")).unwrap();
        assert_eq!(rootfs, Path::new("/run/c1/rootfs"));
        let root = s.root().clone().unwrap();
        assert_eq!(root.path(), Path::new("/run/c1/rootfs"));
        assert_eq!(root.readonly(), Some(true), "the rest of spec.root is kept");
        assert_eq!(s.process().as_ref().unwrap().terminal(), Some(true));
        assert_eq!(s.linux().as_ref().unwrap().cgroups_path().as_deref(), Some(Path::new("/bulkhead/c1")));
    }

    #[test]
    fn adapt_falls_back_to_spec_root_and_keeps_linux_settings() {
        let mut json = minimal();
        json["linux"] = serde_json::json!({"cgroupsPath": "/elsewhere", "sysctl": {"net.ipv4.ip_forward": "1"}});
        let mut s = spec(json);
        let rootfs = adapt_to_sandbox(&mut s, "", false, Path::new("/bulkhead/c2")).unwrap();
        assert_eq!(rootfs, Path::new("/bundle/rootfs"));
        assert_eq!(s.process().as_ref().unwrap().terminal(), Some(false));
        let linux = s.linux().clone().unwrap();
        assert_eq!(linux.cgroups_path().as_deref(), Some(Path::new("/bulkhead/c2")), "the shim's path is replaced");
        assert!(linux.sysctl().as_ref().is_some_and(|m| m.contains_key("net.ipv4.ip_forward")));
    }

    #[test]
    fn adapt_refuses_specs_it_cannot_run() {
        let cg = Path::new("/bulkhead/c");
        let invalid = |json: serde_json::Value, rootfs: &str| {
            matches!(adapt_to_sandbox(&mut spec(json), rootfs, false, cg), Err(AgentError::InvalidArgument(_)))
        };
        let mut no_process = minimal();
        no_process.as_object_mut().unwrap().remove("process");
        assert!(invalid(no_process, "/r"));
        let mut empty_args = minimal();
        empty_args["process"]["args"] = serde_json::json!([]);
        assert!(invalid(empty_args, "/r"));
        let mut no_root = minimal();
        no_root.as_object_mut().unwrap().remove("root");
        assert!(invalid(no_root, ""));
        assert!(invalid(minimal(), "relative/rootfs"));
        let mut relative_root = minimal();
        relative_root["root"]["path"] = "rootfs".into();
        assert!(invalid(relative_root, ""));
    }

    /// The parts of containerd's CRI spec on a cgroup v1 host that matter here.
    fn containerd_v1_host_spec() -> serde_json::Value {
        let mut json = minimal();
        json["mounts"] = serde_json::json!([
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
             "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
        ]);
        json["linux"] = serde_json::json!({"namespaces": [
            {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
            {"type": "network", "path": "/proc/1/ns/net"},
        ]});
        json
    }

    fn namespaces(s: &Spec) -> Vec<LinuxNamespace> {
        s.linux().as_ref().and_then(|l| l.namespaces().clone()).unwrap_or_default()
    }

    #[test]
    fn a_spec_without_a_cgroup_namespace_gets_one_and_keeps_the_rest() {
        let original = spec(containerd_v1_host_spec());
        let mut s = original.clone();
        assert!(give_cgroup_namespace(&mut s));
        let ns = namespaces(&s);
        let cgroup: Vec<_> = ns.iter().filter(|n| n.typ() == LinuxNamespaceType::Cgroup).collect();
        assert_eq!(cgroup.len(), 1);
        assert_eq!(cgroup[0].path(), &None, "a new namespace, not one joined");
        assert_eq!(ns[..ns.len() - 1], namespaces(&original)[..], "the spec's own namespaces stay as they were");
        assert_eq!(s.mounts(), original.mounts(), "the cgroup mount is left to be mounted in the new namespace");

        let mut json = minimal();
        json["linux"] = serde_json::json!({});
        let mut bare = spec(json);
        assert!(give_cgroup_namespace(&mut bare), "a spec that lists no namespaces gets one too");
        assert_eq!(namespaces(&bare).iter().map(|n| n.typ()).collect::<Vec<_>>(), [LinuxNamespaceType::Cgroup]);
    }

    #[test]
    fn a_spec_with_a_cgroup_namespace_is_left_alone() {
        for cgroup in
            [serde_json::json!({"type": "cgroup"}), serde_json::json!({"type": "cgroup", "path": "/proc/7/ns/cgroup"})]
        {
            let mut json = containerd_v1_host_spec();
            json["linux"]["namespaces"].as_array_mut().unwrap().push(cgroup);
            let original = spec(json);
            let mut s = original.clone();
            assert!(!give_cgroup_namespace(&mut s));
            assert_eq!(s, original);
        }
    }

    #[test]
    fn parse_limits_size_and_rejects_malformed_json() {
        assert!(matches!(parse_spec(b"{not json"), Err(AgentError::InvalidArgument(m)) if m.contains("malformed")));
        let huge = vec![b' '; MAX_SPEC_JSON + 1];
        assert!(matches!(parse_spec(&huge), Err(AgentError::InvalidArgument(m)) if m.contains("limit")));
        assert!(
            matches!(exec_process(&huge, false, false), Err(AgentError::InvalidArgument(m)) if m.contains("limit"))
        );
        assert!(matches!(parse_resources(&huge), Err(AgentError::InvalidArgument(m)) if m.contains("limit")));
        assert!(matches!(parse_resources(br#"{"memory": 5}"#), Err(AgentError::InvalidArgument(_))));
        let r = parse_resources(br#"{"memory": {"limit": 1048576}}"#).unwrap();
        assert_eq!(r.memory().as_ref().and_then(|m| m.limit()), Some(1 << 20));
    }

    #[test]
    fn seccomp_is_compiled_and_taken_out_of_the_spec() {
        let mut json = minimal();
        json["process"]["noNewPrivileges"] = true.into();
        json["linux"] = serde_json::json!({"seccomp": {
            "defaultAction": "SCMP_ACT_ALLOW",
            "syscalls": [{"names": ["mkdir"], "action": "SCMP_ACT_ERRNO"}],
        }});
        let mut s = spec(json);
        let bpf = take_seccomp(&mut s).unwrap().expect("a compiled profile");
        assert!(!seccomp::decode(&bpf).unwrap().is_empty());
        assert!(s.linux().as_ref().unwrap().seccomp().is_none(), "libcontainer must not see the profile");

        let mut plain = spec(minimal());
        assert_eq!(take_seccomp(&mut plain).unwrap(), None);
        assert_eq!(plain, spec(minimal()), "a spec without seccomp is left alone");
    }

    #[test]
    fn seccomp_without_no_new_privs_is_refused_not_dropped() {
        let mut json = minimal();
        json["linux"] = serde_json::json!({"seccomp": {"defaultAction": "SCMP_ACT_ERRNO"}});
        let mut s = spec(json);
        assert!(matches!(take_seccomp(&mut s), Err(AgentError::Unsupported(_))));
    }

    #[test]
    fn exec_process_gets_the_terminal_and_no_new_privs_under_seccomp() {
        let json = br#"{"args": ["ls"], "cwd": "/", "user": {"uid": 0, "gid": 0}}"#;
        let p = exec_process(json, true, false).unwrap();
        assert_eq!(p.terminal(), Some(true));
        assert_eq!(p.no_new_privileges(), None);
        let p = exec_process(json, false, true).unwrap();
        assert_eq!(p.terminal(), Some(false));
        assert_eq!(p.no_new_privileges(), Some(true));
        assert!(matches!(exec_process(br#"{"args": [], "cwd": "/", "user": {"uid": 0, "gid": 0}}"#, false, false),
            Err(AgentError::InvalidArgument(m)) if m.contains("args")));
        assert!(matches!(exec_process(b"[1]", false, false), Err(AgentError::InvalidArgument(_))));
    }
}
