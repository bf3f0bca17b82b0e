//! `bulkhead-ctl template build` on this host, with a test guest in the kernel's place that says
//! what the agent says once it listens: the template's VM is booted as a pod's (jailed, the pod's
//! device set, its own virtiofsd), snapshotted once ready, and published into the store, where
//! `template ls` checks it as a pod's lookup would; a second build finds it and builds nothing. A
//! guest that dies before it is ready fails the build, quoting its console, and publishes nothing.
//! Either way nothing of the build VM is left: no process, no mount, no state.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Result;
use bulkhead_integration::host::{eventually_nothing, mounts_with, processes_with};
use bulkhead_integration::{guests, skip, workspace_bin, ContainerdVersion, Setup};

/// The VMM identities of this binary's builds (apart from the other test binaries').
const JAIL_IDS: u32 = 40_400;

/// The checks and directories of the one e2e setup; `bulkhead-ctl` drives the shim's config
/// without a containerd.
struct Env {
    setup: Setup,
    config: PathBuf,
    templates: PathBuf,
}

impl Env {
    fn state(&self) -> &Path {
        self.setup.state()
    }
}

/// A config whose VM boots the test guest `guest`; `None` (with a SKIPPED line) when this host
/// lacks a prerequisite.
fn setup(test: &str, guest: &str) -> Result<Option<Env>> {
    let version = ContainerdVersion::for_test_binary(env!("CARGO_CRATE_NAME"));
    let Some(setup) = Setup::new(test, version, &["bulkhead-vmm", "bulkhead-ctl"])? else { return Ok(None) };
    if let Err(why) = bulkhead_vmm_api::probe::kvm_device_usable() {
        skip::missing_prerequisite(test, &why);
        return Ok(None);
    }
    let guest = match guests::build(guest, &bulkhead_integration::target_dir().join("bulkhead-test-guests")) {
        Ok(path) => path,
        Err(why) => {
            skip::missing_prerequisite(test, &why);
            return Ok(None);
        }
    };
    let virtiofsd = bulkhead_integration::virtiofsd_path();
    if !virtiofsd.is_file() {
        skip::missing_prerequisite(test, &format!("{} is missing (make setup, cargo build)", virtiofsd.display()));
        return Ok(None);
    }
    let initramfs = setup.write_config("initramfs.cpio.gz", "not read by the test guest")?;
    let templates = setup.config_dir().join("templates");
    let config = setup.write_config(
        "bulkhead.toml",
        &format!(
            "backend = \"vm\"\nstate_dir = \"{}\"\n\n[vm]\nvmm_path = \"{}\"\nkernel_path = \"{}\"\n\
             initramfs_path = \"{}\"\nvirtiofsd_path = \"{}\"\nmemory_mib = 64\ntemplate_dir = \"{}\"\n\
             jail_id_first = {JAIL_IDS}\njail_id_count = 4\n",
            setup.state().display(),
            workspace_bin("bulkhead-vmm").display(),
            guest.display(),
            initramfs.display(),
            virtiofsd.display(),
            templates.display(),
        ),
    )?;
    Ok(Some(Env { setup, config, templates }))
}

/// `bulkhead-ctl --config <env> <args> --json`: success, the JSON document, stderr.
fn ctl(env: &Env, args: &[&str]) -> (bool, serde_json::Value, String) {
    let out = Command::new(workspace_bin("bulkhead-ctl"))
        .arg("--config")
        .arg(&env.config)
        .args(args)
        .arg("--json")
        .output()
        .expect("run bulkhead-ctl");
    let json = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (out.status.success(), json, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// No process, mount or state of the build VM is left, and no build of it stays staged.
async fn nothing_left(env: &Env) -> Result<()> {
    let state = env.state().display().to_string();
    let within = Duration::from_secs(20);
    eventually_nothing("the build's VMM and virtiofsd", within, || {
        processes_with(&state).into_iter().map(|(p, c)| format!("{p} {c}")).collect()
    })
    .await?;
    eventually_nothing("mounts", within, || mounts_with(&state)).await?;
    eventually_nothing("the build VM's state", within, || entries(env.state())).await?;
    eventually_nothing("staged builds", within, || {
        entries(&env.templates).into_iter().filter(|e| e.contains(".staging-")).collect()
    })
    .await
}

fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir).map(|d| d.flatten().map(|e| e.path().display().to_string()).collect()).unwrap_or_default()
}

#[tokio::test]
async fn template_build_snapshots_a_ready_guest_and_publishes_it_once() -> Result<()> {
    let test = "template_build_snapshots_a_ready_guest_and_publishes_it_once";
    let Some(env) = setup(test, "agent_ready")? else { return Ok(()) };
    let (ok, built, stderr) = ctl(&env, &["template", "build", "--vcpus", "1", "--memory-mib", "64"]);
    assert!(ok, "build failed: {stderr}\n{built}");
    let key = built["key"].as_str().unwrap().to_string();
    let dir = PathBuf::from(built["dir"].as_str().unwrap());
    assert_eq!((built["vcpus"].as_u64(), built["memory_mib"].as_u64()), (Some(1), Some(64)), "{built}");
    // The VMM's snapshot, sealed by the store: root's alone, read-only, with the store's manifest.
    let mut names: Vec<String> = entries(&dir).iter().map(|p| p.rsplit('/').next().unwrap().to_string()).collect();
    names.sort();
    assert_eq!(names, ["memory", "state", "template.json"], "{dir:?}");
    for name in &names {
        let meta = std::fs::metadata(dir.join(name))?;
        assert_eq!((meta.uid(), meta.mode() & 0o777), (0, 0o400), "{name}");
    }
    assert_eq!(std::fs::metadata(&dir)?.mode() & 0o777, 0o700, "the template's directory");
    assert_eq!(std::fs::metadata(dir.join("memory"))?.len(), 64 << 20, "the guest's memory, whole");

    let (ok, listed, stderr) = ctl(&env, &["template", "ls"]);
    assert!(ok, "{stderr}\n{listed}");
    let rows = listed["templates"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{listed}");
    assert_eq!(rows[0]["state"], "ready", "{listed}");
    assert_eq!(rows[0]["key"], key.as_str(), "{listed}");

    // A second build finds it: same key, same files, nothing rebuilt.
    let before = std::fs::metadata(dir.join("state"))?.mtime_nsec();
    let (ok, again, stderr) = ctl(&env, &["template", "build", "--vcpus", "1", "--memory-mib", "64"]);
    assert!(ok, "{stderr}");
    assert_eq!(
        (again["key"].as_str(), again["created_unix"].clone()),
        (Some(key.as_str()), built["created_unix"].clone())
    );
    assert_eq!(std::fs::metadata(dir.join("state"))?.mtime_nsec(), before, "the template was rebuilt");
    nothing_left(&env).await
}

#[tokio::test]
async fn a_template_guest_that_dies_fails_the_build_quoting_its_console() -> Result<()> {
    let test = "a_template_guest_that_dies_fails_the_build_quoting_its_console";
    let Some(env) = setup(test, "hello")? else { return Ok(()) };
    let (ok, out, stderr) = ctl(&env, &["template", "build"]);
    assert!(!ok, "a guest that never gets ready built a template: {out}");
    assert!(stderr.contains("never got ready"), "{stderr}");
    assert!(stderr.contains("hello from the bulkhead test guest"), "the console is quoted: {stderr}");
    let (ok, listed, stderr) = ctl(&env, &["template", "ls"]);
    assert!(ok, "{stderr}");
    assert!(listed["templates"].as_array().unwrap().is_empty(), "{listed}");
    nothing_left(&env).await
}

/// An installer told to stop (or an operator's Ctrl-C) sends SIGTERM while a build runs: the
/// build ends at once, failing and saying so, and takes its VM with it (processes, cgroups,
/// mounts, state), with nothing published or staged.
#[tokio::test]
async fn sigterm_during_a_build_ends_it_and_leaves_nothing() -> Result<()> {
    let test = "sigterm_during_a_build_ends_it_and_leaves_nothing";
    // The idle guest never says it is ready: the build waits until told to stop.
    let Some(env) = setup(test, "idle")? else { return Ok(()) };
    let mut child = Command::new(workspace_bin("bulkhead-ctl"))
        .arg("--config")
        .arg(&env.config)
        .args(["template", "build", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let state = env.state().display().to_string();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    // The build's VMM runs and has joined its cgroup.
    let cgroup = loop {
        let vmm = processes_with(&state).into_iter().find(|(_, cmd)| cmd.contains("bulkhead-vmm"));
        if let Some(cgroup) = vmm.and_then(|(pid, _)| bulkhead_integration::cgroups::of_pid(pid)) {
            if cgroup.contains("/bulkhead/tpl-") {
                break cgroup;
            }
        }
        if let Some(status) = child.try_wait()? {
            panic!("the build ended ({status}) before its VM ran");
        }
        assert!(std::time::Instant::now() < deadline, "the build's VMM did not start within 60 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id())?);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
    let out = tokio::task::spawn_blocking(move || child.wait_with_output()).await??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "an interrupted build succeeded: {stderr}");
    assert!(stderr.contains("SIGTERM") && stderr.contains("stopped before it published"), "{stderr}");
    let parent = cgroup.rsplit_once('/').map(|(p, _)| p.to_string()).unwrap();
    for dir in [cgroup.as_str(), parent.as_str()] {
        assert!(bulkhead_integration::cgroups::existing(dir).is_empty(), "cgroup {dir} left");
    }
    let (ok, listed, stderr) = ctl(&env, &["template", "ls"]);
    assert!(ok, "{stderr}");
    assert!(listed["templates"].as_array().unwrap().is_empty(), "{listed}");
    nothing_left(&env).await
}
