//! Fuzz bodies for the shim's decoders of what the agent (a hostile guest) and containerd send:
//! the agent's replies as the shim checks and converts them, and the runtime options, config,
//! OCI spec (with the CRI annotations it reads) and 2.x's CRI pod config as containerd hands
//! them over.

use bulkhead_protocol::agent as pb;
use bulkhead_shim::config::{Backend, Config};
use bulkhead_shim::sandbox::emptydir::size_limits;
use bulkhead_shim::spec::{self, BundleSpec};
use containerd_shim::protos::protobuf::well_known_types::any::Any;
use protobuf::Message;

/// The first byte picks the reply; the rest is its protobuf encoding, as a guest could send it.
pub fn agent_reply(data: &[u8]) {
    let Some((&kind, body)) = data.split_first() else { return };
    match kind % 5 {
        0 => {
            if let Ok(reply) = pb::WaitProcessResponse::parse_from_bytes(body) {
                if let Ok(exit) = bulkhead_shim::agent::exit_from_reply(&reply) {
                    assert!(exit.code <= 255);
                    let _ = bulkhead_shim::exit::ExitInfo::from_agent(exit.code, exit.at_unix_nanos, exit.oom_killed);
                }
            }
        }
        1 => {
            if let Ok(event) = pb::OomEvent::parse_from_bytes(body) {
                if let Ok(event) = bulkhead_shim::agent::check_oom_event(event) {
                    assert!(bulkhead_protocol::stream::validate_id(&event.container_id).is_ok());
                }
            }
        }
        2 => {
            if let Ok(stats) = pb::StatsResponse::parse_from_bytes(body) {
                let _ = bulkhead_shim::trans::metrics(&stats);
            }
        }
        3 => {
            // An agent's error text, cut once for every log line and CRI answer.
            let text = String::from_utf8_lossy(body);
            let cut = bulkhead_shim::agent::bounded_text(&text, bulkhead_shim::agent::MAX_AGENT_ERROR);
            assert!(cut.len() <= bulkhead_shim::agent::MAX_AGENT_ERROR + 64);
        }
        _ => {
            let _ = pb::VersionResponse::parse_from_bytes(body);
            let _ = pb::CreateContainerResponse::parse_from_bytes(body);
            let _ = pb::ExecProcessResponse::parse_from_bytes(body);
        }
    }
}

/// containerd's runtime options (`runtimeoptions.v1.Options` in an Any) and the config file they
/// name, as the shim reads them at Create.
pub fn shim_options(data: &[u8]) {
    let any = Any {
        type_url: "type.googleapis.com/runtimeoptions.v1.Options".into(),
        value: data.to_vec(),
        ..Default::default()
    };
    if let Ok(Some(path)) = bulkhead_shim::options::config_path_from_options(Some(&any)) {
        assert!(!path.is_empty());
    }
    let text = String::from_utf8_lossy(data);
    if let Ok(config) = Config::parse(std::path::Path::new("/fuzz.toml"), &text) {
        assert!(config.state_dir.is_absolute());
    }
}

/// A bundle's OCI spec with the CRI annotations the shim reads, and an exec's process, through
/// every check and translation, for both backends.
pub fn shim_spec(data: &[u8]) {
    let _ = spec::exec_process_json(data, Backend::Vm);
    let _ = spec::exec_process_json(data, Backend::Namespace);
    let Ok(spec) = BundleSpec::from_bytes(data) else { return };
    let _ = spec.role();
    let _ = spec.pod_resources();
    let _ = spec.log_directory();
    let _ = spec.sysctls();
    let _ = spec.hostname();
    let _ = (spec.pod_name(), spec.pod_namespace());
    let cgroup = bulkhead_shim::sandbox::cgroups::PodCgroup::for_pod("sb1", "k8s.io", spec.cgroups_path());
    assert!(cgroup.sandbox().starts_with(&cgroup.parent), "the sandbox's cgroup stays below its parent");
    for backend in [Backend::Vm, Backend::Namespace] {
        let _ = spec.validate_sandbox(backend);
        if let Ok(translated) = spec.translate_container(42, backend) {
            // What the shim sends parses, as the agent parses it, back to what the shim meant.
            let json = spec::encode(&translated).expect("a parsed spec encodes");
            let sent = BundleSpec::from_bytes(&json).expect("the agent parses what the shim sends");
            assert_eq!(sent.spec(), &translated);
        }
    }
    emptydir_limits(&spec);
}

/// The pod's emptyDir size limits (its annotation, a pod author's text): every limit accepted is
/// within bounds, and a bind source is taken for one of the pod's emptyDirs only below its UID.
fn emptydir_limits(spec: &BundleSpec) {
    use bulkhead_shim::config::{EmptyDirConfig, MAX_EMPTYDIR_BYTES, MIN_EMPTYDIR_BYTES};
    use bulkhead_shim::sandbox::emptydir::{EmptyDirPolicy, Volume};
    if let Ok(limits) = spec.emptydir_size_limits(MAX_EMPTYDIR_BYTES) {
        assert!(limits.values().all(|b| (MIN_EMPTYDIR_BYTES..=MAX_EMPTYDIR_BYTES).contains(b)));
        assert!(limits.keys().all(|name| size_limits::is_volume_name(name)));
    }
    let Ok(policy) = EmptyDirPolicy::for_pod(&EmptyDirConfig::default(), spec) else { return };
    let mounts = spec.spec().mounts().iter().flatten();
    for path in mounts.filter_map(|m| m.source().as_deref()) {
        if let Volume::EmptyDir { name } | Volume::SubPath { name, .. } = policy.classify(path) {
            let uid = spec.pod_uid().unwrap_or_default();
            let source = path.display().to_string();
            assert!(source.contains(&format!("/pods/{uid}/")) && size_limits::is_volume_name(name), "{source}");
        }
    }
}

/// containerd 2.x's CreateSandbox options (a CRI `PodSandboxConfig`, a pod author's fields and
/// kubelet's), decoded and made into the sandbox spec, which the shim then reads as it reads a
/// pause container's: it parses back, is a sandbox's, and its checks and cgroup hold.
pub fn shim_pod_config(data: &[u8]) {
    use bulkhead_shim::sandboxer::pod_spec;
    let any = Any { type_url: pod_spec::POD_SANDBOX_CONFIG_TYPE.into(), value: data.to_vec(), ..Default::default() };
    let Ok(pod) = pod_spec::decode(Some(&any)) else { return };
    let _ = pod_spec::resolv_conf(pod.dns_config.as_ref());
    let sandbox = pod_spec::sandbox_spec("sb1", "/var/run/netns/x", &pod, Some(std::path::Path::new("/b/resolv.conf")));
    let json = spec::encode(&sandbox).expect("a made spec encodes");
    let parsed = BundleSpec::from_bytes(&json).expect("the shim parses the spec it made");
    assert_eq!(parsed.role(), spec::Role::Sandbox);
    let cgroup = bulkhead_shim::sandbox::cgroups::PodCgroup::for_pod("sb1", "k8s.io", parsed.cgroups_path());
    assert!(cgroup.sandbox().starts_with(&cgroup.parent), "the sandbox's cgroup stays below its parent");
    for backend in [Backend::Vm, Backend::Namespace] {
        let _ = parsed.validate_sandbox(backend);
    }
    let _ = (parsed.pod_resources(), parsed.log_directory(), parsed.sysctls(), parsed.hostname());
    emptydir_limits(&parsed);
}
