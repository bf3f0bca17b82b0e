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
    /// vCPUs the VM has: the pod's, or `vm.max_vcpus` to grow into if more.
    pub vcpus: u8,
    /// vCPUs online at the start: the pod's.
    pub online: u8,
    /// Memory the VM has: the pod's, or `vm.max_memory_mib` to grow into if more.
    pub mem: Mib,
    /// Memory the guest keeps at the start (its balloon holds the rest): the pod's.
    pub mem_start: Mib,
}

impl VmShape {
    /// vCPUs: ceil(the pod's CPU limit), else `config.vcpus`, online; the VM has
    /// `config.max_vcpus` if that is more. Memory (and likewise with `config.max_memory_mib`,
    /// the rest in the balloon at the start): the pod's memory limit
    /// plus `config.memory_mib` (what the guest kernel and agent use beyond the containers),
    /// else `config.memory_mib`. A pod larger than a VM can be is refused, never shrunk.
    pub fn for_pod(config: &VmSettings, pod: &PodResources) -> Result<Self, SandboxError> {
        let too_big = |what: String| SandboxError::Setup(format!("the pod asks for {what}"));
        let online = match pod.cpus {
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
        Ok(Self { vcpus: online.max(config.max_vcpus), online, mem: mem.max(config.max_memory_mib), mem_start: mem })
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
        let shape = VmShape { vcpus: 1, online: 1, mem: Mib(256), mem_start: Mib(256) };
        assert_eq!(VmShape::for_pod(&config(), &PodResources::default()).unwrap(), shape);
    }

    #[test]
    fn pod_limits_shape_the_vm() {
        let pod = PodResources { cpus: Some(3), memory_bytes: Some((512 << 20) + 1) };
        assert_eq!(
            VmShape::for_pod(&config(), &pod).unwrap(),
            VmShape { vcpus: 3, online: 3, mem: Mib(513 + 256), mem_start: Mib(513 + 256) }
        );
    }

    #[test]
    fn vcpus_to_grow_into_are_there_but_not_online() {
        let config = VmSettings { max_vcpus: 4, ..config() };
        let shape = VmShape::for_pod(&config, &PodResources { cpus: Some(2), memory_bytes: None }).unwrap();
        assert_eq!((shape.vcpus, shape.online), (4, 2));
        let shape = VmShape::for_pod(&config, &PodResources { cpus: Some(6), memory_bytes: None }).unwrap();
        assert_eq!((shape.vcpus, shape.online), (6, 6), "a pod larger than the headroom keeps its own");
    }

    #[test]
    fn memory_to_grow_into_is_there_and_in_the_balloon() {
        let config = VmSettings { max_memory_mib: Mib(1024), ..config() };
        let shape = VmShape::for_pod(&config, &PodResources { cpus: None, memory_bytes: Some(128 << 20) }).unwrap();
        assert_eq!((shape.mem, shape.mem_start), (Mib(1024), Mib(128 + 256)));
        let shape = VmShape::for_pod(&config, &PodResources { cpus: None, memory_bytes: Some(2 << 30) }).unwrap();
        assert_eq!((shape.mem, shape.mem_start), (Mib(2048 + 256), Mib(2048 + 256)), "larger than the headroom");
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
