//! The OCI spec, as far as the shim cares: which pod a bundle belongs to, validation against
//! what the backend can honour (errors name the field), and translation into the spec the
//! agent runs (namespace paths that point at the sandbox become "the agent's own").
//!
//! Works on the JSON value, so fields the shim does not know pass through untouched.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::config::Backend;

/// CRI annotation: "sandbox" or "container".
pub const CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";
/// CRI annotation: the pod sandbox id of a container.
pub const SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";
/// CRI annotations: the Kubernetes name and namespace of the pod.
pub const SANDBOX_NAME: &str = "io.kubernetes.cri.sandbox-name";
pub const SANDBOX_NAMESPACE: &str = "io.kubernetes.cri.sandbox-namespace";

/// CRI annotations of the pod's sandbox-level resources (containerd 1.6.7+; kubelet sums the
/// containers' requests and limits): CFS quota and period in microseconds, memory in bytes.
pub const SANDBOX_CPU_QUOTA: &str = "io.kubernetes.cri.sandbox-cpu-quota";
pub const SANDBOX_CPU_PERIOD: &str = "io.kubernetes.cri.sandbox-cpu-period";
pub const SANDBOX_MEMORY: &str = "io.kubernetes.cri.sandbox-memory";
/// CRI annotation: the pod's log directory, where a sandbox may write logs of its own
/// (kubelet removes it with the pod).
pub const SANDBOX_LOG_DIRECTORY: &str = "io.kubernetes.cri.sandbox-log-directory";

/// CRI annotation: the Kubernetes pod's UID (containerd 1.6+), which names the pod's directory
/// under kubelet's root (`<root>/pods/<uid>/volumes/...`).
pub const SANDBOX_UID: &str = "io.kubernetes.cri.sandbox-uid";

/// Pod annotation: size limits of the pod's emptyDir volumes, `name=quantity` pairs separated
/// by commas (`"scratch=1Gi, cache=500Mi"`), as an operator or a mutating webhook copies them
/// from the volumes' `sizeLimit` (CRI carries no sizeLimit). One annotation for all volumes,
/// not one per volume: containerd passes a pod annotation to the shim only when it matches the
/// handler's `pod_annotations` with Go's `path.Match`, where `*` never matches `/`, so the
/// installer's `bulkhead.io/*` admits `bulkhead.io/<name>` and nothing deeper; and a per-volume
/// key `bulkhead.io/<prefix><volume>` would not fit every volume name (63 characters) into
/// Kubernetes' 63-character name part.
pub const EMPTYDIR_SIZE_LIMITS: &str = "bulkhead.io/emptydir-size-limits";
/// Upper bounds of that annotation: its length and its number of volumes.
const MAX_SIZE_LIMITS_BYTES: usize = 8 << 10;
const MAX_SIZE_LIMITS_VOLUMES: usize = 128;

/// The pod's sandbox-level resources; `None` where containerd passes nothing (or zero: no limit).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PodResources {
    /// CPUs the pod may use, rounded up: ceil(quota / period).
    pub cpus: Option<u64>,
    /// The pod's memory limit in bytes.
    pub memory_bytes: Option<u64>,
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

/// A bundle's spec.
#[derive(Debug, Clone)]
pub struct BundleSpec {
    pub value: Value,
}

impl BundleSpec {
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

    pub fn from_bytes(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        let value: Value = serde_json::from_slice(bytes)?;
        Ok(Self { value })
    }

    fn annotation(&self, key: &str) -> Option<&str> {
        self.value.get("annotations")?.get(key)?.as_str()
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
        let Some(value) = self.value.get("annotations").and_then(|a| a.get(EMPTYDIR_SIZE_LIMITS)) else {
            return Ok(BTreeMap::new());
        };
        let bad = |message: String| SpecError::Annotation { key: EMPTYDIR_SIZE_LIMITS, message };
        let value = value.as_str().ok_or_else(|| bad("not a string".into()))?;
        parse_size_limits(value, max).map_err(bad)
    }

    /// The pod's log directory, when containerd names an absolute one.
    pub fn log_directory(&self) -> Option<PathBuf> {
        let dir = Path::new(self.annotation(SANDBOX_LOG_DIRECTORY)?);
        dir.is_absolute().then(|| dir.to_path_buf())
    }

    /// `linux.cgroupsPath`, if set.
    pub fn cgroups_path(&self) -> Option<&str> {
        self.value.pointer("/linux/cgroupsPath")?.as_str()
    }

    /// The Kubernetes pod's name and namespace, as CRI annotates the sandbox.
    pub fn pod_name(&self) -> Option<&str> {
        self.annotation(SANDBOX_NAME)
    }

    pub fn pod_namespace(&self) -> Option<&str> {
        self.annotation(SANDBOX_NAMESPACE)
    }

    pub fn hostname(&self) -> Option<&str> {
        self.value.get("hostname")?.as_str()
    }

    pub fn sysctls(&self) -> Vec<(String, String)> {
        self.value
            .pointer("/linux/sysctl")
            .and_then(Value::as_object)
            .map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect())
            .unwrap_or_default()
    }

    fn namespaces(&self) -> Vec<(String, Option<String>)> {
        self.value
            .pointer("/linux/namespaces")
            .and_then(Value::as_array)
            .map(|list| {
                list.iter()
                    .filter_map(|ns| {
                        let typ = ns.get("type")?.as_str()?.to_string();
                        let path = ns.get("path").and_then(Value::as_str).filter(|p| !p.is_empty()).map(str::to_string);
                        Some((typ, path))
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Fields the backend cannot honour; refused for sandbox and containers alike.
    fn validate_common(&self, backend: Backend) -> Result<(), SpecError> {
        if let Some(hooks) = self.value.get("hooks").and_then(Value::as_object) {
            if hooks.values().any(|v| v.as_array().is_some_and(|a| !a.is_empty())) {
                return Err(unsupported(
                    "hooks",
                    "OCI hooks would run on the host, outside the sandbox; not supported",
                ));
            }
        }
        if self.value.pointer("/linux/intelRdt").is_some_and(|v| !v.is_null()) {
            return Err(unsupported("linux.intelRdt", "not supported by bulkhead"));
        }
        // The guest kernel has cgroup namespaces (containerd gives every container one on cgroup
        // v2 hosts); the namespace backend's agent cannot nest them inside the host's.
        let refused: &[&str] = match backend {
            Backend::Vm => &["user", "time"],
            Backend::Namespace => &["user", "time", "cgroup"],
        };
        for (typ, _) in self.namespaces() {
            if refused.contains(&typ.as_str()) {
                return Err(unsupported(
                    format!("linux.namespaces[type={typ}]"),
                    format!("not supported by the bulkhead {} backend", backend.as_str()),
                ));
            }
        }
        Ok(())
    }

    /// Checks a sandbox spec and returns the pod network namespace to join (`None`: host).
    pub fn validate_sandbox(&self, backend: Backend) -> Result<Option<PathBuf>, SpecError> {
        self.validate_common(backend)?;
        let namespaces = self.namespaces();
        let has = |t: &str| namespaces.iter().any(|(typ, _)| typ == t);
        if !has("pid") {
            return Err(unsupported(
                "linux.namespaces[type=pid]",
                "the pod asks for the host PID namespace (hostPID), which bulkhead cannot honour",
            ));
        }
        if !has("ipc") {
            return Err(unsupported(
                "linux.namespaces[type=ipc]",
                "the pod asks for the host IPC namespace (hostIPC), which bulkhead cannot honour",
            ));
        }
        for (typ, path) in &namespaces {
            if typ != "network" && path.is_some() {
                return Err(unsupported(
                    format!("linux.namespaces[type={typ}].path"),
                    "a sandbox can only join an existing network namespace",
                ));
            }
        }
        Ok(namespaces.into_iter().find(|(typ, _)| typ == "network").and_then(|(_, path)| path.map(PathBuf::from)))
    }

    /// Checks a container spec and returns the JSON the agent runs. Namespace paths that
    /// name the sandbox (`/proc/<sandbox pid>/ns/<type>`, CRI's convention) are removed: in
    /// the sandbox, the agent's own namespaces are the pod's. On the vm backend, the host's LSM
    /// labels are removed too ([`drop_lsm_labels`]).
    pub fn translate_container(&self, sandbox_pid: u32, backend: Backend) -> Result<Vec<u8>, SpecError> {
        self.validate_common(backend)?;
        let mut value = self.value.clone();
        if backend == Backend::Vm {
            drop_lsm_labels(&mut value);
        }
        if let Some(list) = value.pointer_mut("/linux/namespaces").and_then(Value::as_array_mut) {
            let mut kept = Vec::new();
            for ns in list.drain(..) {
                let typ = ns.get("type").and_then(Value::as_str).unwrap_or_default();
                let path = ns.get("path").and_then(Value::as_str).filter(|p| !p.is_empty());
                match path {
                    None => kept.push(ns),
                    Some(path) if points_at_sandbox(path, sandbox_pid, typ) => {}
                    Some(path) => {
                        return Err(unsupported(
                            format!("linux.namespaces[type={typ}].path"),
                            format!("{path} is not the pod sandbox's namespace"),
                        ))
                    }
                }
            }
            *list = kept;
        }
        serde_json::to_vec(&value).map_err(|e| SpecError::Read { path: "config.json".into(), message: e.to_string() })
    }
}

/// Whether `name` is a Kubernetes volume name: a DNS-1123 label (1 to 63 of `a-z`, `0-9` and
/// `-`, starting and ending alphanumeric). So it is also a safe file name.
pub fn is_volume_name(name: &str) -> bool {
    let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let bytes = name.as_bytes();
    (1..=63).contains(&bytes.len())
        && bytes.iter().all(|b| alnum(b) || *b == b'-')
        && bytes.first().is_some_and(alnum)
        && bytes.last().is_some_and(alnum)
}

/// Parses [`EMPTYDIR_SIZE_LIMITS`]'s value: `name=quantity` pairs separated by commas, spaces
/// allowed around a pair, each name a volume name at most once, each size a Kubernetes
/// quantity between [`MIN_EMPTYDIR_BYTES`] and `max` (at most [`MAX_EMPTYDIR_BYTES`]).
///
/// [`MIN_EMPTYDIR_BYTES`]: crate::config::MIN_EMPTYDIR_BYTES
/// [`MAX_EMPTYDIR_BYTES`]: crate::config::MAX_EMPTYDIR_BYTES
pub fn parse_size_limits(value: &str, max: u64) -> Result<BTreeMap<String, u64>, String> {
    use crate::config::{MAX_EMPTYDIR_BYTES, MIN_EMPTYDIR_BYTES};
    use crate::quantity::{format_bytes, parse_bytes};
    if value.len() > MAX_SIZE_LIMITS_BYTES {
        return Err(format!("longer than {MAX_SIZE_LIMITS_BYTES} bytes"));
    }
    let max = max.min(MAX_EMPTYDIR_BYTES);
    let mut limits = BTreeMap::new();
    for (n, pair) in value.split(',').enumerate() {
        let pair = pair.trim_matches(' ');
        let Some((name, size)) = pair.split_once('=') else {
            return Err(format!("entry {} {pair:?} is not name=size (e.g. \"scratch=1Gi, cache=500Mi\")", n + 1));
        };
        if !is_volume_name(name) {
            return Err(format!(
                "{name:?} is not a volume name (1-63 of a-z, 0-9 and '-', starting and ending alphanumeric)"
            ));
        }
        let bytes = parse_bytes(size).map_err(|e| format!("volume {name}: {e}"))?;
        if !(MIN_EMPTYDIR_BYTES..=max).contains(&bytes) {
            return Err(format!(
                "volume {name}: {size} is outside {}..={} (the node's emptydir.max_size_limit or bulkhead's bounds)",
                format_bytes(MIN_EMPTYDIR_BYTES),
                format_bytes(max)
            ));
        }
        if limits.insert(name.to_string(), bytes).is_some() {
            return Err(format!("volume {name} is named twice"));
        }
        if limits.len() > MAX_SIZE_LIMITS_VOLUMES {
            return Err(format!("more than {MAX_SIZE_LIMITS_VOLUMES} volumes"));
        }
    }
    Ok(limits)
}

/// The host's LSM labels, which name profiles and contexts of the host's AppArmor or SELinux
/// policy. The guest kernel has no LSM, so libcontainer would refuse them; the VM boundary is
/// the isolation there. Each one dropped is logged.
fn drop_lsm_labels(value: &mut Value) {
    for pointer in ["/process", "/linux", ""] {
        let Some(object) = value.pointer_mut(pointer).and_then(Value::as_object_mut) else { continue };
        for field in ["apparmorProfile", "selinuxLabel", "mountLabel"] {
            if let Some(label) = object.remove(field) {
                tracing::info!(
                    field,
                    %label,
                    "the guest kernel has no LSM: the host's label is not applied inside the VM"
                );
            }
        }
    }
}

/// Whether `path` is `/proc/<sandbox_pid>/ns/<typ>` (CRI names "network" as "net").
fn points_at_sandbox(path: &str, sandbox_pid: u32, typ: &str) -> bool {
    let file = match typ {
        "network" => "net",
        "mount" => "mnt",
        other => other,
    };
    path == format!("/proc/{sandbox_pid}/ns/{file}")
}

/// The OCI `process` of an Exec request (containerd sends it as JSON in an Any), checked; on
/// the vm backend without the host's LSM labels, as for the container itself.
pub fn exec_process_json(value: &[u8], backend: Backend) -> Result<Vec<u8>, SpecError> {
    let parsed: Map<String, Value> = serde_json::from_slice(value)
        .map_err(|e| SpecError::Read { path: "exec process".into(), message: e.to_string() })?;
    match parsed.get("args").and_then(Value::as_array) {
        Some(args) if !args.is_empty() => {}
        _ => return Err(unsupported("process.args", "an exec needs a command")),
    }
    if backend == Backend::Namespace {
        return Ok(value.to_vec());
    }
    let mut process = Value::Object(parsed);
    drop_lsm_labels(&mut process);
    serde_json::to_vec(&process).map_err(|e| SpecError::Read { path: "exec process".into(), message: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(value: Value) -> BundleSpec {
        BundleSpec { value }
    }

    fn sandbox_spec() -> Value {
        json!({
            "annotations": {CONTAINER_TYPE: "sandbox"},
            "hostname": "pod-a",
            "linux": {
                "namespaces": [
                    {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
                    {"type": "network", "path": "/var/run/netns/cni-1"}
                ],
                "sysctl": {"net.ipv4.ip_forward": "1"}
            }
        })
    }

    #[test]
    fn roles_follow_cri_annotations() {
        assert_eq!(spec(sandbox_spec()).role(), Role::Sandbox);
        let c = spec(json!({"annotations": {CONTAINER_TYPE: "container", SANDBOX_ID: "sb1"}}));
        assert_eq!(c.role(), Role::Container { sandbox_id: "sb1".into() });
        assert_eq!(c.role().group("c1"), "sb1");
        assert_eq!(spec(json!({})).role(), Role::Sandbox);
    }

    #[test]
    fn pod_name_and_namespace_come_from_cri_annotations() {
        let s = spec(json!({"annotations": {SANDBOX_NAME: "web", SANDBOX_NAMESPACE: "shop"}}));
        assert_eq!((s.pod_name(), s.pod_namespace()), (Some("web"), Some("shop")));
        assert_eq!(spec(json!({})).pod_name(), None);
    }

    #[test]
    fn sandbox_netns_and_settings_are_read() {
        let s = spec(sandbox_spec());
        assert_eq!(s.validate_sandbox(Backend::Namespace).unwrap(), Some(PathBuf::from("/var/run/netns/cni-1")));
        assert_eq!(s.hostname(), Some("pod-a"));
        assert_eq!(s.sysctls(), vec![("net.ipv4.ip_forward".into(), "1".into())]);
    }

    #[test]
    fn pod_resources_come_from_the_sandbox_annotations() {
        let mut v = sandbox_spec();
        v["annotations"][SANDBOX_CPU_QUOTA] = json!("150000");
        v["annotations"][SANDBOX_CPU_PERIOD] = json!("100000");
        v["annotations"][SANDBOX_MEMORY] = json!("268435456");
        v["annotations"][SANDBOX_LOG_DIRECTORY] = json!("/var/log/pods/ns_pod_uid");
        let s = spec(v);
        assert_eq!(s.pod_resources(), PodResources { cpus: Some(2), memory_bytes: Some(256 << 20) });
        assert_eq!(s.log_directory(), Some(PathBuf::from("/var/log/pods/ns_pod_uid")));
        // containerd writes 0 for "no limit"; junk and a relative log dir count as absent.
        let mut v = sandbox_spec();
        v["annotations"][SANDBOX_CPU_QUOTA] = json!("0");
        v["annotations"][SANDBOX_CPU_PERIOD] = json!("100000");
        v["annotations"][SANDBOX_MEMORY] = json!("-5");
        v["annotations"][SANDBOX_LOG_DIRECTORY] = json!("relative/dir");
        let s = spec(v);
        assert_eq!(s.pod_resources(), PodResources::default());
        assert_eq!(s.log_directory(), None);
        assert_eq!(spec(json!({"annotations": {SANDBOX_MEMORY: 7}})).pod_resources(), PodResources::default());
    }

    #[test]
    fn host_pid_is_refused_naming_the_field() {
        let mut v = sandbox_spec();
        v["linux"]["namespaces"] = json!([{"type": "ipc"}, {"type": "mount"}]);
        let err = spec(v).validate_sandbox(Backend::Namespace).unwrap_err();
        assert!(err.to_string().contains("linux.namespaces[type=pid]"), "{err}");
    }

    #[test]
    fn hooks_are_refused() {
        let mut v = sandbox_spec();
        v["hooks"] = json!({"prestart": [{"path": "/bin/true"}]});
        assert!(spec(v).validate_sandbox(Backend::Namespace).unwrap_err().to_string().contains("hooks"));
    }

    #[test]
    fn container_namespaces_of_the_sandbox_are_dropped() {
        let s = spec(json!({
            "process": {"args": ["sh"]},
            "linux": {"namespaces": [
                {"type": "pid"},
                {"type": "network", "path": "/proc/42/ns/net"},
                {"type": "ipc", "path": "/proc/42/ns/ipc"},
                {"type": "uts", "path": "/proc/42/ns/uts"},
                {"type": "mount"}
            ]}
        }));
        let out: Value = serde_json::from_slice(&s.translate_container(42, Backend::Namespace).unwrap()).unwrap();
        assert_eq!(out["linux"]["namespaces"], json!([{"type": "pid"}, {"type": "mount"}]));
        assert_eq!(out["process"]["args"], json!(["sh"]));
    }

    #[test]
    fn foreign_namespace_paths_are_refused() {
        let s = spec(json!({"linux": {"namespaces": [
            {"type": "network", "path": "/proc/7/ns/net"}
        ]}}));
        let err = s.translate_container(42, Backend::Namespace).unwrap_err();
        assert!(err.to_string().contains("linux.namespaces[type=network].path"), "{err}");
    }

    #[test]
    fn exec_process_needs_args() {
        for backend in [Backend::Vm, Backend::Namespace] {
            assert!(exec_process_json(br#"{"args":["ls"]}"#, backend).is_ok());
            assert!(exec_process_json(br#"{"args":[]}"#, backend).is_err());
            assert!(exec_process_json(b"not json", backend).is_err());
        }
    }

    #[test]
    fn the_vm_backend_keeps_cgroup_namespaces_the_namespace_backend_refuses_them() {
        let mut v = sandbox_spec();
        v["linux"]["namespaces"].as_array_mut().unwrap().push(json!({"type": "cgroup"}));
        assert!(spec(v.clone()).validate_sandbox(Backend::Vm).is_ok());
        let err = spec(v).validate_sandbox(Backend::Namespace).unwrap_err().to_string();
        assert!(err.contains("linux.namespaces[type=cgroup]") && err.contains("namespace backend"), "{err}");
        let c = spec(json!({"process": {"args": ["sh"]}, "linux": {"namespaces": [{"type": "cgroup"}]}}));
        let out: Value = serde_json::from_slice(&c.translate_container(42, Backend::Vm).unwrap()).unwrap();
        assert_eq!(out["linux"]["namespaces"], json!([{"type": "cgroup"}]));
        let err = spec(json!({"linux": {"namespaces": [{"type": "user"}]}})).validate_sandbox(Backend::Vm);
        assert!(err.unwrap_err().to_string().contains("type=user"));
    }

    #[test]
    fn the_vm_backend_drops_the_hosts_lsm_labels() {
        let c = spec(json!({
            "process": {"args": ["sh"], "apparmorProfile": "cri-containerd.apparmor.d", "selinuxLabel": "system_u:x"},
            "linux": {"mountLabel": "system_u:object_r:x"}
        }));
        let out: Value = serde_json::from_slice(&c.translate_container(42, Backend::Vm).unwrap()).unwrap();
        assert_eq!(out["process"], json!({"args": ["sh"]}));
        assert_eq!(out["linux"], json!({}));
        let kept: Value = serde_json::from_slice(&c.translate_container(42, Backend::Namespace).unwrap()).unwrap();
        assert_eq!(kept["process"]["apparmorProfile"], "cri-containerd.apparmor.d", "the host applies its own");
        let exec = br#"{"args":["ls"],"apparmorProfile":"p","selinuxLabel":"l"}"#;
        let out: Value = serde_json::from_slice(&exec_process_json(exec, Backend::Vm).unwrap()).unwrap();
        assert_eq!(out, json!({"args": ["ls"]}));
        assert_eq!(exec_process_json(exec, Backend::Namespace).unwrap(), exec.to_vec());
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
        let s = spec(json!({"annotations": {EMPTYDIR_SIZE_LIMITS: 5}}));
        assert!(s.emptydir_size_limits(MAX).unwrap_err().to_string().contains("not a string"));
        // The node's ceiling: an annotation above it is refused, naming the ceiling.
        let err = parse_size_limits("scratch=2Gi", 1 << 30).unwrap_err();
        assert!(err.contains("outside 1Mi..=1Gi"), "{err}");
        assert!(is_volume_name(&"a".repeat(63)) && !is_volume_name(&"a".repeat(64)));
    }

    #[test]
    fn malformed_bundle_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), b"{").unwrap();
        assert!(BundleSpec::load(dir.path()).is_err());
        assert!(BundleSpec::load(&dir.path().join("missing")).is_err());
    }
}
