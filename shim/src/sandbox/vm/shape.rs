//! The VM's shape (vCPUs, memory) for one pod: the pod's sandbox-level resources where
//! containerd passes them, else the configured defaults. Containers' own limits are the agent's
//! cgroups inside the guest; the shape only has to hold them.

use bulkhead_vmm_api::config::{MAX_MEM, MAX_VCPUS};
use bulkhead_vmm_api::memory::Mib;

use super::super::SandboxError;
use crate::config::VmSettings;
use crate::spec::PodResources;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmShape {
    pub vcpus: u8,
    pub mem: Mib,
}

impl VmShape {
    /// vCPUs: ceil(the pod's CPU limit), else `config.vcpus`. Memory: the pod's memory limit
    /// plus `config.memory_mib` (what the guest kernel and agent use beyond the containers),
    /// else `config.memory_mib`. A pod larger than a VM can be is refused, never shrunk.
    pub fn for_pod(config: &VmSettings, pod: &PodResources) -> Result<Self, SandboxError> {
        let too_big = |what: String| SandboxError::Setup(format!("the pod asks for {what}"));
        let vcpus = match pod.cpus {
            Some(cpus) => u8::try_from(cpus)
                .ok()
                .filter(|c| *c <= MAX_VCPUS)
                .ok_or_else(|| too_big(format!("{cpus} CPUs; a VM has at most {MAX_VCPUS}")))?,
            None => config.vcpus,
        };
        let base = config.memory_mib;
        let mem = match pod.memory_bytes {
            Some(bytes) => Mib::holding(bytes).saturating_add(base),
            None => base,
        };
        if mem > MAX_MEM {
            let (mem, base, max) = (mem.get(), base.get(), MAX_MEM.get());
            return Err(too_big(format!("{mem} MiB of VM memory (limit + {base} MiB); at most {max}")));
        }
        Ok(Self { vcpus, mem })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> VmSettings {
        VmSettings { vcpus: 1, memory_mib: Mib(256), ..Default::default() }
    }

    #[test]
    fn defaults_without_pod_resources() {
        assert_eq!(VmShape::for_pod(&config(), &PodResources::default()).unwrap(), VmShape { vcpus: 1, mem: Mib(256) });
    }

    #[test]
    fn pod_limits_shape_the_vm() {
        let pod = PodResources { cpus: Some(3), memory_bytes: Some((512 << 20) + 1) };
        assert_eq!(VmShape::for_pod(&config(), &pod).unwrap(), VmShape { vcpus: 3, mem: Mib(513 + 256) });
    }

    #[test]
    fn a_pod_larger_than_a_vm_is_refused() {
        for pod in [
            PodResources { cpus: Some(33), memory_bytes: None },
            PodResources { cpus: Some(u64::MAX), memory_bytes: None },
            PodResources { cpus: None, memory_bytes: Some(u64::MAX) },
        ] {
            let err = VmShape::for_pod(&config(), &pod).unwrap_err().to_string();
            assert!(err.contains("the pod asks for"), "{err}");
        }
    }
}
