//! Namespace mode: what a container sees of the host kernel's own interfaces. Without a VM,
//! `/proc/sys` and the cgroup files are the host's, and root in a container is root there.
//!
//! - **/proc**: kubelet sends the masked and read-only /proc paths with every container, but
//!   containerd adds none of its own when a CRI client sends none, and a writable
//!   `/proc/sys/kernel/core_pattern` is host root. [`keep_proc_read_only`] adds containerd's
//!   default lists to whatever the spec has (privileged containers, which runc gives neither, are
//!   refused on this backend anyway: `crate::privileges`).
//! - **cgroups**: libcontainer 0.7 mounts each cgroup v1 hierarchy into the container read-write,
//!   ignoring the spec's `ro` (the named `systemd` hierarchy at its root, where a container could
//!   move any host process); with them a container could lift its own limits. Once the container
//!   is created and before it starts, [`seal_cgroup_mounts`] remounts everything at and below
//!   /sys/fs/cgroup read-only in its mount namespace, as the spec asks.
//! - **/sys**: an agent in a user namespace of its own (`guest_init::user_ns`) may not
//!   mount a sysfs (the pod's network namespace belongs to the host's user namespace), so
//!   [`bind_sysfs`] makes the spec's sysfs mount a read-only bind of the one the agent's root keeps
//!   for them ([`CONTAINER_SYSFS`]), mounted in the pod's network namespace, read-only
//!   and locked so, with nothing mounted below it.

use std::path::{Path, PathBuf};

use nix::mount::MsFlags;
use oci_spec::runtime::Spec;

use crate::error::{AgentError, Result};

/// The sysfs containers get as /sys from an agent in its own user namespace: the agent's root
/// (`guest_init::minimal_root`) keeps it at this path.
pub const CONTAINER_SYSFS: &str = "/container-sysfs";

/// containerd's default masked paths (`oci.populateDefaultUnixSpec`).
const MASKED: [&str; 12] = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/interrupts",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];
/// containerd's default read-only paths.
const READ_ONLY: [&str; 6] = ["/proc/asound", "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"];
/// Where the container's cgroup hierarchies are mounted.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// Adds containerd's default masked and read-only paths to the spec's own (module docs).
pub fn keep_proc_read_only(spec: &mut Spec) {
    let mut linux = spec.linux().clone().unwrap_or_default();
    let union = |have: Option<Vec<String>>, add: &[&str]| {
        let mut paths = have.unwrap_or_default();
        for path in add {
            if !paths.iter().any(|p| p == path) {
                paths.push((*path).to_string());
            }
        }
        Some(paths)
    };
    linux.set_masked_paths(union(linux.masked_paths().clone(), &MASKED));
    linux.set_readonly_paths(union(linux.readonly_paths().clone(), &READ_ONLY));
    spec.set_linux(Some(linux));
}

/// Turns each sysfs mount of the spec into a read-only bind of `source`: the sysfs the agent keeps
/// for containers (module docs), or in a VM the guest's own /sys for a container in a pod's user
/// namespace (the kernel mounts a sysfs only for the user namespace that owns the network
/// namespace, the guest's). Returns how many it changed.
pub fn bind_sysfs(spec: &mut Spec, source: &Path) -> usize {
    let Some(mounts) = spec.mounts_mut().as_mut() else { return 0 };
    let mut changed = 0;
    for m in mounts.iter_mut().filter(|m| m.typ().as_deref() == Some("sysfs")) {
        m.set_typ(Some("bind".into()));
        m.set_source(Some(source.to_path_buf()));
        // Recursive: a bind of a mount with submounts (the guest's /sys has its cgroup2) that a
        // user namespace did not make is refused otherwise, as it would uncover them.
        let options = ["rbind", "ro", "nosuid", "nodev", "noexec"].map(String::from).to_vec();
        m.set_options(Some(options));
        changed += 1;
    }
    changed
}

/// Whether the spec mounts the cgroup hierarchies read-only (every container but a privileged
/// one, which this backend refuses).
pub fn wants_read_only_cgroups(spec: &Spec) -> bool {
    spec.mounts()
        .iter()
        .flatten()
        .any(|m| m.destination() == Path::new(CGROUP_ROOT) && m.options().iter().flatten().any(|o| o == "ro"))
}

/// The mount points at or below /sys/fs/cgroup in a `/proc/<pid>/mountinfo`, shallowest first
/// (mount point is the fifth field, with octal escapes for space and friends).
pub(crate) fn cgroup_mount_points(mountinfo: &str) -> Vec<PathBuf> {
    let mut points: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(unescape)
        .map(PathBuf::from)
        .filter(|p| p.starts_with(CGROUP_ROOT))
        .collect();
    points.sort_by_key(|p| p.components().count());
    points.dedup();
    points
}

/// mountinfo's `\040`-style escapes.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() && bytes[i + 1..i + 4].iter().all(|b| (b'0'..=b'7').contains(b)) {
            let value = bytes[i + 1..i + 4].iter().fold(0u32, |v, b| v * 8 + u32::from(b - b'0'));
            if let Ok(byte) = u8::try_from(value) {
                out.push(byte);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Remounts every mount at or below /sys/fs/cgroup in the mount namespace of `pid` (a created,
/// not yet started, container's init) read-only, keeping nosuid, nodev and noexec. Returns how
/// many it remounted. Runs on a thread of its own: entering another mount namespace changes
/// the thread's root, which no runtime thread may keep.
pub fn seal_cgroup_mounts(pid: i32) -> Result<usize> {
    let fail = |what: String| AgentError::Internal(format!("cgroup mounts of pid {pid}: {what}"));
    let mountinfo =
        std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).map_err(|e| fail(format!("read mountinfo: {e}")))?;
    let points = cgroup_mount_points(&mountinfo);
    if points.is_empty() {
        return Ok(0);
    }
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/mnt")).map_err(|e| fail(format!("open ns/mnt: {e}")))?;
    let sealed = std::thread::spawn(move || -> std::result::Result<usize, String> {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_FS).map_err(|e| format!("unshare(CLONE_FS): {e}"))?;
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNS).map_err(|e| format!("setns: {e}"))?;
        for point in &points {
            let flags = MsFlags::MS_REMOUNT
                | MsFlags::MS_BIND
                | MsFlags::MS_RDONLY
                | MsFlags::MS_NOSUID
                | MsFlags::MS_NODEV
                | MsFlags::MS_NOEXEC;
            nix::mount::mount(None::<&str>, point, None::<&str>, flags, None::<&str>)
                .map_err(|e| format!("remount {} read-only: {e}", point.display()))?;
        }
        Ok(points.len())
    })
    .join()
    .map_err(|_| fail("the remount thread panicked".into()))?;
    sealed.map_err(fail)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: serde_json::Value) -> Spec {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn the_default_proc_paths_are_added_to_what_the_spec_has() {
        let mut bare = spec(serde_json::json!({"ociVersion": "1.0.2", "linux": {}}));
        keep_proc_read_only(&mut bare);
        let linux = bare.linux().as_ref().unwrap();
        assert!(linux.readonly_paths().as_ref().unwrap().contains(&"/proc/sys".to_string()));
        assert!(linux.masked_paths().as_ref().unwrap().contains(&"/proc/kcore".to_string()));

        let mut own = spec(serde_json::json!({"ociVersion": "1.0.2", "linux": {
            "readonlyPaths": ["/proc/sys", "/proc/custom"], "maskedPaths": ["/proc/kcore"]}}));
        keep_proc_read_only(&mut own);
        let linux = own.linux().as_ref().unwrap();
        let ro = linux.readonly_paths().as_ref().unwrap();
        assert_eq!(ro.iter().filter(|p| *p == "/proc/sys").count(), 1, "no duplicates: {ro:?}");
        assert!(ro.contains(&"/proc/custom".to_string()), "the spec's own stay: {ro:?}");
        assert_eq!(ro.len(), READ_ONLY.len() + 1);
        assert_eq!(linux.masked_paths().as_ref().unwrap().len(), MASKED.len());
    }

    #[test]
    fn read_only_cgroups_follow_the_specs_mount_options() {
        let with = |options: serde_json::Value| {
            spec(serde_json::json!({"ociVersion": "1.0.2", "mounts": [
                {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup", "options": options}]}))
        };
        assert!(wants_read_only_cgroups(&with(serde_json::json!(["nosuid", "ro"]))));
        assert!(!wants_read_only_cgroups(&with(serde_json::json!(["nosuid", "rw"]))));
        assert!(!wants_read_only_cgroups(&spec(serde_json::json!({"ociVersion": "1.0.2"}))));
    }

    #[test]
    fn cgroup_mount_points_are_found_shallowest_first() {
        let mountinfo = "\
120 119 0:48 / /proc rw,nosuid - proc proc rw
125 124 0:51 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs rw,mode=755
129 125 0:32 /bulkhead/p/c /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
134 125 0:37 / /sys/fs/cgroup/cpu\\054cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
135 124 0:22 / /sys/fs/cgroupx rw - tmpfs tmpfs rw
bad line
";
        let points = cgroup_mount_points(mountinfo);
        assert_eq!(
            points,
            [
                PathBuf::from("/sys/fs/cgroup"),
                PathBuf::from("/sys/fs/cgroup/memory"),
                PathBuf::from("/sys/fs/cgroup/cpu,cpuacct")
            ]
        );
        assert_eq!(unescape("a\\040b\\"), "a b\\");
    }

    #[test]
    fn a_sysfs_mount_becomes_a_read_only_bind_of_the_agents_sys() {
        let mut s = spec(serde_json::json!({"ociVersion": "1.0.2", "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "rw"]}]}));
        assert_eq!(bind_sysfs(&mut s, Path::new(CONTAINER_SYSFS)), 1);
        let mounts = s.mounts().clone().unwrap();
        assert_eq!(mounts[0].typ().as_deref(), Some("proc"), "other mounts stay as they were");
        let sys = &mounts[1];
        assert_eq!((sys.typ().as_deref(), sys.source().as_deref()), (Some("bind"), Some(Path::new(CONTAINER_SYSFS))));
        let options = sys.options().clone().unwrap();
        assert!(options.iter().any(|o| o == "ro") && !options.iter().any(|o| o == "rw"), "{options:?}");
        assert_eq!(bind_sysfs(&mut spec(serde_json::json!({"ociVersion": "1.0.2"})), Path::new("/sys")), 0);
    }
}
