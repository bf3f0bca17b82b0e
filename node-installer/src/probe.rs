//! Host capability probe: can this node run bulkhead's `vm` backend?
//!
//! Reads only files under the host root (so tests lay out a fake node): `dev/kvm`, `proc/cpuinfo` flags and
//! `sys/module/kvm_pvm`. It does not open /dev/kvm; the VMM's own checks stay authoritative at pod start.

use std::path::Path;

/// What kind of hardware virtualisation the host offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Virt {
    /// Intel VT-x (`vmx` flag) with /dev/kvm.
    Vmx,
    /// AMD-V (`svm` flag) with /dev/kvm.
    Svm,
    /// /dev/kvm backed by the `kvm_pvm` module (nested without VT-x/AMD-V exposed to us).
    Pvm,
    /// No usable /dev/kvm.
    None,
}

/// The probe's decision, with the reason in words for the pod log and the node annotation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Capable { virt: Virt, reason: String },
    Refused { virt: Virt, reason: String },
}

impl Verdict {
    pub fn reason(&self) -> &str {
        match self {
            Verdict::Capable { reason, .. } | Verdict::Refused { reason, .. } => reason,
        }
    }
}

pub fn detect(host_root: &Path) -> Virt {
    let kvm = host_root.join("dev/kvm").exists();
    if !kvm {
        return Virt::None;
    }
    let cpuinfo = std::fs::read_to_string(host_root.join("proc/cpuinfo")).unwrap_or_default();
    let flags = cpu_flags(&cpuinfo);
    if flags.contains(&"vmx") {
        Virt::Vmx
    } else if flags.contains(&"svm") {
        Virt::Svm
    } else if host_root.join("sys/module/kvm_pvm").exists() {
        Virt::Pvm
    } else {
        Virt::None
    }
}

/// Flags of the first CPU (all CPUs of a node share them).
fn cpu_flags(cpuinfo: &str) -> Vec<&str> {
    cpuinfo
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == "flags").then(|| v.split_whitespace().collect())
        })
        .unwrap_or_default()
}

/// PVM only runs PVM-aware guest kernels; the stock bulkhead kernel is not one, so PVM is refused unless the
/// operator says the shipped kernel is PVM-aware (`allow_pvm`).
pub fn verdict(host_root: &Path, allow_pvm: bool) -> Verdict {
    let virt = detect(host_root);
    match virt {
        Virt::Vmx => Verdict::Capable { virt, reason: "/dev/kvm present with Intel VT-x (vmx)".into() },
        Virt::Svm => Verdict::Capable { virt, reason: "/dev/kvm present with AMD-V (svm)".into() },
        Virt::Pvm if allow_pvm => {
            Verdict::Capable { virt, reason: "/dev/kvm is PVM (kvm_pvm) and the guest kernel is PVM-aware".into() }
        }
        Virt::Pvm => Verdict::Refused {
            virt,
            reason: "/dev/kvm is PVM (kvm_pvm), which cannot boot the non-PVM bulkhead guest kernel; \
                     set allowPvm only with a PVM-aware kernel"
                .into(),
        },
        Virt::None if !host_root.join("dev/kvm").exists() => {
            Verdict::Refused { virt, reason: "no /dev/kvm: use a metal or nested-virtualization instance type".into() }
        }
        Virt::None => Verdict::Refused {
            virt,
            reason: "/dev/kvm present but CPU has neither vmx nor svm and kvm_pvm is not loaded".into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(kvm: bool, flags: &str, pvm: bool) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("dev")).unwrap();
        std::fs::create_dir_all(d.path().join("proc")).unwrap();
        if kvm {
            std::fs::write(d.path().join("dev/kvm"), "").unwrap();
        }
        std::fs::write(d.path().join("proc/cpuinfo"), format!("processor\t: 0\nflags\t\t: fpu {flags} sse\n\n"))
            .unwrap();
        if pvm {
            std::fs::create_dir_all(d.path().join("sys/module/kvm_pvm")).unwrap();
        }
        d
    }

    #[test]
    fn vmx_and_svm_are_capable() {
        assert!(matches!(verdict(node(true, "vmx", false).path(), false), Verdict::Capable { virt: Virt::Vmx, .. }));
        assert!(matches!(verdict(node(true, "svm", false).path(), false), Verdict::Capable { virt: Virt::Svm, .. }));
    }

    #[test]
    fn pvm_refused_unless_allowed() {
        let n = node(true, "", true);
        let v = verdict(n.path(), false);
        assert!(matches!(v, Verdict::Refused { virt: Virt::Pvm, .. }));
        assert!(v.reason().contains("PVM"));
        assert!(matches!(verdict(n.path(), true), Verdict::Capable { virt: Virt::Pvm, .. }));
    }

    #[test]
    fn no_kvm_refused_with_reason() {
        let v = verdict(node(false, "vmx", false).path(), true);
        assert!(matches!(v, Verdict::Refused { virt: Virt::None, .. }));
        assert!(v.reason().contains("no /dev/kvm"));
    }

    #[test]
    fn flag_must_be_whole_word() {
        // "vmxfoo" must not count as vmx.
        assert_eq!(detect(node(true, "vmxfoo svmbar", false).path()), Virt::None);
    }
}
