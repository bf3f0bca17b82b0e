//! Runs every fuzz body on hand-written seeds and on a fixed stream of pseudo-random inputs, so
//! the harnesses themselves stay correct on a toolchain without sanitizers:
//! `cargo test --manifest-path fuzz/Cargo.toml`.

use bulkhead_protocol::stream::{StreamHeader, StreamKind};

type Body = fn(&[u8]);

const BODIES: [(&str, Body); 18] = [
    ("handshake", bulkhead_fuzz::handshake),
    ("stream_header", bulkhead_fuzz::stream_header),
    ("vsock_packet", bulkhead_fuzz::vsock_packet),
    ("block_request", bulkhead_fuzz::block_request),
    ("desc_chain", bulkhead_fuzz::desc_chain),
    ("fs_relay", bulkhead_fuzz::fs_relay),
    ("virtio_blk", bulkhead_fuzz::virtio_blk),
    ("virtio_vsock", bulkhead_fuzz::virtio_vsock),
    ("vsock_muxer", bulkhead_fuzz::vsock_muxer),
    ("snapshot_state", bulkhead_fuzz::snapshot_state),
    ("net_packet", bulkhead_fuzz::net_packet),
    ("virtio_net", bulkhead_fuzz::virtio_net),
    ("api_request", bulkhead_fuzz::api_request),
    ("balloon_report", bulkhead_fuzz::balloon_report),
    ("agent_reply", bulkhead_fuzz::agent_reply),
    ("shim_options", bulkhead_fuzz::shim_options),
    ("shim_spec", bulkhead_fuzz::shim_spec),
    ("shim_pod_config", bulkhead_fuzz::shim_pod_config),
];

fn seeds() -> Vec<Vec<u8>> {
    let mut s: Vec<Vec<u8>> = vec![
        vec![],
        b"CONNECT 1024\n".to_vec(),
        b"OK 4294967295\n".to_vec(),
        b"CONNECT 00000000001\n".to_vec(),
        vec![b'A'; 100],
        vec![0xff; 300],
        vec![0; 4096],
        // balloon_report (and the other descriptor bodies): small values throughout, for short
        // chains of short descriptors low in the address space.
        [1u8, 2, 3, 4].repeat(64),
        // snapshot_state: a valid sample state as is, and with one byte of its body changed.
        vec![2],
        vec![5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
        // api_request: read 8 bytes at a time; every request kind, a restore that fits, junk.
        [
            &b"\x07"[..],
            br#"{"cmd":"info"}"#,
            b"\n",
            br#"{"cmd":"pause"}"#,
            b"\n",
            br#"{"cmd":"resume"}"#,
            b"\n",
            br#"{"cmd":"snapshot","dir":"/tmp/s"}"#,
            b"\n",
            br#"{"cmd":"restore","config":{"vsock_uds_path":"/r/v.sock","net_taps":["tap1"],"fs_sockets":["/r/f"]}}"#,
            b"\n\xff\x00\n",
            br#"{"cmd":"shutdown"}"#,
            b"\n",
        ]
        .concat(),
    ];
    s.push(StreamHeader::new("ctr", Some("exec-1"), StreamKind::Tty).encode().expect("valid header"));
    s.extend(spec_seeds());
    // shim_options: runtimeoptions.v1.Options with a type URL and a config path; a config.
    let (url, path) = (&b"type.googleapis.com/runtimeoptions.v1.Options"[..], &b"/etc/bulkhead/config.toml"[..]);
    s.push([&[0x0a, url.len() as u8][..], url, &[0x12, path.len() as u8], path].concat());
    s.push(b"backend = \"vm\"\nstate_dir = \"/run/bulkhead\"\n[vm]\njail_id_first = 5\njail_id_count = 2\n".to_vec());
    s.push(b"[emptydir]\ndefault_size_limit = \"1Gi\"\nmax_size_limit = \"1e12\"\n".to_vec());
    // agent_reply: each kind, encoded as the agent would.
    use protobuf::Message;
    let wait = bulkhead_protocol::agent::WaitProcessResponse {
        exit_code: 137,
        oom_killed: true,
        exited_at_unix_nanos: 1,
        ..Default::default()
    };
    s.push([&[0u8][..], &wait.write_to_bytes().expect("encodes")].concat());
    let oom = bulkhead_protocol::agent::OomEvent { container_id: "c1".into(), ..Default::default() };
    s.push([&[1u8][..], &oom.write_to_bytes().expect("encodes")].concat());
    s.extend(pod_config_seeds());
    s
}

/// shim_pod_config's seeds: CRI pod configs as kubelet sends them (pod network, host namespaces).
fn pod_config_seeds() -> Vec<Vec<u8>> {
    use k8s_cri::v1 as cri;
    use prost::Message as _;
    let pod = |network: i32, pid: i32| cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: "p".into(),
            uid: "u-1".into(),
            namespace: "d".into(),
            attempt: 0,
        }),
        hostname: "p".into(),
        log_directory: "/var/log/pods/d_p_u-1".into(),
        dns_config: Some(cri::DnsConfig {
            servers: vec!["10.0.0.10".into()],
            searches: vec!["d.svc".into()],
            options: vec![],
        }),
        annotations: [("bulkhead.io/emptydir-size-limits".to_string(), "scratch=32Mi".to_string())].into(),
        linux: Some(cri::LinuxPodSandboxConfig {
            cgroup_parent: "/kubepods.slice/kubepods-pod1.slice".into(),
            security_context: Some(cri::LinuxSandboxSecurityContext {
                namespace_options: Some(cri::NamespaceOption { network, pid, ..Default::default() }),
                ..Default::default()
            }),
            sysctls: [("net.ipv4.ping_group_range".to_string(), "0 1".to_string())].into(),
            resources: Some(cri::LinuxContainerResources {
                cpu_quota: 50_000,
                cpu_period: 100_000,
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let (pod_mode, node) = (cri::NamespaceMode::Pod as i32, cri::NamespaceMode::Node as i32);
    vec![pod(pod_mode, pod_mode).encode_to_vec(), pod(node, node).encode_to_vec()]
}

/// shim_spec's seeds: OCI specs (and an exec's process) as containerd writes them.
fn spec_seeds() -> Vec<Vec<u8>> {
    vec![
        // A CRI sandbox spec with every annotation and field the shim reads.
        br#"{"annotations":{"io.kubernetes.cri.container-type":"sandbox","io.kubernetes.cri.sandbox-cpu-quota":"150000","io.kubernetes.cri.sandbox-cpu-period":"100000","io.kubernetes.cri.sandbox-memory":"268435456","io.kubernetes.cri.sandbox-log-directory":"/var/log/pods/x"},"hostname":"pod","linux":{"cgroupsPath":"kubepods-burstable-pod1.slice:cri-containerd:sb1","namespaces":[{"type":"pid"},{"type":"ipc"},{"type":"network","path":"/var/run/netns/x"},{"type":"cgroup"}],"sysctl":{"net.ipv4.ping_group_range":"0 1"}},"process":{"args":["sh"],"cwd":"/","user":{"uid":0,"gid":0},"apparmorProfile":"p"},"mounts":[{"destination":"/dev/shm","type":"bind","source":"/x"}]}"#
            .to_vec(),
        // A pod's emptyDir size limits, with one of its emptyDirs and a subPath of it.
        br#"{"annotations":{"io.kubernetes.cri.sandbox-uid":"u-1","bulkhead.io/emptydir-size-limits":"scratch=32Mi, cache=1.5Gi"},"mounts":[{"destination":"/d","type":"bind","source":"/var/lib/kubelet/pods/u-1/volumes/kubernetes.io~empty-dir/scratch","options":["rbind"]},{"destination":"/s","type":"bind","source":"/var/lib/kubelet/pods/u-1/volume-subpaths/cache/c/1"}]}"#
            .to_vec(),
        // A container of the pod whose sandbox is pid 42: its namespaces, labels and resources
        // go through the translation the agent gets.
        br#"{"ociVersion":"1.2.0","annotations":{"io.kubernetes.cri.container-type":"container","io.kubernetes.cri.sandbox-id":"sb1"},"process":{"args":["sh"],"cwd":"/","user":{"uid":1000,"gid":1000},"selinuxLabel":"l","capabilities":{"bounding":["CAP_KILL"]}},"root":{"path":"rootfs","readonly":true},"linux":{"namespaces":[{"type":"pid"},{"type":"network","path":"/proc/42/ns/net"},{"type":"ipc","path":"/proc/42/ns/ipc"}],"mountLabel":"m","resources":{"memory":{"limit":268435456},"unified":{"memory.high":"1"},"hugepageLimits":[{"pageSize":"2MB","limit":0}]}},"mounts":[{"destination":"/etc/hosts","type":"bind","source":"/h","options":["rbind","ro"]}]}"#
            .to_vec(),
        // An exec's process.
        br#"{"args":["ls"],"cwd":"/","user":{"uid":0,"gid":0},"apparmorProfile":"p","env":["A=1"]}"#.to_vec(),
    ]
}

#[test]
fn shim_spec_seeds_are_what_the_shim_takes() {
    let (exec, specs) = spec_seeds().split_last().map(|(e, s)| (e.clone(), s.to_vec())).expect("seeds");
    use bulkhead_shim::config::Backend;
    use bulkhead_shim::spec::{BundleSpec, Role};
    for seed in specs {
        let spec = BundleSpec::from_bytes(&seed).unwrap_or_else(|e| panic!("{}: {e}", String::from_utf8_lossy(&seed)));
        if let Role::Container { .. } = spec.role() {
            for backend in [Backend::Vm, Backend::Namespace] {
                assert!(spec.translate_container(42, backend).is_ok(), "{backend:?}");
            }
        }
    }
    let process = bulkhead_shim::spec::exec_process_json(&exec, Backend::Vm);
    assert!(process.is_ok(), "{process:?}");
}

/// xorshift64*: deterministic, so a failure reproduces.
fn random_inputs(n: usize) -> impl Iterator<Item = Vec<u8>> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    (0..n).map(move |_| {
        let len = (next() % 2048) as usize;
        (0..len).map(|_| next() as u8).collect()
    })
}

#[test]
fn every_body_survives_seeds_and_random_inputs() {
    for (name, body) in BODIES {
        for input in seeds().into_iter().chain(random_inputs(200)) {
            let r = std::panic::catch_unwind(|| body(&input));
            assert!(r.is_ok(), "{name} panicked on {input:02x?}");
        }
    }
}
