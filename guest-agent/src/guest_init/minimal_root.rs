//! Namespace mode: the agent's minimal root. Without a VM the agent would be root on the host's
//! whole filesystem; instead its first run, still single-threaded:
//! 1. binds its Unix listener, mode 0600 whatever the umask (the socket's directory is the
//!    shim's, 0700, and stays outside the root);
//! 2. unshares a mount namespace of its own (the launcher's, or a test proxy's, keeps the host's
//!    view) and makes every mount in it a slave: nothing it mounts reaches the host, while what
//!    the host mounts below a shared directory (the shim's view of the pod's container mounts)
//!    still reaches it;
//! 3. builds a tmpfs root ([`build`]) holding only its own binary (read-only, [`AGENT_EXE`];
//!    for a dynamically linked build also its loader and libraries, read-only: `loader`),
//!    a /proc of its own pid namespace, sysfs read-only with the host's cgroup hierarchies on
//!    /sys/fs/cgroup (it manages the containers' cgroups: read-only but for the pod's subtree,
//!    [`CgroupView`]), a read-only /dev of six nodes, its
//!    state dir (nosuid, nodev, noexec) and each `--share-dir`, both at their host paths so that
//!    the paths the shim sends mean the same inside; then makes the tmpfs itself read-only;
//! 4. pivot_root(2)s into it (not chroot: no way back up) and detaches the old root;
//! 5. executes itself again from there (`--in-minimal-root`, the listener as `--listen-fd`), so
//!    no mapping or descriptor of the host's filesystem stays in the agent, and `/proc/self/exe`
//!    (which the `__libcontainer` helper is started from) is the read-only bind inside. The run
//!    executed there is a child in a user namespace of its own, and this one only waits for it
//!    (`user_ns`): the root's mounts reach it locked, as built.
//!
//! The second run checks it is on that root ([`check_entered`]); capabilities are dropped next
//! (`crate::privileges`). Every mount goes through [`Syscall`], so the plan is unit-tested.

use std::convert::Infallible;
use std::ffi::{CString, OsString};
use std::os::fd::IntoRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use anyhow::Context;
use nix::mount::MsFlags as F;

use super::loader::{self, Entry};
use super::user_ns;
use crate::cli::{AgentOpts, Listen};
use crate::host_view::{cgroup_mount_points, CONTAINER_SYSFS};
use crate::syscall::{LinuxSyscall, Syscall};

/// Where the agent's binary is inside its root.
pub const AGENT_EXE: &str = "/bulkhead-agent";
/// The host's cgroup tree, kept at its own path.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// The root tmpfs's source name, by which the second run recognises its root in mountinfo.
const ROOT_SOURCE: &str = "bulkhead-agent-root";
/// The agent's device nodes: name, major, minor (all 0666, as a container gets them).
const DEVICES: [(&str, u64, u64); 6] =
    [("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0)];

/// What the root keeps of the host besides the fixed parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keep {
    /// The agent's binary, by its path in this mount namespace ([`own_binary`]).
    pub exe: PathBuf,
    /// What that binary needs to be executed (its loader and libraries; none if static).
    pub loader: Vec<Entry>,
    /// The agent's state dir: kept writable, but nosuid, nodev and noexec.
    pub state_dir: PathBuf,
    /// `--share-dir`s: kept as the host mounted them (the shim's view is read-only).
    pub share_dirs: Vec<PathBuf>,
    /// The host's cgroup tree as the agent (in its own user namespace) may use it.
    pub cgroups: CgroupView,
}

/// The host's cgroup tree as the agent keeps it. The agent serves from a user namespace of its
/// own (`user_ns`), to which a file's mode is all that counts, so the whole tree is read-only
/// ([`CgroupView::mounts`]) but for the pod's cgroup in each hierarchy the agent manages and what
/// is below it ([`PodCgroupDir`]); of the pod cgroup's own files those sealed (its limits, which
/// kubelet set) stay read-only too. The root also holds a sysfs with nothing mounted below it at
/// [`CONTAINER_SYSFS`], which containers get bound read-only as their /sys (a sysfs mount is
/// refused there: the pod's network namespace is the host user namespace's).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupView {
    /// Every mount at or below /sys/fs/cgroup (host paths, shallowest first): made read-only.
    pub mounts: Vec<PathBuf>,
    /// The pod's cgroup in each hierarchy: kept writable but for its sealed files.
    pub pods: Vec<PodCgroupDir>,
}

/// The pod's cgroup directory in one hierarchy (host path), and its files kept read-only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodCgroupDir {
    pub dir: PathBuf,
    pub sealed: Vec<String>,
}

/// The pod cgroup's files the agent may write: moving processes (v1: `tasks`), enabling
/// controllers for the containers' cgroups, freezing or killing its own pod, and PSI triggers.
const POD_WRITABLE: [&str; 7] = [
    "cgroup.procs",
    "cgroup.threads",
    "tasks",
    "cgroup.subtree_control",
    "cgroup.freeze",
    "cgroup.kill",
    "memory.reclaim",
];

impl PodCgroupDir {
    /// `dir` as it is now, sealing each file the owner may write that is not one the agent
    /// needs ([`POD_WRITABLE`]).
    pub fn of(dir: &Path) -> anyhow::Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let mut sealed = Vec::new();
        for entry in std::fs::read_dir(dir).with_context(|| format!("list the pod cgroup {}", dir.display()))? {
            let entry = entry.with_context(|| format!("list the pod cgroup {}", dir.display()))?;
            let meta = entry.metadata().with_context(|| format!("stat {}", entry.path().display()))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let needed = POD_WRITABLE.contains(&name.as_str()) || name.ends_with(".pressure");
            if meta.is_file() && meta.permissions().mode() & 0o200 != 0 && !needed {
                sealed.push(name);
            }
        }
        sealed.sort();
        Ok(Self { dir: dir.to_path_buf(), sealed })
    }
}

impl CgroupView {
    /// The view for the pod cgroup `pod` (absolute in each hierarchy): on cgroup v2 the one
    /// hierarchy, its controllers enabled down to the pod; on v1 each hierarchy libcgroups
    /// manages, the pod's directory made where it is missing (as libcgroups would, now that it
    /// cannot from inside). `mountinfo` is this process's.
    pub fn for_pod(pod: &Path, mountinfo: &str) -> anyhow::Result<Self> {
        check_kept(pod)?;
        anyhow::ensure!(pod.components().count() > 1, "the pod cgroup {} is the hierarchy's root", pod.display());
        let root = Path::new(CGROUP_ROOT);
        let hierarchies = match crate::cgroups::Hierarchy::detect().map_err(|e| anyhow::anyhow!("{e}"))? {
            crate::cgroups::Hierarchy::V2 => {
                user_ns::enable_controllers_down_to(root, pod);
                vec![root.to_path_buf()]
            }
            crate::cgroups::Hierarchy::V1 => {
                let supported =
                    libcgroups::v1::util::list_supported_mount_points().context("the cgroup v1 hierarchies")?;
                let mut points: Vec<PathBuf> = supported.values().cloned().collect();
                points.sort();
                points.dedup();
                for point in &points {
                    let dir = inside(point, pod);
                    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
                }
                if let Some(cpuset) = supported.get(&libcgroups::v1::ControllerType::CpuSet) {
                    fill_cpuset_down_to(cpuset, pod)?;
                }
                points
            }
        };
        let pods = hierarchies.iter().map(|h| PodCgroupDir::of(&inside(h, pod))).collect::<anyhow::Result<_>>()?;
        Ok(Self { mounts: cgroup_mount_points(mountinfo), pods })
    }
}

/// Gives each cgroup from the cpuset hierarchy's root (`point`) down to `pod` its parent's CPUs
/// and memory nodes where it has none, as libcgroups does for a container's ancestors: a new
/// cpuset cgroup starts empty, no process may join it so, and from inside the user namespace the
/// pod's own values are sealed and its ancestors read-only.
fn fill_cpuset_down_to(point: &Path, pod: &Path) -> anyhow::Result<()> {
    for file in ["cpuset.cpus", "cpuset.mems"] {
        let mut dir = point.to_path_buf();
        let read = |dir: &Path| {
            let path = dir.join(file);
            std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))
        };
        let mut parent = read(&dir)?;
        for part in pod.components().filter(|c| matches!(c, Component::Normal(_))) {
            dir.push(part);
            let own = read(&dir)?;
            if own.trim().is_empty() {
                let path = dir.join(file);
                std::fs::write(&path, parent.trim()).with_context(|| format!("write {}", path.display()))?;
            } else {
                parent = own;
            }
        }
    }
    Ok(())
}

impl Keep {
    pub fn from_opts(opts: &AgentOpts, exe: PathBuf, loader: Vec<Entry>, cgroups: CgroupView) -> Self {
        Self { exe, loader, state_dir: opts.state_dir.clone(), share_dirs: opts.share_dirs.clone(), cgroups }
    }

    /// Every kept directory with whether it is the state dir, shallowest first, so a deeper
    /// bind lands on top of a shallower one that contains it.
    fn ordered(&self) -> Vec<(&Path, bool)> {
        let mut dirs: Vec<(&Path, bool)> = self.share_dirs.iter().map(|d| (d.as_path(), false)).collect();
        dirs.push((&self.state_dir, true));
        dirs.sort_by_key(|(d, _)| d.components().count());
        dirs
    }
}

/// Where the new root is mounted before the pivot: a directory of the state dir (the kept
/// binds are not recursive, so it never appears inside the root).
pub fn mount_point(state_dir: &Path) -> PathBuf {
    state_dir.join(".root")
}

/// A kept directory is bound at its own path inside the root: it must be absolute and plain
/// (no `..`), so that path means one place on both sides.
pub fn check_kept(dir: &Path) -> anyhow::Result<()> {
    let plain = dir.is_absolute() && dir.components().all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    anyhow::ensure!(plain, "kept directory {} must be an absolute path without `..`", dir.display());
    Ok(())
}

/// `host_path` inside `root`.
fn inside(root: &Path, host_path: &Path) -> PathBuf {
    root.join(host_path.strip_prefix("/").unwrap_or(host_path))
}

fn mount(
    sys: &dyn Syscall,
    source: Option<&str>,
    target: &Path,
    fstype: Option<&str>,
    flags: F,
    data: Option<&str>,
) -> anyhow::Result<()> {
    sys.mount(source, target, fstype, flags, data)
        .with_context(|| format!("minimal root: mount {} on {}", source.unwrap_or("(flags)"), target.display()))
}

fn bind(sys: &dyn Syscall, source: &Path, target: &Path, flags: F) -> anyhow::Result<()> {
    let source = source.to_str().with_context(|| format!("{} is not UTF-8", source.display()))?;
    mount(sys, Some(source), target, None, F::MS_BIND | flags, None)
}

fn mkdir(sys: &dyn Syscall, path: &Path) -> anyhow::Result<()> {
    sys.mkdir_all(path).with_context(|| format!("minimal root: mkdir {}", path.display()))
}

/// Builds the minimal root at `root` (an existing directory): module docs, step 3.
pub fn build(root: &Path, keep: &Keep, sys: &dyn Syscall) -> anyhow::Result<()> {
    let hardened = F::MS_NOSUID | F::MS_NODEV | F::MS_NOEXEC;
    mount(sys, Some(ROOT_SOURCE), root, Some("tmpfs"), hardened, Some("mode=0755,size=1m"))?;

    // The agent's own binary, read-only: what the agent runs from after the pivot and what
    // starts each `__libcontainer` helper (runtime/: /proc/self/exe).
    let exe = inside(root, Path::new(AGENT_EXE));
    sys.write_file(&exe, b"").with_context(|| format!("minimal root: create {}", exe.display()))?;
    let read_only_file = F::MS_REMOUNT | F::MS_BIND | F::MS_RDONLY | F::MS_NOSUID | F::MS_NODEV;
    bind(sys, &keep.exe, &exe, F::empty())?;
    mount(sys, None, &exe, None, read_only_file, None)?;
    for entry in &keep.loader {
        match entry {
            Entry::Dir(dir) => mkdir(sys, &inside(root, dir))?,
            Entry::Symlink { link, target } => {
                let at = inside(root, link);
                sys.symlink(target, &at).with_context(|| format!("minimal root: symlink {}", at.display()))?
            }
            Entry::File(file) => {
                let at = inside(root, file);
                sys.write_file(&at, b"").with_context(|| format!("minimal root: create {}", at.display()))?;
                bind(sys, file, &at, F::empty())?;
                mount(sys, None, &at, None, read_only_file, None)?;
            }
        }
    }

    let proc = inside(root, Path::new("/proc"));
    mkdir(sys, &proc)?;
    mount(sys, Some("proc"), &proc, Some("proc"), hardened, None)?;

    // sysfs read-only (libcgroups and the huge page sizes read it); the host's cgroup
    // hierarchies on top, read-only but where the agent makes and steers the containers' cgroups.
    let sysfs = inside(root, Path::new("/sys"));
    mkdir(sys, &sysfs)?;
    mount(sys, Some("sysfs"), &sysfs, Some("sysfs"), hardened | F::MS_RDONLY, None)?;
    let cgroup_root = Path::new(CGROUP_ROOT);
    let cgroups = inside(root, cgroup_root);
    bind(sys, cgroup_root, &cgroups, F::MS_REC)?;
    let read_only = F::MS_REMOUNT | F::MS_BIND | F::MS_RDONLY | hardened;
    // A remount is the one mount's: each of the recursive bind's mounts is made read-only.
    for point in keep.cgroups.mounts.iter().filter(|p| p.starts_with(cgroup_root)) {
        mount(sys, None, &inside(root, point), None, read_only, None)?;
    }
    for pod in &keep.cgroups.pods {
        anyhow::ensure!(
            pod.dir.starts_with(cgroup_root),
            "pod cgroup {} is not below {CGROUP_ROOT}",
            pod.dir.display()
        );
        let at = inside(root, &pod.dir);
        bind(sys, &pod.dir, &at, F::empty())?;
        mount(sys, None, &at, None, F::MS_REMOUNT | F::MS_BIND | hardened, None)?;
        for name in &pod.sealed {
            let file = at.join(name);
            bind(sys, &pod.dir.join(name), &file, F::empty())?;
            mount(sys, None, &file, None, read_only, None)?;
        }
    }
    let container_sysfs = inside(root, Path::new(CONTAINER_SYSFS));
    mkdir(sys, &container_sysfs)?;
    mount(sys, Some("sysfs"), &container_sysfs, Some("sysfs"), hardened | F::MS_RDONLY, None)?;

    // /dev: the nodes the agent itself opens; containers get their own /dev from libcontainer.
    let dev = inside(root, Path::new("/dev"));
    mkdir(sys, &dev)?;
    mount(sys, Some("dev"), &dev, Some("tmpfs"), F::MS_NOSUID | F::MS_NOEXEC, Some("mode=0755,size=64k"))?;
    for (name, major, minor) in DEVICES {
        let node = dev.join(name);
        sys.mknod_char(&node, major, minor, 0o666)
            .with_context(|| format!("minimal root: mknod {}", node.display()))?;
    }
    mount(sys, None, &dev, None, F::MS_REMOUNT | F::MS_RDONLY | F::MS_NOSUID | F::MS_NOEXEC, None)?;

    for (dir, is_state) in keep.ordered() {
        check_kept(dir)?;
        // A kept directory below one of the loader's links would be made through it (outside the
        // root, before the pivot); a loader path below a kept directory would be hidden by it.
        let overlap = keep.loader.iter().find_map(|e| {
            let path = match e {
                Entry::Dir(_) => return None,
                Entry::Symlink { link, .. } => link,
                Entry::File(file) => file,
            };
            (dir.starts_with(path) || path.starts_with(dir)).then_some(path)
        });
        if let Some(path) = overlap {
            anyhow::bail!(
                "kept directory {} overlaps {}, which the agent's loader needs",
                dir.display(),
                path.display()
            );
        }
        let target = inside(root, dir);
        mkdir(sys, &target)?;
        // Not recursive: nothing mounted below it at this moment comes along (the root's own
        // mount point is one); later mounts propagate when the host's side is shared.
        bind(sys, dir, &target, F::empty())?;
        if is_state {
            mount(sys, None, &target, None, F::MS_REMOUNT | F::MS_BIND | hardened, None)?;
        }
    }

    mount(sys, None, root, None, F::MS_REMOUNT | F::MS_RDONLY | hardened, None)
}

/// Whether `/` in `mountinfo` (this process's view) is the minimal root's tmpfs.
pub fn on_minimal_root(mountinfo: &str) -> bool {
    mountinfo.lines().any(|line| {
        let Some((left, right)) = line.split_once(" - ") else { return false };
        let mut fs = right.split(' ');
        left.split(' ').nth(4) == Some("/") && fs.next() == Some("tmpfs") && fs.next() == Some(ROOT_SOURCE)
    })
}

/// The second run's check that it really runs inside its minimal root.
pub fn check_entered() -> anyhow::Result<()> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").context("read /proc/self/mountinfo")?;
    anyhow::ensure!(on_minimal_root(&mountinfo), "--in-minimal-root given, but / is not the agent's minimal root");
    Ok(())
}

/// The running binary's path in this mount namespace. /proc/self/exe itself cannot be the
/// source of a bind once the agent has a mount namespace of its own (the file's mount is the
/// old namespace's: EINVAL), so the path it names is bound, after checking it is still the file
/// that runs (an upgrade may have replaced it since).
pub fn own_binary() -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let path = std::fs::read_link("/proc/self/exe").context("read /proc/self/exe")?;
    let running = std::fs::metadata("/proc/self/exe").context("stat /proc/self/exe")?;
    let named = std::fs::metadata(&path).with_context(|| format!("stat {}", path.display()))?;
    anyhow::ensure!(
        (running.dev(), running.ino()) == (named.dev(), named.ino()),
        "{} is no longer the binary that runs (replaced since it started)",
        path.display()
    );
    Ok(path)
}

/// The first run's way in: module docs, steps 1 to 5. Returns only on failure.
pub fn enter(opts: &AgentOpts) -> anyhow::Result<Infallible> {
    let exe = own_binary()?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").context("read /proc/self/mountinfo")?;
    let cgroups = CgroupView::for_pod(&opts.cgroup_parent, &mountinfo)?;
    let keep = Keep::from_opts(opts, exe.clone(), loader::entries_for(&exe)?, cgroups);
    for (dir, _) in keep.ordered() {
        check_kept(dir)?;
    }
    std::fs::create_dir_all(&opts.state_dir).with_context(|| format!("create {}", opts.state_dir.display()))?;
    let listener = match &opts.listen {
        Listen::Unix(path) => Some(bind_listener(path)?),
        // Not a path: bound after the pivot as in a guest.
        Listen::Vsock => None,
    };
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).context("unshare a mount namespace")?;
    let sys = LinuxSyscall;
    mount(&sys, None, Path::new("/"), None, F::MS_REC | F::MS_SLAVE, None)?;
    let root = mount_point(&opts.state_dir);
    mkdir(&sys, &root)?;
    build(&root, &keep, &sys)?;
    sys.pivot_root(&root).with_context(|| format!("pivot_root into {}", root.display()))?;
    tracing::info!(state_dir = %opts.state_dir.display(), share_dirs = ?opts.share_dirs, "in the minimal root; re-executing");
    let exec = move || match exec_self(listener) {
        Err(e) => e,
        Ok(never) => match never {},
    };
    user_ns::serve_from_child(exec, listener)
}

/// Binds the agent's listener at `path` (replacing a stale socket, mode 0600) for the second run to serve:
/// returns its descriptor, left open across exec.
fn bind_listener(path: &Path) -> anyhow::Result<i32> {
    // Mode 0600 whatever the umask: the agent holds CAP_SYS_ADMIN on the host.
    let listener = crate::transport::bind_unix_std(path).with_context(|| format!("bind {}", path.display()))?;
    nix::fcntl::fcntl(&listener, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()))
        .context("keep the listener open across exec")?;
    Ok(listener.into_raw_fd())
}

/// Executes [`AGENT_EXE`] with this run's arguments and the markers of the second run.
fn exec_self(listener: Option<i32>) -> anyhow::Result<Infallible> {
    let cstring = |s: &[u8]| CString::new(s).context("argument with a NUL byte");
    let mut args: Vec<OsString> = std::env::args_os().skip(1).collect();
    args.push("--in-minimal-root".into());
    if let Some(fd) = listener {
        args.extend(["--listen-fd".into(), fd.to_string().into()]);
    }
    let program = cstring(AGENT_EXE.as_bytes())?;
    let mut argv = vec![program.clone()];
    for a in &args {
        argv.push(cstring(a.as_bytes())?);
    }
    let err = nix::unistd::execv(&program, &argv).unwrap_err();
    anyhow::bail!("execute {AGENT_EXE} in the minimal root: {err}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::syscall::test::{Call, RecordingSyscall};

    fn keep() -> Keep {
        Keep {
            exe: "/opt/bulkhead/bin/bulkhead-agent".into(),
            loader: vec![
                Entry::Dir("/lib64".into()),
                Entry::Symlink { link: "/lib64/ld.so".into(), target: "/usr/lib/ld.so".into() },
                Entry::Dir("/usr".into()),
                Entry::Dir("/usr/lib".into()),
                Entry::File("/usr/lib/ld.so".into()),
            ],
            state_dir: "/run/bh/pod1/agent".into(),
            share_dirs: vec!["/run/bh/pod1/view".into(), "/srv/shared".into()],
            cgroups: CgroupView::default(),
        }
    }

    fn mounts(calls: &[Call]) -> Vec<(Option<String>, PathBuf, F)> {
        calls
            .iter()
            .filter_map(|c| match c {
                Call::Mount { source, target, flags, .. } => Some((source.clone(), target.clone(), *flags)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_root_binds_only_what_the_agent_needs() {
        let sys = RecordingSyscall::default();
        let root = Path::new("/run/bh/pod1/agent/.root");
        build(root, &keep(), &sys).unwrap();
        let calls = sys.calls();
        // Every bind from the host's filesystem, and nothing else of it.
        let mut binds: Vec<String> = mounts(&calls)
            .into_iter()
            .filter(|(_, _, flags)| flags.contains(F::MS_BIND) && !flags.contains(F::MS_REMOUNT))
            .map(|(source, target, _)| format!("{} -> {}", source.unwrap_or_default(), target.display()))
            .collect();
        binds.sort();
        assert_eq!(
            binds,
            [
                "/opt/bulkhead/bin/bulkhead-agent -> /run/bh/pod1/agent/.root/bulkhead-agent",
                "/run/bh/pod1/agent -> /run/bh/pod1/agent/.root/run/bh/pod1/agent",
                "/run/bh/pod1/view -> /run/bh/pod1/agent/.root/run/bh/pod1/view",
                "/srv/shared -> /run/bh/pod1/agent/.root/srv/shared",
                "/sys/fs/cgroup -> /run/bh/pod1/agent/.root/sys/fs/cgroup",
                "/usr/lib/ld.so -> /run/bh/pod1/agent/.root/usr/lib/ld.so",
            ]
        );
        // The loader's links are links in the root, its files read-only binds.
        assert!(calls.contains(&Call::Symlink("/usr/lib/ld.so".into(), "/run/bh/pod1/agent/.root/lib64/ld.so".into())));
        assert!(mounts(&calls)
            .iter()
            .any(|(_, target, flags)| target == Path::new("/run/bh/pod1/agent/.root/usr/lib/ld.so")
                && flags.contains(F::MS_REMOUNT | F::MS_RDONLY)));
        // Fresh filesystems: the root tmpfs, proc, sysfs (read-only), /dev.
        let fresh: Vec<(String, F)> = calls
            .iter()
            .filter_map(|c| match c {
                Call::Mount { fstype: Some(t), target, flags, .. } => {
                    Some((format!("{t}:{}", target.strip_prefix(root).unwrap_or(target).display()), *flags))
                }
                _ => None,
            })
            .collect();
        let names: Vec<&str> = fresh.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["tmpfs:", "proc:proc", "sysfs:sys", "sysfs:container-sysfs", "tmpfs:dev"]);
        assert!(fresh[2].1.contains(F::MS_RDONLY), "sysfs is read-only");
        let nodes: Vec<String> = calls
            .iter()
            .filter_map(|c| match c {
                Call::Mknod { path, mode: 0o666, .. } => path.file_name().map(|n| n.to_string_lossy().into_owned()),
                _ => None,
            })
            .collect();
        assert_eq!(nodes, ["null", "zero", "full", "random", "urandom", "tty"]);
        // Only the cgroup hierarchies come along recursively: the kept directories bring none of
        // what is mounted below them now (the root's own mount point is below the state dir).
        for (source, _, flags) in mounts(&calls) {
            if flags.contains(F::MS_REC) && flags.contains(F::MS_BIND) {
                assert_eq!(source.as_deref(), Some("/sys/fs/cgroup"));
            }
        }
    }

    #[test]
    fn the_agent_writes_only_below_its_pod_cgroup_in_each_hierarchy() {
        let sys = RecordingSyscall::default();
        let root = Path::new("/r");
        // cgroup v1: a tmpfs of hierarchies; the pod's directory in two of them.
        let cgroups = CgroupView {
            mounts: ["/sys/fs/cgroup", "/sys/fs/cgroup/memory", "/sys/fs/cgroup/pids"].map(PathBuf::from).to_vec(),
            pods: vec![
                PodCgroupDir {
                    dir: "/sys/fs/cgroup/memory/kubepods/pod1".into(),
                    sealed: vec!["memory.limit_in_bytes".into()],
                },
                PodCgroupDir { dir: "/sys/fs/cgroup/pids/kubepods/pod1".into(), sealed: vec!["pids.max".into()] },
            ],
        };
        build(root, &Keep { cgroups, ..keep() }, &sys).unwrap();
        let all = mounts(&sys.calls());
        let at = |target: &str| -> Vec<F> {
            all.iter().filter(|(_, t, _)| t == Path::new(target)).map(|(_, _, f)| *f).collect()
        };
        let ro = F::MS_REMOUNT | F::MS_BIND | F::MS_RDONLY;
        let cgroup = at("/r/sys/fs/cgroup");
        assert!(cgroup[0].contains(F::MS_BIND | F::MS_REC) && cgroup[1].contains(ro), "{cgroup:?}");
        for hierarchy in ["/r/sys/fs/cgroup/memory", "/r/sys/fs/cgroup/pids"] {
            assert_eq!(at(hierarchy), [ro | F::MS_NOSUID | F::MS_NODEV | F::MS_NOEXEC], "{hierarchy}: each mount");
        }
        for (pod, limit) in [("memory", "memory.limit_in_bytes"), ("pids", "pids.max")] {
            let pod_dir = at(&format!("/r/sys/fs/cgroup/{pod}/kubepods/pod1"));
            assert_eq!(pod_dir.len(), 2, "{pod_dir:?}");
            assert!(pod_dir[0].contains(F::MS_BIND) && !pod_dir[1].contains(F::MS_RDONLY), "{pod}: writable");
            let sealed = at(&format!("/r/sys/fs/cgroup/{pod}/kubepods/pod1/{limit}"));
            assert!(sealed[0].contains(F::MS_BIND) && sealed[1].contains(ro), "{pod}: its own limit: {sealed:?}");
        }
        let order: Vec<&Path> = all.iter().map(|(_, t, _)| t.as_path()).collect();
        let first = |p: &str| order.iter().position(|t| *t == Path::new(p)).unwrap();
        assert!(first("/r/sys/fs/cgroup/pids") < first("/r/sys/fs/cgroup/memory/kubepods/pod1"));
        assert!(first("/r/sys/fs/cgroup/pids/kubepods/pod1") < first("/r/sys/fs/cgroup/pids/kubepods/pod1/pids.max"));
        let sysfs = all.iter().find(|(_, t, _)| t == Path::new("/r/container-sysfs")).unwrap();
        assert_eq!(sysfs.0.as_deref(), Some("sysfs"));
        assert!(sysfs.2.contains(F::MS_RDONLY | F::MS_NOSUID | F::MS_NODEV | F::MS_NOEXEC));

        // A pod directory outside the tree is refused, not bound.
        let stray = CgroupView { mounts: vec![], pods: vec![PodCgroupDir { dir: "/etc".into(), sealed: vec![] }] };
        assert!(build(root, &Keep { cgroups: stray, ..keep() }, &RecordingSyscall::default()).is_err());
    }

    #[test]
    fn empty_cpusets_down_to_the_pod_get_their_parents_values() {
        let root = tempfile::tempdir().unwrap();
        let at = |dir: &str, file: &str| root.path().join(dir).join(file);
        for (dir, cpus, mems) in [("", "0-3\n", "0\n"), ("kubepods", "\n", "\n"), ("kubepods/pod1", "", "")] {
            std::fs::create_dir_all(root.path().join(dir)).unwrap();
            std::fs::write(at(dir, "cpuset.cpus"), cpus).unwrap();
            std::fs::write(at(dir, "cpuset.mems"), mems).unwrap();
        }
        std::fs::write(at("kubepods", "cpuset.cpus"), "1-2\n").unwrap();
        fill_cpuset_down_to(root.path(), Path::new("/kubepods/pod1")).unwrap();
        assert_eq!(
            std::fs::read_to_string(at("kubepods/pod1", "cpuset.cpus")).unwrap(),
            "1-2",
            "the nearest set value"
        );
        assert_eq!(std::fs::read_to_string(at("kubepods", "cpuset.mems")).unwrap(), "0");
        assert_eq!(std::fs::read_to_string(at("kubepods/pod1", "cpuset.mems")).unwrap(), "0");
        assert!(fill_cpuset_down_to(root.path(), Path::new("/kubepods/missing")).is_err());
    }

    #[test]
    fn the_pod_cgroup_files_sealed_are_those_the_agent_has_no_use_for() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        for (name, mode) in [
            ("cgroup.procs", 0o644),
            ("tasks", 0o644),
            ("cgroup.subtree_control", 0o644),
            ("cgroup.kill", 0o200),
            ("memory.pressure", 0o644),
            ("memory.max", 0o644),
            ("memory.limit_in_bytes", 0o644),
            ("cgroup.max.descendants", 0o644),
            ("memory.current", 0o444),
        ] {
            let path = dir.path().join(name);
            std::fs::write(&path, "").unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        std::fs::create_dir(dir.path().join("ctr1")).unwrap();
        let PodCgroupDir { sealed, .. } = PodCgroupDir::of(dir.path()).unwrap();
        assert_eq!(
            sealed,
            ["cgroup.max.descendants", "memory.limit_in_bytes", "memory.max"],
            "read-only files and child cgroups need no seal"
        );
        assert!(PodCgroupDir::of(&dir.path().join("missing")).is_err());
        let mountinfo = "";
        assert!(CgroupView::for_pod(Path::new("/"), mountinfo).is_err(), "the whole hierarchy is not a pod");
        assert!(CgroupView::for_pod(Path::new("/a/../b"), mountinfo).is_err());
    }

    #[test]
    fn the_binary_dev_state_and_root_end_up_read_only_or_hardened() {
        let sys = RecordingSyscall::default();
        let root = Path::new("/s/.root");
        let keep = Keep {
            exe: "/a".into(),
            loader: vec![],
            state_dir: "/s".into(),
            share_dirs: vec![],
            cgroups: CgroupView::default(),
        };
        build(root, &keep, &sys).unwrap();
        let remounts: Vec<(PathBuf, F)> = mounts(&sys.calls())
            .into_iter()
            .filter(|(_, _, f)| f.contains(F::MS_REMOUNT))
            .map(|(_, target, flags)| (target, flags))
            .collect();
        let flags_of = |p: &str| remounts.iter().find(|(t, _)| t == Path::new(p)).map(|(_, f)| *f).unwrap();
        assert!(flags_of("/s/.root/bulkhead-agent").contains(F::MS_RDONLY | F::MS_NOSUID));
        assert!(flags_of("/s/.root/dev").contains(F::MS_RDONLY));
        let state = flags_of("/s/.root/s");
        assert!(state.contains(F::MS_NOSUID | F::MS_NODEV | F::MS_NOEXEC) && !state.contains(F::MS_RDONLY));
        // The root itself last of all: read-only, once everything is in place.
        assert_eq!(remounts.last().unwrap().0, root);
        assert!(remounts.last().unwrap().1.contains(F::MS_RDONLY | F::MS_NODEV));
        assert!(!sys.calls().iter().any(|c| matches!(c, Call::PivotRoot(_))), "build never pivots");
    }

    #[test]
    fn a_state_dir_inside_a_share_dir_is_bound_after_it() {
        let sys = RecordingSyscall::default();
        let keep = Keep {
            exe: "/a".into(),
            loader: vec![],
            state_dir: "/t/a/state".into(),
            share_dirs: vec!["/t/a".into()],
            cgroups: CgroupView::default(),
        };
        build(Path::new("/t/a/state/.root"), &keep, &sys).unwrap();
        let order: Vec<Option<String>> = mounts(&sys.calls())
            .into_iter()
            .filter(|(s, _, f)| f.contains(F::MS_BIND) && s.as_deref().is_some_and(|s| s.starts_with("/t")))
            .map(|(s, _, _)| s)
            .collect();
        assert_eq!(order, [Some("/t/a".to_string()), Some("/t/a/state".to_string())]);
    }

    #[test]
    fn kept_directories_must_be_plain_absolute_paths() {
        check_kept(Path::new("/run/bh/pod/view")).unwrap();
        for bad in ["relative/dir", "/run/../etc", "run", ""] {
            assert!(check_kept(Path::new(bad)).is_err(), "{bad:?}");
        }
        let sys = RecordingSyscall::default();
        let keep = Keep {
            exe: "/a".into(),
            loader: vec![],
            state_dir: "/s".into(),
            share_dirs: vec!["/a/../etc".into()],
            cgroups: CgroupView::default(),
        };
        assert!(build(Path::new("/s/.root"), &keep, &sys).is_err());
    }

    #[test]
    fn kept_directories_stay_clear_of_the_loaders_paths() {
        let loader = vec![
            Entry::Symlink { link: "/lib".into(), target: "usr/lib".into() },
            Entry::Dir("/usr".into()),
            Entry::File("/usr/lib/libc.so.6".into()),
        ];
        for (dir, fine) in
            [("/run/bh/state", true), ("/usr/local/state", true), ("/lib/bh", false), ("/usr/lib", false)]
        {
            let keep = Keep {
                exe: "/a".into(),
                loader: loader.clone(),
                state_dir: dir.into(),
                share_dirs: vec![],
                cgroups: CgroupView::default(),
            };
            let built = build(Path::new("/r"), &keep, &RecordingSyscall::default());
            assert_eq!(built.is_ok(), fine, "{dir}: {built:?}");
        }
    }

    #[test]
    fn the_second_run_recognises_its_root() {
        let inside = "310 290 0:95 / / ro,nosuid,nodev,noexec - tmpfs bulkhead-agent-root ro,size=1024k,mode=755\n\
                      311 310 0:96 / /proc rw - proc proc rw";
        assert!(on_minimal_root(inside));
        let host = "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n\
                    40 27 0:50 / /mnt rw - tmpfs bulkhead-agent-root rw";
        assert!(!on_minimal_root(host), "the root tmpfs mounted elsewhere is not /");
        assert!(!on_minimal_root("20 1 0:5 / / rw - tmpfs tmpfs rw"));
        assert!(!on_minimal_root(""));
    }
}
