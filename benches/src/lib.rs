//! Helpers the VMM benches share.

pub mod phases;
pub mod procmem;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

/// Nanoseconds since the epoch (the VMM's API reports its times this way).
pub fn unix_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

/// Other builds to measure beside this one, for before/after figures in one run:
/// `BULKHEAD_BENCH_BASELINE=<dir>[:<dir>...]`, each dir holding a build's binaries; each is
/// labelled by its dir's name.
pub fn baselines() -> Vec<(String, PathBuf)> {
    let Some(list) = std::env::var_os("BULKHEAD_BENCH_BASELINE") else { return Vec::new() };
    std::env::split_paths(&list)
        .filter(|p| !p.as_os_str().is_empty())
        .map(|p| (p.file_name().map_or("baseline".into(), |n| n.to_string_lossy().into_owned()), p))
        .collect()
}

/// The release VMM binary as `make image` ships it (static glibc, which starts ~0.5 ms sooner
/// than a dynamic build here: no loader, no symbol binding), built on demand (override with
/// BULKHEAD_VMM).
pub fn vmm_binary() -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("BULKHEAD_VMM") {
        return Ok(PathBuf::from(p));
    }
    const TARGET: &str = "x86_64-unknown-linux-gnu";
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let status = Command::new(env!("CARGO"))
        .args(["build", "--release", "-q", "--target", TARGET, "-p", "bulkhead-vmm", "--bin", "bulkhead-vmm"])
        .env("CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS", "-C target-feature=+crt-static")
        .current_dir(&root)
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err("building bulkhead-vmm failed".into());
    }
    let target = std::env::var("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|_| root.join("target"));
    Ok(target.join(TARGET).join("release/bulkhead-vmm"))
}
