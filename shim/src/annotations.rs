//! The annotations of a pod's sandbox spec that the shim reads (`crate::spec`): CRI's, which
//! containerd writes and the sandboxer writes too on the sandbox API path
//! (`crate::sandboxer::pod_spec`), and bulkhead's own pod annotations. One list for the writer
//! and the reader.

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
