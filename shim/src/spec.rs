//! The OCI spec, as far as the shim cares: which pod a bundle belongs to, validation against
//! what the backend can honour (errors name the field), and translation into the spec the
//! agent runs (namespace paths that point at the sandbox become "the agent's own").
//!
//! A bundle's spec is parsed once into `oci_spec::runtime::Spec`, the type the agent parses it
//! into (the same crate and version: the workspace pins it), edited as that type by every step
//! on the way (this module, the emptyDir disks, the backend's sharing) and encoded once, by
//! [`encode`], when it goes to the agent. A field oci-spec does not know is dropped here, as the
//! agent would drop it; `shim/tests/spec_round_trip.rs` checks that what containerd writes
//! reaches the agent whole.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use oci_spec::runtime::{Hooks, LinuxIdMapping, LinuxNamespace, LinuxNamespaceType, Process, Spec};

use crate::annotations::{
    CONTAINER_TYPE, EMPTYDIR_SIZE_LIMITS, SANDBOX_CPU_PERIOD, SANDBOX_CPU_QUOTA, SANDBOX_ID, SANDBOX_LOG_DIRECTORY,
    SANDBOX_MEMORY, SANDBOX_NAME, SANDBOX_NAMESPACE, SANDBOX_UID,
};
use crate::config::Backend;
use crate::sandbox::emptydir::size_limits::parse_size_limits;

/// The pod's sandbox-level resources; `None` where containerd passes nothing (or zero: no limit).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PodResources {
    /// CPUs the pod may use, rounded up: ceil(quota / period).
    pub cpus: Option<u64>,
    /// The pod's memory limit in bytes.
    pub memory_bytes: Option<u64>,
}

/// A `hostUsers: false` pod's id maps, as its sandbox spec gives them (`linux.uidMappings`,
/// `linux.gidMappings`; containerd writes one line of each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodIdMaps {
    pub uid: Vec<LinuxIdMapping>,
    pub gid: Vec<LinuxIdMapping>,
}

/// Upper bound for a bundle's config.json.
const MAX_SPEC_BYTES: u64 = 4 << 20;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpecError {
    #[error("OCI spec {path}: {message}")]
    Read { path: String, message: String },
    #[error("OCI spec field {field}: {message}")]
    Unsupported { field: String, message: String },
    #[error("pod annotation {key}: {message}")]
    Annotation { key: &'static str, message: String },
    #[error("encode the {what}: {message}")]
    Encode { what: &'static str, message: String },
}

fn unsupported(field: impl Into<String>, message: impl Into<String>) -> SpecError {
    SpecError::Unsupported { field: field.into(), message: message.into() }
}

/// Where a bundle sits in its pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// The pod sandbox (CRI's pause container); starts the shim and the sandbox.
    Sandbox,
    /// A workload container of the pod `sandbox_id`.
    Container { sandbox_id: String },
}

impl Role {
    /// The id that groups the pod: the sandbox's own id, or the one it names.
    pub fn group<'a>(&'a self, own_id: &'a str) -> &'a str {
        match self {
            Role::Sandbox => own_id,
            Role::Container { sandbox_id } => sandbox_id,
        }
    }
}

/// A bundle's spec, parsed once into the type the agent parses it into.
#[derive(Debug, Clone, PartialEq)]
pub struct BundleSpec {
    spec: Spec,
}

impl From<Spec> for BundleSpec {
    fn from(spec: Spec) -> Self {
        Self { spec }
    }
}

impl BundleSpec {
    /// Reads `<bundle>/config.json`, at most [`MAX_SPEC_BYTES`] of it.
    pub fn load(bundle: &Path) -> Result<Self, SpecError> {
        use std::io::Read;
        let path = bundle.join("config.json");
        let err = |message: String| SpecError::Read { path: path.display().to_string(), message };
        let file = std::fs::File::open(&path).map_err(|e| err(e.to_string()))?;
        let mut bytes = Vec::new();
        file.take(MAX_SPEC_BYTES + 1).read_to_end(&mut bytes).map_err(|e| err(e.to_string()))?;
        if bytes.len() as u64 > MAX_SPEC_BYTES {
            return Err(err(format!("larger than {MAX_SPEC_BYTES} bytes")));
        }
        Self::from_bytes(&bytes).map_err(|e| err(e.to_string()))
    }

    /// Parses a spec as the agent does (`serde_json` into [`Spec`]).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes).map(|spec| Self { spec })
    }

    pub fn spec(&self) -> &Spec {
        &self.spec
    }

    pub(crate) fn annotation(&self, key: &str) -> Option<&str> {
        self.spec.annotations().as_ref()?.get(key).map(String::as_str)
    }

    /// Pod grouping from the CRI annotations. A bundle without them (plain `ctr run`) is a
    /// pod of its own.
    pub fn role(&self) -> Role {
        match (self.annotation(CONTAINER_TYPE), self.annotation(SANDBOX_ID)) {
            (Some("container"), Some(sandbox_id)) if !sandbox_id.is_empty() => {
                Role::Container { sandbox_id: sandbox_id.into() }
            }
            _ => Role::Sandbox,
        }
    }

    /// The sandbox-level resources of a pod sandbox's spec. Malformed or non-positive values
    /// count as absent: containerd writes 0 for "no limit".
    pub fn pod_resources(&self) -> PodResources {
        let positive = |key: &str| self.annotation(key)?.trim().parse::<u64>().ok().filter(|v| *v > 0);
        let cpus = match (positive(SANDBOX_CPU_QUOTA), positive(SANDBOX_CPU_PERIOD)) {
            (Some(quota), Some(period)) => Some(quota.div_ceil(period)),
            _ => None,
        };
        PodResources { cpus, memory_bytes: positive(SANDBOX_MEMORY) }
    }

    /// The Kubernetes pod's UID, as CRI annotates the sandbox (and every container).
    pub fn pod_uid(&self) -> Option<&str> {
        self.annotation(SANDBOX_UID).filter(|uid| !uid.is_empty())
    }

    /// The emptyDir size limits the pod's [`EMPTYDIR_SIZE_LIMITS`] annotation sets (none
    /// without it), each checked against `max`; a malformed one is an error naming the
    /// annotation and what is wrong.
    pub fn emptydir_size_limits(&self, max: u64) -> Result<BTreeMap<String, u64>, SpecError> {
        let Some(value) = self.annotation(EMPTYDIR_SIZE_LIMITS) else {
            return Ok(BTreeMap::new());
        };
        parse_size_limits(value, max).map_err(|message| SpecError::Annotation { key: EMPTYDIR_SIZE_LIMITS, message })
    }

    /// The pod's log directory, when containerd names an absolute one.
    pub fn log_directory(&self) -> Option<PathBuf> {
        let dir = Path::new(self.annotation(SANDBOX_LOG_DIRECTORY)?);
        dir.is_absolute().then(|| dir.to_path_buf())
    }

    /// `linux.cgroupsPath`, if set.
    pub fn cgroups_path(&self) -> Option<&str> {
        self.spec.linux().as_ref()?.cgroups_path().as_deref()?.to_str()
    }

    /// The Kubernetes pod's name and namespace, as CRI annotates the sandbox.
    pub fn pod_name(&self) -> Option<&str> {
        self.annotation(SANDBOX_NAME)
    }

    pub fn pod_namespace(&self) -> Option<&str> {
        self.annotation(SANDBOX_NAMESPACE)
    }

    pub fn hostname(&self) -> Option<&str> {
        self.spec.hostname().as_deref()
    }

    /// `process.oomScoreAdj` (containerd gives a sandbox -998 unless kubelet says otherwise).
    pub fn oom_score_adj(&self) -> Option<i32> {
        self.spec.process().as_ref()?.oom_score_adj()
    }

    /// `linux.sysctl`, sorted by name.
    pub fn sysctls(&self) -> Vec<(String, String)> {
        let map = self.spec.linux().as_ref().and_then(|l| l.sysctl().as_ref());
        let mut sysctls: Vec<_> = map.into_iter().flatten().map(|(k, v)| (k.clone(), v.clone())).collect();
        sysctls.sort();
        sysctls
    }

    /// `linux.namespaces` as (type, path); an empty path is no path.
    fn namespaces(&self) -> Vec<(LinuxNamespaceType, Option<&Path>)> {
        let list = self.spec.linux().as_ref().and_then(|l| l.namespaces().as_ref());
        list.into_iter().flatten().map(|ns| (ns.typ(), ns_path(ns))).collect()
    }

    /// Fields the backend cannot honour; refused for sandbox and containers alike.
    fn validate_common(&self, backend: Backend) -> Result<(), SpecError> {
        if self.spec.hooks().as_ref().is_some_and(has_hooks) {
            return Err(unsupported("hooks", "OCI hooks would run on the host, outside the sandbox; not supported"));
        }
        if self.spec.linux().as_ref().is_some_and(|l| l.intel_rdt().is_some()) {
            return Err(unsupported("linux.intelRdt", "not supported by bulkhead"));
        }
        // Cgroup namespaces pass on both backends: containerd gives every container one on a
        // cgroup v2 host (EKS AL2023), and the namespace backend's agent makes it below the
        // container's cgroup as runc does (refusing it failed every container on such a host).
        use LinuxNamespaceType::{Time, User};
        for (typ, _) in self.namespaces() {
            if typ == Time {
                return Err(unsupported(
                    "linux.namespaces[type=time]",
                    format!("not supported by the bulkhead {} backend yet", backend.as_str()),
                ));
            }
            // A pod that asked for its own user namespace must never run in the host's (or the
            // guest's): the agent makes it, with these maps.
            if typ == User {
                self.id_maps()?;
            }
        }
        Ok(())
    }

    /// `linux.uidMappings` and `linux.gidMappings`, which a user namespace needs: both present,
    /// and none onto the host's root (the agent checks the rest).
    fn id_maps(&self) -> Result<PodIdMaps, SpecError> {
        let linux = self.spec.linux().as_ref();
        let uid = linux.and_then(|l| l.uid_mappings().clone()).unwrap_or_default();
        let gid = linux.and_then(|l| l.gid_mappings().clone()).unwrap_or_default();
        for (field, map) in [("linux.uidMappings", &uid), ("linux.gidMappings", &gid)] {
            if map.is_empty() {
                return Err(unsupported(field, "a pod user namespace (hostUsers: false) needs the pod's id maps"));
            }
            if let Some(m) = map.iter().find(|m| m.host_id() == 0) {
                return Err(unsupported(
                    field,
                    format!(
                        "{} {} {} maps onto the host's root, which a pod with hostUsers: false must never be",
                        m.container_id(),
                        m.host_id(),
                        m.size()
                    ),
                ));
            }
        }
        Ok(PodIdMaps { uid, gid })
    }

    /// The id maps of the pod's own user namespace, if this sandbox spec asks for one (checked by
    /// [`Self::validate_sandbox`]).
    pub fn pod_id_maps(&self) -> Result<Option<PodIdMaps>, SpecError> {
        let asks = self.namespaces().iter().any(|(typ, _)| *typ == LinuxNamespaceType::User);
        asks.then(|| self.id_maps()).transpose()
    }

    /// Checks a sandbox spec and returns the pod network namespace to join (`None`: host).
    pub fn validate_sandbox(&self, backend: Backend) -> Result<Option<PathBuf>, SpecError> {
        self.validate_common(backend)?;
        let namespaces = self.namespaces();
        let has = |t: LinuxNamespaceType| namespaces.iter().any(|(typ, _)| *typ == t);
        if !has(LinuxNamespaceType::Pid) {
            return Err(unsupported(
                "linux.namespaces[type=pid]",
                "the pod asks for the host PID namespace (hostPID), which bulkhead cannot honour",
            ));
        }
        if !has(LinuxNamespaceType::Ipc) {
            return Err(unsupported(
                "linux.namespaces[type=ipc]",
                "the pod asks for the host IPC namespace (hostIPC), which bulkhead cannot honour",
            ));
        }
        for (typ, path) in &namespaces {
            // containerd 2.x pins a hostUsers: false pod's user namespace itself and names it here;
            // the agent makes the pod's own with the same maps (crate::sandbox::idmap).
            if !matches!(typ, LinuxNamespaceType::Network | LinuxNamespaceType::User) && path.is_some() {
                return Err(unsupported(
                    format!("linux.namespaces[type={}].path", oci_name(*typ)),
                    "a sandbox can only join an existing network namespace",
                ));
            }
        }
        Ok(namespaces
            .into_iter()
            .find(|(typ, _)| *typ == LinuxNamespaceType::Network)
            .and_then(|(_, path)| path.map(Path::to_path_buf)))
    }

    /// Checks a container spec and returns the spec the agent runs, for the backend to adapt
    /// further. Namespace paths that name the sandbox (`/proc/<sandbox pid>/ns/<type>`, CRI's
    /// convention) are removed: in the sandbox, the agent's own namespaces are the pod's. On the
    /// vm backend, the host's LSM labels are removed too ([`drop_lsm_labels`]).
    pub fn translate_container(&self, sandbox_pid: u32, backend: Backend) -> Result<Spec, SpecError> {
        self.validate_common(backend)?;
        let mut spec = self.spec.clone();
        if backend == Backend::Vm {
            drop_lsm_labels(&mut spec);
        }
        if let Some(list) = spec.linux_mut().as_mut().and_then(|l| l.namespaces_mut().as_mut()) {
            let mut kept = Vec::with_capacity(list.len());
            for ns in list.drain(..) {
                match ns_path(&ns) {
                    // The pod's user namespace is the agent's (containerd names the one it pinned):
                    // the agent joins the container to it, and refuses one its pod does not have.
                    Some(_) if ns.typ() == LinuxNamespaceType::User => {
                        let mut ns = ns;
                        ns.set_path(None);
                        kept.push(ns);
                    }
                    None => kept.push(ns),
                    Some(path) if points_at_sandbox(path, sandbox_pid, ns.typ()) => {}
                    Some(path) => {
                        return Err(unsupported(
                            format!("linux.namespaces[type={}].path", oci_name(ns.typ())),
                            format!("{} is not the pod sandbox's namespace", path.display()),
                        ))
                    }
                }
            }
            *list = kept;
        }
        Ok(spec)
    }
}

/// The JSON the agent gets: the one place a spec the shim parsed is encoded again.
pub fn encode(spec: &Spec) -> Result<Vec<u8>, SpecError> {
    serde_json::to_vec(spec).map_err(|e| SpecError::Encode { what: "OCI spec", message: e.to_string() })
}

/// A namespace's path, if it names one (an empty path names none).
fn ns_path(ns: &LinuxNamespace) -> Option<&Path> {
    ns.path().as_deref().filter(|p| !p.as_os_str().is_empty())
}

/// A namespace type as the OCI spec names it (`linux.namespaces[].type`).
fn oci_name(typ: LinuxNamespaceType) -> &'static str {
    match typ {
        LinuxNamespaceType::Mount => "mount",
        LinuxNamespaceType::Cgroup => "cgroup",
        LinuxNamespaceType::Uts => "uts",
        LinuxNamespaceType::Ipc => "ipc",
        LinuxNamespaceType::User => "user",
        LinuxNamespaceType::Pid => "pid",
        LinuxNamespaceType::Network => "network",
        LinuxNamespaceType::Time => "time",
    }
}

/// Whether the spec sets any hook, of any kind.
#[allow(deprecated)] // `prestart`: deprecated by the runtime spec, and still a hook to refuse
fn has_hooks(hooks: &Hooks) -> bool {
    [
        hooks.prestart(),
        hooks.create_runtime(),
        hooks.create_container(),
        hooks.start_container(),
        hooks.poststart(),
        hooks.poststop(),
    ]
    .into_iter()
    .any(|list| list.as_ref().is_some_and(|l| !l.is_empty()))
}

/// The host's LSM labels, which name profiles and contexts of the host's AppArmor or SELinux
/// policy. The guest kernel has no LSM, so libcontainer would refuse them; the VM boundary is
/// the isolation there. Each one dropped is logged.
fn drop_lsm_labels(spec: &mut Spec) {
    if let Some(process) = spec.process_mut() {
        drop_process_labels(process);
    }
    if let Some(linux) = spec.linux_mut() {
        if let Some(label) = linux.mount_label_mut().take() {
            log_dropped("mountLabel", &label);
        }
    }
}

/// [`drop_lsm_labels`] of a process (a container's, or an exec's).
fn drop_process_labels(process: &mut Process) {
    if let Some(label) = process.apparmor_profile().clone() {
        log_dropped("apparmorProfile", &label);
        process.set_apparmor_profile(None);
    }
    if let Some(label) = process.selinux_label().clone() {
        log_dropped("selinuxLabel", &label);
        process.set_selinux_label(None);
    }
}

fn log_dropped(field: &str, label: &str) {
    tracing::info!(field, label, "the guest kernel has no LSM: the host's label is not applied inside the VM");
}

/// Whether `path` is `/proc/<sandbox_pid>/ns/<file>` of namespace `typ`.
fn points_at_sandbox(path: &Path, sandbox_pid: u32, typ: LinuxNamespaceType) -> bool {
    let file = match typ {
        LinuxNamespaceType::Network => "net",
        LinuxNamespaceType::Mount => "mnt",
        other => oci_name(other),
    };
    path.as_os_str() == format!("/proc/{sandbox_pid}/ns/{file}").as_str()
}

/// The OCI `process` of an Exec request (containerd sends it as JSON in an Any), parsed as the
/// agent parses it, checked, and encoded for the agent; on the vm backend without the host's
/// LSM labels, as for the container itself.
pub fn exec_process_json(value: &[u8], backend: Backend) -> Result<Vec<u8>, SpecError> {
    let mut process: Process = serde_json::from_slice(value)
        .map_err(|e| SpecError::Read { path: "exec process".into(), message: e.to_string() })?;
    if process.args().as_ref().is_none_or(|args| args.is_empty()) {
        return Err(unsupported("process.args", "an exec needs a command"));
    }
    if backend == Backend::Vm {
        drop_process_labels(&mut process);
    }
    serde_json::to_vec(&process).map_err(|e| SpecError::Encode { what: "exec process", message: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use oci_spec::runtime::LinuxNamespaceType::{Cgroup, Ipc, Mount, Network, Pid, Uts};
    use serde_json::json;

    /// A spec as containerd hands it over: JSON, parsed as the shim parses a bundle's.
    fn spec(json: impl serde::Serialize) -> BundleSpec {
        BundleSpec::from_bytes(&serde_json::to_vec(&json).unwrap()).unwrap()
    }

    /// An OCI process as containerd writes one (`user` and `cwd` are required).
    fn process(args: &[&str]) -> Process {
        serde_json::from_value(json!({"args": args, "user": {"uid": 0, "gid": 0}, "cwd": "/"})).unwrap()
    }

    fn ns(typ: LinuxNamespaceType, path: Option<&str>) -> LinuxNamespace {
        let mut ns = LinuxNamespace::default();
        ns.set_typ(typ);
        ns.set_path(path.map(PathBuf::from));
        ns
    }

    /// A pod sandbox's spec as CRI makes it, with `extra` annotations.
    fn sandbox_spec_with(extra: &[(&str, &str)]) -> BundleSpec {
        let mut annotations = BTreeMap::from([(CONTAINER_TYPE, "sandbox")]);
        annotations.extend(extra.iter().copied());
        spec(json!({
            "annotations": annotations,
            "hostname": "pod-a",
            "process": process(&["/pause"]),
            "linux": {
                "namespaces": [
                    {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
                    {"type": "network", "path": "/var/run/netns/cni-1"}
                ],
                "sysctl": {"net.ipv4.ip_forward": "1", "kernel.shm_rmid_forced": "1"}
            }
        }))
    }

    fn sandbox_spec() -> BundleSpec {
        sandbox_spec_with(&[])
    }

    /// The sandbox spec, edited.
    fn sandbox_edited(edit: impl FnOnce(&mut Spec)) -> BundleSpec {
        let mut s = sandbox_spec();
        edit(&mut s.spec);
        s
    }

    fn linux(spec: &mut Spec) -> &mut oci_spec::runtime::Linux {
        spec.linux_mut().as_mut().unwrap()
    }

    fn namespaces(spec: &Spec) -> Vec<(LinuxNamespaceType, Option<PathBuf>)> {
        let list = spec.linux().as_ref().unwrap().namespaces().as_ref().unwrap();
        list.iter().map(|ns| (ns.typ(), ns.path().clone())).collect()
    }

    #[test]
    fn roles_follow_cri_annotations() {
        assert_eq!(sandbox_spec().role(), Role::Sandbox);
        let c = spec(json!({"annotations": {CONTAINER_TYPE: "container", SANDBOX_ID: "sb1"}}));
        assert_eq!(c.role(), Role::Container { sandbox_id: "sb1".into() });
        assert_eq!(c.role().group("c1"), "sb1");
        assert_eq!(spec(json!({})).role(), Role::Sandbox);
        let no_id = spec(json!({"annotations": {CONTAINER_TYPE: "container", SANDBOX_ID: ""}}));
        assert_eq!(no_id.role(), Role::Sandbox);
    }

    #[test]
    fn pod_name_and_namespace_come_from_cri_annotations() {
        let s = spec(json!({"annotations": {SANDBOX_NAME: "web", SANDBOX_NAMESPACE: "shop"}}));
        assert_eq!((s.pod_name(), s.pod_namespace()), (Some("web"), Some("shop")));
        assert_eq!(spec(json!({})).pod_name(), None);
    }

    #[test]
    fn sandbox_netns_and_settings_are_read() {
        let s = sandbox_spec();
        assert_eq!(s.validate_sandbox(Backend::Namespace).unwrap(), Some(PathBuf::from("/var/run/netns/cni-1")));
        assert_eq!(s.hostname(), Some("pod-a"));
        let sorted = vec![
            ("kernel.shm_rmid_forced".to_string(), "1".to_string()),
            ("net.ipv4.ip_forward".to_string(), "1".to_string()),
        ];
        assert_eq!(s.sysctls(), sorted);
        let cgroups = spec(json!({"linux": {"cgroupsPath": "kubepods-pod1.slice:cri-containerd:sb1"}}));
        assert_eq!(cgroups.cgroups_path(), Some("kubepods-pod1.slice:cri-containerd:sb1"));
        assert_eq!(spec(json!({})).cgroups_path(), None);
        assert_eq!(spec(json!({})).hostname(), None);
        assert!(spec(json!({})).sysctls().is_empty());
        // Host network: no network namespace, or one without a path (or an empty path).
        let host = sandbox_edited(|s| linux(s).namespaces_mut().as_mut().unwrap()[4] = ns(Network, Some("")));
        assert_eq!(host.validate_sandbox(Backend::Vm).unwrap(), None);
        let host = sandbox_edited(|s| {
            linux(s).namespaces_mut().as_mut().unwrap().pop();
        });
        assert_eq!(host.validate_sandbox(Backend::Vm).unwrap(), None);
    }

    #[test]
    fn pod_resources_come_from_the_sandbox_annotations() {
        let s = sandbox_spec_with(&[
            (SANDBOX_CPU_QUOTA, "150000"),
            (SANDBOX_CPU_PERIOD, "100000"),
            (SANDBOX_MEMORY, "268435456"),
            (SANDBOX_LOG_DIRECTORY, "/var/log/pods/ns_pod_uid"),
        ]);
        assert_eq!(s.pod_resources(), PodResources { cpus: Some(2), memory_bytes: Some(256 << 20) });
        assert_eq!(s.log_directory(), Some(PathBuf::from("/var/log/pods/ns_pod_uid")));
        // containerd writes 0 for "no limit"; junk and a relative log dir count as absent.
        let s = sandbox_spec_with(&[
            (SANDBOX_CPU_QUOTA, "0"),
            (SANDBOX_CPU_PERIOD, "100000"),
            (SANDBOX_MEMORY, "-5"),
            (SANDBOX_LOG_DIRECTORY, "relative/dir"),
        ]);
        assert_eq!(s.pod_resources(), PodResources::default());
        assert_eq!(s.log_directory(), None);
        assert_eq!(spec(json!({"annotations": {SANDBOX_MEMORY: "7x"}})).pod_resources(), PodResources::default());
    }

    #[test]
    fn annotations_that_are_not_strings_are_a_malformed_spec() {
        // The runtime spec's annotations are strings; containerd never writes others, and the
        // agent's parse refuses them just the same.
        let err = BundleSpec::from_bytes(br#"{"annotations": {"io.kubernetes.cri.sandbox-memory": 7}}"#).unwrap_err();
        assert!(err.to_string().contains("invalid type: integer"), "{err}");
    }

    #[test]
    fn host_pid_is_refused_naming_the_field() {
        let no_pid = sandbox_edited(|s| {
            linux(s).set_namespaces(Some(vec![ns(Ipc, None), ns(Mount, None)]));
        });
        let err = no_pid.validate_sandbox(Backend::Namespace).unwrap_err();
        assert!(err.to_string().contains("linux.namespaces[type=pid]"), "{err}");
        let no_ipc = sandbox_edited(|s| {
            linux(s).set_namespaces(Some(vec![ns(Pid, None), ns(Mount, None)]));
        });
        let err = no_ipc.validate_sandbox(Backend::Vm).unwrap_err();
        assert!(err.to_string().contains("linux.namespaces[type=ipc]"), "{err}");
        let joined =
            sandbox_edited(|s| linux(s).namespaces_mut().as_mut().unwrap()[3] = ns(Mount, Some("/proc/1/ns/mnt")));
        let err = joined.validate_sandbox(Backend::Vm).unwrap_err();
        assert!(err.to_string().contains("linux.namespaces[type=mount].path"), "{err}");
    }

    #[test]
    fn hooks_and_intel_rdt_are_refused() {
        for kind in ["prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"] {
            let hooks: Hooks = serde_json::from_value(json!({kind: [{"path": "/bin/true"}]})).unwrap();
            let s = sandbox_edited(|s| {
                s.set_hooks(Some(hooks));
            });
            let err = s.validate_sandbox(Backend::Namespace).unwrap_err().to_string();
            assert!(err.contains("OCI spec field hooks"), "{kind}: {err}");
        }
        let empty: Hooks = serde_json::from_value(json!({"prestart": [], "poststop": []})).unwrap();
        let s = sandbox_edited(|s| {
            s.set_hooks(Some(empty));
        });
        assert!(s.validate_sandbox(Backend::Vm).is_ok(), "empty hook lists are no hooks");
        let rdt = serde_json::from_value(json!({"closID": "c"})).unwrap();
        let s = sandbox_edited(|s| {
            linux(s).set_intel_rdt(Some(rdt));
        });
        assert!(s.validate_sandbox(Backend::Vm).unwrap_err().to_string().contains("linux.intelRdt"));
        let null = spec(json!({"linux": {"intelRdt": null, "namespaces": [{"type": "pid"}, {"type": "ipc"}]}}));
        assert!(null.validate_sandbox(Backend::Vm).is_ok());
    }

    #[test]
    fn container_namespaces_of_the_sandbox_are_dropped() {
        let s = spec(json!({
            "process": process(&["sh"]),
            "linux": {"namespaces": [
                {"type": "pid"},
                {"type": "network", "path": "/proc/42/ns/net"},
                {"type": "ipc", "path": "/proc/42/ns/ipc"},
                {"type": "uts", "path": "/proc/42/ns/uts"},
                {"type": "mount"},
                {"type": "cgroup", "path": ""}
            ]}
        }));
        let out = s.translate_container(42, Backend::Vm).unwrap();
        assert_eq!(namespaces(&out), vec![(Pid, None), (Mount, None), (Cgroup, Some(PathBuf::new()))]);
        assert_eq!(out.process().as_ref().unwrap().args().as_deref(), Some(&["sh".to_string()][..]));
        // Everything else is the spec as it came; the bundle's own spec is untouched.
        let mut want = s.spec().clone();
        want.linux_mut().as_mut().unwrap().set_namespaces(out.linux().as_ref().unwrap().namespaces().clone());
        assert_eq!(out, want);
        assert_eq!(namespaces(s.spec()).len(), 6);
        let mnt = spec(json!({"linux": {"namespaces": [{"type": "mount", "path": "/proc/42/ns/mnt"}]}}));
        assert_eq!(namespaces(&mnt.translate_container(42, Backend::Namespace).unwrap()), vec![]);
    }

    #[test]
    fn foreign_namespace_paths_are_refused() {
        for path in ["/proc/7/ns/net", "/proc/42/ns/ipc", "/var/run/netns/other"] {
            let s = spec(json!({"linux": {"namespaces": [{"type": "network", "path": path}]}}));
            let err = s.translate_container(42, Backend::Namespace).unwrap_err().to_string();
            assert!(err.contains("linux.namespaces[type=network].path") && err.contains(path), "{err}");
        }
    }

    #[test]
    fn exec_process_needs_args() {
        let json = |args: &[&str]| serde_json::to_vec(&process(args)).unwrap();
        for backend in [Backend::Vm, Backend::Namespace] {
            let out = exec_process_json(&json(&["ls"]), backend).unwrap();
            let parsed: Process = serde_json::from_slice(&out).unwrap();
            assert_eq!(parsed, process(&["ls"]));
            let err = exec_process_json(&json(&[]), backend).unwrap_err().to_string();
            assert!(err.contains("process.args"), "{err}");
            assert!(exec_process_json(br#"{"cwd": "/", "user": {"uid": 0, "gid": 0}}"#, backend).is_err());
            let err = exec_process_json(b"not json", backend).unwrap_err().to_string();
            assert!(err.starts_with("OCI spec exec process: "), "{err}");
            let err = exec_process_json(br#"{"args": ["ls"]}"#, backend).unwrap_err().to_string();
            assert!(err.contains("missing field"), "{err}");
        }
    }

    #[test]
    fn both_backends_keep_cgroup_namespaces() {
        let s = sandbox_edited(|s| linux(s).namespaces_mut().as_mut().unwrap().push(ns(Cgroup, None)));
        assert!(s.validate_sandbox(Backend::Vm).is_ok());
        assert!(s.validate_sandbox(Backend::Namespace).is_ok(), "containerd's spec on a cgroup v2 host");
        let c = spec(json!({"process": process(&["sh"]), "linux": {"namespaces": [{"type": "cgroup"}]}}));
        for backend in [Backend::Vm, Backend::Namespace] {
            assert_eq!(namespaces(&c.translate_container(42, backend).unwrap()), vec![(Cgroup, None)]);
        }
        for backend in [Backend::Vm, Backend::Namespace] {
            let s = spec(json!({"linux": {"namespaces": [{"type": "time"}]}}));
            let err = s.validate_sandbox(backend).unwrap_err().to_string();
            assert!(err.contains("type=time"), "{err}");
            assert!(s.translate_container(42, backend).is_err());
        }
    }

    /// A hostUsers: false pod's sandbox spec as containerd 2.1 writes it: the user namespace it pinned, by path,
    /// and the pod's maps; its containers' name the same path.
    fn userns_spec(maps: serde_json::Value) -> serde_json::Value {
        json!({
            "process": process(&["sh"]),
            "linux": {
                "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "user", "path": "/run/containerd/userns/x"}],
                "uidMappings": maps, "gidMappings": maps
            }
        })
    }

    #[test]
    fn a_pod_user_namespace_needs_its_maps_and_never_maps_the_hosts_root() {
        let maps = json!([{"containerID": 0, "hostID": 65536, "size": 65536}]);
        let s = spec(userns_spec(maps.clone()));
        for backend in [Backend::Namespace, Backend::Vm] {
            assert!(s.validate_sandbox(backend).is_ok());
            // A container keeps the user namespace without containerd's path: the agent joins it to the pod's.
            let c = s.translate_container(42, backend).unwrap();
            assert_eq!(namespaces(&c), vec![(Pid, None), (Ipc, None), (LinuxNamespaceType::User, None)]);
        }
        let pod = s.pod_id_maps().unwrap().unwrap();
        assert_eq!((pod.uid[0].host_id(), pod.gid[0].size()), (65536, 65536));
        assert_eq!(sandbox_spec().pod_id_maps().unwrap(), None);

        let root = spec(userns_spec(json!([{"containerID": 0, "hostID": 0, "size": 65536}])));
        let err = root.validate_sandbox(Backend::Namespace).unwrap_err().to_string();
        assert!(err.contains("linux.uidMappings") && err.contains("host's root"), "{err}");
        let mut none = userns_spec(maps);
        none["linux"]["gidMappings"] = json!([]);
        let err = spec(none).validate_sandbox(Backend::Namespace).unwrap_err().to_string();
        assert!(err.contains("linux.gidMappings") && err.contains("needs the pod's id maps"), "{err}");
    }

    #[test]
    fn the_vm_backend_drops_the_hosts_lsm_labels() {
        let mut p = process(&["sh"]);
        p.set_apparmor_profile(Some("cri-containerd.apparmor.d".into()));
        p.set_selinux_label(Some("system_u:x".into()));
        let c = spec(
            json!({"process": p, "linux": {"mountLabel": "system_u:object_r:x", "namespaces": [{"type": "pid"}]}}),
        );
        let out = c.translate_container(42, Backend::Vm).unwrap();
        assert_eq!(out.process().as_ref(), Some(&process(&["sh"])));
        assert_eq!(out.linux().as_ref().unwrap().mount_label(), &None);
        assert_eq!(namespaces(&out), vec![(Pid, None)], "the rest of linux stays");
        let kept = c.translate_container(42, Backend::Namespace).unwrap();
        assert_eq!(&kept, c.spec(), "the host applies its own labels");

        let mut exec = process(&["ls"]);
        exec.set_apparmor_profile(Some("p".into()));
        exec.set_selinux_label(Some("l".into()));
        let json = serde_json::to_vec(&exec).unwrap();
        let out: Process = serde_json::from_slice(&exec_process_json(&json, Backend::Vm).unwrap()).unwrap();
        assert_eq!(out, process(&["ls"]));
        let kept: Process = serde_json::from_slice(&exec_process_json(&json, Backend::Namespace).unwrap()).unwrap();
        assert_eq!(kept, exec);
    }

    #[test]
    fn what_goes_to_the_agent_parses_back_to_the_same_spec() {
        let c = spec(json!({
            "ociVersion": "1.1.0",
            "process": process(&["sh"]),
            "root": {"path": "rootfs", "readonly": true},
            "mounts": [{"destination": "/data", "type": "bind", "source": "/v", "options": ["rbind", "ro"]}],
            "annotations": {CONTAINER_TYPE: "container", SANDBOX_ID: "sb1"},
            "linux": {"namespaces": [{"type": "pid"}, {"type": "uts", "path": "/proc/42/ns/uts"}]}
        }));
        for backend in [Backend::Vm, Backend::Namespace] {
            let out = c.translate_container(42, backend).unwrap();
            assert_eq!(BundleSpec::from_bytes(&encode(&out).unwrap()).unwrap().spec(), &out);
        }
        assert_eq!(namespaces(c.spec()), vec![(Pid, None), (Uts, Some("/proc/42/ns/uts".into()))]);
    }

    #[test]
    fn emptydir_size_limits_come_from_one_pod_annotation() {
        const MAX: u64 = crate::config::MAX_EMPTYDIR_BYTES;
        let s = spec(json!({"annotations": {
            EMPTYDIR_SIZE_LIMITS: "scratch=32Mi, cache=1G,x=2e6",
            SANDBOX_UID: "0b1c-uid"
        }}));
        let limits = s.emptydir_size_limits(MAX).unwrap();
        let want = [("cache", 1_000_000_000), ("scratch", 32 << 20), ("x", 2_000_000)];
        assert_eq!(limits, want.into_iter().map(|(k, v)| (k.to_string(), v)).collect());
        assert_eq!(s.pod_uid(), Some("0b1c-uid"));
        assert!(spec(json!({})).emptydir_size_limits(MAX).unwrap().is_empty());
        assert_eq!(spec(json!({"annotations": {SANDBOX_UID: ""}})).pod_uid(), None);
    }

    #[test]
    fn malformed_emptydir_size_limits_name_the_annotation_and_the_fault() {
        const MAX: u64 = crate::config::MAX_EMPTYDIR_BYTES;
        for (value, fault) in [
            ("", "entry 1"),
            ("scratch", "is not name=size"),
            ("scratch=32Mi,", "entry 2"),
            ("scratch=32Mi,,cache=1Gi", "entry 2"),
            ("scratch = 32Mi", "\"scratch \" is not a volume name"),
            ("Scratch=32Mi", "not a volume name"),
            ("-a=32Mi", "not a volume name"),
            ("a-=32Mi", "not a volume name"),
            ("../x=32Mi", "not a volume name"),
            ("a/b=32Mi", "not a volume name"),
            ("=32Mi", "not a volume name"),
            ("scratch=", "volume scratch: empty quantity"),
            ("scratch=32MiB", "volume scratch"),
            ("scratch=-1Gi", "negative"),
            ("scratch=500m", "milli"),
            ("scratch=1e40", "volume scratch"),
            ("scratch=999999999999999999999", "digits"),
            ("scratch=512Ki", "outside 1Mi..=16Ti"),
            ("scratch=17Ti", "outside 1Mi..=16Ti"),
            ("scratch=1Mi,scratch=2Mi", "named twice"),
        ] {
            let s = spec(json!({"annotations": {EMPTYDIR_SIZE_LIMITS: value}}));
            let err = s.emptydir_size_limits(MAX).unwrap_err().to_string();
            assert!(err.starts_with("pod annotation bulkhead.io/emptydir-size-limits: "), "{value:?}: {err}");
            assert!(err.contains(fault), "{value:?}: {err}");
        }
        let long = format!("a={}", "1".repeat(9000));
        assert!(parse_size_limits(&long, MAX).unwrap_err().contains("longer than"));
        let many: Vec<String> = (0..129).map(|i| format!("v{i}=1Mi")).collect();
        assert!(parse_size_limits(&many.join(","), MAX).unwrap_err().contains("more than 128"));
        // The node's ceiling: an annotation above it is refused, naming the ceiling.
        let err = parse_size_limits("scratch=2Gi", 1 << 30).unwrap_err();
        assert!(err.contains("outside 1Mi..=1Gi"), "{err}");
    }

    #[test]
    fn malformed_bundle_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), b"{").unwrap();
        let err = BundleSpec::load(dir.path()).unwrap_err().to_string();
        assert!(err.starts_with("OCI spec ") && err.contains("config.json: EOF"), "{err}");
        assert!(BundleSpec::load(&dir.path().join("missing")).is_err());
        // Well-formed JSON that is no OCI spec: the error names the field.
        std::fs::write(dir.path().join("config.json"), br#"{"linux": {"namespaces": [{"type": "bogus"}]}}"#).unwrap();
        let err = BundleSpec::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("unknown variant `bogus`"), "{err}");
        std::fs::write(dir.path().join("config.json"), br#"{"process": {"args": ["sh"]}}"#).unwrap();
        let err = BundleSpec::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("missing field `user`"), "{err}");
        // The size limit holds before any parse.
        std::fs::write(dir.path().join("config.json"), vec![b' '; MAX_SPEC_BYTES as usize + 1]).unwrap();
        assert!(BundleSpec::load(dir.path()).unwrap_err().to_string().contains("larger than"));
    }
}
