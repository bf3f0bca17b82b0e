//! The installer against a real containerd 2.1 (unpacked by `make setup`) started from a scratch node root's own
//! config, as `real_containerd.rs` does with 1.6:
//! - a version-3 config whose CRI settings partly come from the user's own `imports`: the version-3 drop-in (our
//!   runtime alone, merged key by key) keeps every user setting; a second install changes nothing and does not
//!   restart; uninstall restores the config byte for byte;
//! - a version-2 config, which containerd 2.1 migrates itself when it loads it: the version-2 drop-in works there too;
//! - a failed restart (containerd left down) rolls the drop-in back and containerd comes up on the node's own
//!   config, on 2.1 and on 1.6;
//! - a pod served through the installed handler (this build's shim on the namespace backend), on 2.1 and on 1.6.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod support;

use std::fs;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use bulkhead_integration::{container_config, pod_config, workspace_bin, ContainerdVersion, Cri};
use bulkhead_node_installer::containerd::ConfigVersion;
use bulkhead_node_installer::cri;
use bulkhead_node_installer::error::Error;
use bulkhead_node_installer::failpoint::FailPoints;
use bulkhead_node_installer::installer::{Installer, Outcome};
use bulkhead_node_installer::restart::Restarter;
use k8s_cri::v1 as crip;
use serde_json::{json, Value};

const V2_1: ContainerdVersion = ContainerdVersion::V2_1;

/// containerd's effective CRI runtime config (CRI `Status`, verbose), once it answers with `runc` registered.
async fn cri_config(node: &support::Node) -> Value {
    assert!(support::registered(node, "runc").await, "runc must stay registered");
    let mut c = cri::connect(&node.socket()).await.expect("connect CRI");
    let st = c.status(crip::StatusRequest { verbose: true }).await.expect("CRI Status").into_inner();
    serde_json::from_str(st.info.get("config").expect("verbose config")).expect("config JSON")
}

fn installer<'a>(node: &support::Node, restarter: &'a dyn Restarter) -> Installer<'a> {
    Installer { settings: node.settings(), restarter, nodes: None, fail: FailPoints::none() }
}

/// RunPodSandbox with the bulkhead handler; with the fake shim it fails, but only after containerd ran its `start`.
async fn reach_the_shim(node: &support::Node) {
    let cri = Cri::connect(&node.socket()).await.unwrap();
    let logs = tempfile::tempdir().unwrap();
    let res = cri.run_pod_sandbox(&pod_config("p1", logs.path()), "bulkhead").await;
    let calls = node.shim_calls();
    assert!(
        calls.iter().any(|l| l.contains("-id ") && l.trim_end().ends_with("start")),
        "shim calls: {calls:?}; {res:?}"
    );
}

/// The shared story of the two config formats on 2.1: install, reach the shim, reinstall without a restart,
/// uninstall back to the original bytes. Returns containerd's CRI config and the node's config file while installed.
async fn install_reinstall_uninstall(
    node: &support::Node,
    ctd: &support::Containerd,
    want: ConfigVersion,
) -> (Value, String) {
    let original = fs::read(node.config()).unwrap();
    let before = node.snapshot();
    let inst = installer(node, ctd);

    let r = inst.install().await.unwrap_or_else(|e| panic!("install: {e}\n{}", ctd.log_tail()));
    assert_eq!(r.outcome, Outcome::Ready { config_version: want });
    assert!(r.restarted && r.artifacts_changed);
    assert_eq!(ctd.restart_count(), 1);
    let installed_config = cri_config(node).await;
    let installed_file = fs::read_to_string(node.config()).unwrap();
    reach_the_shim(node).await;

    let installed = node.snapshot();
    let r2 = inst.install().await.unwrap();
    assert!(!r2.restarted && !r2.artifacts_changed, "{r2:?}");
    assert_eq!(ctd.restart_count(), 1, "a second install must not restart containerd");
    assert_eq!(node.snapshot(), installed);

    inst.uninstall().await.unwrap();
    assert_eq!(fs::read(node.config()).unwrap(), original, "config restored byte for byte");
    assert_eq!(node.snapshot(), before, "uninstall leaves no files");
    assert_eq!(ctd.restart_count(), 2);
    let cfg = cri_config(node).await;
    assert!(cfg.pointer("/containerd/runtimes/bulkhead").is_none(), "{cfg}");
    (installed_config, installed_file)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v3_dropin_keeps_the_users_imports_on_containerd_2_1() {
    if !support::can_run_containerd_on(V2_1) {
        return;
    }
    let node = support::node_v3(true);
    let user_import = node.root().join("etc/containerd/user.toml").display().to_string();
    let ctd = support::Containerd::start_on(&node, V2_1);
    support::import_pause_on(&node, V2_1);

    let (cfg, installed) = install_reinstall_uninstall(&node, &ctd, ConfigVersion::V3).await;

    // While installed, the config imported the user's file first, then our drop-in.
    let dropin = node.root().join("etc/containerd/conf.d/zz-bulkhead.toml").display().to_string();
    let doc: toml::Table = installed.parse().unwrap();
    let imports: Vec<&str> = doc["imports"].as_array().unwrap().iter().filter_map(|v| v.as_str()).collect();
    assert_eq!(imports, [user_import.as_str(), dropin.as_str()], "{installed}");

    // containerd 2.1 merged our runtime into the user's settings, the imported ones included.
    let bulkhead = cfg.pointer("/containerd/runtimes/bulkhead").unwrap_or_else(|| panic!("{cfg}"));
    let shim = node.root().join("opt/bulkhead/current/containerd-shim-bulkhead-v2").display().to_string();
    assert_eq!(bulkhead["runtimeType"], "io.containerd.bulkhead.v2", "{bulkhead}");
    assert_eq!(bulkhead["runtimePath"], json!(shim), "{bulkhead}");
    assert_eq!(bulkhead["sandboxer"], "podsandbox", "{bulkhead}");
    let config_path = node.root().join("opt/bulkhead/current/config.toml").display().to_string();
    assert_eq!(bulkhead.pointer("/options/ConfigPath"), Some(&json!(config_path)), "{bulkhead}");
    assert_eq!(cfg.get("restrictOOMScoreAdj"), Some(&json!(true)), "the user's import is kept: {cfg}");
    assert_eq!(cfg.pointer("/containerd/runtimes/runc/options/NoNewKeyring"), Some(&json!(true)), "{cfg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v2_config_that_containerd_2_1_migrates_gets_the_v2_dropin() {
    if !support::can_run_containerd_on(V2_1) {
        return;
    }
    let node = support::node(true);
    // containerd 2.x keeps one NRI socket per host by default; this config is the 1.x one and does not say.
    let config = fs::read_to_string(node.config()).unwrap();
    fs::write(node.config(), format!("{config}\n[plugins.\"io.containerd.nri.v1.nri\"]\n  disable = true\n")).unwrap();
    let ctd = support::Containerd::start_on(&node, V2_1);
    support::import_pause_on(&node, V2_1);
    let (cfg, _) = install_reinstall_uninstall(&node, &ctd, ConfigVersion::V2).await;
    // Migrated by containerd itself: the v2 drop-in's runtime and the user's CRI settings it mirrors.
    let shim = node.root().join("opt/bulkhead/current/containerd-shim-bulkhead-v2").display().to_string();
    assert_eq!(cfg.pointer("/containerd/runtimes/bulkhead/runtimeType"), Some(&json!(shim)), "{cfg}");
    assert_eq!(cfg.get("restrictOOMScoreAdj"), Some(&json!(true)), "{cfg}");
    assert_eq!(cfg.pointer("/containerd/runtimes/runc/runtimeType"), Some(&json!("io.containerd.runc.v2")));
}

/// A restart that fails the way `systemctl restart` can: containerd is down afterwards. The next restart works.
struct FailsFirstRestart<'a> {
    ctd: &'a support::Containerd,
    calls: AtomicUsize,
}

impl Restarter for FailsFirstRestart<'_> {
    fn restart(&self) -> bulkhead_node_installer::Result<()> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            self.ctd.stop();
            return Err(Error::Restart("containerd.service: start request repeated too quickly".into()));
        }
        self.ctd.restart()
    }
}

/// A failed restart leaves containerd `version` down; the rollback's restart brings it up on the node's own config.
async fn a_failed_restart_rolls_back(version: ContainerdVersion) {
    if !support::can_run_containerd_on(version) {
        return;
    }
    let node = if version.config_format() == 3 { support::node_v3(true) } else { support::node(true) };
    let original = fs::read(node.config()).unwrap();
    let before = node.snapshot();
    let ctd = support::Containerd::start_on(&node, version);
    let restarter = FailsFirstRestart { ctd: &ctd, calls: AtomicUsize::new(0) };
    let err = installer(&node, &restarter).install().await.unwrap_err().to_string();
    assert!(err.contains("rolled back"), "{err}");
    assert_eq!(restarter.calls.load(Ordering::SeqCst), 2, "the failed restart, then one without us");
    assert_eq!(fs::read(node.config()).unwrap(), original, "containerd's config is the node's own again");
    let dropins = node.root().join("etc/containerd/conf.d");
    assert!(!dropins.join("zz-bulkhead.toml").exists(), "the drop-in is gone");
    // containerd is up again, on the node's own config: runc yes, bulkhead no.
    assert!(!support::registered(&node, "bulkhead").await, "{}", ctd.log_tail());
    assert!(support::registered(&node, "runc").await);
    // What is left is the installer's own state under /opt; uninstall takes the node back to where it was.
    installer(&node, &ctd).uninstall().await.unwrap();
    assert_eq!(node.snapshot(), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_restart_rolls_back_and_containerd_2_1_comes_up_on_the_nodes_config() {
    a_failed_restart_rolls_back(V2_1).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_restart_rolls_back_and_containerd_1_6_comes_up_on_the_nodes_config() {
    a_failed_restart_rolls_back(ContainerdVersion::V1_6).await
}

/// Installs this build's shim (namespace backend) on a node running containerd `version` and runs a pod through
/// the installed handler: a container, an exec, removal; uninstall leaves the node as it was.
async fn a_pod_is_served_through_the_installed_handler(test: &str, version: ContainerdVersion) {
    if !support::can_run_containerd_on(version) || bulkhead_integration::skip_if_unready_on(test, version) {
        return;
    }
    for bin in ["containerd-shim-bulkhead-v2", "bulkhead-agent"] {
        if !workspace_bin(bin).is_file() {
            let why = format!("{} is not built (run `cargo build --workspace --bins`)", workspace_bin(bin).display());
            bulkhead_integration::skip::missing_prerequisite(test, &why);
            return;
        }
    }
    let node = if version.config_format() == 3 { support::node_v3(true) } else { support::node(true) };
    let img = node.artifacts.path().join("image");
    for bin in ["containerd-shim-bulkhead-v2", "bulkhead-agent"] {
        // Without debug info: the installer copies the files.
        let out = Command::new("objcopy").arg("--strip-debug").arg(workspace_bin(bin)).arg(img.join(bin)).output();
        assert!(out.unwrap().status.success(), "objcopy {bin}");
    }
    let root = node.root();
    let shim_config = format!(
        "backend = \"namespace\"\nstate_dir = \"{}\"\n[namespace]\nagent_path = \"{}\"\n",
        root.join("run/bulkhead").display(),
        root.join("opt/bulkhead/current/bulkhead-agent").display()
    );
    fs::write(img.join("config.toml"), shim_config).unwrap();
    let original = fs::read(node.config()).unwrap();
    let before = node.snapshot();
    let ctd = support::Containerd::start_on(&node, version);
    let inst = installer(&node, &ctd);
    inst.install().await.unwrap_or_else(|e| panic!("install: {e}\n{}", ctd.log_tail()));
    support::import_pause_on(&node, version);
    let images =
        bulkhead_integration::images::build_all(&bulkhead_integration::target_dir().join("bulkhead-test-images"));
    support::import_on(&node, version, &images.unwrap().busybox);

    let cri = Cri::connect(&node.socket()).await.unwrap();
    let logs = tempfile::tempdir().unwrap();
    let pod = pod_config("served", logs.path());
    let pod_id = cri.run_pod_sandbox(&pod, "bulkhead").await.unwrap_or_else(|e| panic!("{e:#}\n{}", ctd.log_tail()));
    let c = cri.create_container(&pod_id, &container_config("c", &["sleep", "600"]), &pod).await.unwrap();
    cri.start_container(&c).await.unwrap();
    let out = cri.exec_sync(&c, &["echo", "served"], 10).await.unwrap();
    assert_eq!((out.exit_code, String::from_utf8_lossy(&out.stdout).trim()), (0, "served"));
    // The pod's shim is the installed one.
    let record = bulkhead_shim::sandbox::paths::PodPaths::new(&root.join("run/bulkhead"), &pod_id).unwrap();
    let record = bulkhead_shim::sandbox::paths::PodRecord::read(&record).unwrap();
    let exe = fs::read_link(format!("/proc/{}/exe", record.shim_pid)).unwrap();
    assert!(exe.starts_with(root.join("opt/bulkhead")), "{}", exe.display());

    cri.stop_container(&c, 5).await.unwrap();
    cri.remove_container(&c).await.unwrap();
    cri.stop_pod_sandbox(&pod_id).await.unwrap();
    cri.remove_pod_sandbox(&pod_id).await.unwrap();
    // containerd ends the pod's shim after the removal; uninstall waits for what still runs from the install.
    inst.uninstall().await.unwrap_or_else(|e| panic!("uninstall: {e}"));
    assert_eq!(fs::read(node.config()).unwrap(), original);
    assert_eq!(node.snapshot(), before);
    assert!(!Path::new(&root.join("opt/bulkhead")).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_is_served_through_the_installed_handler_on_containerd_2_1() {
    let test = "a_pod_is_served_through_the_installed_handler_on_containerd_2_1";
    a_pod_is_served_through_the_installed_handler(test, V2_1).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_is_served_through_the_installed_handler_on_containerd_1_6() {
    let test = "a_pod_is_served_through_the_installed_handler_on_containerd_1_6";
    a_pod_is_served_through_the_installed_handler(test, ContainerdVersion::V1_6).await
}
