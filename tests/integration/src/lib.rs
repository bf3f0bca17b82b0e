//! End-to-end harness for bulkhead: the one setup of every end-to-end file (`shim_env`), a
//! private containerd (`containerd`), local OCI images (`images`), a CRI client (`cri`), the VMM's
//! test guests (`guests`), host leftovers checks (`host`) and a vm pod's environment on the real
//! guest (`vm_env`), the emulated node's vCPU faults told from ours (`node_kvm`), and a TTY exec over containerd's streaming server (`ws`). Every end-to-end test in the workspace uses it.
//!
//! Tests that need root or containerd call [`skip_reason`] first and print one
//! `SKIPPED: <reason>` line when it returns `Some`.

pub mod cgroups;
pub mod containerd;
pub mod cri;
pub mod guests;
pub mod host;
pub mod images;
pub mod node_kvm;
pub mod shim_env;
pub mod standin;
pub mod vm_env;
pub mod ws;

pub use containerd::{CniNetwork, CniRoute, Containerd, ContainerdConfig, ContainerdVersion, RuntimeHandler};
pub use cri::{container_config, pod_config, Cri};
pub use shim_env::{Setup, ShimEnv};

use std::path::PathBuf;

/// Why end-to-end tests cannot run here on this run's containerd ([`ContainerdVersion::from_env`]), or `None`.
pub fn skip_reason() -> Option<String> {
    match ContainerdVersion::from_env() {
        Ok(version) => skip_reason_on(version),
        Err(e) => Some(e),
    }
}

/// Why end-to-end tests cannot run here on containerd `version`, or `None` when they can.
pub fn skip_reason_on(version: ContainerdVersion) -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("end-to-end tests need root (containerd, mounts, namespaces)".into());
    }
    // The system's containerd and runc too: 1.6 is every test's default, and 1.7 runs runc from PATH.
    for tool in ["containerd", "ctr", "runc", "cc"] {
        if which(tool).is_none() {
            return Some(format!("`{tool}` is not on PATH (run `make setup`)"));
        }
    }
    version.missing()
}

/// Prints `SKIPPED: <reason>` and returns true when end-to-end tests cannot run here.
/// Under `BULKHEAD_REQUIRE_E2E=1` (CI) a missing prerequisite fails the test instead.
pub fn skip_if_unready(test: &str) -> bool {
    match skip_reason() {
        None => false,
        Some(reason) => skip::missing_prerequisite(test, &reason),
    }
}

/// [`skip_if_unready`] for a test that runs on containerd `version`.
pub fn skip_if_unready_on(test: &str, version: ContainerdVersion) -> bool {
    match skip_reason_on(version) {
        None => false,
        Some(reason) => skip::missing_prerequisite(test, &reason),
    }
}

/// The two kinds of skip every test in the workspace uses. Each prints one
/// `SKIPPED: <test>: <reason>` line; `scripts/run-tests.sh` then checks it against the ledger.
pub mod skip {
    /// Something `make setup` or the build provides is missing (root, a tool, a built binary).
    /// Under `BULKHEAD_REQUIRE_E2E=1` (set by CI) that is a failure: panics instead of skipping.
    pub fn missing_prerequisite(test: &str, reason: &str) -> bool {
        if std::env::var_os("BULKHEAD_REQUIRE_E2E").is_some() {
            panic!("{test}: BULKHEAD_REQUIRE_E2E is set but: {reason}");
        }
        println!("SKIPPED: {test}: {reason}");
        true
    }

    /// The host cannot do what the test proves (the host probe says no ordinary guests run, the
    /// kernel lacks a module). Always a skip; the ledger says for which host kinds it is allowed.
    pub fn host_cannot(test: &str, reason: &str) -> bool {
        println!("SKIPPED: {test}: {reason}");
        true
    }
}

/// Finds `tool` on PATH.
pub fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| PathBuf::from(d).join(tool)).find(|p| p.is_file())
}

/// The cargo target profile dir (`target/debug`) of the running test binary.
pub fn target_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("BULKHEAD_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let exe = std::env::current_exe().unwrap_or_default();
    // <target>/<profile>/deps/<test-binary>
    let mut dir = exe.parent().map(PathBuf::from).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

/// Where `make setup` puts virtiofsd (`$BULKHEAD_CACHE/bin/virtiofsd`, default cache
/// /var/cache/bulkhead): the one place tests look for it.
pub fn virtiofsd_path() -> PathBuf {
    let cache = std::env::var_os("BULKHEAD_CACHE").unwrap_or_else(|| "/var/cache/bulkhead".into());
    PathBuf::from(cache).join("bin/virtiofsd")
}

/// Path of a workspace binary (built by `cargo build --workspace` before the tests).
pub fn workspace_bin(name: &str) -> PathBuf {
    target_dir().join(name)
}
