//! Local OCI image-layout tarballs for tests: no registry is reachable, so the harness
//! builds a static busybox image and a static pause image itself and imports them.

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The busybox image every test container runs.
pub const BUSYBOX: &str = "localhost/bulkhead/busybox:test";
/// The pod sandbox ("pause") image; containerd's `sandbox_image`.
pub const PAUSE: &str = "localhost/bulkhead/pause:test";

const BUSYBOX_BIN: &str = "/bin/busybox";
const PAUSE_SOURCE: &str = include_str!("../images/pause.c");
const CONFORMANCE_SOURCE: &str = include_str!("../images/conformance.c");
const FORKBOMB_SOURCE: &str = include_str!("../images/forkbomb.c");
const EARLY_EXIT_SOURCE: &str = include_str!("../images/early-exit.c");
/// What [`early_exit_init`] writes to the console before it exits.
pub const EARLY_EXIT_LINE: &str = "simulated early exit before serving";
/// In the busybox image: `images/conformance.c`, the kernel facilities ordinary programs use.
pub const CONFORMANCE_BIN: &str = "/bin/bulkhead-conformance";
/// In the busybox image: a character device node with /dev/null's numbers (1:3), mode 0666, as
/// a hostile image may carry one; containerd makes it as it is when it unpacks the layer.
pub const IMAGE_NODE: &str = "/bulkhead-image-null";
/// What the busybox layer holds besides its programs, in its cache name: a change here names
/// a new tarball.
const BUSYBOX_LAYOUT: &str = "layout 2: busybox, applets, conformance, forkbomb, passwd, group, image node";
/// In the busybox image: `images/forkbomb.c`, a fork bomb that prints how many forks it made and
/// how many the kernel refused, once a second.
pub const FORKBOMB_BIN: &str = "/bin/bulkhead-forkbomb";
const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Paths of the two image tarballs, built on first use into `dir` and reused after.
pub struct ImageTarballs {
    pub busybox: PathBuf,
    pub pause: PathBuf,
}

/// Builds (or reuses) both tarballs in `dir`. Content is deterministic, so a tarball that
/// already exists under its final name is complete: files are written then renamed.
pub fn build_all(dir: &Path) -> Result<ImageTarballs> {
    // Tests of one binary run in parallel threads and would write the same temporary files.
    static BUILDING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = BUILDING.lock().unwrap_or_else(|p| p.into_inner());
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(ImageTarballs {
        // Named by what goes into it, so a changed conformance program replaces a cached image.
        busybox: ensure(
            dir,
            &format!("busybox-{}.oci.tar", short_hash(&[BUSYBOX_LAYOUT, CONFORMANCE_SOURCE, FORKBOMB_SOURCE].concat())),
            build_busybox_layer,
            BUSYBOX,
            &["sh"],
        )?,
        pause: ensure(dir, "pause.oci.tar", build_pause_layer, PAUSE, &["/pause"])?,
    })
}

fn ensure(
    dir: &Path,
    name: &str,
    layer: impl Fn(&Path) -> Result<Vec<u8>>,
    image_name: &str,
    cmd: &[&str],
) -> Result<PathBuf> {
    let out = dir.join(name);
    if out.exists() {
        return Ok(out);
    }
    let layer = layer(dir)?;
    let tarball = oci_layout_tar(&layer, image_name, cmd)?;
    let tmp = dir.join(format!(".{}", unique(name)));
    std::fs::write(&tmp, tarball).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &out).with_context(|| format!("renaming to {}", out.display()))?;
    Ok(out)
}

/// `stem.<pid>.<n>`: a scratch name no other build shares (tests of one binary build
/// concurrently, in one process).
fn unique(stem: &str) -> String {
    static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    format!("{stem}.{}.{}", std::process::id(), SEQ.fetch_add(1, std::sync::atomic::Ordering::SeqCst))
}

fn short_hash(text: &str) -> String {
    hex::encode(&Sha256::digest(text.as_bytes())[..6])
}

/// `source` (C) compiled into a static binary in `dir`, read back; `what` names it in errors.
fn compile_static(dir: &Path, what: &str, source: &str) -> Result<Vec<u8>> {
    let bin = dir.join(unique(what));
    let src = bin.with_extension("c");
    std::fs::write(&src, source)?;
    let status = Command::new("cc")
        .args(["-static", "-Os", "-o"])
        .arg(&bin)
        .arg(&src)
        .status()
        .with_context(|| format!("running cc to build the static {what} binary"))?;
    let _ = std::fs::remove_file(&src);
    if !status.success() {
        bail!("cc -static {what}.c failed ({status}); is libc6-dev installed?");
    }
    let out = std::fs::read(&bin)?;
    let _ = std::fs::remove_file(&bin);
    Ok(out)
}

/// A static `/init` that writes [`EARLY_EXIT_LINE`] to the console and exits at once: an agent
/// that fails before it serves, for tests of how a failed boot is reported.
pub fn early_exit_init(dir: &Path) -> Result<PathBuf> {
    exit_init(dir, "early-exit", EARLY_EXIT_SOURCE.to_string())
}

/// [`early_exit_init`], but it exits `seconds` after its line, so a test can act on the host
/// while the guest still runs.
pub fn late_exit_init(dir: &Path, seconds: u32) -> Result<PathBuf> {
    exit_init(dir, "late-exit", format!("#define EXIT_AFTER_SECONDS {seconds}\n{EARLY_EXIT_SOURCE}"))
}

fn exit_init(dir: &Path, name: &str, source: String) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let out = dir.join(name);
    std::fs::write(&out, compile_static(dir, name, &source)?)?;
    std::fs::set_permissions(&out, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    Ok(out)
}

/// A layer with `/bin/busybox`, a symlink per applet, the usual empty directories, and
/// [`CONFORMANCE_BIN`].
fn build_busybox_layer(dir: &Path) -> Result<Vec<u8>> {
    let busybox =
        std::fs::read(BUSYBOX_BIN).with_context(|| format!("reading {BUSYBOX_BIN} (install busybox-static)"))?;
    let list = Command::new(BUSYBOX_BIN).arg("--list").output().context("running busybox --list")?;
    if !list.status.success() {
        bail!("busybox --list failed: {}", list.status);
    }
    let applets = String::from_utf8(list.stdout).context("busybox --list output")?;

    let mut tar = LayerBuilder::new();
    for d in ["bin", "dev", "etc", "proc", "sys", "tmp", "root", "var", "run"] {
        tar.dir(d, if d == "tmp" { 0o1777 } else { 0o755 })?;
    }
    tar.file("bin/busybox", &busybox, 0o755)?;
    let conformance = compile_static(dir, "conformance", CONFORMANCE_SOURCE)?;
    tar.file(CONFORMANCE_BIN.trim_start_matches('/'), &conformance, 0o755)?;
    let forkbomb = compile_static(dir, "forkbomb", FORKBOMB_SOURCE)?;
    tar.file(FORKBOMB_BIN.trim_start_matches('/'), &forkbomb, 0o755)?;
    for applet in applets.lines().map(str::trim).filter(|a| !a.is_empty()) {
        if applet == "busybox" || applet.contains('/') {
            continue;
        }
        tar.symlink(&format!("bin/{applet}"), "busybox")?;
    }
    tar.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n", 0o644)?;
    tar.file("etc/group", b"root:x:0:\nnogroup:x:65534:\n", 0o644)?;
    tar.char_device(IMAGE_NODE.trim_start_matches('/'), (1, 3), 0o666)?;
    tar.finish()
}

/// A layer with a statically linked `/pause`, compiled from `images/pause.c`.
fn build_pause_layer(dir: &Path) -> Result<Vec<u8>> {
    let pause = compile_static(dir, "pause", PAUSE_SOURCE)?;
    let mut tar = LayerBuilder::new();
    tar.file("pause", &pause, 0o755)?;
    tar.finish()
}

struct LayerBuilder(tar::Builder<Vec<u8>>);

impl LayerBuilder {
    fn new() -> Self {
        let mut b = tar::Builder::new(Vec::new());
        b.mode(tar::HeaderMode::Deterministic);
        Self(b)
    }

    fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(size);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h
    }

    fn dir(&mut self, path: &str, mode: u32) -> Result<()> {
        let mut h = Self::header(tar::EntryType::Directory, mode, 0);
        self.0.append_data(&mut h, path, std::io::empty())?;
        Ok(())
    }

    fn file(&mut self, path: &str, data: &[u8], mode: u32) -> Result<()> {
        let mut h = Self::header(tar::EntryType::Regular, mode, data.len() as u64);
        self.0.append_data(&mut h, path, data)?;
        Ok(())
    }

    fn char_device(&mut self, path: &str, (major, minor): (u32, u32), mode: u32) -> Result<()> {
        let mut h = Self::header(tar::EntryType::Char, mode, 0);
        h.set_device_major(major)?;
        h.set_device_minor(minor)?;
        self.0.append_data(&mut h, path, std::io::empty())?;
        Ok(())
    }

    fn symlink(&mut self, path: &str, target: &str) -> Result<()> {
        let mut h = Self::header(tar::EntryType::Symlink, 0o777, 0);
        self.0.append_link(&mut h, path, target)?;
        Ok(())
    }

    fn finish(self) -> Result<Vec<u8>> {
        Ok(self.0.into_inner()?)
    }
}

fn digest(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// Wraps one uncompressed layer into an OCI image layout (index.json, oci-layout, blobs/),
/// named with both the containerd and the OCI ref-name annotations so `ctr import` tags it.
fn oci_layout_tar(layer: &[u8], image_name: &str, cmd: &[&str]) -> Result<Vec<u8>> {
    let layer_digest = digest(layer);
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": { "Env": [DEFAULT_PATH], "Cmd": cmd, "WorkingDir": "/" },
        "rootfs": { "type": "layers", "diff_ids": [layer_digest] },
    }))?;
    let config_digest = digest(&config);
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest, "size": config.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": layer_digest, "size": layer.len(),
        }],
    }))?;
    let manifest_digest = digest(&manifest);
    let tag = image_name.rsplit(':').next().unwrap_or("latest");
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest, "size": manifest.len(),
            "platform": { "architecture": "amd64", "os": "linux" },
            "annotations": {
                "io.containerd.image.name": image_name,
                "org.opencontainers.image.ref.name": tag,
            },
        }],
    }))?;

    let mut out = LayerBuilder::new();
    out.file("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#, 0o644)?;
    out.file("index.json", &index, 0o644)?;
    out.dir("blobs", 0o755)?;
    out.dir("blobs/sha256", 0o755)?;
    for (d, data) in [(&layer_digest, layer), (&config_digest, &config[..]), (&manifest_digest, &manifest[..])] {
        let hexpart = d.trim_start_matches("sha256:");
        out.file(&format!("blobs/sha256/{hexpart}"), data, 0o644)?;
    }
    out.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_names_every_blob_by_its_digest() {
        let layer = LayerBuilder::new().finish().expect("empty layer");
        let tarball = oci_layout_tar(&layer, "localhost/x/y:t", &["sh"]).expect("layout");
        let mut archive = tar::Archive::new(&tarball[..]);
        let mut seen = 0;
        for entry in archive.entries().expect("entries") {
            let mut entry = entry.expect("entry");
            let path = entry.path().expect("path").to_string_lossy().into_owned();
            if let Some(name) = path.strip_prefix("blobs/sha256/") {
                if name.is_empty() {
                    continue;
                }
                let mut data = Vec::new();
                std::io::Read::read_to_end(&mut entry, &mut data).expect("read");
                assert_eq!(format!("sha256:{name}"), digest(&data));
                seen += 1;
            }
        }
        assert_eq!(seen, 3, "layer, config and manifest blobs");
    }
}
