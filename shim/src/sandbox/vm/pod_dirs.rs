//! Where a pod's VM lives on the host, and the two documents the VMM reads.
//!
//! ```text
//! <state_dir>/<pod>/
//!   shared/                        what virtiofsd serves (share.rs): <container>/rootfs, volumes/<n>
//!   vm/                            root 0700: the shim's own files
//!     vm.json, jail.json           the VM config (paths inside the jail) and the jail
//!     restore.json                 a restored VM's own settings (warm start from a template)
//!     vmm.pid, virtiofsd.pid       the VMM's waiter and virtiofsd, for `delete` after a crash
//!     root/                        root 0755: the VMM's chroot
//!       vmlinux, initramfs.cpio.gz read-only bind mounts (made by the VMM in its own namespace)
//!       snapshot/state, memory     a warm start's template files, read-only bind mounts too
//!       dev/kvm                    made by the VMM
//!       run/                       made by the shim, then the jail user's: fs0.sock (virtiofsd's
//!                                  listener, bound by the shim), v.sock (hybrid vsock),
//!                                  api.sock, console.log (the guest's serial console)
//! ```

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use bulkhead_protocol::guest::SHARED_FS_PARAM;
use bulkhead_vmm_api::command_line::{self, Start, VmmCommand};
use bulkhead_vmm_api::config::{BalloonConfig, FsConfig, NetConfig, VmConfig, VsockConfig, DEFAULT_CMDLINE};
use bulkhead_vmm_api::jail::{JailConfig, JailFile};
use bulkhead_vmm_api::restore::{RestoreConfig, MEMORY_FILE, STATE_FILE};

use super::super::paths::PodPaths;
use super::shape::VmShape;

/// Paths inside the jail.
const KERNEL: &str = "/vmlinux";
const INITRAMFS: &str = "/initramfs.cpio.gz";
const RUN_DIR: &str = "/run";
const VSOCK: &str = "/run/v.sock";
const API: &str = "/run/api.sock";
const CONSOLE: &str = "/run/console.log";
const FS_SOCKET: &str = "/run/fs0.sock";
/// A warm start's template inside the jail.
const SNAPSHOT_DIR: &str = "/snapshot";
/// The virtio-fs tag of the pod's shared directory (named on the guest's command line).
const FS_TAG: &str = "bulkhead";
/// Size of the virtio-fs request queue (the VMM's default).
const FS_QUEUE_SIZE: u16 = 1024;
/// The guest's vsock context id (the only guest on its vsock device).
const GUEST_CID: u64 = 3;

/// `sun_path` of a Unix socket address, NUL included.
pub const SUN_PATH_MAX: usize = 108;

/// What the jail and VM documents are made of, for one pod.
#[derive(Debug, Clone)]
pub struct VmPlan<'a> {
    pub id: &'a str,
    pub kernel: &'a Path,
    pub initramfs: &'a Path,
    pub uid: u32,
    pub gid: u32,
    pub cgroup: PathBuf,
    pub netns: Option<PathBuf>,
    pub shape: VmShape,
    /// The guest's NICs, on taps the shim made in the pod's netns (`crate::network::attach_vm`).
    pub net: Vec<NetConfig>,
    /// A warm start: the template directory the VM is restored from (its `state` and `memory`).
    pub template: Option<&'a Path>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmLayout {
    /// `<state_dir>/<pod>/vm`
    pub dir: PathBuf,
    /// `<state_dir>/<pod>/shared`
    pub shared_dir: PathBuf,
}

impl VmLayout {
    pub fn new(paths: &PodPaths) -> Self {
        Self { dir: paths.dir.join("vm"), shared_dir: paths.dir.join("shared") }
    }

    pub fn virtiofsd_pid_file(&self) -> PathBuf {
        self.dir.join("virtiofsd.pid")
    }

    /// virtiofsd's listener, which the jailed VMM connects to.
    pub fn fs_socket(&self) -> PathBuf {
        self.host(FS_SOCKET)
    }

    pub fn chroot(&self) -> PathBuf {
        self.dir.join("root")
    }

    pub fn vm_json(&self) -> PathBuf {
        self.dir.join("vm.json")
    }

    pub fn jail_json(&self) -> PathBuf {
        self.dir.join("jail.json")
    }

    pub fn pid_file(&self) -> PathBuf {
        self.dir.join("vmm.pid")
    }

    fn host(&self, jail_path: &str) -> PathBuf {
        self.chroot().join(jail_path.trim_start_matches('/'))
    }

    /// The hybrid-vsock socket the shim dials the agent through.
    pub fn vsock_socket(&self) -> PathBuf {
        self.host(VSOCK)
    }

    pub fn api_socket(&self) -> PathBuf {
        self.host(API)
    }

    /// The guest's serial console, as the VMM writes it.
    pub fn console_log(&self) -> PathBuf {
        self.host(CONSOLE)
    }

    /// A restored VM's own settings (read by the VMM before it jails itself).
    pub fn restore_json(&self) -> PathBuf {
        self.dir.join("restore.json")
    }

    /// The arguments that start the VMM (after its path): booting `vm.json`, or restoring the
    /// template bound at `/snapshot` with `restore.json`.
    pub fn vmm_args(&self, plan: &VmPlan<'_>) -> Vec<String> {
        let start = match plan.template {
            None => Start::Boot { config: self.vm_json() },
            Some(_) => Start::Restore { snapshot: SNAPSHOT_DIR.into(), restore_config: self.restore_json() },
        };
        VmmCommand { start, jail: Some(self.jail_json()), log_json: false }.to_args()
    }

    /// What `delete` recognises the pod's VMM waiter by on its command line, booted or restored:
    /// its jail document, which is the pod's alone.
    pub fn vmm_identity(&self) -> Vec<String> {
        command_line::jail_identity(&self.jail_json()).to_vec()
    }

    /// A restored VM's settings: this pod's sockets and console in place of the template's.
    pub fn restore_config(&self, plan: &VmPlan<'_>) -> RestoreConfig {
        RestoreConfig {
            api_socket: Some(API.into()),
            serial_log: Some(CONSOLE.into()),
            vsock_uds_path: Some(VSOCK.into()),
            block: Vec::new(),
            net_taps: plan.net.iter().map(|n| n.tap.clone()).collect(),
            fs_sockets: vec![FS_SOCKET.into()],
            // Nothing is done between the restore and the guest's run: the VMM resumes at once.
            resume: true,
        }
    }

    pub fn jail_config(&self, plan: &VmPlan<'_>) -> JailConfig {
        let mut read_only = vec![
            JailFile { host: plan.kernel.to_owned(), jail: KERNEL.into() },
            JailFile { host: plan.initramfs.to_owned(), jail: INITRAMFS.into() },
        ];
        if let Some(template) = plan.template {
            for name in [STATE_FILE, MEMORY_FILE] {
                read_only.push(JailFile { host: template.join(name), jail: Path::new(SNAPSHOT_DIR).join(name) });
            }
        }
        JailConfig {
            id: plan.id.to_string(),
            chroot: self.chroot(),
            uid: plan.uid,
            gid: plan.gid,
            read_only,
            writable_dirs: vec![RUN_DIR.into()],
            cgroup: Some(plan.cgroup.clone()),
            netns: plan.netns.clone(),
            // The VMM opens its taps through /dev/net/tun inside the chroot.
            tun: !plan.net.is_empty(),
        }
    }

    pub fn vm_config(&self, plan: &VmPlan<'_>) -> VmConfig {
        VmConfig {
            kernel: Some(KERNEL.into()),
            initramfs: Some(INITRAMFS.into()),
            cmdline: Some(format!("{DEFAULT_CMDLINE} {SHARED_FS_PARAM}={FS_TAG}")),
            raw_guest: None,
            vcpus: plan.shape.vcpus,
            mem_mib: plan.shape.mem,
            serial_log: Some(CONSOLE.into()),
            vsock: Some(VsockConfig { uds_path: VSOCK.into(), guest_cid: GUEST_CID }),
            block: Vec::new(),
            fs: vec![FsConfig { tag: FS_TAG.into(), socket: FS_SOCKET.into(), queue_size: FS_QUEUE_SIZE }],
            net: plan.net.clone(),
            api_socket: Some(API.into()),
            // Memory the guest frees goes back to the host (and stops counting against the pod).
            balloon: Some(BalloonConfig { free_page_reporting: true }),
        }
    }

    /// Makes the directories and writes both documents. The chroot is root's and empty: the
    /// VMM adds its device node, mounts and writable dirs itself.
    pub fn create(&self, plan: &VmPlan<'_>) -> std::io::Result<()> {
        let too_long =
            [self.vsock_socket(), self.api_socket()].into_iter().find(|s| s.as_os_str().len() >= SUN_PATH_MAX);
        if let Some(socket) = too_long {
            return Err(std::io::Error::other(format!(
                "the VM socket {} exceeds {SUN_PATH_MAX} bytes; use a shorter state_dir",
                socket.display()
            )));
        }
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&self.dir)?;
        std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o700))?;
        std::fs::DirBuilder::new().mode(0o755).create(self.chroot())?;
        std::fs::DirBuilder::new().mode(0o755).create(self.host(RUN_DIR))?;
        let jail = serde_json::to_vec_pretty(&self.jail_config(plan)).map_err(std::io::Error::other)?;
        std::fs::write(self.jail_json(), jail)?;
        let vm = serde_json::to_vec_pretty(&self.vm_config(plan)).map_err(std::io::Error::other)?;
        std::fs::write(self.vm_json(), vm)?;
        if plan.template.is_some() {
            let run = serde_json::to_vec_pretty(&self.restore_config(plan)).map_err(std::io::Error::other)?;
            std::fs::write(self.restore_json(), run)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_vmm_api::command_line::Invocation;
    use bulkhead_vmm_api::config::LinkState;
    use bulkhead_vmm_api::memory::Mib;
    use std::os::unix::fs::MetadataExt;

    fn plan<'a>(kernel: &'a Path, initramfs: &'a Path) -> VmPlan<'a> {
        VmPlan {
            id: "sb1",
            kernel,
            initramfs,
            uid: 40_000,
            gid: 40_001,
            cgroup: "/bulkhead/sb1/sb1".into(),
            netns: Some("/var/run/netns/cni-1".into()),
            shape: VmShape { vcpus: 2, online: 2, mem: Mib(512), mem_start: Mib(512) },
            net: Vec::new(),
            template: None,
        }
    }

    #[test]
    fn a_vm_with_nics_gets_them_and_the_tun_device() {
        let dir = tempfile::tempdir().unwrap();
        let paths = PodPaths::new(dir.path(), "sb1").unwrap();
        let layout = VmLayout::new(&paths);
        let mut plan = plan(Path::new("/k"), Path::new("/i"));
        assert!(!layout.jail_config(&plan).tun, "no NICs, no tun device in the chroot");
        plan.net = vec![NetConfig {
            tap: "bhtap0".into(),
            mac: "02:00:00:00:00:01".into(),
            mtu: Some(1450),
            rate_limiter: None,
            link: LinkState::Up,
        }];
        layout.create(&plan).unwrap();
        assert!(JailConfig::from_file(&layout.jail_json()).unwrap().tun);
        let vm = VmConfig::from_file(&layout.vm_json()).unwrap();
        assert_eq!(vm.net, plan.net);
    }

    #[test]
    fn documents_are_what_the_vmm_accepts() {
        let dir = tempfile::tempdir().unwrap();
        let paths = PodPaths::new(dir.path(), "sb1").unwrap();
        let layout = VmLayout::new(&paths);
        let plan = plan(Path::new("/usr/share/bulkhead/vmlinux"), Path::new("/usr/share/bulkhead/initramfs.cpio.gz"));
        layout.create(&plan).unwrap();

        let jail = JailConfig::from_file(&layout.jail_json()).unwrap();
        assert_eq!(jail.chroot, layout.chroot());
        assert_eq!((jail.uid, jail.gid), (40_000, 40_001));
        assert_eq!(jail.cgroup.as_deref(), Some(Path::new("/bulkhead/sb1/sb1")));
        assert_eq!(jail.host_path(Path::new(VSOCK)), layout.vsock_socket());
        assert_eq!(jail.read_only[0].host, PathBuf::from("/usr/share/bulkhead/vmlinux"));

        let vm = VmConfig::from_file(&layout.vm_json()).unwrap();
        assert_eq!((vm.vcpus, vm.mem_mib), (2, Mib(512)));
        assert_eq!(vm.kernel.as_deref(), Some(Path::new(KERNEL)));
        assert_eq!(jail.host_path(vm.serial_log.as_deref().unwrap()), layout.console_log());
        assert_eq!(jail.host_path(vm.api_socket.as_deref().unwrap()), layout.api_socket());
        // Every path the VM config names is inside the jail: a read-only file or a writable dir.
        for p in [vm.kernel.unwrap(), vm.initramfs.unwrap()] {
            assert!(jail.read_only.iter().any(|f| f.jail == p), "{}", p.display());
        }
        assert_eq!(jail.host_path(&vm.fs[0].socket), layout.fs_socket());
        assert!(vm.cmdline.as_deref().unwrap().ends_with(" bulkhead.shared_fs=bulkhead"), "{:?}", vm.cmdline);
        assert_eq!(
            bulkhead_protocol::guest::shared_fs_tag(vm.cmdline.as_deref().unwrap()),
            Some(vm.fs[0].tag.as_str()),
            "the agent mounts the tag the VM's device has"
        );
        for p in [vm.serial_log.unwrap(), vm.api_socket.unwrap(), vm.vsock.unwrap().uds_path, vm.fs[0].socket.clone()] {
            assert!(jail.writable_dirs.iter().any(|d| p.starts_with(d)), "{}", p.display());
        }

        // The chroot is root's and not writable by others (the jail checks it).
        let meta = std::fs::metadata(layout.chroot()).unwrap();
        assert_eq!(meta.mode() & 0o022, 0);
        assert_eq!(std::fs::metadata(&layout.dir).unwrap().mode() & 0o777, 0o700);
        let args = layout.vmm_args(&plan);
        let Ok(Invocation::Run(command)) = VmmCommand::parse(&args) else { panic!("{args:?}") };
        assert_eq!(command.start, Start::Boot { config: layout.vm_json() });
        assert_eq!(command.jail, Some(layout.jail_json()));
        assert!(args.ends_with(&layout.vmm_identity()), "{args:?}");
        assert!(!layout.restore_json().exists(), "a cold start has no restore settings");
    }

    #[test]
    fn a_warm_start_binds_the_template_and_restores_with_the_pods_own_sockets() {
        let dir = tempfile::tempdir().unwrap();
        let paths = PodPaths::new(dir.path(), "sb1").unwrap();
        let layout = VmLayout::new(&paths);
        let template = dir.path().join("templates/k1");
        let mut plan = plan(Path::new("/k"), Path::new("/i"));
        plan.template = Some(&template);
        layout.create(&plan).unwrap();
        let jail = JailConfig::from_file(&layout.jail_json()).unwrap();
        for name in [STATE_FILE, MEMORY_FILE] {
            let bound = jail.read_only.iter().find(|f| f.host == template.join(name)).unwrap();
            assert_eq!(bound.jail, Path::new(SNAPSHOT_DIR).join(name));
        }
        let run = RestoreConfig::from_file(&layout.restore_json()).unwrap();
        assert_eq!(jail.host_path(run.vsock_uds_path.as_deref().unwrap()), layout.vsock_socket());
        assert_eq!(jail.host_path(run.api_socket.as_deref().unwrap()), layout.api_socket());
        assert_eq!(jail.host_path(run.serial_log.as_deref().unwrap()), layout.console_log());
        assert_eq!(run.fs_sockets.iter().map(|s| jail.host_path(s)).collect::<Vec<_>>(), vec![layout.fs_socket()]);
        let args = layout.vmm_args(&plan);
        let Ok(Invocation::Run(command)) = VmmCommand::parse(&args) else { panic!("{args:?}") };
        let restore = Start::Restore { snapshot: SNAPSHOT_DIR.into(), restore_config: layout.restore_json() };
        assert_eq!(command.start, restore);
        assert!(args.ends_with(&layout.vmm_identity()), "delete finds a restored VMM as a booted one: {args:?}");
    }

    #[test]
    fn socket_paths_must_fit() {
        let long = PathBuf::from("/").join("d".repeat(90));
        let paths = PodPaths::new(&long, "sb1").unwrap();
        let layout = VmLayout::new(&paths);
        let err = layout.create(&plan(Path::new("/k"), Path::new("/i"))).unwrap_err();
        assert!(err.to_string().contains("shorter state_dir"), "{err}");
        assert!(!long.exists(), "nothing is created when the paths do not fit");
    }

    #[test]
    fn default_state_dir_fits_a_64_char_pod_id() {
        let paths = PodPaths::new(Path::new("/run/bulkhead"), &"a".repeat(64)).unwrap();
        assert!(VmLayout::new(&paths).vsock_socket().as_os_str().len() < SUN_PATH_MAX);
    }
}
