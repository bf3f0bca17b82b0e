//! The shim's two documents (`vm.json`, `jail.json`) resolved into what the stand-in runs: host
//! paths for everything the VM config names inside the jail. A config the stand-in cannot honour
//! (a raw test guest, block devices, a path outside the jail's files) is refused with its reason.

use std::path::{Path, PathBuf};

use bulkhead_vmm_api::config::{LinkState, NetConfig, VmConfig, DEFAULT_CMDLINE};
use bulkhead_vmm_api::jail::JailConfig;
use bulkhead_vmm_api::memory::Mib;

/// A virtio-fs device: the tag the guest mounts and the vhost-user backend's socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsDevice {
    pub tag: String,
    pub socket: PathBuf,
    pub queue_size: u16,
}

/// The hybrid-vsock socket the host dials, and the guest's context id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vsock {
    pub uds_path: PathBuf,
    pub guest_cid: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub id: String,
    pub kernel: PathBuf,
    pub initramfs: Option<PathBuf>,
    pub cmdline: String,
    pub vcpus: u8,
    pub mem_mib: Mib,
    pub console: Option<PathBuf>,
    pub vsock: Option<Vsock>,
    pub fs: Vec<FsDevice>,
    pub net: Vec<NetConfig>,
    pub api_socket: Option<PathBuf>,
    /// A virtio-balloon device with free page reporting.
    pub free_page_reporting: bool,
    /// Where the stand-in keeps its own sockets (QMP, vhost-user vsock): the jail's first
    /// writable directory, as a host path.
    pub run_dir: PathBuf,
    /// Every writable directory of the jail, as host paths (the VMM creates them).
    pub writable_dirs: Vec<PathBuf>,
    pub cgroup: Option<PathBuf>,
    pub netns: Option<PathBuf>,
}

impl Plan {
    pub fn load(config: &Path, jail: &Path) -> Result<Self, String> {
        let vm = VmConfig::from_file(config).map_err(|e| format!("{}: {e}", config.display()))?;
        let jail = JailConfig::from_file(jail).map_err(|e| format!("{}: {e}", jail.display()))?;
        Self::new(vm, &jail)
    }

    pub fn new(vm: VmConfig, jail: &JailConfig) -> Result<Self, String> {
        if vm.raw_guest.is_some() {
            return Err("the QEMU stand-in boots a Linux kernel only, not a raw test guest".into());
        }
        if !vm.block.is_empty() {
            return Err("the QEMU stand-in has no block devices".into());
        }
        // Only a template's NICs start down, and the stand-in builds no templates.
        if vm.net.iter().any(|n| n.link == LinkState::Down) {
            return Err("the QEMU stand-in starts no NIC with its link down (template VMs are bulkhead-vmm's)".into());
        }
        let read_only = |what: &str, p: &Path| {
            jail.read_only
                .iter()
                .find(|f| f.jail == p)
                .map(|f| f.host.clone())
                .ok_or_else(|| format!("{what} {} is not one of the jail's read-only files", p.display()))
        };
        let writable_dirs: Vec<PathBuf> = jail.writable_dirs.iter().map(|d| jail.host_path(d)).collect();
        let writable = |what: &str, p: &Path| {
            if jail.writable_dirs.iter().any(|d| p.starts_with(d)) {
                Ok(jail.host_path(p))
            } else {
                Err(format!("{what} {} is not in a writable directory of the jail", p.display()))
            }
        };
        let kernel = vm.kernel.as_deref().ok_or("the VM config names no kernel")?;
        let kernel = read_only("kernel", kernel)?;
        let initramfs = vm.initramfs.as_deref().map(|p| read_only("initramfs", p)).transpose()?;
        let console = vm.serial_log.as_deref().map(|p| writable("serial_log", p)).transpose()?;
        let api_socket = vm.api_socket.as_deref().map(|p| writable("api_socket", p)).transpose()?;
        let vsock = vm
            .vsock
            .as_ref()
            .map(|v| writable("vsock uds_path", &v.uds_path).map(|uds_path| Vsock { uds_path, guest_cid: v.guest_cid }))
            .transpose()?;
        let fs = vm
            .fs
            .iter()
            .map(|f| {
                writable("fs socket", &f.socket).map(|socket| FsDevice {
                    tag: f.tag.clone(),
                    socket,
                    queue_size: f.queue_size,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let run_dir = writable_dirs.first().cloned().ok_or("the jail has no writable directory for sockets")?;
        Ok(Self {
            id: jail.id.clone(),
            kernel,
            initramfs,
            cmdline: vm.cmdline.unwrap_or_else(|| DEFAULT_CMDLINE.to_string()),
            vcpus: vm.vcpus,
            mem_mib: vm.mem_mib,
            console,
            vsock,
            fs,
            net: vm.net,
            api_socket,
            free_page_reporting: vm.balloon.is_some_and(|b| b.free_page_reporting),
            run_dir,
            writable_dirs,
            cgroup: jail.cgroup.clone(),
            netns: jail.netns.clone(),
        })
    }

    /// QEMU's QMP socket.
    pub fn qmp_socket(&self) -> PathBuf {
        self.run_dir.join("q.sock")
    }

    /// QEMU's second QMP socket, which the stand-in only reads events from.
    pub fn qmp_events_socket(&self) -> PathBuf {
        self.run_dir.join("qe.sock")
    }

    /// Where `vhost-device-vsock` listens for host connections until the stand-in publishes it
    /// at the hybrid socket's path ([`super::vsock_gate`]).
    pub fn vsock_private_socket(&self) -> PathBuf {
        self.run_dir.join("vh.sock")
    }

    /// The vhost-user socket between QEMU and `vhost-device-vsock`.
    pub fn vhost_vsock_socket(&self) -> PathBuf {
        self.run_dir.join("vv.sock")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_vmm_api::config::{FsConfig, VsockConfig};
    use bulkhead_vmm_api::jail::JailFile;

    fn jail() -> JailConfig {
        JailConfig {
            id: "pod1".into(),
            chroot: "/s/pod1/vm/root".into(),
            uid: 40_000,
            gid: 40_000,
            read_only: vec![
                JailFile { host: "/cache/vmlinux".into(), jail: "/vmlinux".into() },
                JailFile { host: "/cache/initramfs.cpio.gz".into(), jail: "/initramfs.cpio.gz".into() },
            ],
            writable_dirs: vec!["/run".into()],
            cgroup: Some("/bulkhead/pod1".into()),
            netns: Some("/var/run/netns/cni-1".into()),
            tun: false,
        }
    }

    fn vm() -> VmConfig {
        serde_json::from_value(serde_json::json!({
            "kernel": "/vmlinux",
            "initramfs": "/initramfs.cpio.gz",
            "cmdline": "console=ttyS0 bulkhead.shared_fs=bulkhead",
            "vcpus": 2,
            "mem_mib": 512,
            "serial_log": "/run/console.log",
            "vsock": {"uds_path": "/run/v.sock", "guest_cid": 3},
            "fs": [{"tag": "bulkhead", "socket": "/run/fs0.sock", "queue_size": 1024}],
            "api_socket": "/run/api.sock"
        }))
        .unwrap()
    }

    #[test]
    fn jail_paths_become_host_paths() {
        let plan = Plan::new(vm(), &jail()).unwrap();
        assert_eq!(plan.kernel, PathBuf::from("/cache/vmlinux"));
        assert_eq!(plan.initramfs, Some(PathBuf::from("/cache/initramfs.cpio.gz")));
        assert_eq!(plan.console, Some(PathBuf::from("/s/pod1/vm/root/run/console.log")));
        assert_eq!(plan.vsock, Some(Vsock { uds_path: "/s/pod1/vm/root/run/v.sock".into(), guest_cid: 3 }));
        assert_eq!(
            plan.fs,
            [FsDevice { tag: "bulkhead".into(), socket: "/s/pod1/vm/root/run/fs0.sock".into(), queue_size: 1024 }]
        );
        assert_eq!(plan.api_socket, Some(PathBuf::from("/s/pod1/vm/root/run/api.sock")));
        assert_eq!(plan.run_dir, PathBuf::from("/s/pod1/vm/root/run"));
        assert_eq!((plan.vcpus, plan.mem_mib), (2, Mib(512)));
        assert_eq!(plan.cgroup.as_deref(), Some(Path::new("/bulkhead/pod1")));
    }

    #[test]
    fn what_the_stand_in_cannot_honour_is_refused_with_a_reason() {
        let mut v = vm();
        v.kernel = Some("/elsewhere/vmlinux".into());
        assert!(Plan::new(v, &jail()).unwrap_err().contains("not one of the jail's read-only files"));
        let mut v = vm();
        v.vsock = Some(VsockConfig { uds_path: "/tmp/v.sock".into(), guest_cid: 3 });
        assert!(Plan::new(v, &jail()).unwrap_err().contains("not in a writable directory"));
        let mut v = vm();
        v.fs = vec![FsConfig { tag: "t".into(), socket: "/x.sock".into(), queue_size: 8 }];
        assert!(Plan::new(v, &jail()).unwrap_err().contains("fs socket"));
        let mut v = vm();
        v.kernel = None;
        assert!(Plan::new(v, &jail()).unwrap_err().contains("no kernel"));
        let mut v = vm();
        v.block = vec![serde_json::from_value(serde_json::json!({"path": "/run/disk"})).unwrap()];
        assert!(Plan::new(v, &jail()).unwrap_err().contains("block"));
    }
}
