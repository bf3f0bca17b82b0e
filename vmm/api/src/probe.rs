//! The host probe: what kind of KVM this host offers, and so whether the `vm` backend can boot
//! bulkhead's (ordinary, non-PVM) guest kernel here. The one probe used by the installer, the
//! shim, `bulkhead-vmm --probe`, the tests and the benches.
//!
//! It reads only files under a root directory (tests lay out a fake host): `dev/kvm`,
//! `sys/module/kvm_pvm` and the CPU flags in `proc/cpuinfo`. It does not open /dev/kvm; the VMM's
//! own KVM calls stay authoritative at pod start.

use std::path::Path;

/// Hardware virtualization extensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HwVirt {
    /// Intel VT-x.
    Vmx,
    /// AMD-V.
    Svm,
}

/// The kind of KVM behind /dev/kvm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvmKind {
    /// VMX/SVM: ordinary guests run, so the `vm` backend runs real pods.
    Hardware(HwVirt),
    /// PVM (`kvm_pvm`): only PVM-aware guest kernels run natively; anything else goes through an
    /// instruction emulator and no Linux guest reaches userspace.
    Pvm,
    /// /dev/kvm exists but the CPU shows neither vmx nor svm and kvm_pvm is not loaded.
    Unknown,
    /// No /dev/kvm.
    Absent,
}

impl KvmKind {
    /// Probes this host.
    pub fn probe() -> Self {
        Self::probe_at(Path::new("/"))
    }

    /// Probes a host whose root is at `root`. PVM is checked before the CPU flags: when the
    /// `kvm_pvm` module is loaded it is what serves /dev/kvm, whatever the flags say.
    pub fn probe_at(root: &Path) -> Self {
        if !root.join("dev/kvm").exists() {
            return Self::Absent;
        }
        if root.join("sys/module/kvm_pvm").exists() {
            return Self::Pvm;
        }
        let cpuinfo = std::fs::read_to_string(root.join("proc/cpuinfo")).unwrap_or_default();
        let flags = cpu_flags(&cpuinfo);
        if flags.contains(&"vmx") {
            Self::Hardware(HwVirt::Vmx)
        } else if flags.contains(&"svm") {
            Self::Hardware(HwVirt::Svm)
        } else {
            Self::Unknown
        }
    }

    /// Short name for logs, labels and JSON: `vmx`, `svm`, `pvm`, `unknown` or `absent`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Hardware(HwVirt::Vmx) => "vmx",
            Self::Hardware(HwVirt::Svm) => "svm",
            Self::Pvm => "pvm",
            Self::Unknown => "unknown",
            Self::Absent => "absent",
        }
    }

    /// `Ok(())` when ordinary guests (bulkhead's guest kernel) run here, else why not, in one line.
    pub fn ordinary_guests(&self) -> Result<(), String> {
        match self {
            Self::Hardware(_) => Ok(()),
            Self::Pvm => Err("/dev/kvm is PVM (kvm_pvm), which runs only PVM-aware guest kernels; \
                              bulkhead's guest kernel is not one"
                .into()),
            Self::Unknown => {
                Err("/dev/kvm exists but the CPU shows neither vmx nor svm, and kvm_pvm is not loaded".into())
            }
            Self::Absent => {
                Err("there is no /dev/kvm on this host (use a metal or nested-virtualization instance)".into())
            }
        }
    }
}

/// `Ok(())` when /dev/kvm opens read-write here. The VMM's own tests with test guests need only
/// this: they run on PVM too, through the instruction emulator.
pub fn kvm_device_usable() -> Result<(), String> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map(drop)
        .map_err(|e| format!("/dev/kvm is not usable: {e}"))
}

/// Flags of the first CPU (all CPUs of a host share them), as whole words.
fn cpu_flags(cpuinfo: &str) -> Vec<&str> {
    cpuinfo
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == "flags").then(|| v.split_whitespace().collect())
        })
        .unwrap_or_default()
}

/// A fake host root for tests of code that probes (this crate's and its users').
pub mod fake {
    use std::path::Path;

    /// Lays out `dev/kvm` (if `kvm`), `sys/module/kvm_pvm` (if `pvm`) and a cpuinfo with `flags`.
    pub fn host(root: &Path, kvm: bool, pvm: bool, flags: &str) -> std::io::Result<()> {
        for sub in ["dev", "proc", "sys/module"] {
            std::fs::create_dir_all(root.join(sub))?;
        }
        if kvm {
            std::fs::write(root.join("dev/kvm"), "")?;
        }
        if pvm {
            std::fs::create_dir_all(root.join("sys/module/kvm_pvm"))?;
        }
        std::fs::write(root.join("proc/cpuinfo"), format!("processor\t: 0\nflags\t\t: fpu {flags} sse\n\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(kvm: bool, pvm: bool, flags: &str) -> KvmKind {
        let d = tempfile::tempdir().unwrap();
        fake::host(d.path(), kvm, pvm, flags).unwrap();
        KvmKind::probe_at(d.path())
    }

    #[test]
    fn classifies_hosts() {
        assert_eq!(kind(false, false, "vmx"), KvmKind::Absent);
        assert_eq!(kind(true, true, ""), KvmKind::Pvm);
        assert_eq!(kind(true, true, "vmx"), KvmKind::Pvm, "the loaded kvm_pvm module serves /dev/kvm");
        assert_eq!(kind(true, false, "vmx"), KvmKind::Hardware(HwVirt::Vmx));
        assert_eq!(kind(true, false, "svm"), KvmKind::Hardware(HwVirt::Svm));
        assert_eq!(kind(true, false, "vmxfoo svmbar"), KvmKind::Unknown, "flags are whole words");
    }

    #[test]
    fn only_hardware_runs_ordinary_guests() {
        assert!(KvmKind::Hardware(HwVirt::Vmx).ordinary_guests().is_ok());
        for k in [KvmKind::Pvm, KvmKind::Unknown, KvmKind::Absent] {
            let why = k.ordinary_guests().unwrap_err();
            assert!(!why.contains('\n') && !why.is_empty(), "{why}");
        }
        assert!(KvmKind::Pvm.ordinary_guests().unwrap_err().contains("kvm_pvm"));
        assert_eq!(KvmKind::Pvm.name(), "pvm");
    }
}
