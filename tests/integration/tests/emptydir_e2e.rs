//! emptyDir `sizeLimit` enforced where the data lives (issue 20, "Disk fill"), through a private
//! containerd and CRI: a pod annotated `bulkhead.io/emptydir-size-limits: scratch=32Mi` (what an
//! operator or webhook copies from the volume's `sizeLimit`; passed by containerd because the
//! handler allows `bulkhead.io/*`, as the installer's does) mounts its emptyDir `scratch`, and a
//! container fills it with `dd`. The writer gets ENOSPC at the limit, the node's disk gives the
//! volume no more than the limit, a second container of the pod shares the same full volume,
//! deleting files gives the space back, and stopping and removing the pod leaves no process,
//! mount, loop device or state. A shim killed with SIGKILL leaves no mount or loop device after
//! containerd's `shim delete`, and the sandbox kubelet then recreates finds the volume's data.
//!
//! The node's disk is the test's own: a loop-mounted ext4 holding kubelet's root (the pod's
//! emptyDir directory, made as kubelet makes it) and the shim's state dir, so its free space
//! moves only with what this pod does (the host's root filesystem is shared with parallel
//! builds). On the vm backend the guest runs on the QEMU stand-in (and on `bulkhead-vmm` where
//! the host probe allows); the namespace backend runs the same fill, plus the config's default
//! limit for an emptyDir the pod names no limit for, and a malformed annotation's refusal.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use bulkhead_integration::containerd::unmount_under;
use bulkhead_integration::guests::{self, GuestVmm};
use bulkhead_integration::host::{eventually_nothing, mounts_with, processes_with};
use bulkhead_integration::{
    container_config, skip, skip_if_unready, workspace_bin, ContainerdConfig, ContainerdVersion, RuntimeHandler, Setup,
    ShimEnv,
};
use k8s_cri::v1 as cri;

const RUNNING: i32 = cri::ContainerState::ContainerRunning as i32;
const MIB: u64 = 1 << 20;
/// The volume's limit, as the pod's annotation says it.
const LIMIT: u64 = 32 * MIB;
/// The annotation, and the handler's pass-through glob the node installer writes.
const ANNOTATION: &str = "bulkhead.io/emptydir-size-limits";
const INSTALLER_GLOB: &str = "bulkhead.io/*";
/// What the test's node disk may lose beyond the limit while the volume fills: the host
/// filesystem's own extent blocks for the image (the pod's state is written before the fill).
const FILL_SLACK: u64 = MIB;
/// The same for the pod's whole life, its state dir (console log, records) included.
const LIFE_SLACK: u64 = 8 * MIB;
/// How long the agent may take to answer (TCG on a loaded host), below the harness's 60 s CRI deadline.
const CONNECT_TIMEOUT_MS: u64 = 45_000;

/// A loop-mounted ext4 of its own standing in for the node's disk, unmounted (and its loop
/// device released: `mount -o loop` sets autoclear) when dropped.
struct NodeDisk {
    dir: tempfile::TempDir,
    image: PathBuf,
}

impl NodeDisk {
    fn new(size: u64) -> Result<Self> {
        // Short: the VM's sockets live below the shim's state dir on this disk.
        let dir = tempfile::Builder::new().prefix("bd").rand_bytes(4).tempdir_in("/run")?;
        // One per disk (the tests of this file run in parallel), named after its mount point.
        let name = dir.path().file_name().unwrap_or_default().to_string_lossy().into_owned();
        let image = PathBuf::from(format!("/var/tmp/bulkhead-emptydir-e2e-{name}.ext4"));
        let file = std::fs::OpenOptions::new().write(true).create_new(true).open(&image)?;
        file.set_len(size)?;
        drop(file);
        let mkfs = ["/sbin/mkfs.ext4", "/usr/sbin/mkfs.ext4"]
            .into_iter()
            .find(|p| Path::new(p).is_file())
            .context("mkfs.ext4 is missing (e2fsprogs)")?;
        run(Command::new(mkfs).args(["-q", "-F", "-m", "0"]).arg(&image))?;
        run(Command::new("mount").args(["-o", "loop"]).arg(&image).arg(dir.path()))?;
        Ok(Self { dir, image })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Bytes the node's disk has free (for unprivileged writers too: no root reserve here).
    fn free(&self) -> Result<u64> {
        let st = nix::sys::statvfs::statvfs(self.path())?;
        Ok(st.blocks_available() * st.fragment_size())
    }
}

impl Drop for NodeDisk {
    fn drop(&mut self) {
        unmount_under(self.path());
        let _ = std::fs::remove_file(&self.image);
    }
}

fn run(command: &mut Command) -> Result<()> {
    let out = command.output().with_context(|| format!("{command:?}"))?;
    ensure!(out.status.success(), "{command:?}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

/// kubelet's directory of emptyDir `name` of pod `uid` under kubelet root `root`, made as
/// kubelet makes it (mode 0777).
fn kubelet_emptydir(root: &Path, uid: &str, name: &str) -> Result<PathBuf> {
    let dir = root.join("pods").join(uid).join("volumes/kubernetes.io~empty-dir").join(name);
    std::fs::create_dir_all(&dir)?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))?;
    Ok(dir)
}

/// Loop devices whose backing file is `image` (sysfs; a deleted one ends in " (deleted)").
fn loop_devices_of(image: &Path) -> Vec<String> {
    let image = image.display().to_string();
    let Ok(entries) = std::fs::read_dir("/sys/block") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| {
            let backing = std::fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
            backing.starts_with(&image).then(|| format!("{} -> {}", e.file_name().to_string_lossy(), backing.trim()))
        })
        .collect()
}

/// A container that runs until SIGTERM, with kubelet's `host_dir` at /data.
fn with_volume(name: &str, host_dir: &Path) -> cri::ContainerConfig {
    let mut c = container_config(name, &["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.2; done"]);
    c.mounts = vec![cri::Mount {
        container_path: "/data".into(),
        host_path: host_dir.display().to_string(),
        ..Default::default()
    }];
    c
}

struct Env {
    shim: ShimEnv,
    /// Last: unmounted after containerd (and so the pods) and the shim's state on it are gone.
    disk: NodeDisk,
}

impl std::ops::Deref for Env {
    type Target = ShimEnv;

    fn deref(&self) -> &ShimEnv {
        &self.shim
    }
}

impl Env {
    /// A containerd whose `bulkhead` handler passes `bulkhead.io/*` to the shim, configured by
    /// `config(state_dir)`, with the shim's state on a fresh node disk. `None` (after one
    /// `SKIPPED` line) when `test` cannot run here.
    async fn start(test: &str, config: impl FnOnce(&Path) -> Result<String>) -> Result<Option<Self>> {
        let disk = NodeDisk::new(512 * MIB)?;
        let version = ContainerdVersion::for_test_binary(env!("CARGO_CRATE_NAME"));
        let bins = ["bulkhead-agent", "containerd-shim-bulkhead-v2"];
        let Some(setup) = Setup::new_in(test, version, &bins, disk.path())? else { return Ok(None) };
        let cfg = setup.write_config("bulkhead.toml", &config(setup.state())?)?;
        let mut handler = RuntimeHandler::bulkhead(Some(&cfg));
        handler.pod_annotations = vec![INSTALLER_GLOB.into()];
        let shim = setup.start(ContainerdConfig { handlers: vec![handler], ..Default::default() }).await?;
        Ok(Some(Self { shim, disk }))
    }

    fn kubelet_root(&self) -> PathBuf {
        self.disk.path().join("k")
    }

    /// A pod config whose annotation sets `limits`.
    fn pod(&self, name: &str, limits: &str) -> Result<cri::PodSandboxConfig> {
        let mut pod = self.shim.pod(name)?;
        pod.annotations.insert(ANNOTATION.into(), limits.into());
        Ok(pod)
    }

    async fn exec(&self, id: &str, script: &str) -> Result<(i32, String)> {
        // Long: a guest on TCG writes through virtio-fs at emulated speed.
        let out = self.cri.exec_sync(id, &["sh", "-c", script], 180).await?;
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        Ok((out.exit_code, text))
    }
}

/// Fills /data in container `id` with `dd` to twice `limit`: the writer must get ENOSPC at no
/// more than `limit` (and at no less than half of it: ext4's own metadata takes a share of a
/// small volume), and the node's disk must give no more than the limit. Returns the bytes written.
async fn fill(test: &str, env: &Env, pod_id: &str, id: &str, host_dir: &Path, limit: u64) -> Result<u64> {
    let file = "fill";
    // Counted on the node's disk, not in page caches: the volume's own filesystem (where the
    // shim mounts it on the host) flushed into its image, then the node's disk.
    let volume = env.state_dir.path().join(pod_id).join("emptydir").join(host_dir.file_name().unwrap_or_default());
    let flush = || -> Result<()> {
        for fs in [volume.as_path(), env.disk.path()] {
            let dir = std::fs::File::open(fs).with_context(|| {
                format!("no filesystem of the volume's own where the shim mounts it: {}", fs.display())
            })?;
            nix::unistd::syncfs(&dir).with_context(|| format!("syncfs {}", fs.display()))?;
        }
        Ok(())
    };
    flush()?;
    let free_before = env.disk.free()?;
    let count = 2 * limit / MIB;
    let started = Instant::now();
    let (code, out) = env
        .exec(
            id,
            &format!("dd if=/dev/zero of=/data/{file} bs=1M count={count}; echo dd-exit=$?; echo written=$(wc -c < /data/{file})"),
        )
        .await?;
    println!("{test}: dd of {count} MiB into a {} MiB volume took {:?}", limit / MIB, started.elapsed());
    ensure!(code == 0, "the fill script failed: {out}");
    ensure!(out.contains("No space left on device"), "the writer must see ENOSPC: {out}");
    ensure!(!out.contains("dd-exit=0"), "dd must fail at the limit: {out}");
    let written = out.lines().find_map(|l| l.strip_prefix("written=")).unwrap_or_default();
    let written: u64 = written.trim().parse().with_context(|| out.clone())?;
    ensure!(written <= limit, "wrote {written} bytes into a volume limited to {limit}");
    ensure!(written >= limit / 2, "ENOSPC came at {written} bytes, far below the limit {limit}");
    flush()?;
    let free_after = env.disk.free()?;
    let taken = free_before.saturating_sub(free_after);
    let image = std::fs::metadata(host_dir.join(".bulkhead-emptydir.ext4")).context("the volume's image")?;
    println!(
        "{test}: ENOSPC after {written} bytes ({:.1}% of the limit); the node's disk lost {taken} bytes; \
         the image holds {} bytes",
        written as f64 * 100.0 / limit as f64,
        image.blocks() * 512
    );
    ensure!(taken <= limit + FILL_SLACK, "the node's disk lost {taken} bytes for a {limit}-byte volume");
    ensure!(image.len() == limit, "the image is {} bytes, not the limit", image.len());
    ensure!(image.blocks() * 512 <= limit + FILL_SLACK, "the image holds {} bytes", image.blocks() * 512);
    let in_host_dir: Vec<_> = std::fs::read_dir(host_dir)?.flatten().map(|e| e.file_name()).collect();
    ensure!(in_host_dir.len() == 1, "kubelet's directory holds only the image: {in_host_dir:?}");
    Ok(written)
}

/// The whole story on one backend (module docs); `config` is the shim's config for `state_dir`.
async fn disk_fill(test: &str, config: impl FnOnce(&Path) -> Result<String>) -> Result<()> {
    let Some(env) = Env::start(test, config).await? else { return Ok(()) };
    let free_at_start = env.disk.free()?;
    let pod = env.pod("emptydir-fill", "scratch=32Mi")?;
    let uid = pod.metadata.as_ref().map(|m| m.uid.clone()).unwrap_or_default();
    let host_dir = kubelet_emptydir(&env.kubelet_root(), &uid, "scratch")?;
    let pod_id = env.cri.run_pod_sandbox(&pod, "bulkhead").await.with_context(|| env.containerd.log_tail(60))?;

    let writer = env.cri.create_container(&pod_id, &with_volume("writer", &host_dir), &pod).await?;
    env.cri.start_container(&writer).await?;
    env.cri.wait_container(&writer, Duration::from_secs(60), |s| s.state == RUNNING).await?;
    let (_, df) = env.exec(&writer, "df -k /data | tail -n 1").await?;
    println!("{test}: the container's df of its volume: {}", df.trim());
    let written = fill(test, &env, &pod_id, &writer, &host_dir, LIMIT).await?;

    // The writer goes; the pod's next container shares the same volume, data and limit.
    env.cri.stop_container(&writer, 10).await?;
    env.cri.remove_container(&writer).await?;
    let next = env.cri.create_container(&pod_id, &with_volume("next", &host_dir), &pod).await?;
    env.cri.start_container(&next).await?;
    env.cri.wait_container(&next, Duration::from_secs(60), |s| s.state == RUNNING).await?;
    let (code, size) = env.exec(&next, "wc -c < /data/fill").await?;
    // The shim's lines in containerd's log say whether the exec's output was cut (seen once in
    // the emulated node: empty output).
    ensure!(
        size.trim() == written.to_string(),
        "the next container sees {size:?} (exit code {code}), not {written}; containerd's log:\n{}",
        env.containerd.log_tail(60)
    );
    let (_, more) = env.exec(&next, "dd if=/dev/zero of=/data/more bs=1M count=4; echo dd-exit=$?").await?;
    ensure!(more.contains("No space left on device"), "the volume is still full for the next container: {more}");

    // Deleting files gives the node its space back (discard punches them out of the image).
    let (code, out) = env.exec(&next, "rm /data/fill /data/more; sync").await?;
    ensure!(code == 0, "rm: {out}");
    let image = host_dir.join(".bulkhead-emptydir.ext4");
    let deadline = Instant::now() + Duration::from_secs(30);
    let held = loop {
        let held = std::fs::metadata(&image)?.blocks() * 512;
        if held < LIMIT / 4 || Instant::now() >= deadline {
            break held;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    println!("{test}: after rm the image holds {held} bytes");
    ensure!(held < LIMIT / 4, "deleted data still holds {held} bytes of the node's disk");

    // Stop and remove: nothing of the pod stays but the volume's image in kubelet's directory.
    env.cri.stop_pod_sandbox(&pod_id).await?;
    env.cri.remove_pod_sandbox(&pod_id).await?;
    let state = env.state_dir.path().display().to_string();
    let within = Duration::from_secs(20);
    eventually_nothing("the pod's processes", within, || {
        processes_with(&state).into_iter().map(|(p, c)| format!("{p} {c}")).collect()
    })
    .await?;
    eventually_nothing("mounts of the pod", within, || mounts_with(&state)).await?;
    eventually_nothing("loop devices on the volume's image", within, || loop_devices_of(&image)).await?;
    eventually_nothing("pod state", within, || bulkhead_integration::host::state_left(env.state_dir.path())).await?;
    ensure!(image.is_file(), "the volume's image stays with kubelet's directory until kubelet removes it");
    // kubelet removes the pod's volume directory; then the node has its space back.
    std::fs::remove_dir_all(env.kubelet_root().join("pods").join(&uid))?;
    let free_at_end = env.disk.free()?;
    println!("{test}: the node's disk: {free_at_start} bytes free before the pod, {free_at_end} after it");
    ensure!(free_at_end + LIFE_SLACK >= free_at_start, "the pod left {} bytes taken", free_at_start - free_at_end);
    Ok(())
}

/// Whether the tools the node disk needs are here (`make setup` installs e2fsprogs).
fn skip_without_disk_tools(test: &str) -> bool {
    let mkfs = ["/sbin/mkfs.ext4", "/usr/sbin/mkfs.ext4"].into_iter().any(|p| Path::new(p).is_file());
    if !mkfs || !Path::new("/dev/loop-control").exists() {
        return skip::missing_prerequisite(test, "mkfs.ext4 (e2fsprogs) and /dev/loop-control are needed");
    }
    false
}

fn namespace_config(state_dir: &Path, emptydir: &str) -> Result<String> {
    let agent = workspace_bin("bulkhead-agent");
    ensure!(agent.is_file(), "{} is not built", agent.display());
    Ok(format!(
        "backend = \"namespace\"\nstate_dir = \"{}\"\n[namespace]\nagent_path = \"{}\"\n{emptydir}\n",
        state_dir.display(),
        agent.display()
    ))
}

#[tokio::test]
async fn vm_pod_fills_its_emptydir_to_the_limit_and_no_further() -> Result<()> {
    vm_disk_fill("vm_pod_fills_its_emptydir_to_the_limit_and_no_further", GuestVmm::QemuStandIn).await
}

#[tokio::test]
async fn vm_pod_fills_its_emptydir_to_the_limit_and_no_further_on_bulkhead_vmm() -> Result<()> {
    vm_disk_fill("vm_pod_fills_its_emptydir_to_the_limit_and_no_further_on_bulkhead_vmm", GuestVmm::Bulkhead).await
}

async fn vm_disk_fill(test: &str, vmm: GuestVmm) -> Result<()> {
    if skip_if_unready(test) || vmm.skip(test) || skip_without_disk_tools(test) {
        return Ok(());
    }
    println!("{test}: the guest runs on {}", vmm.name());
    disk_fill(test, |state_dir| guests::real_vm_config(state_dir, CONNECT_TIMEOUT_MS, vmm)).await
}

#[tokio::test]
async fn namespace_pod_fills_its_emptydir_to_the_limit_and_no_further() -> Result<()> {
    let test = "namespace_pod_fills_its_emptydir_to_the_limit_and_no_further";
    if skip_if_unready(test) || skip_without_disk_tools(test) {
        return Ok(());
    }
    disk_fill(test, |state_dir| namespace_config(state_dir, "")).await
}

/// The shim dies (SIGKILL) while the pod's limited emptyDir is mounted: containerd's `shim
/// delete` leaves no mount and no loop device, and a sandbox kubelet recreates for the same pod
/// finds the volume's data again (the image stays in kubelet's directory, as a plain emptyDir's
/// files would).
async fn shim_crash(test: &str, config: impl FnOnce(&Path) -> Result<String>) -> Result<()> {
    let Some(env) = Env::start(test, config).await? else { return Ok(()) };
    let mut pod = env.pod("emptydir-crash", "scratch=8Mi")?;
    let uid = pod.metadata.as_ref().map(|m| m.uid.clone()).unwrap_or_default();
    let host_dir = kubelet_emptydir(&env.kubelet_root(), &uid, "scratch")?;
    let image = host_dir.join(".bulkhead-emptydir.ext4");
    let pod_id = env.cri.run_pod_sandbox(&pod, "bulkhead").await.with_context(|| env.containerd.log_tail(60))?;
    let c = env.cri.create_container(&pod_id, &with_volume("c", &host_dir), &pod).await?;
    env.cri.start_container(&c).await?;
    env.cri.wait_container(&c, Duration::from_secs(60), |s| s.state == RUNNING).await?;
    let (code, out) = env.exec(&c, "echo kept > /data/f && sync").await?;
    ensure!(code == 0, "write: {out}");
    ensure!(!loop_devices_of(&image).is_empty(), "the volume is on a loop device while the pod runs");

    let shims: Vec<u32> = processes_with("containerd-shim-bulkhead-v2")
        .into_iter()
        .filter(|(_, cmd)| cmd.contains(&pod_id) && !cmd.contains("__bulkhead-ns-launch"))
        .map(|(pid, _)| pid)
        .collect();
    ensure!(shims.len() == 1, "one shim serves the pod: {shims:?}");
    // The shim is a descendant of the containerd this test started; signalled by PID only.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(shims[0] as i32), nix::sys::signal::Signal::SIGKILL)?;
    let state = env.state_dir.path().display().to_string();
    let within = Duration::from_secs(30);
    eventually_nothing("loop devices on the volume's image after the shim died", within, || loop_devices_of(&image))
        .await?;
    eventually_nothing("mounts of the pod after the shim died", within, || mounts_with(&state)).await?;
    println!("{test}: after the shim's SIGKILL, containerd's delete left no mount and no loop device");
    let _ = env.cri.stop_container(&c, 1).await;
    env.cri.remove_container(&c).await?;
    env.cri.stop_pod_sandbox(&pod_id).await?;
    env.cri.remove_pod_sandbox(&pod_id).await?;

    // kubelet makes the pod a new sandbox: the volume's data is there.
    if let Some(m) = pod.metadata.as_mut() {
        m.attempt = 1;
    }
    let again = env.cri.run_pod_sandbox(&pod, "bulkhead").await.with_context(|| env.containerd.log_tail(60))?;
    let c = env.cri.create_container(&again, &with_volume("c", &host_dir), &pod).await?;
    env.cri.start_container(&c).await?;
    env.cri.wait_container(&c, Duration::from_secs(60), |s| s.state == RUNNING).await?;
    let (_, out) = env.exec(&c, "cat /data/f").await?;
    ensure!(out == "kept\n", "the recreated sandbox sees {out:?}");
    env.cri.stop_pod_sandbox(&again).await?;
    env.cri.remove_pod_sandbox(&again).await?;
    eventually_nothing("loop devices on the volume's image", within, || loop_devices_of(&image)).await?;
    eventually_nothing("mounts of the pod", within, || mounts_with(&state)).await
}

#[tokio::test]
async fn vm_shim_crash_leaves_no_loop_device_and_the_data_stays_with_the_pod() -> Result<()> {
    let test = "vm_shim_crash_leaves_no_loop_device_and_the_data_stays_with_the_pod";
    let vmm = GuestVmm::QemuStandIn;
    if skip_if_unready(test) || vmm.skip(test) || skip_without_disk_tools(test) {
        return Ok(());
    }
    shim_crash(test, |state_dir| guests::real_vm_config(state_dir, CONNECT_TIMEOUT_MS, vmm)).await
}

#[tokio::test]
async fn namespace_shim_crash_leaves_no_loop_device_and_the_data_stays_with_the_pod() -> Result<()> {
    let test = "namespace_shim_crash_leaves_no_loop_device_and_the_data_stays_with_the_pod";
    if skip_if_unready(test) || skip_without_disk_tools(test) {
        return Ok(());
    }
    shim_crash(test, |state_dir| namespace_config(state_dir, "")).await
}

/// The node's default limit applies to an emptyDir the pod names no limit for; a malformed
/// annotation fails RunPodSandbox naming it, and starts nothing.
#[tokio::test]
async fn node_default_limits_unnamed_emptydirs_and_bad_annotations_are_refused() -> Result<()> {
    let test = "node_default_limits_unnamed_emptydirs_and_bad_annotations_are_refused";
    if skip_if_unready(test) || skip_without_disk_tools(test) {
        return Ok(());
    }
    let limits = "[emptydir]\ndefault_size_limit = \"16Mi\"\nmax_size_limit = \"1Gi\"";
    let Some(env) = Env::start(test, |s| namespace_config(s, limits)).await? else { return Ok(()) };

    let pod = env.pod("emptydir-default", "scratch=32Mi")?;
    let uid = pod.metadata.as_ref().map(|m| m.uid.clone()).unwrap_or_default();
    let other = kubelet_emptydir(&env.kubelet_root(), &uid, "other")?;
    let pod_id = env.cri.run_pod_sandbox(&pod, "bulkhead").await.with_context(|| env.containerd.log_tail(60))?;
    let c = env.cri.create_container(&pod_id, &with_volume("c", &other), &pod).await?;
    env.cri.start_container(&c).await?;
    env.cri.wait_container(&c, Duration::from_secs(60), |s| s.state == RUNNING).await?;
    fill(test, &env, &pod_id, &c, &other, 16 * MIB).await?;
    env.cri.stop_pod_sandbox(&pod_id).await?;
    env.cri.remove_pod_sandbox(&pod_id).await?;

    for (limits, fault) in
        [("scratch=32MB", "volume scratch"), ("scratch=2Gi", "outside 1Mi..=1Gi"), ("Scratch=1Gi", "not a volume name")]
    {
        let pod = env.pod("emptydir-bad", limits)?;
        let err = match env.cri.run_pod_sandbox(&pod, "bulkhead").await {
            Ok(id) => bail!("a pod annotated {limits:?} ran as {id}"),
            Err(e) => format!("{e:#}"),
        };
        ensure!(err.contains(ANNOTATION) && err.contains(fault), "{limits:?}: {err}");
        println!("{test}: {limits:?} refused: {}", err.lines().next().unwrap_or_default());
    }
    let state = env.state_dir.path().display().to_string();
    eventually_nothing("state of refused pods", Duration::from_secs(20), || {
        let mut left = mounts_with(&state);
        left.extend(processes_with(&state).into_iter().map(|(p, c)| format!("{p} {c}")));
        left.extend(bulkhead_integration::host::state_left(env.state_dir.path()));
        left
    })
    .await
}
