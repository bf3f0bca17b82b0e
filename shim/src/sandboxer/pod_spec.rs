//! The pod sandbox's spec, made from the CRI `PodSandboxConfig` that containerd 2.x hands the
//! sandbox API: the same spec its `podsandbox` controller would have given the pause container
//! (annotations, hostname, sysctls, cgroupsPath, namespaces, resolv.conf mount), so both paths
//! go through one sandbox create, with the same checks and the same refusals.

use std::collections::HashMap;
use std::path::Path;

use containerd_shim::protos::protobuf::well_known_types::any::Any;
use k8s_cri::v1::{DnsConfig, NamespaceMode, PodSandboxConfig};
use oci_spec::runtime::{
    LinuxBuilder, LinuxIdMapping, LinuxNamespace, LinuxNamespaceBuilder, LinuxNamespaceType, Mount, Spec,
};
use prost::Message as _;

use crate::annotations::{
    CONTAINER_TYPE, SANDBOX_CPU_PERIOD, SANDBOX_CPU_QUOTA, SANDBOX_ID, SANDBOX_LOG_DIRECTORY, SANDBOX_MEMORY,
    SANDBOX_NAME, SANDBOX_NAMESPACE, SANDBOX_UID,
};

/// The type URL containerd 2.x gives `CreateSandboxRequest.options` (gogo's registry name, no
/// `type.googleapis.com/` prefix; accepted with one too).
pub const POD_SANDBOX_CONFIG_TYPE: &str = "runtime.v1.PodSandboxConfig";

/// Largest pod config accepted. kubelet's is a few KiB; annotations are capped at 256 KiB by the
/// API server.
pub const MAX_POD_CONFIG: usize = 1 << 20;

/// Pod annotations that reach the sandbox spec: bulkhead's own, as the installer's
/// `pod_annotations` lets through on the `podsandbox` path.
const POD_ANNOTATION_PREFIX: &str = "bulkhead.io/";

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PodConfigError {
    #[error("CreateSandbox carries no pod config (options); containerd's CRI always sends one")]
    Missing,
    #[error("CreateSandbox options are a {0:?}, not a {POD_SANDBOX_CONFIG_TYPE}")]
    WrongType(String),
    #[error("CreateSandbox pod config is {0} bytes, over the {MAX_POD_CONFIG}-byte limit")]
    TooBig(usize),
    #[error("CreateSandbox pod config does not decode: {0}")]
    Decode(String),
}

/// Decodes `CreateSandboxRequest.options`.
pub fn decode(options: Option<&Any>) -> Result<PodSandboxConfig, PodConfigError> {
    let any = options.ok_or(PodConfigError::Missing)?;
    let name = any.type_url.rsplit('/').next().unwrap_or_default();
    if name != POD_SANDBOX_CONFIG_TYPE {
        return Err(PodConfigError::WrongType(any.type_url.clone()));
    }
    if any.value.len() > MAX_POD_CONFIG {
        return Err(PodConfigError::TooBig(any.value.len()));
    }
    PodSandboxConfig::decode(any.value.as_slice()).map_err(|e| PodConfigError::Decode(e.to_string()))
}

/// The pod's resolv.conf, as containerd's CRI writes it for a pause container; `None` when the
/// pod has no DNS config (its containers then keep the image's).
pub fn resolv_conf(dns: Option<&DnsConfig>) -> Option<String> {
    let dns = dns.filter(|d| !(d.servers.is_empty() && d.searches.is_empty() && d.options.is_empty()))?;
    let mut text = String::new();
    if !dns.searches.is_empty() {
        text.push_str(&format!("search {}\n", dns.searches.join(" ")));
    }
    for server in &dns.servers {
        text.push_str(&format!("nameserver {server}\n"));
    }
    if !dns.options.is_empty() {
        text.push_str(&format!("options {}\n", dns.options.join(" ")));
    }
    Some(text)
}

/// The pause container's `linux.cgroupsPath` under `parent`, as containerd makes it: a systemd
/// slice gives `slice:cri-containerd:id`, a cgroupfs parent `parent/id`.
pub fn cgroups_path(parent: &str, id: &str) -> Option<String> {
    if parent.is_empty() {
        None
    } else if parent.ends_with(".slice") {
        let slice = Path::new(parent).file_name()?.to_str()?;
        Some(format!("{slice}:cri-containerd:{id}"))
    } else {
        Some(Path::new(parent).join(id).to_str()?.to_string())
    }
}

/// CRI's id maps as OCI's (a pod's user namespace).
fn id_maps(maps: &[k8s_cri::v1::IdMapping]) -> Vec<LinuxIdMapping> {
    maps.iter().filter_map(|m| crate::sandbox::idmap::id_mapping(m.container_id, m.host_id, m.length)).collect()
}

fn namespace(typ: LinuxNamespaceType, path: Option<&str>) -> LinuxNamespace {
    let mut builder = LinuxNamespaceBuilder::default().typ(typ);
    if let Some(path) = path {
        builder = builder.path(path);
    }
    // Infallible: the builder's only required field is set.
    builder.build().unwrap_or_default()
}

/// The sandbox spec for pod `id`. `netns_path`: the network namespace CRI made (empty for a
/// host-network pod); `resolv_conf`: where the pod's resolv.conf was written, if it has one.
pub fn sandbox_spec(id: &str, netns_path: &str, pod: &PodSandboxConfig, resolv_conf: Option<&Path>) -> Spec {
    let mut annotations: HashMap<String, String> = pod
        .annotations
        .iter()
        .filter(|(k, _)| k.starts_with(POD_ANNOTATION_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    annotations.insert(CONTAINER_TYPE.into(), "sandbox".into());
    annotations.insert(SANDBOX_ID.into(), id.into());
    if let Some(m) = &pod.metadata {
        annotations.insert(SANDBOX_NAME.into(), m.name.clone());
        annotations.insert(SANDBOX_NAMESPACE.into(), m.namespace.clone());
        annotations.insert(SANDBOX_UID.into(), m.uid.clone());
    }
    if !pod.log_directory.is_empty() {
        annotations.insert(SANDBOX_LOG_DIRECTORY.into(), pod.log_directory.clone());
    }
    let linux = pod.linux.clone().unwrap_or_default();
    if let Some(r) = &linux.resources {
        for (key, value) in [
            (SANDBOX_CPU_PERIOD, r.cpu_period),
            (SANDBOX_CPU_QUOTA, r.cpu_quota),
            (SANDBOX_MEMORY, r.memory_limit_in_bytes),
        ] {
            annotations.insert(key.into(), value.to_string());
        }
    }

    // As the pause container: its own pid, ipc, uts and mount namespaces, the CRI-made network
    // namespace. A namespace the pod shares with the node is left out, so that the sandbox
    // checks refuse hostPID and hostIPC by name, and a host-network pod has no netns.
    let options = linux.security_context.as_ref().and_then(|s| s.namespace_options.clone()).unwrap_or_default();
    let node = NamespaceMode::Node as i32;
    let mut namespaces = vec![namespace(LinuxNamespaceType::Mount, None), namespace(LinuxNamespaceType::Uts, None)];
    if options.pid != node {
        namespaces.push(namespace(LinuxNamespaceType::Pid, None));
    }
    if options.ipc != node {
        namespaces.push(namespace(LinuxNamespaceType::Ipc, None));
    }
    if options.network != node && !netns_path.is_empty() {
        namespaces.push(namespace(LinuxNamespaceType::Network, Some(netns_path)));
    }
    let userns = options.userns_options.as_ref().filter(|u| u.mode == NamespaceMode::Pod as i32);
    if userns.is_some() {
        namespaces.push(namespace(LinuxNamespaceType::User, None));
    }

    let mut linux_builder = LinuxBuilder::default().namespaces(namespaces).sysctl(linux.sysctls.clone());
    if let Some(u) = userns {
        // As containerd writes them into a pause container's spec; the sandbox checks refuse none.
        linux_builder = linux_builder.uid_mappings(id_maps(&u.uids)).gid_mappings(id_maps(&u.gids));
    }
    if let Some(path) = cgroups_path(&linux.cgroup_parent, id) {
        linux_builder = linux_builder.cgroups_path(path);
    }
    let mut spec = Spec::default();
    spec.set_hostname((!pod.hostname.is_empty()).then(|| pod.hostname.clone()));
    spec.set_annotations(Some(annotations));
    spec.set_linux(linux_builder.build().ok());
    let mounts = resolv_conf.map(|source| {
        let mut m = Mount::default();
        m.set_destination("/etc/resolv.conf".into());
        m.set_typ(Some("bind".into()));
        m.set_source(Some(source.to_path_buf()));
        m.set_options(Some(vec!["rbind".into(), "ro".into()]));
        vec![m]
    });
    spec.set_mounts(mounts);
    spec
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Backend;
    use crate::spec::BundleSpec;
    use k8s_cri::v1::{
        LinuxContainerResources, LinuxPodSandboxConfig, LinuxSandboxSecurityContext, NamespaceOption,
        PodSandboxMetadata,
    };

    fn pod() -> PodSandboxConfig {
        PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: "web".into(),
                uid: "uid-1".into(),
                namespace: "default".into(),
                attempt: 0,
            }),
            hostname: "web-0".into(),
            log_directory: "/var/log/pods/default_web_uid-1".into(),
            dns_config: Some(DnsConfig {
                servers: vec!["10.96.0.10".into()],
                searches: vec!["default.svc.cluster.local".into(), "svc.cluster.local".into()],
                options: vec!["ndots:5".into()],
            }),
            annotations: [
                ("bulkhead.io/emptydir-size-limits".to_string(), "scratch=1Gi".to_string()),
                ("other.io/x".to_string(), "y".to_string()),
            ]
            .into(),
            linux: Some(LinuxPodSandboxConfig {
                cgroup_parent: "/kubepods/burstable/poduid-1".into(),
                sysctls: [("net.ipv4.ip_unprivileged_port_start".to_string(), "0".to_string())].into(),
                resources: Some(LinuxContainerResources {
                    cpu_period: 100_000,
                    cpu_quota: 150_000,
                    memory_limit_in_bytes: 256 << 20,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn any(type_url: &str, value: Vec<u8>) -> Any {
        Any { type_url: type_url.into(), value, ..Default::default() }
    }

    fn bundle(spec: &Spec) -> BundleSpec {
        BundleSpec::from_bytes(&serde_json::to_vec(spec).unwrap()).unwrap()
    }

    #[test]
    fn the_pod_config_decodes_and_malformed_or_foreign_options_are_refused_by_name() {
        let bytes = pod().encode_to_vec();
        assert_eq!(decode(Some(&any(POD_SANDBOX_CONFIG_TYPE, bytes.clone()))).unwrap(), pod());
        let prefixed = format!("type.googleapis.com/{POD_SANDBOX_CONFIG_TYPE}");
        assert_eq!(decode(Some(&any(&prefixed, bytes.clone()))).unwrap(), pod());
        assert_eq!(decode(None), Err(PodConfigError::Missing));
        assert!(matches!(decode(Some(&any("containerd.runc.v1.Options", bytes))), Err(PodConfigError::WrongType(_))));
        assert!(matches!(decode(Some(&any(POD_SANDBOX_CONFIG_TYPE, vec![0xff; 7]))), Err(PodConfigError::Decode(_))));
        let huge = vec![0u8; MAX_POD_CONFIG + 1];
        assert_eq!(decode(Some(&any(POD_SANDBOX_CONFIG_TYPE, huge))), Err(PodConfigError::TooBig(MAX_POD_CONFIG + 1)));
    }

    #[test]
    fn the_spec_says_what_the_pause_container_spec_would() {
        let spec = bundle(&sandbox_spec("sb1", "/var/run/netns/cni-1", &pod(), Some(Path::new("/b/resolv.conf"))));
        assert_eq!(spec.role(), crate::spec::Role::Sandbox);
        assert_eq!(spec.pod_name(), Some("web"));
        assert_eq!(spec.pod_namespace(), Some("default"));
        assert_eq!(spec.pod_uid(), Some("uid-1"));
        assert_eq!(spec.hostname(), Some("web-0"));
        assert_eq!(spec.log_directory(), Some("/var/log/pods/default_web_uid-1".into()));
        assert_eq!(spec.cgroups_path(), Some("/kubepods/burstable/poduid-1/sb1"));
        assert_eq!(spec.sysctls(), vec![("net.ipv4.ip_unprivileged_port_start".to_string(), "0".to_string())]);
        let resources = spec.pod_resources();
        assert_eq!((resources.cpus, resources.memory_bytes), (Some(2), Some(256 << 20)));
        assert_eq!(spec.annotation(crate::annotations::EMPTYDIR_SIZE_LIMITS), Some("scratch=1Gi"));
        assert_eq!(spec.annotation("other.io/x"), None, "only bulkhead.io/ pod annotations pass, as the installer's");
        let netns = spec.validate_sandbox(Backend::Namespace).unwrap();
        assert_eq!(netns, Some("/var/run/netns/cni-1".into()));
        assert_eq!(crate::network::dns::resolv_conf_source(&spec), Some("/b/resolv.conf".into()));
    }

    #[test]
    fn node_namespaces_are_refused_by_the_sandbox_checks_and_host_network_has_no_netns() {
        let with = |options: NamespaceOption| {
            let mut p = pod();
            p.linux.as_mut().unwrap().security_context =
                Some(LinuxSandboxSecurityContext { namespace_options: Some(options), ..Default::default() });
            bundle(&sandbox_spec("sb1", "", &p, None))
        };
        let node = NamespaceMode::Node as i32;
        let err = with(NamespaceOption { pid: node, ..Default::default() }).validate_sandbox(Backend::Vm).unwrap_err();
        assert!(err.to_string().contains("hostPID"), "{err}");
        let err = with(NamespaceOption { ipc: node, ..Default::default() }).validate_sandbox(Backend::Vm).unwrap_err();
        assert!(err.to_string().contains("hostIPC"), "{err}");
        let host_net = with(NamespaceOption { network: node, ..Default::default() });
        assert_eq!(host_net.validate_sandbox(Backend::Vm).unwrap(), None);
    }

    #[test]
    fn resolv_conf_and_cgroups_path_follow_containerd() {
        let text = resolv_conf(pod().dns_config.as_ref()).unwrap();
        assert_eq!(
            text,
            "search default.svc.cluster.local svc.cluster.local\nnameserver 10.96.0.10\noptions ndots:5\n"
        );
        assert_eq!(resolv_conf(Some(&DnsConfig::default())), None);
        assert_eq!(resolv_conf(None), None);
        assert_eq!(
            cgroups_path("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice", "sb1").as_deref(),
            Some("kubepods-burstable-pod1.slice:cri-containerd:sb1")
        );
        assert_eq!(cgroups_path("/kubepods/pod1", "sb1").as_deref(), Some("/kubepods/pod1/sb1"));
        assert_eq!(cgroups_path("", "sb1"), None);
    }
}
