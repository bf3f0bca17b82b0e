//! The installer against a scratch root laid out like a node, with a real containerd 1.6 started from that root's
//! config. The shim is a script that records its invocation: reaching it is what these tests prove.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod support;

use std::fs;

use bulkhead_node_installer::containerd::ConfigVersion;
use bulkhead_node_installer::cri;
use bulkhead_node_installer::error::Error;
use bulkhead_node_installer::failpoint::{self, FailMode, FailPoints};
use bulkhead_node_installer::installer::{Installer, Outcome};
use bulkhead_node_installer::kube::FakeNodes;
use k8s_cri::v1 as crip;
use serde_json::{json, Value};

fn fake_node() -> FakeNodes {
    FakeNodes::new(json!({
        "metadata": {"name": "n1", "resourceVersion": "1", "labels": {"kubernetes.io/hostname": "n1"}},
        "spec": {"taints": [{"key": "bulkhead.io/not-ready", "effect": "NoSchedule"}]},
    }))
}

async fn cri_config(node: &support::Node) -> Value {
    assert!(support::registered(node, "runc").await, "runc must stay registered");
    let mut c = cri::connect(&node.socket()).await.expect("connect CRI");
    let st = c.status(crip::StatusRequest { verbose: true }).await.expect("CRI Status").into_inner();
    serde_json::from_str(st.info.get("config").expect("verbose config")).expect("config JSON")
}

fn sandbox_request(name: &str) -> crip::RunPodSandboxRequest {
    crip::RunPodSandboxRequest {
        config: Some(crip::PodSandboxConfig {
            metadata: Some(crip::PodSandboxMetadata {
                name: name.into(),
                uid: format!("uid-{name}"),
                namespace: "default".into(),
                attempt: 0,
            }),
            hostname: name.into(),
            linux: Some(crip::LinuxPodSandboxConfig {
                security_context: Some(crip::LinuxSandboxSecurityContext {
                    namespace_options: Some(crip::NamespaceOption {
                        network: crip::NamespaceMode::Node as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        runtime_handler: "bulkhead".into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_reaches_shim_reinstall_is_noop_uninstall_restores_bytes() {
    if !support::can_run_containerd() {
        return;
    }
    let node = support::node(true);
    let original = fs::read(node.config()).unwrap();
    let before = node.snapshot();
    let ctd = support::Containerd::start(&node);
    support::import_pause(&node);
    let api = fake_node();
    let inst = Installer {
        settings: node.settings(),
        restarter: &ctd,
        nodes: Some((&api, "n1".into())),
        fail: FailPoints::none(),
    };

    // Install: files, drop-in, one restart, CRI check, label, taint removed.
    let r = inst.install().await.unwrap_or_else(|e| panic!("install: {e}\n{}", ctd.log_tail()));
    assert_eq!(r.outcome, Outcome::Ready { config_version: ConfigVersion::V2 });
    assert!(r.restarted && r.artifacts_changed);
    assert_eq!(ctd.restart_count(), 1);
    let n = api.snapshot();
    assert_eq!(n.pointer("/metadata/labels/bulkhead.io~1runtime"), Some(&json!("ready")));
    assert_eq!(n.pointer("/metadata/labels/kubernetes.io~1hostname"), Some(&json!("n1")));
    assert_eq!(n.pointer("/spec/taints"), Some(&json!([])));

    // containerd kept every user CRI setting (the v2 merge replaces whole plugin tables) and added ours.
    let cfg = cri_config(&node).await;
    assert_eq!(cfg.get("sandboxImage"), Some(&json!(support::PAUSE_IMAGE)), "{cfg}");
    assert_eq!(cfg.get("restrictOOMScoreAdj"), Some(&json!(true)));
    assert_eq!(cfg.pointer("/containerd/snapshotter"), Some(&json!("native")));
    assert_eq!(cfg.pointer("/containerd/runtimes/runc/runtimeType"), Some(&json!("io.containerd.runc.v2")));
    let shim = node.root().join("opt/bulkhead/current/containerd-shim-bulkhead-v2");
    assert_eq!(cfg.pointer("/containerd/runtimes/bulkhead/runtimeType"), Some(&json!(shim.display().to_string())));

    // A pod with handler bulkhead reaches the shim (which then fails on purpose).
    let mut c = cri::connect(&node.socket()).await.unwrap();
    let res = c.run_pod_sandbox(sandbox_request("p1")).await;
    let calls = node.shim_calls();
    assert!(
        calls.iter().any(|l| l.contains("-id ") && l.trim_end().ends_with("start")),
        "shim calls: {calls:?}; {res:?}"
    );
    assert!(calls.iter().all(|l| l.contains("-namespace k8s.io")), "{calls:?}");

    println!("shim reached: {calls:?}");
    // Second install: nothing changes on disk, no restart.
    let installed = node.snapshot();
    let r2 = inst.install().await.unwrap();
    assert!(!r2.restarted && !r2.artifacts_changed, "{r2:?}");
    assert_eq!(ctd.restart_count(), 1, "second install must not restart containerd");
    assert_eq!(node.snapshot(), installed);

    // Uninstall: label first, config back byte for byte, no files left, handler gone.
    inst.uninstall().await.unwrap();
    assert_eq!(api.snapshot().pointer("/metadata/labels/bulkhead.io~1runtime"), None);
    assert_eq!(fs::read(node.config()).unwrap(), original, "config restored byte for byte");
    assert_eq!(node.snapshot(), before, "uninstall leaves no files");
    assert_eq!(ctd.restart_count(), 2);
    let cfg = cri_config(&node).await;
    assert!(cfg.pointer("/containerd/runtimes/bulkhead").is_none());
    assert!(cfg.pointer("/containerd/runtimes/runc").is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupted_install_or_uninstall_converges_on_rerun() {
    if !support::can_run_containerd() {
        return;
    }
    let node = support::node(true);
    let original = fs::read(node.config()).unwrap();
    let before = node.snapshot();
    let ctd = support::Containerd::start(&node);
    let api = fake_node();
    let mk = |fail: FailPoints| Installer {
        settings: node.settings(),
        restarter: &ctd,
        nodes: Some((&api, "n1".into())),
        fail,
    };
    mk(FailPoints::none()).install().await.unwrap_or_else(|e| panic!("install: {e}\n{}", ctd.log_tail()));
    let installed = node.snapshot();
    mk(FailPoints::none()).uninstall().await.unwrap();
    assert_eq!(node.snapshot(), before);

    for &point in failpoint::ALL {
        let uninstall_point = point.starts_with("uninstall-");
        if uninstall_point {
            mk(FailPoints::none()).install().await.unwrap();
            let err = mk(FailPoints::arm(point, FailMode::Error)).uninstall().await.unwrap_err();
            assert!(matches!(&err, Error::Interrupted(p) if p == point), "{point}: {err}");
        } else {
            let err = mk(FailPoints::arm(point, FailMode::Error)).install().await.unwrap_err();
            assert!(matches!(&err, Error::Interrupted(p) if p == point), "{point}: {err}");
            let r = mk(FailPoints::none()).install().await.unwrap_or_else(|e| panic!("{point}: rerun: {e}"));
            assert!(matches!(r.outcome, Outcome::Ready { .. }), "{point}");
            assert_eq!(node.snapshot(), installed, "{point}: rerun converges to the clean install");
            assert!(support::registered(&node, "bulkhead").await, "{point}");
            assert_eq!(api.snapshot().pointer("/metadata/labels/bulkhead.io~1runtime"), Some(&json!("ready")));
        }
        mk(FailPoints::none()).uninstall().await.unwrap_or_else(|e| panic!("{point}: uninstall: {e}"));
        assert_eq!(fs::read(node.config()).unwrap(), original, "{point}: config bytes");
        assert_eq!(node.snapshot(), before, "{point}: uninstall leaves no files");
        assert!(!support::registered(&node, "bulkhead").await, "{point}: handler gone");
    }
    println!("restarts over all fail points: {}", ctd.restart_count());
}

struct NoRestart;
impl bulkhead_node_installer::restart::Restarter for NoRestart {
    fn restart(&self) -> bulkhead_node_installer::Result<()> {
        panic!("a refused node must not restart containerd")
    }
}

#[tokio::test]
async fn node_without_kvm_is_refused_with_reason_and_left_untouched() {
    let node = support::node(false);
    let before = node.snapshot();
    let api = fake_node();
    let inst = Installer {
        settings: node.settings(),
        restarter: &NoRestart,
        nodes: Some((&api, "n1".into())),
        fail: FailPoints::none(),
    };
    let r = inst.install().await.unwrap();
    let Outcome::Refused { reason } = r.outcome else { panic!("expected refusal") };
    assert!(reason.contains("no /dev/kvm"), "{reason}");
    let n = api.snapshot();
    assert_eq!(n.pointer("/metadata/labels/bulkhead.io~1runtime"), None);
    assert_eq!(n.pointer("/metadata/annotations/bulkhead.io~1runtime-reason"), Some(&json!(reason)));
    assert_eq!(n.pointer("/spec/taints/0/key"), Some(&json!("bulkhead.io/not-ready")), "taint stays: no pods land");
    assert_eq!(node.snapshot(), before);
}

#[tokio::test]
async fn image_without_vm_artifacts_is_refused() {
    let node = support::node(true);
    fs::remove_file(node.artifacts.path().join("image/bulkhead-vmm")).unwrap();
    let api = fake_node();
    let inst = Installer {
        settings: node.settings(),
        restarter: &NoRestart,
        nodes: Some((&api, "n1".into())),
        fail: FailPoints::none(),
    };
    let Outcome::Refused { reason } = inst.install().await.unwrap().outcome else { panic!("expected refusal") };
    assert!(reason.contains("bulkhead-vmm"), "{reason}");
    let cfg = fs::read_to_string(node.config()).unwrap();
    assert_eq!(cfg, support::user_config(node.root()), "containerd not wired when refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labelled_node_whose_containerd_lost_the_handler_is_unlabelled_first() {
    if !support::can_run_containerd() {
        return;
    }
    let node = support::node(true);
    let ctd = support::Containerd::start(&node);
    let api = fake_node();
    let inst = Installer {
        settings: node.settings(),
        restarter: &ctd,
        nodes: Some((&api, "n1".into())),
        fail: FailPoints::none(),
    };
    inst.install().await.unwrap();
    // A reboot regenerates containerd's config without our imports entry (AL2023's nodeadm does this).
    fs::write(node.config(), support::user_config(node.root())).unwrap();
    bulkhead_node_installer::restart::Restarter::restart(&ctd).unwrap();
    assert!(!support::registered(&node, "bulkhead").await);
    // Stop right after the guard: the label must already be gone before anything is repaired.
    let stopped = Installer {
        settings: node.settings(),
        restarter: &ctd,
        nodes: Some((&api, "n1".into())),
        fail: FailPoints::arm("restart-marked", FailMode::Error),
    };
    assert!(matches!(stopped.install().await, Err(Error::Interrupted(_))));
    assert_eq!(api.snapshot().pointer("/metadata/labels/bulkhead.io~1runtime"), None, "unlabelled before repair");
    // The full rerun repairs and labels again.
    inst.install().await.unwrap();
    assert!(support::registered(&node, "bulkhead").await);
    assert_eq!(api.snapshot().pointer("/metadata/labels/bulkhead.io~1runtime"), Some(&json!("ready")));
    inst.uninstall().await.unwrap();
}

#[tokio::test]
async fn failed_install_is_explained_on_the_node() {
    let node = support::node(true);
    fs::write(node.config(), "version = 1\n").unwrap();
    let api = fake_node();
    let inst = Installer {
        settings: node.settings(),
        restarter: &NoRestart,
        nodes: Some((&api, "n1".into())),
        fail: FailPoints::none(),
    };
    let err = inst.install().await.unwrap_err().to_string();
    assert!(err.contains("version 1"), "{err}");
    let reason = api.snapshot().pointer("/metadata/annotations/bulkhead.io~1runtime-reason").cloned();
    assert!(reason
        .and_then(|r| r.as_str().map(|r| r.starts_with("install failed:") && r.contains("version 1")))
        .unwrap_or(false));
    assert_eq!(api.snapshot().pointer("/metadata/labels/bulkhead.io~1runtime"), None);
}

/// The API refuses everything, as after the RBAC was deleted together with the DaemonSet.
struct RefusingApi;
#[async_trait::async_trait]
impl bulkhead_node_installer::kube::NodeApi for RefusingApi {
    async fn get(&self, _: &str) -> bulkhead_node_installer::Result<Value> {
        Err(Error::Kube("403 Forbidden".into()))
    }
    async fn merge_patch(&self, _: &str, _: &Value) -> Result<Value, bulkhead_node_installer::kube::PatchError> {
        Err(Error::Kube("403 Forbidden".into()).into())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uninstall_unwires_the_node_even_when_the_api_refuses() {
    if !support::can_run_containerd() {
        return;
    }
    let node = support::node(true);
    let original = fs::read(node.config()).unwrap();
    let before = node.snapshot();
    let ctd = support::Containerd::start(&node);
    let api = fake_node();
    let inst = Installer {
        settings: node.settings(),
        restarter: &ctd,
        nodes: Some((&api, "n1".into())),
        fail: FailPoints::none(),
    };
    inst.install().await.unwrap();
    let refusing = Installer {
        settings: node.settings(),
        restarter: &ctd,
        nodes: Some((&RefusingApi, "n1".into())),
        fail: FailPoints::none(),
    };
    let err = refusing.uninstall().await.unwrap_err();
    assert!(err.to_string().contains("403"), "{err}");
    assert_eq!(fs::read(node.config()).unwrap(), original);
    assert_eq!(node.snapshot(), before);
}

/// Fails its first restart (containerd does not come up with the new config), then succeeds.
#[derive(Default)]
struct FailsFirstRestart(std::sync::atomic::AtomicUsize);
impl bulkhead_node_installer::restart::Restarter for FailsFirstRestart {
    fn restart(&self) -> bulkhead_node_installer::Result<()> {
        match self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
            0 => Err(Error::Restart("containerd.service: start request repeated too quickly".into())),
            _ => Ok(()),
        }
    }
}

#[tokio::test]
async fn a_failing_containerd_restart_rolls_the_dropin_back() {
    let node = support::node(true);
    let original = fs::read(node.config()).unwrap();
    let restarter = FailsFirstRestart::default();
    let inst = Installer { settings: node.settings(), restarter: &restarter, nodes: None, fail: FailPoints::none() };
    let err = inst.install().await.unwrap_err().to_string();
    assert!(err.contains("rolled back"), "{err}");
    assert_eq!(restarter.0.load(std::sync::atomic::Ordering::SeqCst), 2, "the failed restart, then one without us");
    assert_eq!(fs::read(node.config()).unwrap(), original, "containerd's config is the node's own again");
    let dropins = node.root().join("etc/containerd/conf.d");
    let left: Vec<_> = fs::read_dir(&dropins).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    assert!(left.is_empty(), "drop-ins left: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_installers_at_once_converge_with_one_restart() {
    if !support::can_run_containerd() {
        return;
    }
    let node = support::node(true);
    let ctd = support::Containerd::start(&node);
    let (a, b) = (
        Installer { settings: node.settings(), restarter: &ctd, nodes: None, fail: FailPoints::none() },
        Installer { settings: node.settings(), restarter: &ctd, nodes: None, fail: FailPoints::none() },
    );
    let (ra, rb) = tokio::join!(a.install(), b.install());
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(ctd.restart_count(), 1, "one restart for both: {ra:?} {rb:?}\n{}", ctd.log_tail());
    assert!(ra.restarted != rb.restarted, "exactly one of them restarted containerd");
    assert!(support::registered(&node, "bulkhead").await);
    a.uninstall().await.unwrap();
}
