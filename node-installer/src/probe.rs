//! Can this node run bulkhead's `vm` backend? Detection is the shared host probe
//! (`bulkhead_vmm_api::probe`); this module adds the installer's policy: PVM is refused unless
//! the operator says the shipped guest kernel is PVM-aware (`allow_pvm`).

use std::path::Path;

pub use bulkhead_vmm_api::probe::KvmKind;

/// The probe's decision, with the reason in words for the pod log and the node annotation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Capable { kvm: KvmKind, reason: String },
    Refused { kvm: KvmKind, reason: String },
}

impl Verdict {
    pub fn reason(&self) -> &str {
        match self {
            Verdict::Capable { reason, .. } | Verdict::Refused { reason, .. } => reason,
        }
    }
}

/// The verdict for the host whose root is mounted at `host_root`.
pub fn verdict(host_root: &Path, allow_pvm: bool) -> Verdict {
    let kvm = KvmKind::probe_at(host_root);
    match (kvm, kvm.ordinary_guests()) {
        (KvmKind::Pvm, _) if allow_pvm => {
            Verdict::Capable { kvm, reason: "/dev/kvm is PVM and the guest kernel is PVM-aware".into() }
        }
        (KvmKind::Pvm, Err(why)) => {
            Verdict::Refused { kvm, reason: format!("{why}; set allowPvm only with a PVM-aware kernel") }
        }
        (_, Ok(())) => Verdict::Capable { kvm, reason: format!("/dev/kvm present with {}", kvm.name()) },
        (_, Err(why)) => Verdict::Refused { kvm, reason: why },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_vmm_api::probe::{fake, HwVirt};

    fn node(kvm: bool, flags: &str, pvm: bool) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        fake::host(d.path(), kvm, pvm, flags).unwrap();
        d
    }

    #[test]
    fn vmx_and_svm_are_capable() {
        let vmx = verdict(node(true, "vmx", false).path(), false);
        assert!(matches!(vmx, Verdict::Capable { kvm: KvmKind::Hardware(HwVirt::Vmx), .. }));
        assert!(vmx.reason().contains("vmx"));
        let svm = verdict(node(true, "svm", false).path(), false);
        assert!(matches!(svm, Verdict::Capable { kvm: KvmKind::Hardware(HwVirt::Svm), .. }));
    }

    #[test]
    fn pvm_refused_unless_allowed() {
        let n = node(true, "", true);
        let v = verdict(n.path(), false);
        assert!(matches!(v, Verdict::Refused { kvm: KvmKind::Pvm, .. }));
        assert!(v.reason().contains("PVM") && v.reason().contains("allowPvm"));
        assert!(matches!(verdict(n.path(), true), Verdict::Capable { kvm: KvmKind::Pvm, .. }));
    }

    #[test]
    fn no_kvm_refused_with_reason() {
        let v = verdict(node(false, "vmx", false).path(), true);
        assert!(matches!(v, Verdict::Refused { kvm: KvmKind::Absent, .. }));
        assert!(v.reason().contains("no /dev/kvm"));
    }
}
