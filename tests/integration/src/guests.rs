//! What VMs in tests boot. The VMM's tiny `no_std` test guests (`vmm/tests/guests/*.rs`),
//! compiled with rustc for `x86_64-unknown-none` into static ELFs: the VMM's KVM tests boot them
//! as raw guests, the shim's `vm` backend tests in place of a kernel (the ELF loader takes them
//! like a vmlinux); the one builder both use. And the real guest kernel and initramfs, with the
//! VMMs that boot them here ([`GuestVmm`]): `bulkhead-vmm` where the host probe says ordinary
//! guests run, and everywhere the QEMU stand-in (`crate::standin`).

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
/// the initramfs of `make -C guest-kernel initramfs` (the static agent as /init). Built once per
/// test process; concurrent test processes take turns (a lock file beside the initramfs).
pub fn kernel_and_initramfs() -> anyhow::Result<(PathBuf, PathBuf)> {
    use anyhow::{bail, Context};
    static BUILT: std::sync::Mutex<Option<(PathBuf, PathBuf)>> = std::sync::Mutex::new(None);
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(paths) = built.as_ref() {
        return Ok(paths.clone());
    }
    // Prebuilt by the caller: the emulated node's stage builds both on the host, where a kernel hash
    // and a cargo build take seconds instead of minutes of emulation.
    if let (Some(kernel), Some(initramfs)) =
        (std::env::var_os("BULKHEAD_GUEST_KERNEL"), std::env::var_os("BULKHEAD_GUEST_INITRAMFS"))
    {
        let paths = (PathBuf::from(kernel), PathBuf::from(initramfs));
        for path in [&paths.0, &paths.1] {
            if !path.is_file() {
                bail!("{} (BULKHEAD_GUEST_KERNEL/BULKHEAD_GUEST_INITRAMFS) is not a file", path.display());
            }
        }
        *built = Some(paths.clone());
        return Ok(paths);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let build_dir = root.join("guest-kernel/build");
    std::fs::create_dir_all(&build_dir).with_context(|| format!("create {}", build_dir.display()))?;
    let lock_file = std::fs::File::create(build_dir.join(".test-lock")).context("guest-kernel/build/.test-lock")?;
    let _lock = nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| anyhow::anyhow!("lock guest-kernel/build/.test-lock: {e}"))?;
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
    let initramfs = build_dir.join("initramfs.cpio.gz");
    if !initramfs.exists() {
        bail!("{} was not produced", initramfs.display());
    }
    *built = Some((kernel.clone(), initramfs.clone()));
    Ok((kernel, initramfs))
}

/// What boots the real guest in a full-VM test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestVmm {
    /// `bulkhead-vmm`, the product; needs a host whose /dev/kvm runs ordinary guests (VMX/SVM).
    Bulkhead,
    /// `bulkhead-qemu-vmm`, QEMU under TCG in the VMM's place; runs on every host.
    QemuStandIn,
}

impl GuestVmm {
    pub fn name(self) -> &'static str {
        match self {
            GuestVmm::Bulkhead => "bulkhead-vmm",
            GuestVmm::QemuStandIn => "the QEMU stand-in (TCG)",
        }
    }

    pub fn binary(self) -> PathBuf {
        match self {
            GuestVmm::Bulkhead => crate::workspace_bin("bulkhead-vmm"),
            GuestVmm::QemuStandIn => crate::workspace_bin("bulkhead-qemu-vmm"),
        }
    }

    /// Why this VMM cannot boot the real guest here, or `None`. For the stand-in that is a
    /// missing prerequisite (`make setup` installs QEMU and vhost-device-vsock); for
    /// `bulkhead-vmm`, what the host probe says.
    pub fn unavailable(self) -> Option<Unavailable> {
        let bin = self.binary();
        if !bin.is_file() {
            return Some(Unavailable::Prerequisite(format!(
                "{} is not built (run `cargo build --workspace`)",
                bin.display()
            )));
        }
        match self {
            GuestVmm::Bulkhead => {
                bulkhead_vmm_api::probe::KvmKind::probe().ordinary_guests().err().map(Unavailable::Host)
            }
            GuestVmm::QemuStandIn => {
                if crate::which(crate::standin::qemu::QEMU).is_none() {
                    return Some(Unavailable::Prerequisite(format!(
                        "{} is not on PATH (run `make setup`: Debian's qemu-system-x86)",
                        crate::standin::qemu::QEMU
                    )));
                }
                let vsock = vhost_device_vsock_path();
                (!vsock.is_file())
                    .then(|| Unavailable::Prerequisite(format!("{} is missing (run `make setup`)", vsock.display())))
            }
        }
    }

    /// Prints the skip line for a full-VM test on this VMM and returns true when it cannot run
    /// here: a host that cannot is a ledgered skip, a missing prerequisite fails under CI.
    pub fn skip(self, test: &str) -> bool {
        match self.unavailable() {
            None => false,
            Some(Unavailable::Host(why)) => crate::skip::host_cannot(
                test,
                &format!("{why}; `make test` runs it in the emulated AMD-V node instead (scripts/node-stage.sh)"),
            ),
            Some(Unavailable::Prerequisite(why)) => crate::skip::missing_prerequisite(test, &why),
        }
    }
}

/// Why a [`GuestVmm`] cannot run here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unavailable {
    /// The host cannot (the probe says no ordinary guests run).
    Host(String),
    /// Something `make setup` or the build provides is missing.
    Prerequisite(String),
}

/// Where `make setup` puts `vhost-device-vsock` (`$BULKHEAD_CACHE/bin`).
pub fn vhost_device_vsock_path() -> PathBuf {
    let cache = std::env::var_os("BULKHEAD_CACHE").unwrap_or_else(|| "/var/cache/bulkhead".into());
    PathBuf::from(cache).join("bin/vhost-device-vsock")
}

/// The `[vm]` line of [`vm_config`] that makes its pods boot cold (`vm.start` is `auto` by default,
/// warm where the probe says VMX or SVM: the emulated node).
pub const COLD: &str = "start = \"cold\"\n";

/// A shim config (TOML) for the `vm` backend with the real guest ([`kernel_and_initramfs`]) on
/// `vmm`, and `make setup`'s virtiofsd, keeping pod state in `state_dir`.
pub fn real_vm_config(state_dir: &Path, connect_timeout_ms: u64, vmm: GuestVmm) -> anyhow::Result<String> {
    let (kernel, initramfs) = kernel_and_initramfs()?;
    Ok(vm_config(state_dir, connect_timeout_ms, vmm, &kernel, &initramfs))
}

/// A shim config (TOML) for the `namespace` backend: pods' state in `state_dir`, `agent` as the agent.
pub fn namespace_config(state_dir: &Path, agent: &Path) -> String {
    format!(
        "backend = \"namespace\"\nstate_dir = \"{}\"\n[namespace]\nagent_path = \"{}\"\n",
        state_dir.display(),
        agent.display()
    )
}

/// A shim config (TOML) for the `vm` backend booting `kernel` and `initramfs` on `vmm`. Its pods
/// boot cold ([`COLD`]): each test says which start it proves, and a warm one replaces that line.
pub fn vm_config(state_dir: &Path, connect_timeout_ms: u64, vmm: GuestVmm, kernel: &Path, initramfs: &Path) -> String {
    format!(
        "backend = \"vm\"\nstate_dir = \"{}\"\n\n[agent]\nconnect_timeout_ms = {connect_timeout_ms}\n\n\
         [vm]\n{COLD}vmm_path = \"{}\"\nkernel_path = \"{}\"\ninitramfs_path = \"{}\"\nvirtiofsd_path = \"{}\"\n",
        state_dir.display(),
        vmm.binary().display(),
        kernel.display(),
        initramfs.display(),
        crate::virtiofsd_path().display()
    )
}

/// An initramfs holding `init` (a static binary) as /init, written to `out` by the project's
/// own `guest-kernel/mkinitramfs.py`.
pub fn initramfs_with(init: &Path, out: &Path) -> anyhow::Result<()> {
    use anyhow::{bail, Context};
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../guest-kernel/mkinitramfs.py");
    let status = Command::new("python3").arg(&script).arg(init).arg(out).status().context("python3")?;
    if !status.success() {
        bail!("{} {} {} failed: {status}", script.display(), init.display(), out.display());
    }
    Ok(())
}
