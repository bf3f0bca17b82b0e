//! SetupSandbox's network part, in the agent's namespace mode: interfaces and routes applied in
//! its own network namespace, and the pod's resolv.conf served to containers.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod common;

use std::process::Command;

use bulkhead_protocol::{agent::*, stream::StreamKind};
use common::*;
use serde_json::json;

fn in_netns(pid: i32, args: &[&str]) -> String {
    let out =
        Command::new("nsenter").args(["--target", &pid.to_string(), "--net"]).args(args).output().expect("nsenter");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// SetupSandbox of one interface with one address.
fn one_interface(name: &str, address: &str) -> SetupSandboxRequest {
    SetupSandboxRequest {
        interfaces: vec![Interface { name: name.into(), addresses: vec![address.into()], ..Default::default() }],
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_sandbox_configures_interfaces_and_routes() {
    if !can_run("setup_sandbox_configures_interfaces_and_routes") {
        return;
    }
    if Command::new("ip").arg("-V").output().is_err() {
        bulkhead_integration::skip::missing_prerequisite(
            "setup_sandbox_configures_interfaces_and_routes",
            "ip(8) not installed (make setup)",
        );
        return;
    }
    let agent = Agent::start_netns("net").await;
    let pid = agent.agent_pid().expect("agent pid");
    // Stand-in for the guest's virtio-net device; its carrier comes with the peer's link.
    in_netns(pid, &["ip", "link", "add", "eth0", "type", "veth", "peer", "name", "peer0"]);
    in_netns(pid, &["ip", "link", "set", "peer0", "up"]);

    let req = SetupSandboxRequest {
        interfaces: vec![Interface {
            name: "eth0".into(),
            mac: "02:42:0a:58:00:07".into(),
            mtu: 1400,
            addresses: vec!["10.88.0.7/16".into(), "fd00::7/64".into()],
            ..Default::default()
        }],
        routes: vec![
            Route {
                destination: "default".into(),
                gateway: "10.88.0.1".into(),
                device: "eth0".into(),
                ..Default::default()
            },
            Route { destination: "192.168.50.0/24".into(), device: "eth0".into(), ..Default::default() },
            // A gateway outside every address's prefix, reachable through an on-link route
            // given before it (Calico's shape; the shim sends gateway-less routes first).
            Route { destination: "169.254.1.1/32".into(), device: "eth0".into(), ..Default::default() },
            Route {
                destination: "172.31.0.0/16".into(),
                gateway: "169.254.1.1".into(),
                device: "eth0".into(),
                ..Default::default()
            },
        ],
        ..Default::default()
    };
    agent.client.setup_sandbox(ctx(), &req).await.unwrap_or_else(|e| panic!("setup: {e}\n{}", agent.log()));

    let link = in_netns(pid, &["ip", "-o", "link", "show", "eth0"]);
    assert!(link.contains("02:42:0a:58:00:07") && link.contains("mtu 1400"), "{link}");
    assert!(link.contains(",UP") || link.contains("<UP") || link.contains(" UP"), "{link}");
    let addrs = in_netns(pid, &["ip", "-o", "addr", "show", "dev", "eth0"]);
    assert!(addrs.contains("10.88.0.7/16") && addrs.contains("fd00::7/64"), "{addrs}");
    let routes = in_netns(pid, &["ip", "route"]);
    assert!(routes.contains("default via 10.88.0.1 dev eth0"), "{routes}");
    assert!(routes.contains("192.168.50.0/24 dev eth0"), "{routes}");
    assert!(routes.lines().any(|l| l.starts_with("169.254.1.1 dev eth0") && l.contains("scope link")), "{routes}");
    assert!(routes.contains("172.31.0.0/16 via 169.254.1.1 dev eth0"), "{routes}");
    let lo = in_netns(pid, &["ip", "-o", "link", "show", "lo"]);
    assert!(lo.contains("UP"), "lo not up: {lo}");

    // Applying the same config again is fine (replace semantics).
    agent.client.setup_sandbox(ctx(), &req).await.unwrap();

    // Precise errors: unknown device, malformed address.
    let bad = SetupSandboxRequest {
        interfaces: vec![Interface { name: "nope0".into(), ..Default::default() }],
        ..Default::default()
    };
    let e = agent.client.setup_sandbox(ctx(), &bad).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::NOT_FOUND, "{e}");
    let e = agent.client.setup_sandbox(ctx(), &one_interface("eth0", "10.0.0.300/8")).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::INVALID_ARGUMENT, "{e}");

    // A device whose link stays down (a restored VM's NIC the VMM never raised) fails the
    // setup with its name, after the agent's bounded wait, rather than leave a pod offline.
    in_netns(pid, &["ip", "link", "add", "eth1", "type", "veth", "peer", "name", "peer1"]);
    let e = agent.client.setup_sandbox(ctx(), &one_interface("eth1", "10.89.0.7/16")).await.unwrap_err();
    assert_eq!(code_of(&e), ttrpc::Code::FAILED_PRECONDITION, "{e}");
    assert!(format!("{e}").contains("eth1 has no carrier"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_sandbox_resolv_conf_reaches_containers() {
    if !can_run("setup_sandbox_resolv_conf_reaches_containers") {
        return;
    }
    let agent = Agent::start("dns").await;
    let rootfs = busybox_rootfs(agent.dir.path(), "rootfs");
    let pod_dns = "nameserver 10.96.0.10\nsearch default.svc.cluster.local svc.cluster.local\noptions ndots:5\n";
    let req = SetupSandboxRequest { resolv_conf: pod_dns.as_bytes().to_vec(), ..Default::default() };
    agent.client.setup_sandbox(ctx(), &req).await.unwrap_or_else(|e| panic!("setup: {e}\n{}", agent.log()));

    // As containerd writes it: a bind of the sandbox's resolv.conf, a host path the agent's side
    // (a guest, on the vm backend) does not have.
    let resolv = json!({
        "destination": "/etc/resolv.conf", "type": "bind",
        "source": "/var/lib/containerd/io.containerd.grpc.v1.cri/sandboxes/nowhere/resolv.conf",
        "options": ["rbind", "rprivate", "ro"]
    });
    agent.create_ok("dns", &spec(&rootfs, &["cat", "/etc/resolv.conf"], vec![resolv], json!({}))).await;
    let mut out = agent.stream("dns", None, StreamKind::Stdout).await;
    agent.start_ctr("dns").await;
    assert_eq!(read_all(&mut out).await, pod_dns);
    assert_eq!(agent.wait("dns", "").await.exit_code, 0);
    agent.remove("dns").await;
}
