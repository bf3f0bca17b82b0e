//! What a running pod's VM can take of its containers' new limits, and what the VM follows. The
//! VM has the memory and vCPUs it booted with (`shape`: the pod's limits plus `vm.memory_mib`, or
//! the configured defaults, and `vm.max_memory_mib` and `vm.max_vcpus` to grow into), so a
//! resize that needs more is refused, naming that size and what sets it, and the container keeps
//! its old limits. A limit the guest can honour goes through.
//!
//! Memory is checked for the pod's containers together: kubelet sizes the pod as the sum of its
//! containers' limits, and the guest's cgroups enforce each one. Only growth is refused: kubelet
//! sends a container's unchanged limits again (the CPU manager's reconcile loop does), and a pod
//! started without pod-level resources (containerd before 1.7) may already have a container
//! limit beyond its default-sized VM.
//!
//! What the guest keeps follows the containers' limits once every container has one: the vCPUs
//! online (their CPU limits added up, each rounded up), and the memory outside the balloon (their
//! memory limits added up, plus `vm.memory_mib` for the guest itself, plus whatever slack the pod
//! had over its containers when it started, such as the RuntimeClass overhead), within the VM.
//! So `nproc` follows a resize both ways, and a pod resized down gives its memory back to the
//! node. A pod with a container without such a limit keeps what it has.

use std::collections::HashMap;
use std::sync::Mutex;

use bulkhead_vmm_api::memory::Mib;
use oci_spec::runtime::LinuxResources;

use super::shape::VmShape;
use crate::spec::PodResources;

/// One container's memory and CPU limits, as far as they bind (0 = none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: u64,
    /// ceil(quota / period).
    pub cpus: u64,
}

impl Limits {
    pub fn of(resources: &LinuxResources) -> Self {
        let memory_bytes = resources.memory().as_ref().and_then(|m| m.limit()).and_then(|l| u64::try_from(l).ok());
        let cpus = resources.cpu().as_ref().and_then(|c| match (c.quota(), c.period()) {
            (Some(quota), Some(period)) if quota > 0 && period > 0 => Some((quota as u64).div_ceil(period)),
            _ => None,
        });
        Self { memory_bytes: memory_bytes.unwrap_or(0), cpus: cpus.unwrap_or(0) }
    }
}

/// A resize the VM cannot take, said so that an operator knows what would.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("container {container}: {what} A running VM does not grow beyond what it booted with: recreate the pod with the new limits")]
pub struct ResizeRefused {
    container: String,
    what: String,
}

/// What the guest should now keep, where an applied resize changed it.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Follow {
    /// vCPUs online.
    pub online: Option<u32>,
    /// Memory outside the balloon.
    pub guest: Option<Mib>,
}

/// The pod's VM size and the limits its containers have now.
pub struct ResizeCeiling {
    vcpus: u64,
    mem: Mib,
    /// `vm.memory_mib`: the guest's own share.
    base: Mib,
    /// What the containers may hold together.
    memory_room: Mib,
    /// Whether the pod's own CPU and memory limits sized the VM (else the configured defaults did),
    /// and whether it has memory to grow into.
    cpus_from_pod: bool,
    memory_from_pod: bool,
    memory_headroom: bool,
    now: Mutex<Now>,
}

struct Now {
    limits: HashMap<String, Limits>,
    /// vCPUs online in the guest.
    online: u64,
    /// Memory outside the balloon.
    guest: Mib,
}

impl ResizeCeiling {
    /// A VM of `shape` for a pod asking `pod`, the guest's own share being `base`: its
    /// containers have the VM less `base` where the pod gave a memory limit or the VM has memory
    /// to grow into, else the whole (default-sized) VM, as they always had.
    pub fn new(shape: VmShape, pod: &PodResources, base: Mib) -> Self {
        let memory_headroom = shape.mem > shape.mem_start;
        let memory_room = match pod.memory_bytes.is_some() || memory_headroom {
            true => Mib(shape.mem.get().saturating_sub(base.get())),
            false => shape.mem,
        };
        Self {
            vcpus: u64::from(shape.vcpus),
            mem: shape.mem,
            base,
            memory_room,
            cpus_from_pod: pod.cpus.is_some(),
            memory_from_pod: pod.memory_bytes.is_some(),
            memory_headroom,
            now: Mutex::new(Now { limits: HashMap::new(), online: u64::from(shape.online), guest: shape.mem_start }),
        }
    }

    fn now(&self) -> std::sync::MutexGuard<'_, Now> {
        self.now.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new container's limits, as kubelet created it: never refused (its pod was sized for it).
    pub fn created(&self, container: &str, limits: Limits) {
        self.now().limits.insert(container.to_string(), limits);
    }

    pub fn removed(&self, container: &str) {
        self.now().limits.remove(container);
    }

    /// Whether the VM can take `container`'s new limits (module docs).
    pub fn check(&self, container: &str, new: Limits) -> Result<(), ResizeRefused> {
        let now = self.now();
        let old = now.limits.get(container).copied().unwrap_or_default();
        let refuse = |what: String| Err(ResizeRefused { container: container.to_string(), what });
        let set_by = |from_pod: bool, what: &str, config: &str| {
            if from_pod {
                format!("set when the pod started, from its {what}")
            } else {
                format!("the pod gave no pod-level {what}, so the VM has the default {config} from bulkhead's config")
            }
        };
        if new.cpus > self.vcpus && new.cpus > old.cpus {
            let why = set_by(self.cpus_from_pod, "CPU limit", "vm.vcpus");
            return refuse(format!(
                "a CPU limit of {} CPUs is more than its VM's {} vCPUs ({why}; `vm.max_vcpus` gives new VMs vCPUs to \
                 grow into).",
                new.cpus, self.vcpus
            ));
        }
        if new.memory_bytes > old.memory_bytes {
            let others: u64 = now.limits.iter().filter(|(id, _)| *id != container).map(|(_, l)| l.memory_bytes).sum();
            let together = Mib::holding(others.saturating_add(new.memory_bytes));
            if together > self.memory_room {
                let room = self.memory_room.get();
                let room = if self.memory_headroom {
                    format!(
                        "{room} MiB for its containers (`vm.max_memory_mib`, {} MiB, less `vm.memory_mib`, {} MiB, \
                         for the guest itself)",
                        self.mem.get(),
                        self.base.get()
                    )
                } else {
                    let why = set_by(self.memory_from_pod, "memory limit", "vm.memory_mib");
                    let of = if self.memory_from_pod { " for its containers" } else { "" };
                    format!("{room} MiB{of} ({why}; `vm.max_memory_mib` gives new VMs memory to grow into)")
                };
                return refuse(format!(
                    "a memory limit of {} MiB (the pod's containers together: {} MiB) does not fit its VM: it \
                     has {room}.",
                    Mib::holding(new.memory_bytes).get(),
                    together.get(),
                ));
            }
        }
        Ok(())
    }

    /// Records `container`'s limits once the guest applied them; returns what the guest should
    /// keep now, where that changed (module docs).
    pub fn resized(&self, container: &str, new: Limits) -> Follow {
        let mut now = self.now();
        let before: u64 = now.limits.values().map(|l| l.memory_bytes).sum();
        now.limits.insert(container.to_string(), new);
        let mut follow = Follow::default();
        if now.limits.values().all(|l| l.cpus > 0) {
            let wanted = now.limits.values().map(|l| l.cpus).sum::<u64>().clamp(1, self.vcpus);
            follow.online = (wanted != now.online).then(|| u32::try_from(wanted).unwrap_or(u32::MAX));
        }
        if now.limits.values().all(|l| l.memory_bytes > 0) {
            // The pod's slack over its containers before this resize stays the pod's.
            let slack = now.guest.get().saturating_sub(self.base.get()).saturating_sub(Mib::holding(before).get());
            let after: u64 = now.limits.values().map(|l| l.memory_bytes).sum();
            let wanted = Mib(Mib::holding(after).get().saturating_add(self.base.get()).saturating_add(slack));
            let wanted = wanted.min(self.mem);
            follow.guest = (wanted != now.guest).then_some(wanted);
        }
        follow
    }

    /// The vCPUs the guest has online, as its agent said after a change.
    pub fn online(&self, count: u32) {
        self.now().online = u64::from(count);
    }

    /// The memory the guest keeps outside the balloon, once the VMM took the new target.
    pub fn guest(&self, mib: Mib) {
        self.now().guest = mib;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn mem(mib: u64) -> Limits {
        Limits { memory_bytes: mib * MIB, cpus: 0 }
    }

    fn sized(mem_mib: u64, vcpus: u8) -> ResizeCeiling {
        let pod = PodResources { cpus: Some(u64::from(vcpus)), memory_bytes: Some(mem_mib * MIB) };
        ResizeCeiling::new(
            VmShape { vcpus, online: vcpus, mem: Mib(mem_mib + 256), mem_start: Mib(mem_mib + 256) },
            &pod,
            Mib(256),
        )
    }

    #[test]
    fn growth_within_the_pods_size_goes_through() {
        let c = sized(512, 2);
        c.created("a", mem(200));
        c.created("b", mem(200));
        assert_eq!(c.check("a", mem(312)), Ok(()));
        assert_eq!(c.resized("a", mem(312)).online, None, "containers without CPU limits leave the vCPUs be");
        assert_eq!(c.check("b", mem(150)), Ok(()), "shrinking");
    }

    #[test]
    fn growth_beyond_the_pods_size_is_refused_naming_it() {
        let c = sized(512, 2);
        c.created("a", mem(200));
        c.created("b", mem(200));
        let err = c.check("a", mem(400)).unwrap_err().to_string();
        for want in ["container a", "400 MiB", "together: 600 MiB", "512 MiB for its containers", "its memory limit"] {
            assert!(err.contains(want), "{want} missing from: {err}");
        }
        assert!(err.contains("recreate the pod") && err.contains("does not grow beyond"), "{err}");
        let err = c.check("a", Limits { memory_bytes: 0, cpus: 3 }).unwrap_err().to_string();
        assert!(err.contains("3 CPUs") && err.contains("2 vCPUs") && err.contains("its CPU limit"), "{err}");
    }

    #[test]
    fn a_default_sized_vm_names_the_config_keys() {
        let c = ResizeCeiling::new(
            VmShape { vcpus: 1, online: 1, mem: Mib(512), mem_start: Mib(512) },
            &PodResources::default(),
            Mib(256),
        );
        c.created("a", mem(64));
        assert_eq!(c.check("a", mem(512)), Ok(()));
        let err = c.check("a", mem(2048)).unwrap_err().to_string();
        assert!(err.contains("512 MiB") && err.contains("vm.memory_mib"), "{err}");
        let err = c.check("a", Limits { memory_bytes: 0, cpus: 2 }).unwrap_err().to_string();
        assert!(err.contains("vm.vcpus"), "{err}");
    }

    #[test]
    fn unchanged_or_smaller_limits_beyond_the_vm_are_not_refused() {
        // A pod without pod-level resources, created with a limit its VM cannot hold.
        let c = ResizeCeiling::new(
            VmShape { vcpus: 1, online: 1, mem: Mib(512), mem_start: Mib(512) },
            &PodResources::default(),
            Mib(256),
        );
        let big = Limits { memory_bytes: 1024 * MIB, cpus: 4 };
        c.created("a", big);
        assert_eq!(c.check("a", big), Ok(()), "the CPU manager's reconcile sends them again");
        assert_eq!(c.check("a", Limits { memory_bytes: 900 * MIB, cpus: 3 }), Ok(()));
        c.removed("a");
        assert!(c.check("a", big).is_err(), "a removed container's limits are forgotten");
    }

    #[test]
    fn online_vcpus_follow_the_containers_cpu_limits_within_the_vm() {
        let c = ResizeCeiling::new(
            VmShape { vcpus: 4, online: 1, mem: Mib(512), mem_start: Mib(512) },
            &PodResources::default(),
            Mib(256),
        );
        let cpus = |n| Limits { memory_bytes: 0, cpus: n };
        c.created("a", cpus(1));
        c.created("b", Limits::default());
        assert_eq!(c.check("a", cpus(3)), Ok(()), "within the VM's 4 vCPUs");
        assert_eq!(c.resized("a", cpus(3)).online, None, "b has no CPU limit");
        c.removed("b");
        assert_eq!(c.resized("a", cpus(3)).online, Some(3));
        c.online(3);
        assert_eq!(c.resized("a", cpus(3)).online, None, "unchanged");
        assert_eq!(c.resized("a", cpus(1)).online, Some(1), "shrinking takes vCPUs offline");
        c.online(1);
        let err = c.check("a", cpus(5)).unwrap_err().to_string();
        assert!(err.contains("4 vCPUs") && err.contains("vm.max_vcpus"), "{err}");
    }

    #[test]
    fn the_guests_memory_follows_the_containers_limits_within_the_vm_keeping_the_pods_slack() {
        // vm.memory_mib 256, vm.max_memory_mib 1024; a pod of 300 MiB (its containers' 256 and
        // 44 of RuntimeClass overhead) starts with 556 MiB outside the balloon.
        let pod = PodResources { cpus: None, memory_bytes: Some(300 * MIB) };
        let shape = VmShape { vcpus: 1, online: 1, mem: Mib(1024), mem_start: Mib(556) };
        let c = ResizeCeiling::new(shape, &pod, Mib(256));
        c.created("a", mem(128));
        c.created("b", Limits::default());
        assert_eq!(c.resized("a", mem(128)).guest, None, "b has no memory limit");
        c.created("b", mem(128));
        assert_eq!(c.check("a", mem(400)), Ok(()), "within the 768 MiB the containers may grow to");
        assert_eq!(c.resized("a", mem(400)).guest, Some(Mib(400 + 128 + 256 + 44)));
        c.guest(Mib(828));
        assert_eq!(c.resized("a", mem(64)).guest, Some(Mib(64 + 128 + 256 + 44)), "given back, the slack kept");
        c.guest(Mib(492));
        let err = c.check("a", mem(700)).unwrap_err().to_string();
        assert!(err.contains("768 MiB for its containers") && err.contains("vm.max_memory_mib"), "{err}");
        assert_eq!(c.resized("b", mem(900)).guest, Some(Mib(1024)), "never more than the VM");
    }

    #[test]
    fn limits_come_from_the_oci_resources() {
        let r: LinuxResources =
            serde_json::from_str(r#"{"memory": {"limit": 104857600}, "cpu": {"quota": 150000, "period": 100000}}"#)
                .unwrap();
        assert_eq!(Limits::of(&r), Limits { memory_bytes: 100 * MIB, cpus: 2 });
        let none: LinuxResources = serde_json::from_str(r#"{"memory": {"limit": -1}, "cpu": {"quota": -1}}"#).unwrap();
        assert_eq!(Limits::of(&none), Limits::default());
    }
}
