//! What this host can run: the `vm` backend needs /dev/kvm backed by VMX or SVM (or a
//! PVM host with a PVM-aware guest kernel, which bulkhead does not ship yet).

use std::path::Path;

/// The kind of KVM this host offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvmKind {
    /// Hardware virtualization: the `vm` backend runs real guests.
    Hardware(&'static str),
    /// PVM (`kvm_pvm`): only PVM-aware guest kernels run natively.
    Pvm,
    /// /dev/kvm exists but neither VMX/SVM nor PVM was found.
    Unknown,
    /// No /dev/kvm.
    Absent,
}

impl KvmKind {
    pub fn probe() -> Self {
        Self::probe_at(Path::new("/"))
    }

    /// Probes a host whose root is mounted at `root` (tests use a fake root).
    pub fn probe_at(root: &Path) -> Self {
        if !root.join("dev/kvm").exists() {
            return Self::Absent;
        }
        if root.join("sys/module/kvm_pvm").exists() {
            return Self::Pvm;
        }
        let cpuinfo = std::fs::read_to_string(root.join("proc/cpuinfo")).unwrap_or_default();
        let flags = cpuinfo.lines().find(|l| l.starts_with("flags")).unwrap_or("");
        let has = |f: &str| flags.split_whitespace().any(|x| x == f);
        if has("vmx") {
            Self::Hardware("vmx")
        } else if has("svm") {
            Self::Hardware("svm")
        } else {
            Self::Unknown
        }
    }

    /// `Ok(())` when the `vm` backend can boot its guest here, else the reason it cannot.
    pub fn vm_backend(&self) -> Result<(), String> {
        match self {
            Self::Hardware(_) => Ok(()),
            Self::Pvm => Err("/dev/kvm is PVM (kvm_pvm), which runs only PVM-aware guest kernels; \
                              bulkhead's guest kernel is not one yet"
                .into()),
            Self::Unknown => Err("/dev/kvm exists but the CPU shows neither vmx nor svm".into()),
            Self::Absent => Err("there is no /dev/kvm on this host".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_root(kvm: bool, pvm: bool, flags: &str) -> tempfile::TempDir {
        let d = tempfile::tempdir().expect("tempdir");
        for sub in ["dev", "proc", "sys/module"] {
            std::fs::create_dir_all(d.path().join(sub)).expect("mkdir");
        }
        if kvm {
            std::fs::write(d.path().join("dev/kvm"), "").expect("kvm");
        }
        if pvm {
            std::fs::create_dir_all(d.path().join("sys/module/kvm_pvm")).expect("pvm");
        }
        std::fs::write(d.path().join("proc/cpuinfo"), format!("processor\t: 0\nflags\t\t: {flags}\n"))
            .expect("cpuinfo");
        d
    }

    #[test]
    fn classifies_hosts() {
        assert_eq!(KvmKind::probe_at(fake_root(false, false, "vmx").path()), KvmKind::Absent);
        assert_eq!(KvmKind::probe_at(fake_root(true, true, "fpu").path()), KvmKind::Pvm);
        assert_eq!(KvmKind::probe_at(fake_root(true, false, "fpu vmx sse").path()), KvmKind::Hardware("vmx"));
        assert_eq!(KvmKind::probe_at(fake_root(true, false, "fpu svm").path()), KvmKind::Hardware("svm"));
        assert_eq!(KvmKind::probe_at(fake_root(true, false, "fpu vmxx").path()), KvmKind::Unknown);
        assert!(KvmKind::Pvm.vm_backend().is_err());
        assert!(KvmKind::Hardware("vmx").vm_backend().is_ok());
    }
}
