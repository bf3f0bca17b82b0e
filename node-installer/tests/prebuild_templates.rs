//! Template pre-builds after an install (warm pods, issue 22), for real: a scratch node whose image holds this
//! build's `bulkhead-ctl` and `bulkhead-vmm`, the real virtiofsd, and the agent stub test guest as its kernel, a
//! real containerd 1.6, and an install asked for two shapes. Once the node is ready the installed ctl has built
//! both templates into the shim config's cache, one with a NIC; a second install finds them and builds nothing;
//! uninstall removes them.
//!
//! Needs root, /dev/kvm, the guest toolchain and the workspace's binaries; otherwise it says SKIPPED.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod support;

use std::fs;
use std::process::Command;

use bulkhead_integration::{guests, skip, workspace_bin};
use bulkhead_node_installer::failpoint::FailPoints;
use bulkhead_node_installer::installer::{Installer, Outcome, Settings};
use bulkhead_node_installer::templates::{parse_shapes, Templates, BUILD_TIMEOUT};

const TEST: &str = "an_install_prebuilds_the_asked_templates_once";

/// The installed ctl's `template ls --json`.
fn template_ls(node: &support::Node) -> serde_json::Value {
    let current = node.root().join("opt/bulkhead/current");
    let out = Command::new(current.join("bulkhead-ctl"))
        .arg("--config")
        .arg(current.join("config.toml"))
        .args(["template", "ls", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "template ls: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_install_prebuilds_the_asked_templates_once() {
    if !support::can_run_containerd() {
        return;
    }
    if let Err(why) = bulkhead_vmm_api::probe::kvm_device_usable() {
        skip::missing_prerequisite(TEST, &why);
        return;
    }
    let (ctl, vmm, virtiofsd) =
        (workspace_bin("bulkhead-ctl"), workspace_bin("bulkhead-vmm"), bulkhead_integration::virtiofsd_path());
    if let Some(missing) = [&ctl, &vmm, &virtiofsd].into_iter().find(|p| !p.is_file()) {
        skip::missing_prerequisite(
            TEST,
            &format!("{} is missing (`make setup`, `cargo build --workspace`)", missing.display()),
        );
        return;
    }
    let node = support::node(true);
    let guest = match guests::build("agent_stub", &node.artifacts.path().join("guests")) {
        Ok(guest) => guest,
        Err(why) => {
            skip::missing_prerequisite(TEST, &why);
            return;
        }
    };
    let image = node.artifacts.path().join("image");
    for (from, name) in [(&ctl, "bulkhead-ctl"), (&vmm, "bulkhead-vmm"), (&virtiofsd, "virtiofsd"), (&guest, "vmlinux")]
    {
        fs::copy(from, image.join(name)).unwrap();
    }
    // The shim config the image ships: its files in the installed version's directory, its pods' state in a short
    // directory of its own (the VMs' socket paths must fit), its templates under the scratch root.
    let state = tempfile::Builder::new().prefix("bp").tempdir_in("/run").unwrap();
    let settings = node.settings();
    let version_dir = node.root().join("opt/bulkhead").join(&settings.version);
    let templates = node.root().join("var/lib/bulkhead/templates");
    fs::write(
        image.join("config.toml"),
        format!(
            "backend = \"vm\"\nstate_dir = \"{}\"\n[vm]\nvmm_path = \"{v}/bulkhead-vmm\"\nkernel_path = \"{v}/vmlinux\"\n\
             initramfs_path = \"{v}/initramfs.cpio.gz\"\nvirtiofsd_path = \"{v}/virtiofsd\"\nmemory_mib = 64\n\
             jail_id_first = 40700\njail_id_count = 8\nstart = \"warm\"\ntemplate_dir = \"{}\"\n",
            state.path().display(),
            templates.display(),
            v = version_dir.display(),
        ),
    )
    .unwrap();
    let ctd = support::Containerd::start(&node);
    let installer = Installer {
        settings: Settings {
            templates: Templates {
                shapes: parse_shapes("default,default/1500").unwrap(),
                host_exec: vec![],
                timeout: BUILD_TIMEOUT,
            },
            ..settings
        },
        restarter: &ctd,
        nodes: None,
        fail: FailPoints::none(),
    };

    let r = installer.install().await.unwrap_or_else(|e| panic!("install: {e}\n{}", ctd.log_tail()));
    assert!(matches!(r.outcome, Outcome::Ready { .. }), "{r:?}");
    let listed = template_ls(&node);
    println!("{TEST}: {listed}");
    let rows = listed["templates"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{listed}");
    assert!(rows.iter().all(|t| t["state"] == "ready"), "{listed}");
    let mut nics: Vec<String> = rows.iter().map(|t| t["nic_mtus"].to_string()).collect();
    nics.sort();
    assert_eq!(nics, ["[1500]", "[]"], "{listed}");
    let created = |l: &serde_json::Value| -> Vec<String> {
        let mut v: Vec<String> = l["templates"].as_array().unwrap().iter().map(|t| t.to_string()).collect();
        v.sort();
        v
    };

    // Again: both are found, none rebuilt.
    installer.install().await.unwrap();
    assert_eq!(created(&template_ls(&node)), created(&listed), "a second install rebuilt a template");
    // The builds' VMs and their state are gone.
    let left: Vec<String> = fs::read_dir(state.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "left in the state dir: {left:?}");

    // Uninstall takes the templates with it (pods may have built more than were asked for).
    installer.uninstall().await.unwrap();
    let kept: Vec<_> =
        fs::read_dir(&templates).map(|d| d.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
    assert!(kept.iter().all(|n| n.to_string_lossy().starts_with('.')), "templates left after uninstall: {kept:?}");
}
