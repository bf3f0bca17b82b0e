//! An update of a node with bulkhead pods on it, against a scratch node root and a real containerd 1.6: version
//! N+1 installs beside N without touching containerd, N's pods keep every file they were started with, new pods get
//! N+1, and N goes once its last pod has; an uninstall refuses while pods run, unless forced.
//!
//! The pods here are stand-ins (`support::FakePod`): processes executing the installed shim binary, with the
//! shim's own pod record, which is what the installer looks at. `tests/upgrade_real_pods.rs` runs the same story
//! with the real shim serving real pods through containerd.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod support;

use std::fs;
use std::path::{Path, PathBuf};

use bulkhead_node_installer::error::Error;
use bulkhead_node_installer::failpoint::FailPoints;
use bulkhead_node_installer::installer::{Installer, Outcome, Settings, WhileInUse};
use bulkhead_node_installer::kube::FakeNodes;
use serde_json::json;

fn fake_node() -> FakeNodes {
    FakeNodes::new(json!({
        "metadata": {"name": "n1", "resourceVersion": "1", "labels": {}},
        "spec": {"taints": []},
    }))
}

fn settings(node: &support::Node, version: &str) -> Settings {
    Settings { version: version.into(), ..node.settings() }
}

fn versions(node: &support::Node) -> Vec<String> {
    bulkhead_node_installer::versions::installed(&node.root().join("opt/bulkhead")).unwrap()
}

/// Every absolute path the version's shim config names.
fn config_paths(dir: &Path) -> Vec<PathBuf> {
    let doc: toml::Table = fs::read_to_string(dir.join("config.toml")).unwrap().parse().unwrap();
    let vm = doc.get("vm").and_then(toml::Value::as_table).unwrap();
    vm.values().filter_map(toml::Value::as_str).filter(|s| s.starts_with('/')).map(PathBuf::from).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_keeps_the_version_its_pods_run_and_collects_it_after_them() {
    if !support::can_run_containerd() {
        return;
    }
    let node = support::node(true);
    support::elf_shim(&node);
    let original = fs::read(node.config()).unwrap();
    let before = node.snapshot();
    let ctd = support::Containerd::start(&node);
    let api = fake_node();
    let installer = |version: &str| Installer {
        settings: settings(&node, version),
        restarter: &ctd,
        nodes: Some((&api, "n1".into())),
        fail: FailPoints::none(),
    };
    let opt = node.root().join("opt/bulkhead");
    let dropin = node.root().join("etc/containerd/conf.d/zz-bulkhead.toml");

    // Version 1.0, and a pod on it.
    let r = installer("1.0").install().await.unwrap_or_else(|e| panic!("install 1.0: {e}\n{}", ctd.log_tail()));
    assert!(matches!(r.outcome, Outcome::Ready { .. }) && r.restarted);
    let wired = fs::read(&dropin).unwrap();
    let mut old_pod = support::FakePod::start(&node, "aaa111", "web");
    assert_eq!(old_pod.exe(), opt.join("1.0/containerd-shim-bulkhead-v2"), "the kernel resolved current at exec");

    // 1.1 is installed and replaced by 2.0 before anything ran from it: it goes as soon as 2.0 is in.
    installer("1.1").install().await.unwrap();
    let r = installer("2.0").install().await.unwrap();
    assert!(matches!(r.outcome, Outcome::Ready { .. }));
    assert_eq!(r.collected, ["1.1"], "{r:?}");
    assert!(!r.restarted, "an update changes no containerd config: {r:?}");
    assert_eq!(ctd.restart_count(), 1);
    assert_eq!(fs::read(&dropin).unwrap(), wired, "the drop-in names current, so an update leaves it alone");
    assert!(support::registered(&node, "bulkhead").await);
    assert_eq!(fs::read_link(opt.join("current")).unwrap(), Path::new("2.0"));
    assert_eq!(versions(&node), ["1.0", "2.0"], "1.0 stays: a pod runs from it");

    // The old pod still has every file it was started with.
    assert!(old_pod.is_running());
    assert_eq!(old_pod.exe(), opt.join("1.0/containerd-shim-bulkhead-v2"), "not deleted");
    for path in config_paths(&opt.join("1.0")) {
        assert!(path.starts_with(opt.join("1.0")), "1.0's config names 1.0's files: {}", path.display());
        assert!(path.is_file(), "{} is gone", path.display());
    }
    // New pods get 2.0.
    let new_pod = support::FakePod::start(&node, "bbb222", "db");
    assert_eq!(new_pod.exe(), opt.join("2.0/containerd-shim-bulkhead-v2"));
    // A resync while 1.0's pod runs keeps it.
    assert!(installer("2.0").install().await.unwrap().collected.is_empty());

    // No uninstall under running pods: nothing changes, and the message says how many and how to force.
    let wired_node = node.snapshot();
    let err = installer("2.0").uninstall().await.unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::InUse { pods: 2, .. }), "{msg}");
    assert!(msg.contains("2 bulkhead pods run on this node (default/web, default/db)"), "{msg}");
    assert!(msg.contains("BULKHEAD_FORCE_UNINSTALL=1"), "{msg}");
    assert_eq!(node.snapshot(), wired_node, "a refused uninstall touches nothing");
    assert_eq!(api.snapshot().pointer("/metadata/labels/bulkhead.io~1runtime"), Some(&json!("ready")));
    assert!(support::registered(&node, "bulkhead").await);

    // The old pod ends; containerd's cleanup after it runs the shim through current, which is there.
    old_pod.stop();
    assert!(opt.join("current/containerd-shim-bulkhead-v2").is_file());
    let r = installer("2.0").install().await.unwrap();
    assert_eq!(r.collected, ["1.0"], "collected once its last pod is gone");
    assert_eq!(versions(&node), ["2.0"]);
    assert!(!r.restarted);

    // Forced, uninstall proceeds under the running pod; the pod itself is left alone.
    let mut new_pod = new_pod;
    installer("2.0").uninstall_with(WhileInUse::Force).await.unwrap();
    assert!(new_pod.is_running(), "uninstall stops no pod");
    assert_eq!(fs::read(node.config()).unwrap(), original, "config restored byte for byte");
    assert_eq!(node.snapshot(), before, "no files left");
    assert!(!support::registered(&node, "bulkhead").await);
    new_pod.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uninstall_of_an_idle_node_needs_no_force() {
    if !support::can_run_containerd() {
        return;
    }
    let node = support::node(true);
    support::elf_shim(&node);
    let before = node.snapshot();
    let ctd = support::Containerd::start(&node);
    let inst = Installer { settings: settings(&node, "1.0"), restarter: &ctd, nodes: None, fail: FailPoints::none() };
    inst.install().await.unwrap();
    // A pod that ended without cleanup (its record names a dead shim) is containerd's to clean up, not a pod.
    let mut gone = support::FakePod::start(&node, "ccc333", "gone");
    let record = gone.dir.join("pod.json");
    let kept = fs::read(&record).unwrap();
    gone.stop();
    fs::create_dir_all(record.parent().unwrap()).unwrap();
    fs::write(&record, kept).unwrap();
    inst.uninstall().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(node.snapshot(), before);
}

/// A process of the test's own, ended (by its PID) when dropped if it still runs.
struct Spawned(std::process::Child);

impl Drop for Spawned {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            // SAFETY: kill(2) on the PID of a child this test spawned and has not reaped (checked just above).
            unsafe { libc::kill(self.0.id() as i32, libc::SIGKILL) };
            let _ = self.0.wait();
        }
    }
}

/// The installed shim binary (an ELF copy of sleep) run for `secs`, with no pod record: like a `start` or `delete`
/// containerd runs, or a shim on its way out after its pod was removed.
fn shim_process(node: &support::Node, secs: &str) -> Spawned {
    let shim = node.root().join("opt/bulkhead/current/containerd-shim-bulkhead-v2");
    Spawned(std::process::Command::new(shim).arg(secs).spawn().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uninstall_lets_a_process_without_a_pod_end_and_refuses_one_that_stays() {
    if !support::can_run_containerd() {
        return;
    }
    let node = support::node(true);
    support::elf_shim(&node);
    let before = node.snapshot();
    let ctd = support::Containerd::start(&node);
    let inst = Installer { settings: settings(&node, "1.0"), restarter: &ctd, nodes: None, fail: FailPoints::none() };
    inst.install().await.unwrap();

    let (_brief, stays) = (shim_process(&node, "1"), shim_process(&node, "3600"));
    let started = std::time::Instant::now();
    let msg = inst.uninstall().await.unwrap_err().to_string();
    assert!(started.elapsed() >= std::time::Duration::from_secs(5), "waited for processes to end: {msg}");
    let pid = stays.0.id();
    assert!(
        msg.contains(&format!(
            "0 bulkhead pods run on this node; 1 process executes installed files (1.0: pids [{pid}])"
        )),
        "{msg}"
    );
    drop(stays);

    let _brief = shim_process(&node, "1");
    inst.uninstall().await.unwrap_or_else(|e| panic!("a process that ends on its own does not block: {e}"));
    assert_eq!(node.snapshot(), before);
}
