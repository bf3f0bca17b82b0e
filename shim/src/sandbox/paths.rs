//! Host paths of a pod's state, shared by the running shim, `delete` after a crash, and
//! `bulkhead-ctl` (which reads the [`PodRecord`] and the console log).

use std::path::{Path, PathBuf};

use crate::config::Backend;

/// `<state_dir>/<sandbox id>/...`
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodPaths {
    pub dir: PathBuf,
}

impl PodPaths {
    /// `None` unless `sandbox_id` is a plain id (containerd's rule: `[A-Za-z0-9_.-]`, starting
    /// alphanumeric), so a pod directory can never be the state dir itself or outside it.
    pub fn new(state_dir: &Path, sandbox_id: &str) -> Option<Self> {
        bulkhead_protocol::stream::validate_id(sandbox_id).ok()?;
        Some(Self { dir: state_dir.join(sandbox_id) })
    }

    /// Makes the pod directory, mode 0700 whatever the umask (and whatever an earlier run left):
    /// it holds the agent's socket and the records teardown trusts, so it is root's alone, and the
    /// files inside need no mode of their own. The state dir above it is made 0711 if missing,
    /// and loses any group or other write bit: whoever can write it could plant a pod's
    /// directory, or `.ids`, before the shim makes it.
    pub fn create_dir(&self) -> std::io::Result<()> {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
        let private = |path: &Path, mode: u32| -> std::io::Result<()> {
            let meta = std::fs::symlink_metadata(path)?;
            if !meta.is_dir() {
                return Err(std::io::Error::other(format!("{} is not a directory", path.display())));
            }
            if meta.mode() & 0o7777 != mode {
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
            }
            Ok(())
        };
        if let Some(state_dir) = self.dir.parent() {
            std::fs::DirBuilder::new().recursive(true).mode(0o711).create(state_dir)?;
            let mode = std::fs::metadata(state_dir)?.mode() & 0o7777;
            if mode & 0o022 != 0 && mode & 0o1000 != 0 {
                // A shared sticky directory (/tmp) is not ours to close: say so, change nothing.
                tracing::warn!(dir = %state_dir.display(), "the state dir is a shared directory (mode {mode:o}): other users can plant names in it; configure a private state_dir");
            } else if mode & 0o022 != 0 {
                tracing::warn!(dir = %state_dir.display(), "the state dir was mode {mode:o}: no longer writable by others");
                private(state_dir, mode & !0o022)?;
            }
        }
        match std::fs::DirBuilder::new().mode(0o700).create(&self.dir) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
            _ => {}
        }
        private(&self.dir, 0o700)
    }

    /// The agent's hybrid-vsock Unix socket (short name: sun_path has 108 bytes).
    pub fn agent_socket(&self) -> PathBuf {
        self.dir.join("a.sock")
    }

    /// The namespace launcher's pid, for cleanup after a shim crash.
    pub fn pid_file(&self) -> PathBuf {
        self.dir.join("sandbox.pid")
    }

    /// The agent's own state (bundles, libcontainer state), per pod.
    pub fn agent_state_dir(&self) -> PathBuf {
        self.dir.join("agent")
    }

    /// The pod's cgroup parent, recorded for cleanup after a crash.
    pub fn cgroup_file(&self) -> PathBuf {
        self.dir.join("cgroup.json")
    }

    /// What the shim added to the pod's network namespace, for teardown (also after a crash).
    pub fn network_record(&self) -> PathBuf {
        self.dir.join("network.json")
    }

    /// Parent of the containers' rootfs mount points.
    pub fn rootfs_dir(&self) -> PathBuf {
        self.dir.join("rootfs")
    }

    /// Where the agent assembles a container's rootfs (same path on the host, unmounted).
    pub fn rootfs(&self, container_id: &str) -> PathBuf {
        self.rootfs_dir().join(container_id)
    }

    /// Where the pod's size-limited emptyDir volumes are mounted (`sandbox/emptydir`), each
    /// `<name>` below it; a private mount of its own, host-only.
    pub fn emptydir_dir(&self) -> PathBuf {
        self.dir.join("emptydir")
    }

    /// What the shim recorded about the pod for `bulkhead-ctl` ([`PodRecord`]).
    pub fn record_file(&self) -> PathBuf {
        self.dir.join("pod.json")
    }

    /// The guest console: the VM's serial output (`vm`), the agent's own output (`namespace`).
    pub fn console_log(&self) -> PathBuf {
        self.dir.join("console.log")
    }
}

/// The host processes behind a running sandbox.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HostPids {
    /// The process reported as the sandbox task (namespace: the launcher; vm: the VMM).
    pub sandbox: u32,
    pub vmm: Option<u32>,
    pub virtiofsd: Option<u32>,
}

/// What the pod's shim writes into the pod directory once its sandbox runs, so that
/// `bulkhead-ctl` can name and find the pod's processes without asking the shim.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PodRecord {
    pub sandbox_id: String,
    /// The Kubernetes pod name and namespace (CRI annotations; empty outside CRI).
    pub pod_name: String,
    pub pod_namespace: String,
    /// containerd's namespace (`k8s.io` under CRI).
    pub containerd_namespace: String,
    /// `vm` or `namespace`.
    pub backend: String,
    pub shim_pid: u32,
    pub pids: HostPids,
    pub started_at_unix: u64,
}

impl PodRecord {
    /// Upper bound for a record file: anything larger was not written by a shim.
    const MAX_BYTES: usize = 64 * 1024;

    /// Writes the record atomically (a reader never sees half of it).
    pub fn write(&self, paths: &PodPaths) -> std::io::Result<()> {
        let json = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        let tmp = paths.record_file().with_extension("json.tmp");
        std::fs::write(&tmp, json)?;
        std::fs::rename(&tmp, paths.record_file())
    }

    pub fn read(paths: &PodPaths) -> std::io::Result<Self> {
        let bytes = std::fs::read(paths.record_file())?;
        if bytes.len() > Self::MAX_BYTES {
            return Err(std::io::Error::other("pod record too large"));
        }
        serde_json::from_slice(&bytes).map_err(std::io::Error::other)
    }
}

/// What the shim records in each bundle at Create, so that `delete` (which gets no runtime
/// options) finds the pod's state after a crash.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BundleRecord {
    pub state_dir: PathBuf,
    pub sandbox_id: String,
    pub is_sandbox: bool,
    /// Which backend runs the pod, so `delete` tears down the right things.
    pub backend: Backend,
}

impl BundleRecord {
    pub const FILE: &'static str = "bulkhead.json";

    pub fn write(&self, bundle: &Path) -> std::io::Result<()> {
        let json = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        std::fs::write(bundle.join(Self::FILE), json)
    }

    pub fn read(bundle: &Path) -> std::io::Result<Self> {
        let bytes = std::fs::read(bundle.join(Self::FILE))?;
        if bytes.len() > 64 * 1024 {
            return Err(std::io::Error::other("bundle record too large"));
        }
        serde_json::from_slice(&bytes).map_err(std::io::Error::other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let record = BundleRecord {
            state_dir: "/run/bulkhead".into(),
            sandbox_id: "sb1".into(),
            is_sandbox: true,
            backend: Backend::Vm,
        };
        record.write(dir.path()).unwrap();
        assert_eq!(BundleRecord::read(dir.path()).unwrap(), record);
    }

    #[test]
    fn pod_record_round_trips_and_rejects_junk() {
        let dir = tempfile::tempdir().unwrap();
        let paths = PodPaths::new(dir.path(), "sb1").unwrap();
        std::fs::create_dir_all(&paths.dir).unwrap();
        let record = PodRecord {
            sandbox_id: "sb1".into(),
            pod_name: "web".into(),
            pod_namespace: "default".into(),
            containerd_namespace: "k8s.io".into(),
            backend: "namespace".into(),
            shim_pid: 10,
            pids: HostPids { sandbox: 11, vmm: None, virtiofsd: None },
            started_at_unix: 1_700_000_000,
        };
        record.write(&paths).unwrap();
        assert_eq!(PodRecord::read(&paths).unwrap(), record);
        std::fs::write(paths.record_file(), b"{not json").unwrap();
        assert!(PodRecord::read(&paths).is_err());
        std::fs::write(paths.record_file(), vec![b' '; 100_000]).unwrap();
        assert!(PodRecord::read(&paths).is_err());
    }

    #[test]
    fn the_pod_dir_is_0700_and_the_state_dir_not_writable_by_others() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let paths = PodPaths::new(&state, "sb1").unwrap();
        paths.create_dir().unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
        assert_eq!(mode(&paths.dir), 0o700);
        assert_eq!(mode(&state) & 0o022, 0);
        // What an earlier release (or a umask of 000) left is put right.
        std::fs::set_permissions(&paths.dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o777)).unwrap();
        paths.create_dir().unwrap();
        assert_eq!((mode(&state), mode(&paths.dir)), (0o755, 0o700));
        // A shared sticky directory (a state_dir of /tmp) is left as it is.
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o1777)).unwrap();
        paths.create_dir().unwrap();
        assert_eq!(mode(&state), 0o1777);
        // A link where the pod directory goes is not followed.
        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o755)).unwrap();
        let linked = PodPaths::new(&state, "sb2").unwrap();
        std::os::unix::fs::symlink(&elsewhere, &linked.dir).unwrap();
        assert!(linked.create_dir().is_err());
        assert_eq!(mode(&elsewhere), 0o755);
    }

    #[test]
    fn pod_dirs_stay_inside_the_state_dir() {
        let state = Path::new("/run/bulkhead");
        for bad in ["", ".", "..", "../x", "a/b", "/abs"] {
            assert!(PodPaths::new(state, bad).is_none(), "{bad:?}");
        }
        assert_eq!(PodPaths::new(state, "abc").unwrap().dir, state.join("abc"));
    }

    #[test]
    fn socket_path_fits_sun_path_for_default_state_dir() {
        let id = "a".repeat(64);
        let paths = PodPaths::new(Path::new("/run/bulkhead"), &id).unwrap();
        assert!(paths.agent_socket().as_os_str().len() < 108);
    }
}
