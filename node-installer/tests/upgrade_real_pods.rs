//! An update under real pods: the installed shim (this build's, on the `namespace` backend) serves pods through a
//! real containerd 1.6 started from a scratch node root. Version 1.0 runs a pod; 2.0 installs beside it without a
//! containerd restart; the 1.0 pod keeps serving, takes a new container (containerd runs 2.0's `start` for it, which
//! hands back the 1.0 shim's address) and is stopped and removed cleanly; a new pod runs 2.0's shim; 1.0 goes once
//! its pod has; uninstall refuses while a pod runs.
//!
//! Needs the workspace's shim and agent binaries (`cargo build --workspace --bins`); without them it says SKIPPED.
//! The kernel, initramfs, VMM and virtiofsd are the scratch node's stand-ins: the namespace backend does not use them.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod support;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use bulkhead_integration::{container_config, pod_config, workspace_bin, Cri};
use bulkhead_node_installer::error::Error;
use bulkhead_node_installer::failpoint::FailPoints;
use bulkhead_node_installer::installer::{Installer, Settings};
use bulkhead_shim::sandbox::paths::{PodPaths, PodRecord};

const TEST: &str = "real_pods_keep_their_version_across_an_update_and_it_goes_after_them";

fn run(cmd: &mut Command) {
    let out = cmd.stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
}

/// The image's shim config for `version`: the namespace backend, naming that version's agent.
fn write_config(node: &support::Node, version: &str) {
    let root = node.root();
    let text = format!(
        "backend = \"namespace\"\nstate_dir = \"{}\"\n[namespace]\nagent_path = \"{}\"\n",
        root.join("run/bulkhead").display(),
        root.join("opt/bulkhead").join(version).join("bulkhead-agent").display()
    );
    fs::write(node.artifacts.path().join("image/config.toml"), text).unwrap();
}

/// The executable of the shim serving `pod`, from the shim's own record.
fn shim_exe(node: &support::Node, pod: &str) -> PathBuf {
    let paths = PodPaths::new(&node.root().join("run/bulkhead"), pod).unwrap();
    let record = PodRecord::read(&paths).unwrap_or_else(|e| panic!("pod record of {pod}: {e}"));
    fs::read_link(format!("/proc/{}/exe", record.shim_pid)).unwrap()
}

/// What containerd's log (the shims' logs included) says about errors and the agent, for a failed pod start.
fn shim_errors(node: &support::Node) -> String {
    let log = fs::read_to_string(node.root().join("var/containerd.log")).unwrap_or_default();
    let lines = log.lines().filter(|l| l.contains("level=error") || l.contains("ERROR") || l.contains("agent"));
    lines.collect::<Vec<_>>().join("\n")
}

async fn echo(cri: &Cri, container: &str, word: &str) {
    let out = cri.exec_sync(container, &["echo", word], 10).await.unwrap();
    assert_eq!((out.exit_code, String::from_utf8_lossy(&out.stdout).trim()), (0, word));
}

/// On a failed assertion, stops and removes the pods (through CRI, so containerd and the shims end them) before the
/// node's containerd is stopped: no shim or agent of this test outlives it.
struct RemovePodsOnPanic(PathBuf);

impl Drop for RemovePodsOnPanic {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let socket = self.0.clone();
        let cleanup = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                if let Ok(cri) = Cri::connect(&socket).await {
                    let _ = cri.remove_all_pods().await;
                }
            })
        });
        let _ = cleanup.join();
    }
}

async fn remove_pod(cri: &Cri, pod: &str, containers: &[&str]) {
    for c in containers {
        cri.stop_container(c, 5).await.unwrap();
        cri.remove_container(c).await.unwrap();
    }
    cri.stop_pod_sandbox(pod).await.unwrap();
    cri.remove_pod_sandbox(pod).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_pods_keep_their_version_across_an_update_and_it_goes_after_them() {
    if !support::can_run_containerd() || bulkhead_integration::skip_if_unready(TEST) {
        return;
    }
    for bin in ["containerd-shim-bulkhead-v2", "bulkhead-agent"] {
        if !workspace_bin(bin).is_file() {
            let why = format!("{} is not built (run `cargo build --workspace --bins`)", workspace_bin(bin).display());
            bulkhead_integration::skip::missing_prerequisite(TEST, &why);
            return;
        }
    }
    let node = support::node(true);
    let img = node.artifacts.path().join("image");
    for bin in ["containerd-shim-bulkhead-v2", "bulkhead-agent"] {
        // Without debug info: the installer copies each version's files.
        run(Command::new("objcopy").arg("--strip-debug").arg(workspace_bin(bin)).arg(img.join(bin)));
    }
    let original = fs::read(node.config()).unwrap();
    let before = node.snapshot();
    let ctd = support::Containerd::start(&node);
    let installer = |version: &str| Installer {
        settings: Settings { version: version.into(), ..node.settings() },
        restarter: &ctd,
        nodes: None,
        fail: FailPoints::none(),
    };
    let opt = node.root().join("opt/bulkhead");

    write_config(&node, "1.0");
    installer("1.0").install().await.unwrap_or_else(|e| panic!("install 1.0: {e}\n{}", ctd.log_tail()));
    support::import_pause(&node);
    let busybox =
        bulkhead_integration::images::build_all(&bulkhead_integration::target_dir().join("bulkhead-test-images"))
            .unwrap()
            .busybox;
    run(Command::new("ctr")
        .arg("--address")
        .arg(node.socket())
        .args(["-n", "k8s.io", "images", "import", "--snapshotter", "native"])
        .arg(&busybox));
    let cri = Cri::connect(&node.socket()).await.unwrap();
    let _cleanup = RemovePodsOnPanic(node.socket());
    let logs = tempfile::tempdir().unwrap();

    // A pod on 1.0.
    let old = pod_config("old", logs.path());
    let old_id =
        cri.run_pod_sandbox(&old, "bulkhead").await.unwrap_or_else(|e| panic!("{e:#}\n{}", shim_errors(&node)));
    let c1 = cri.create_container(&old_id, &container_config("c1", &["sleep", "600"]), &old).await.unwrap();
    cri.start_container(&c1).await.unwrap();
    echo(&cri, &c1, "one").await;
    assert_eq!(shim_exe(&node, &old_id), opt.join("1.0/containerd-shim-bulkhead-v2"));

    // 2.0 beside it: no containerd restart, 1.0 stays.
    write_config(&node, "2.0");
    let r = installer("2.0").install().await.unwrap();
    assert!(!r.restarted && r.collected.is_empty(), "{r:?}");
    assert_eq!(ctd.restart_count(), 1);
    assert_eq!(bulkhead_node_installer::versions::installed(&opt).unwrap(), ["1.0", "2.0"]);

    // The 1.0 pod keeps serving and takes a new container.
    echo(&cri, &c1, "still").await;
    let c2 = cri.create_container(&old_id, &container_config("c2", &["sleep", "600"]), &old).await.unwrap();
    cri.start_container(&c2).await.unwrap();
    echo(&cri, &c2, "two").await;
    assert_eq!(shim_exe(&node, &old_id), opt.join("1.0/containerd-shim-bulkhead-v2"), "the same 1.0 shim");

    // A new pod runs 2.0's shim.
    let new = pod_config("new", logs.path());
    let new_id =
        cri.run_pod_sandbox(&new, "bulkhead").await.unwrap_or_else(|e| panic!("{e:#}\n{}", shim_errors(&node)));
    let c3 = cri.create_container(&new_id, &container_config("c3", &["sleep", "600"]), &new).await.unwrap();
    cri.start_container(&c3).await.unwrap();
    echo(&cri, &c3, "three").await;
    assert_eq!(shim_exe(&node, &new_id), opt.join("2.0/containerd-shim-bulkhead-v2"));

    // Uninstall refuses while they run.
    let err = installer("2.0").uninstall().await.unwrap_err();
    assert!(matches!(err, Error::InUse { pods: 2, .. }), "{err}");

    // The 1.0 pod is stopped and removed cleanly, and its version goes with it.
    remove_pod(&cri, &old_id, &[&c1, &c2]).await;
    assert!(!node.root().join("run/bulkhead").join(&old_id).exists(), "the shim cleaned up");
    // containerd shuts the pod's shim down after the removal; once it has exited, nothing runs from 1.0.
    let layout = node.settings().layout;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while bulkhead_node_installer::usage::scan(&layout).unwrap().by_version().contains_key("1.0") {
        assert!(std::time::Instant::now() < deadline, "1.0's shim did not exit after its pod was removed");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let r = installer("2.0").install().await.unwrap();
    assert_eq!(r.collected, ["1.0"], "{r:?}");
    assert_eq!(bulkhead_node_installer::versions::installed(&opt).unwrap(), ["2.0"]);
    echo(&cri, &c3, "after").await;

    remove_pod(&cri, &new_id, &[&c3]).await;
    installer("2.0").uninstall().await.unwrap();
    assert_eq!(fs::read(node.config()).unwrap(), original);
    assert_eq!(node.snapshot(), before);
    assert!(!Path::new(&opt).exists());
}
