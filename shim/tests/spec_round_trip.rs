//! The shim parses a bundle's spec once into `oci_spec::runtime::Spec` and encodes it once for
//! the agent. These tests hold the promise that makes that safe: what containerd writes reaches
//! the agent whole, with only the shim's own edits (the sandbox's namespace paths; on the vm
//! backend the host's LSM labels). The agent parses with the same type, crate and version (the
//! workspace pins oci-spec), as `serde_json::from_slice::<Spec>`; a field oci-spec does not know
//! never reached the agent before either.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use bulkhead_shim::config::Backend;
use bulkhead_shim::spec::{self, BundleSpec};
use oci_spec::runtime::Spec;
use serde_json::{json, Value};

/// A container spec as containerd's CRI plugin writes it (2.x, cgroupfs driver), with every
/// field CRI sets and the newer ones it may pass on (cgroup v2 `unified`, hugepage limits,
/// seccomp arguments, rlimits, CPU burst and idle, I/O priority, domainname). The sandbox's pid
/// is 4242. On a cgroup v2 host containerd adds a cgroup namespace, which only the vm backend
/// takes: [`for_backend`].
fn containerd_container_spec() -> Value {
    json!({
        "ociVersion": "1.2.0",
        "process": {
            "user": {"uid": 1000, "gid": 3000, "umask": 18, "additionalGids": [3000, 2000]},
            "args": ["sh", "-c", "sleep 3600"],
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOSTNAME=web-0"],
            "cwd": "/",
            "capabilities": {
                "bounding": ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
                             "CAP_NET_RAW", "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
                             "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE"],
                "effective": ["CAP_CHOWN", "CAP_KILL"],
                "permitted": ["CAP_CHOWN", "CAP_KILL"]
            },
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1048576, "soft": 1048576}],
            "noNewPrivileges": true,
            "apparmorProfile": "cri-containerd.apparmor.d",
            "oomScoreAdj": 1000,
            "selinuxLabel": "system_u:system_r:container_t:s0:c1,c2",
            "ioPriority": {"class": "IOPRIO_CLASS_BE", "priority": 4}
        },
        "root": {"path": "rootfs", "readonly": true},
        "hostname": "web-0",
        "domainname": "svc.cluster.local",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
             "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
            {"destination": "/etc/hosts", "type": "bind",
             "source": "/var/lib/kubelet/pods/5b1e7c2a/etc-hosts", "options": ["rbind", "rprivate", "rw"]},
            {"destination": "/dev/termination-log", "type": "bind",
             "source": "/var/lib/kubelet/pods/5b1e7c2a/containers/web/0b9e", "options": ["rbind", "rprivate", "rw"]},
            {"destination": "/etc/hostname", "type": "bind",
             "source": "/var/lib/containerd/io.containerd.grpc.v1.cri/sandboxes/sb1/hostname",
             "options": ["rbind", "rprivate", "rw"]},
            {"destination": "/etc/resolv.conf", "type": "bind",
             "source": "/var/lib/containerd/io.containerd.grpc.v1.cri/sandboxes/sb1/resolv.conf",
             "options": ["rbind", "rprivate", "rw"]},
            {"destination": "/dev/shm", "type": "bind",
             "source": "/run/containerd/io.containerd.grpc.v1.cri/sandboxes/sb1/shm", "options": ["rbind", "rprivate", "rw"]},
            {"destination": "/var/run/secrets/kubernetes.io/serviceaccount", "type": "bind",
             "source": "/var/lib/kubelet/pods/5b1e7c2a/volumes/kubernetes.io~projected/kube-api-access-x",
             "options": ["rbind", "rprivate", "ro"],
             "uidMappings": [{"containerID": 0, "hostID": 100000, "size": 65536}],
             "gidMappings": [{"containerID": 0, "hostID": 100000, "size": 65536}]}
        ],
        "annotations": {
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.container-name": "web",
            "io.kubernetes.cri.image-name": "docker.io/library/busybox:latest",
            "io.kubernetes.cri.sandbox-id": "sb1",
            "io.kubernetes.cri.sandbox-name": "web-0",
            "io.kubernetes.cri.sandbox-namespace": "shop",
            "io.kubernetes.cri.sandbox-uid": "5b1e7c2a"
        },
        "linux": {
            "uidMappings": [{"containerID": 0, "hostID": 100000, "size": 65536}],
            "gidMappings": [{"containerID": 0, "hostID": 100000, "size": 65536}],
            "sysctl": {"net.ipv4.ping_group_range": "0 2147483647"},
            "resources": {
                "devices": [{"allow": false, "access": "rwm"}, {"allow": true, "type": "c", "major": 1, "minor": 3, "access": "rwm"}],
                "memory": {"limit": 268435456, "swap": 268435456, "swappiness": 0, "disableOOMKiller": false},
                "cpu": {"shares": 102, "quota": 50000, "period": 100000, "burst": 10000, "idle": 0,
                        "cpus": "0-1", "mems": "0"},
                "pids": {"limit": 1024},
                "blockIO": {"weight": 100, "throttleReadBpsDevice": [{"major": 8, "minor": 0, "rate": 1048576}]},
                "hugepageLimits": [{"pageSize": "2MB", "limit": 0}, {"pageSize": "1GB", "limit": 0}],
                "unified": {"memory.high": "214748364", "memory.oom.group": "1"}
            },
            "cgroupsPath": "/kubepods/burstable/pod5b1e7c2a/0b9e",
            "namespaces": [
                {"type": "pid"},
                {"type": "ipc", "path": "/proc/4242/ns/ipc"},
                {"type": "uts", "path": "/proc/4242/ns/uts"},
                {"type": "mount"},
                {"type": "network", "path": "/proc/4242/ns/net"}
            ],
            "devices": [{"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229, "fileMode": 438, "uid": 0, "gid": 0}],
            "seccomp": {
                "defaultAction": "SCMP_ACT_ERRNO",
                "defaultErrnoRet": 1,
                "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
                "flags": ["SECCOMP_FILTER_FLAG_SPEC_ALLOW"],
                "syscalls": [
                    {"names": ["accept", "accept4", "read", "write"], "action": "SCMP_ACT_ALLOW"},
                    {"names": ["personality"], "action": "SCMP_ACT_ALLOW",
                     "args": [{"index": 0, "value": 0, "op": "SCMP_CMP_EQ"}]},
                    {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
                     "args": [{"index": 0, "value": 2114060288, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]},
                    {"names": ["ptrace"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38}
                ]
            },
            "rootfsPropagation": "rslave",
            "maskedPaths": ["/proc/asound", "/proc/acpi", "/proc/kcore", "/proc/keys", "/sys/firmware"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
            "mountLabel": "system_u:object_r:container_file_t:s0:c1,c2",
            "personality": {"domain": "LINUX"}
        }
    })
}

/// The container spec containerd writes for a pod of `backend` (module docs of the fixture).
fn for_backend(backend: Backend) -> Value {
    let mut spec = containerd_container_spec();
    if backend == Backend::Vm {
        spec["linux"]["namespaces"].as_array_mut().unwrap().push(json!({"type": "cgroup"}));
    }
    spec
}

/// `original` with the shim's deliberate edits: the namespaces that name the sandbox (pid 4242)
/// dropped; on the vm backend the host's LSM labels too.
fn with_the_shims_edits(mut original: Value, backend: Backend) -> Value {
    let namespaces = original["linux"]["namespaces"].as_array_mut().unwrap();
    namespaces.retain(|ns| !ns["path"].as_str().is_some_and(|p| p.starts_with("/proc/4242/ns/")));
    if backend == Backend::Vm {
        original["process"].as_object_mut().unwrap().remove("apparmorProfile");
        original["process"].as_object_mut().unwrap().remove("selinuxLabel");
        original["linux"].as_object_mut().unwrap().remove("mountLabel");
    }
    original
}

/// Every field of `want` that `got` lacks or holds differently, as JSON paths. Arrays of
/// capabilities are sets (oci-spec keeps them in a HashSet); fields `got` has beyond `want`
/// are oci-spec's explicit defaults and are checked by the typed comparison instead.
fn lost(want: &Value, got: &Value, path: &str, out: &mut Vec<String>) {
    match (want, got) {
        (Value::Object(w), Value::Object(g)) => {
            for (key, value) in w {
                match g.get(key) {
                    Some(other) => lost(value, other, &format!("{path}/{key}"), out),
                    None => out.push(format!("{path}/{key} (dropped)")),
                }
            }
        }
        (Value::Array(w), Value::Array(g)) if path.contains("/capabilities/") => {
            let sorted = |a: &Vec<Value>| {
                let mut v: Vec<String> = a.iter().map(Value::to_string).collect();
                v.sort();
                v
            };
            if sorted(w) != sorted(g) {
                out.push(format!("{path} (changed)"));
            }
        }
        (Value::Array(w), Value::Array(g)) if w.len() == g.len() => {
            for (i, (a, b)) in w.iter().zip(g).enumerate() {
                lost(a, b, &format!("{path}/{i}"), out);
            }
        }
        (w, g) if w == g => {}
        _ => out.push(format!("{path} (changed: {want} -> {got})")),
    }
}

/// What the shim sends the agent for `original`, on `backend`.
fn sent(original: &Value, backend: Backend) -> Vec<u8> {
    let bundle = BundleSpec::from_bytes(&serde_json::to_vec(original).unwrap()).unwrap();
    spec::encode(&bundle.translate_container(4242, backend).unwrap()).unwrap()
}

/// The agent's parse (guest-agent `spec::parse_spec`, less its size check).
fn agent_parse(json: &[u8]) -> Spec {
    serde_json::from_slice(json).unwrap()
}

#[test]
fn what_containerd_writes_reaches_the_agent_whole() {
    for backend in [Backend::Namespace, Backend::Vm] {
        let original = for_backend(backend);
        let want = with_the_shims_edits(original.clone(), backend);
        let json = sent(&original, backend);
        let mut missing = Vec::new();
        lost(&want, &serde_json::from_slice(&json).unwrap(), "", &mut missing);
        assert!(missing.is_empty(), "{backend:?}: lost on the way to the agent: {missing:#?}");
        // And typed: the agent gets exactly the spec it would have parsed from containerd's
        // own bytes, edits aside.
        let direct = agent_parse(&serde_json::to_vec(&want).unwrap());
        assert_eq!(agent_parse(&json), direct, "{backend:?}");
    }
}

#[test]
fn edits_reach_the_agent() {
    use oci_spec::runtime::LinuxNamespaceType::{Cgroup, Mount, Pid};
    let spec = agent_parse(&sent(&for_backend(Backend::Vm), Backend::Vm));
    let namespaces = spec.linux().as_ref().unwrap().namespaces().clone().unwrap();
    assert!(namespaces.iter().all(|ns| ns.path().is_none()), "{namespaces:?}");
    assert_eq!(namespaces.iter().map(|ns| ns.typ()).collect::<Vec<_>>(), [Pid, Mount, Cgroup]);
    let process = spec.process().as_ref().unwrap();
    assert_eq!((process.apparmor_profile(), process.selinux_label()), (&None, &None));
    assert_eq!(spec.linux().as_ref().unwrap().mount_label(), &None);
    // The namespace backend keeps the labels: the host applies them.
    let spec = agent_parse(&sent(&for_backend(Backend::Namespace), Backend::Namespace));
    let process = spec.process().as_ref().unwrap();
    assert_eq!(process.apparmor_profile().as_deref(), Some("cri-containerd.apparmor.d"));
}

/// A field oci-spec 0.10 does not know is dropped by the shim's parse, as it always was by the
/// agent's: the agent sees the same spec either way. Were the agent ever to need such a field,
/// oci-spec (for both) would have to learn it first.
#[test]
fn fields_oci_spec_does_not_know_were_never_the_agents() {
    let mut original = for_backend(Backend::Namespace);
    original["linux"]["futureIsolation"] = json!({"mode": "strict"});
    original["process"]["futureKnob"] = json!(7);
    original["futureTopLevel"] = json!(["x"]);
    let json = sent(&original, Backend::Namespace);
    let got: Value = serde_json::from_slice(&json).unwrap();
    let want = with_the_shims_edits(original, Backend::Namespace);
    let mut missing = Vec::new();
    lost(&want, &got, "", &mut missing);
    missing.sort();
    let dropped = ["/futureTopLevel (dropped)", "/linux/futureIsolation (dropped)", "/process/futureKnob (dropped)"];
    assert_eq!(missing, dropped);
    assert_eq!(agent_parse(&json), agent_parse(&serde_json::to_vec(&want).unwrap()));
}

/// The pod sandbox's spec (never sent to the agent) is read typed too: every CRI field the shim
/// takes from it survives the parse.
#[test]
fn the_sandbox_spec_is_read_as_containerd_wrote_it() {
    let mut original = containerd_container_spec();
    original["annotations"] = json!({
        "io.kubernetes.cri.container-type": "sandbox",
        "io.kubernetes.cri.sandbox-cpu-quota": "150000",
        "io.kubernetes.cri.sandbox-cpu-period": "100000",
        "io.kubernetes.cri.sandbox-memory": "268435456",
        "io.kubernetes.cri.sandbox-log-directory": "/var/log/pods/shop_web-0_5b1e7c2a",
        "io.kubernetes.cri.sandbox-uid": "5b1e7c2a",
        "bulkhead.io/emptydir-size-limits": "scratch=32Mi"
    });
    original["linux"]["namespaces"] = json!([
        {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
        {"type": "network", "path": "/var/run/netns/cni-1"}
    ]);
    let bundle = BundleSpec::from_bytes(&serde_json::to_vec(&original).unwrap()).unwrap();
    assert_eq!(bundle.role(), bulkhead_shim::spec::Role::Sandbox);
    let resources = bundle.pod_resources();
    assert_eq!((resources.cpus, resources.memory_bytes), (Some(2), Some(256 << 20)));
    assert_eq!(bundle.validate_sandbox(Backend::Vm).unwrap().unwrap().to_str(), Some("/var/run/netns/cni-1"));
    assert_eq!(bundle.hostname(), Some("web-0"));
    assert_eq!(bundle.cgroups_path(), Some("/kubepods/burstable/pod5b1e7c2a/0b9e"));
    assert_eq!(bundle.sysctls(), [("net.ipv4.ping_group_range".to_string(), "0 2147483647".to_string())]);
    assert_eq!(bundle.pod_uid(), Some("5b1e7c2a"));
    assert_eq!(bundle.emptydir_size_limits(u64::MAX).unwrap().get("scratch"), Some(&(32 << 20)));
}
