//! What VMs in tests boot. The VMM's tiny `no_std` test guests (`vmm/tests/guests/*.rs`),
//! compiled with rustc for `x86_64-unknown-none` into static ELFs: the VMM's KVM tests boot them
//! as raw guests, the shim's `vm` backend tests in place of a kernel (the ELF loader takes them
//! like a vmlinux); the one builder both use. And the real guest kernel and initramfs, for hosts
//! that run ordinary guests (the full-VM test, `make demo`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Where the guests' sources are.
pub fn sources_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../vmm/tests/guests")
}

/// Compiles `<sources_dir>/<name>.rs` into `<out_dir>/<name>.elf`. `Err(reason)` means the guest
/// toolchain is missing here (`make setup` installs it); a guest that does not compile panics.
pub fn build(name: &str, out_dir: &Path) -> Result<PathBuf, String> {
    std::fs::create_dir_all(out_dir).map_err(|e| e.to_string())?;
    let out = out_dir.join(format!("{name}.elf"));
    // Tests build the same guest concurrently: compile in a private directory (rustc puts its
    // intermediate files, named after the crate, next to the output), then rename into place.
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    let seq = SEQ.fetch_add(1, Ordering::SeqCst);
    let tmp_dir = out_dir.join(format!("{name}.{}.{seq}.d", std::process::id()));
    std::fs::create_dir_all(&tmp_dir).map_err(|e| e.to_string())?;
    let tmp = tmp_dir.join(format!("{name}.elf"));
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let output = Command::new(rustc)
        .args(["--edition", "2021", "--target", "x86_64-unknown-none", "--crate-type", "bin"])
        .args(["-C", "panic=abort", "-C", "opt-level=s", "-C", "relocation-model=static"])
        .arg("-o")
        .arg(&tmp)
        .arg(sources_dir().join(format!("{name}.rs")))
        .output()
        .map_err(|e| format!("cannot run rustc: {e}"))?;
    if !output.status.success() {
        let err = String::from_utf8_lossy(&output.stderr);
        let _ = std::fs::remove_dir_all(&tmp_dir);
        if err.contains("can't find crate for `core`") || err.contains("target may not be installed") {
            return Err("rust target x86_64-unknown-none is not installed (run `make setup`)".into());
        }
        panic!("test guest {name} failed to compile:\n{err}");
    }
    std::fs::rename(&tmp, &out).map_err(|e| format!("installing {name}: {e}"))?;
    let _ = std::fs::remove_dir_all(&tmp_dir);
    Ok(out)
}

/// The real guest: the kernel `guest-kernel/build-kernel.sh` builds (cached by content hash) and
/// the initramfs of `make -C guest-kernel initramfs` (the static agent as /init).
pub fn kernel_and_initramfs() -> anyhow::Result<(PathBuf, PathBuf)> {
    use anyhow::{bail, Context};
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out =
        Command::new(root.join("guest-kernel/build-kernel.sh")).output().context("guest-kernel/build-kernel.sh")?;
    if !out.status.success() {
        bail!("building the guest kernel failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let kernel = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let status = Command::new("make").arg("-C").arg(root.join("guest-kernel")).arg("initramfs").status()?;
    if !status.success() {
        bail!("make -C guest-kernel initramfs failed");
    }
    let initramfs = root.join("guest-kernel/build/initramfs.cpio.gz");
    if !initramfs.exists() {
        bail!("{} was not produced", initramfs.display());
    }
    Ok((kernel, initramfs))
}

/// A shim config (TOML) for the `vm` backend with the real guest ([`kernel_and_initramfs`]),
/// this workspace's VMM and `make setup`'s virtiofsd, keeping pod state in `state_dir`.
pub fn real_vm_config(state_dir: &Path, connect_timeout_ms: u64) -> anyhow::Result<String> {
    let (kernel, initramfs) = kernel_and_initramfs()?;
    Ok(format!(
        "backend = \"vm\"\nstate_dir = \"{}\"\n\n[agent]\nconnect_timeout_ms = {connect_timeout_ms}\n\n\
         [vm]\nvmm_path = \"{}\"\nkernel_path = \"{}\"\ninitramfs_path = \"{}\"\nvirtiofsd_path = \"{}\"\n",
        state_dir.display(),
        crate::workspace_bin("bulkhead-vmm").display(),
        kernel.display(),
        initramfs.display(),
        crate::virtiofsd_path().display()
    ))
}
