//! The installer image as `make image` builds it (`mkimage.py`, no container engine), end to end:
//! built twice from the same inputs (same digest), imported into the test harness's private
//! containerd, the installer run from the image's own filesystem against a scratch node root, and
//! the installed shim serving a pod on the `namespace` backend through that node's containerd.
//!
//! The test image carries this build's debug binaries, stripped of debug info (a release build of
//! everything takes minutes here; `make image` ships static release binaries), the cached guest
//! kernel, an initramfs packed from the same agent, virtiofsd from `make setup`, busybox for
//! `nsenter`, and a `config.toml` selecting the namespace backend (the image-shipped override the
//! installer supports).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod support;

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use bulkhead_integration::{container_config, pod_config, workspace_bin, Containerd, ContainerdConfig, Cri};
use bulkhead_node_installer::artifacts::{Need, ARTIFACTS};
use serde_json::Value;

const INSTALLER: &str = env!("CARGO_BIN_EXE_bulkhead-node-installer");
const REF: &str = "bulkhead.test/bulkhead-node-installer:0.1.0-img";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A debug binary without its debug info (the bytes the image carries).
fn stripped(bin: &Path, dir: &Path) -> PathBuf {
    let out = dir.join(bin.file_name().unwrap());
    run(Command::new("objcopy").arg("--strip-debug").arg(bin).arg(&out));
    out
}

/// Everything the test image is made of.
struct Inputs {
    installer: PathBuf,
    artifacts: Vec<(String, PathBuf)>,
}

fn inputs(work: &Path, shim_config: &str) -> Inputs {
    let bin = work.join("bin");
    fs::create_dir_all(&bin).unwrap();
    let agent = stripped(&workspace_bin("bulkhead-agent"), &bin);
    let initramfs = work.join("initramfs.cpio.gz");
    run(Command::new("python3").arg(repo().join("guest-kernel/mkinitramfs.py")).arg(&agent).arg(&initramfs));
    let kernel = run(&mut Command::new(repo().join("guest-kernel/build-kernel.sh")));
    let cache = std::env::var("BULKHEAD_CACHE").unwrap_or_else(|_| "/var/cache/bulkhead".into());
    let config = work.join("config.toml");
    fs::write(&config, shim_config).unwrap();
    let mut artifacts = vec![
        ("containerd-shim-bulkhead-v2".to_string(), stripped(&workspace_bin("containerd-shim-bulkhead-v2"), &bin)),
        ("bulkhead-vmm".into(), stripped(&workspace_bin("bulkhead-vmm"), &bin)),
        ("bulkhead-ctl".into(), stripped(&workspace_bin("bulkhead-ctl"), &bin)),
        ("bulkhead-agent".into(), agent),
        ("virtiofsd".into(), PathBuf::from(cache).join("bin/virtiofsd")),
        ("vmlinux".into(), PathBuf::from(kernel)),
        ("initramfs.cpio.gz".into(), initramfs),
        ("config.toml".into(), config),
    ];
    artifacts.sort();
    Inputs { installer: stripped(Path::new(INSTALLER), &bin), artifacts }
}

/// Runs `make image`'s builder; returns the image digest it printed.
fn build(inputs: &Inputs, out: &Path) -> String {
    let mut cmd = Command::new("python3");
    cmd.arg(repo().join("node-installer/mkimage.py"))
        .arg("--out")
        .arg(out)
        .args(["--ref", REF, "--gzip-level", "1", "--busybox", "/bin/busybox", "--installer"])
        .arg(&inputs.installer)
        .env("SOURCE_DATE_EPOCH", "1700000000");
    for (name, path) in &inputs.artifacts {
        cmd.arg("--artifact").arg(format!("{name}={}", path.display()));
    }
    run(&mut cmd)
}

/// A blob of the OCI archive, by digest.
fn blob(archive: &Path, digest: &str) -> Vec<u8> {
    let want = format!("blobs/sha256/{}", digest.trim_start_matches("sha256:"));
    let mut tar = tar::Archive::new(fs::File::open(archive).unwrap());
    for entry in tar.entries().unwrap() {
        let mut entry = entry.unwrap();
        if entry.path().unwrap().to_string_lossy() == want {
            let mut bytes = Vec::new();
            entry.read_to_end(&mut bytes).unwrap();
            return bytes;
        }
    }
    panic!("{want} not in {}", archive.display());
}

fn ctr(address: &Path, args: &[&str]) -> String {
    run(Command::new("ctr").arg("--address").arg(address).args(["-n", "k8s.io"]).args(args))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_builds_reproducibly_installs_from_containerd_and_serves_a_pod() {
    if !support::can_run_containerd()
        || bulkhead_integration::skip_if_unready("image_builds_reproducibly_installs_from_containerd_and_serves_a_pod")
    {
        return;
    }
    for bin in ["containerd-shim-bulkhead-v2", "bulkhead-vmm", "bulkhead-ctl", "bulkhead-agent"] {
        if !workspace_bin(bin).is_file() {
            let why = format!("{} is not built (run `cargo build --workspace --bins`)", workspace_bin(bin).display());
            bulkhead_integration::skip::missing_prerequisite(
                "image_builds_reproducibly_installs_from_containerd_and_serves_a_pod",
                &why,
            );
            return;
        }
    }
    let node = support::node(true);
    let root = node.root().to_path_buf();
    let state_dir = tempfile::Builder::new().prefix("bhi").tempdir_in("/run").unwrap();
    let shim_config = format!(
        "backend = \"namespace\"\nstate_dir = \"{}\"\n[namespace]\nagent_path = \"{}\"\n",
        state_dir.path().display(),
        root.join("opt/bulkhead/current/bulkhead-agent").display()
    );

    // Two builds, same inputs: the same digest, byte for byte the same archive.
    let work = tempfile::tempdir_in(bulkhead_integration::target_dir()).unwrap();
    let inputs = inputs(work.path(), &shim_config);
    let (a, b) = (work.path().join("a.oci.tar"), work.path().join("b.oci.tar"));
    let digest = build(&inputs, &a);
    assert_eq!(build(&inputs, &b), digest, "two builds, two digests");
    assert_eq!(fs::read(&a).unwrap(), fs::read(&b).unwrap());
    fs::remove_file(&b).unwrap();
    let manifest: Value = serde_json::from_slice(&blob(&a, &digest)).unwrap();
    let config: Value = serde_json::from_slice(&blob(&a, manifest["config"]["digest"].as_str().unwrap())).unwrap();
    let entrypoint = config["config"]["Entrypoint"][0].as_str().unwrap().to_string();
    let env: Vec<&str> = config["config"]["Env"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    let artifacts_dir =
        env.iter().find_map(|e| e.strip_prefix("BULKHEAD_ARTIFACTS=")).expect("image sets BULKHEAD_ARTIFACTS");

    // Imported into the harness's private containerd, which reports the same digest.
    let harness = Containerd::start(ContainerdConfig::default()).await.unwrap();
    ctr(harness.address(), &["images", "import", &a.display().to_string()]);
    let listed = ctr(harness.address(), &["images", "ls"]);
    assert!(listed.lines().any(|l| l.starts_with(REF) && l.contains(&digest)), "{listed}");
    let mnt = harness.dir().join("image-rootfs");
    fs::create_dir_all(&mnt).unwrap();
    ctr(harness.address(), &["images", "mount", REF, &mnt.display().to_string()]);
    let image_dir = mnt.join(artifacts_dir.trim_start_matches('/'));
    for a in ARTIFACTS.iter().filter(|a| a.need != Need::Optional) {
        assert!(image_dir.join(a.name).is_file(), "image lacks {}", a.name);
    }
    assert_eq!(
        fs::read_link(mnt.join("usr/local/bin/bulkhead-ctl")).unwrap(),
        Path::new("/opt/bulkhead-artifacts/bulkhead-ctl")
    );
    assert!(mnt.join("usr/bin/nsenter").symlink_metadata().is_ok(), "nsenter for the restart command");

    // The installer from the image's filesystem, against the scratch node and its own containerd.
    let script = support::Script::new(&node);
    script.run("start");
    let installer = |cmd: &str| {
        let mut c = Command::new(mnt.join(entrypoint.trim_start_matches('/')));
        c.arg(cmd)
            .arg("--no-kube")
            .arg("--host-root")
            .arg(&root)
            .arg("--view-root")
            .arg(&root)
            .arg("--artifacts")
            .arg(&image_dir)
            .args(["--artifact-version", "0.1.0-img", "--cri-timeout-secs", "60"])
            .arg("--restart-command")
            .arg(format!("{} restart", script.path.display()));
        c
    };
    run(&mut installer("install"));
    assert_eq!(script.restarts(), 1);
    let installed = root.join("opt/bulkhead/current");
    for name in ["containerd-shim-bulkhead-v2", "bulkhead-ctl", "bulkhead-agent", "config.toml", "vmlinux"] {
        assert!(installed.join(name).is_file(), "not installed: {name}");
    }

    // The installed shim serves a pod through the node's containerd.
    support::import_pause(&node);
    let busybox =
        bulkhead_integration::images::build_all(&bulkhead_integration::target_dir().join("bulkhead-test-images"))
            .unwrap()
            .busybox;
    let sock = node.socket();
    run(Command::new("ctr")
        .arg("--address")
        .arg(&sock)
        .args(["-n", "k8s.io", "images", "import", "--snapshotter", "native"])
        .arg(&busybox));
    let cri = Cri::connect(&sock).await.unwrap();
    let logs = tempfile::tempdir().unwrap();
    let pod = pod_config("from-image", logs.path());
    let pod_id = cri.run_pod_sandbox(&pod, "bulkhead").await.unwrap_or_else(|e| {
        panic!("{e:#}\n{}", fs::read_to_string(node.artifacts.path().join("containerd.log")).unwrap_or_default())
    });
    let ctr_id = cri.create_container(&pod_id, &container_config("c", &["sleep", "60"]), &pod).await.unwrap();
    cri.start_container(&ctr_id).await.unwrap();
    let out = cri.exec_sync(&ctr_id, &["echo", "served"], 10).await.unwrap();
    assert_eq!((out.exit_code, String::from_utf8_lossy(&out.stdout).trim()), (0, "served"));
    let ps = run(Command::new(installed.join("bulkhead-ctl"))
        .arg("--config")
        .arg(installed.join("config.toml"))
        .args(["ps", "--json"]));
    let ps: Value = serde_json::from_str(&ps).unwrap();
    assert_eq!(ps["pods"][0]["id"], pod_id.as_str(), "{ps}");
    assert_eq!(ps["pods"][0]["state"], "running", "{ps}");

    cri.stop_container(&ctr_id, 5).await.unwrap();
    cri.remove_container(&ctr_id).await.unwrap();
    cri.stop_pod_sandbox(&pod_id).await.unwrap();
    cri.remove_pod_sandbox(&pod_id).await.unwrap();
    run(&mut installer("uninstall"));
    assert!(!root.join("opt/bulkhead").exists());
    ctr(harness.address(), &["images", "unmount", "--rm", &mnt.display().to_string()]);
    // Dropped here: the node's containerd (by PID), then the harness's.
}
