//! The pod's cgroups on the host, and which of them the pod owns.
//!
//! The agent puts every container at `<parent>/<container id>` in each hierarchy, and the
//! sandbox (launcher and agent) lives at `<parent>/<sandbox id>`. Who owns `parent` is decided
//! once, from the sandbox spec's `linux.cgroupsPath` (see [`PodCgroup::for_pod`]):
//! - **Caller's**: kubelet's per-pod cgroup (cgroupfs driver: `<pod cgroup>/<sandbox id>`), or a
//!   parent an operator named. The caller removes it; the pod may share it with nothing of ours
//!   to delete, so teardown removes only the sandbox's cgroup and the containers' cgroups this
//!   pod created, by name, and never walks the parent.
//!   With the systemd cgroup driver (EKS, kubeadm), containerd passes `slice:prefix:name`, e.g.
//!   `kubepods-burstable-pod<uid>.slice:cri-containerd:<sandbox id>`: the parent is kubelet's
//!   pod slice, expanded to its cgroupfs path as systemd lays slices out
//!   (`/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice`, runc's rule),
//!   and the sandbox's cgroup is the scope `<prefix>-<name>.scope` in it, where runc would put
//!   the pause container. Where systemd is PID 1 the scope is also made a systemd unit
//!   ([`systemd_scope`]), as runc does, so systemd knows what lives in its slice.
//! - **The shim's**: `/bulkhead/<sandbox id>` when the pod has no parent of its own (containerd's
//!   default `/<namespace>/<sandbox id>`, which crictl pods get and which every such pod shares),
//!   an empty path, or one that is neither a plain absolute path nor a valid systemd one. The
//!   whole subtree is this pod's, so teardown removes all of it.
//!
//! When the agent dies abruptly nobody else removes the containers' cgroups, so the sandbox's
//! teardown does, within a fixed time budget: a cgroup that stays busy is reported, never
//! waited for, because containerd's Delete must not time out.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

/// Where the shim puts pods that have no cgroup of their own.
const OWN_ROOT: &str = "/bulkhead";
/// Most containers recorded per pod (pods restart containers; the record stays small).
const MAX_RECORDED: usize = 4096;
/// Largest cgroup record read back (4096 ids of up to 128 bytes, with room to spare).
const MAX_RECORD_BYTES: u64 = 1 << 20;

/// Who removes the pod's cgroup parent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ParentOwner {
    /// kubelet (or the operator) made it and removes it.
    Caller,
    /// The shim made it for this pod alone and removes it with everything below.
    Shim,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PodCgroup {
    /// Absolute path inside each hierarchy.
    pub parent: PathBuf,
    pub owner: ParentOwner,
    pub sandbox_id: String,
    /// The sandbox cgroup's name in `parent`, where it is not the sandbox id (a systemd scope).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_name: Option<String>,
    /// Containers whose cgroups this pod created below a caller's parent.
    #[serde(default)]
    pub containers: BTreeSet<String>,
}

/// `a-b-c.slice` as systemd lays it out in the cgroup tree: `/a.slice/a-b.slice/a-b-c.slice`
/// (`-.slice` is the root). `None` for anything that is not a valid slice name, runc's rules:
/// ends in `.slice`, no `/`, no empty part between dashes.
pub fn expand_slice(slice: &str) -> Option<PathBuf> {
    let name = slice.strip_suffix(".slice")?;
    if slice == "-.slice" {
        return Some(PathBuf::from("/"));
    }
    if name.is_empty() || name.contains('/') || name.split('-').any(str::is_empty) {
        return None;
    }
    let mut path = PathBuf::from("/");
    let mut prefix = String::new();
    for part in name.split('-') {
        if !prefix.is_empty() {
            prefix.push('-');
        }
        prefix.push_str(part);
        path.push(format!("{prefix}.slice"));
    }
    Some(path)
}

/// A systemd-driver cgroups path, `slice:prefix:name`: the slice's cgroupfs path and the scope's
/// name in it. `None` unless every part is plain.
fn systemd_path(path: &str) -> Option<(PathBuf, String)> {
    let mut parts = path.split(':');
    let (slice, prefix, name) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || !plain_name(prefix) || !plain_name(name) || prefix.contains('.') {
        return None;
    }
    let parent = expand_slice(slice)?;
    plain_absolute(&parent).then(|| (parent, format!("{prefix}-{name}.scope")))
}

/// Whether systemd manages this host's cgroups (it is PID 1): then scopes are its units.
pub fn systemd_is_init() -> bool {
    Path::new("/run/systemd/system").is_dir()
}

/// Makes `scope` (holding `pid`) a transient systemd unit in `slice`, through systemd's D-Bus
/// API as runc's systemd driver does (`busctl`, systemd's own client, so no D-Bus library).
/// Best effort: the cgroup exists either way; systemd only learns who lives in its slice.
pub fn systemd_scope(slice: &str, scope: &str, pid: u32) -> Result<(), String> {
    let out = std::process::Command::new("busctl")
        .args(systemd_scope_args(slice, scope, pid))
        .output()
        .map_err(|e| format!("busctl: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("busctl StartTransientUnit {scope}: {}", String::from_utf8_lossy(&out.stderr).trim()))
    }
}

fn systemd_scope_args(slice: &str, scope: &str, pid: u32) -> Vec<String> {
    [
        "call",
        "org.freedesktop.systemd1",
        "/org/freedesktop/systemd1",
        "org.freedesktop.systemd1.Manager",
        "StartTransientUnit",
        "ssa(sv)a(sa(sv))",
        scope,
        "replace",
        "4",
        "Slice",
        "s",
        slice,
        "Description",
        "s",
        "bulkhead pod sandbox",
        "Delegate",
        "b",
        "true",
        "PIDs",
        "au",
        "1",
        &pid.to_string(),
        "0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// A cgroupfs path the shim may use: absolute, plain components, not the root.
fn plain_absolute(path: &Path) -> bool {
    path.is_absolute()
        && path.components().count() > 1
        && path.components().all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
}

/// A single plain path component (an id), so `<parent>/<id>` stays a child of `parent`.
fn plain_name(id: &str) -> bool {
    let mut components = Path::new(id).components();
    matches!(components.next(), Some(Component::Normal(_))) && components.next().is_none()
}

impl PodCgroup {
    /// Decides the pod's parent from the sandbox spec's `linux.cgroupsPath`. `namespace` is the
    /// containerd namespace: `/<namespace>/<sandbox id>` is what containerd uses when the pod
    /// names no parent, a parent shared by all such pods, so the shim makes its own instead.
    pub fn for_pod(sandbox_id: &str, namespace: &str, spec_cgroups_path: Option<&str>) -> Self {
        let own = || Self {
            parent: Path::new(OWN_ROOT).join(sandbox_id),
            owner: ParentOwner::Shim,
            sandbox_id: sandbox_id.to_string(),
            sandbox_name: None,
            containers: BTreeSet::new(),
        };
        let Some(text) = spec_cgroups_path.filter(|p| !p.is_empty()) else {
            return own();
        };
        if text.contains(':') {
            return match systemd_path(text) {
                Some((parent, scope)) if plain_name(sandbox_id) => Self {
                    parent,
                    owner: ParentOwner::Caller,
                    sandbox_id: sandbox_id.to_string(),
                    sandbox_name: Some(scope),
                    containers: BTreeSet::new(),
                },
                _ => {
                    warn!(cgroups_path = text, "sandbox cgroupsPath is not a valid systemd path; using the shim's own");
                    own()
                }
            };
        }
        let path = Path::new(text);
        let shared_default = Path::new("/").join(namespace).join(sandbox_id);
        let given = path
            .parent()
            .filter(|parent| plain_absolute(parent) && plain_absolute(path) && plain_name(sandbox_id))
            .filter(|_| path.file_name() == Some(sandbox_id.as_ref()))
            .filter(|_| path != shared_default);
        match given {
            Some(parent) => Self {
                parent: parent.to_path_buf(),
                owner: ParentOwner::Caller,
                sandbox_id: sandbox_id.to_string(),
                sandbox_name: None,
                containers: BTreeSet::new(),
            },
            None => {
                if path != shared_default {
                    warn!(cgroups_path = %path.display(), "sandbox cgroupsPath is not cgroupfs style; using the shim's own");
                }
                own()
            }
        }
    }

    /// The sandbox's own cgroup, where the launcher and agent live: `<parent>/<sandbox id>`
    /// (for kubelet pods exactly the sandbox spec's `linux.cgroupsPath`), or its systemd scope.
    pub fn sandbox(&self) -> PathBuf {
        self.parent.join(self.sandbox_name.as_deref().unwrap_or(&self.sandbox_id))
    }

    /// The slice and scope names, when the sandbox's cgroup is a systemd scope.
    pub fn systemd_unit(&self) -> Option<(String, &str)> {
        let scope = self.sandbox_name.as_deref()?;
        let slice = self.parent.file_name()?.to_str()?.to_string();
        Some((slice, scope))
    }

    /// The pod's process limit on the host: the lowest `pids.max` on the way from `parent` (kubelet's
    /// pod cgroup, where podPidsLimit lands) up to the root of the pids hierarchy. The host's
    /// limit counts only the pod's host processes, so a vm pod carries it into its guest.
    pub fn pids_limit(&self) -> Option<u64> {
        if !plain_absolute(&self.parent) {
            return None;
        }
        cgroup_mounts().iter().filter(|mount| has_pids(mount)).find_map(|mount| lowest_pids_max(mount, &self.parent))
    }

    /// Records that a container's cgroup `<parent>/<id>` is this pod's. Returns false (and
    /// records nothing) for an id that is not a plain name.
    pub fn add_container(&mut self, id: &str) -> bool {
        if !plain_name(id) {
            return false;
        }
        if self.containers.len() < MAX_RECORDED {
            self.containers.insert(id.to_string());
        }
        true
    }

    /// The cgroups this pod owns, each removed with everything below it.
    fn owned(&self) -> Vec<PathBuf> {
        let sandbox_name = self.sandbox_name.as_deref().unwrap_or(&self.sandbox_id);
        if !plain_absolute(&self.parent) || !plain_name(&self.sandbox_id) || !plain_name(sandbox_name) {
            return Vec::new();
        }
        match self.owner {
            ParentOwner::Shim => vec![self.parent.clone()],
            ParentOwner::Caller => std::iter::once(self.sandbox())
                .chain(self.containers.iter().filter(|id| plain_name(id)).map(|id| self.parent.join(id)))
                .collect(),
        }
    }

    /// Writes the record `delete` reads after a crash, atomically (never half a record).
    pub fn write_record(&self, file: &Path) -> std::io::Result<()> {
        let json = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        let tmp = file.with_extension("json.tmp");
        std::fs::write(&tmp, json)?;
        std::fs::rename(&tmp, file)
    }

    /// Reads what [`PodCgroup::write_record`] wrote; `None` if there is no (valid) record.
    pub fn read_record(file: &Path) -> Option<Self> {
        use std::io::Read;
        let mut bytes = Vec::new();
        std::fs::File::open(file).ok()?.take(MAX_RECORD_BYTES + 1).read_to_end(&mut bytes).ok()?;
        if bytes.len() as u64 > MAX_RECORD_BYTES {
            warn!(file = %file.display(), "cgroup record too large; ignored");
            return None;
        }
        serde_json::from_slice(&bytes).ok()
    }

    /// Removes the cgroups this pod owns in every mounted hierarchy, retrying while the last
    /// processes of a killed pod exit, for at most `budget`. Returns what is still there (and
    /// logs it once) instead of waiting longer.
    pub async fn remove(&self, budget: Duration) -> Vec<PathBuf> {
        self.remove_in(&cgroup_mounts(), budget).await
    }

    async fn remove_in(&self, mounts: &[PathBuf], budget: Duration) -> Vec<PathBuf> {
        let dirs: Vec<PathBuf> = mounts
            .iter()
            .flat_map(|mount| self.owned().into_iter().map(move |cg| mount.join(cg.strip_prefix("/").unwrap_or(&cg))))
            .collect();
        let deadline = Instant::now() + budget;
        loop {
            let left: Vec<PathBuf> = dirs.iter().filter(|dir| remove_tree(dir) > 0).cloned().collect();
            if left.is_empty() {
                return left;
            }
            if Instant::now() >= deadline {
                warn!(left = ?left, "pod cgroups still busy after teardown; leaving them");
                return left;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The `cgroup.procs` files of cgroup `path` in every hierarchy a helper process joins, the
/// cgroup created where missing, and what failed. cpuset is skipped: a new cpuset cgroup has no
/// CPUs until configured, and helpers need none of their own.
pub fn procs_files(path: &Path) -> (Vec<PathBuf>, Vec<String>) {
    if !plain_absolute(path) {
        return (Vec::new(), vec![format!("cgroup {} is not a plain absolute path", path.display())]);
    }
    let relative = path.strip_prefix("/").unwrap_or(path);
    let (mut files, mut problems) = (Vec::new(), Vec::new());
    for mount in cgroup_mounts() {
        if mount.file_name().is_some_and(|n| n.to_string_lossy().contains("cpuset")) {
            continue;
        }
        let dir = mount.join(relative);
        match std::fs::create_dir_all(&dir) {
            Ok(()) => files.push(dir.join("cgroup.procs")),
            Err(e) => problems.push(format!("create cgroup {}: {e}", dir.display())),
        }
    }
    (files, problems)
}

/// Moves `pid` into the cgroup `path` of every hierarchy that accepts it ([`procs_files`]);
/// returns what failed.
pub fn join(path: &Path, pid: u32) -> Vec<String> {
    let (files, mut problems) = procs_files(path);
    for file in files {
        if let Err(e) = std::fs::write(&file, pid.to_string()) {
            problems.push(format!("join cgroup {}: {e}", file.display()));
        }
    }
    problems
}

/// Moves the calling process into the cgroups whose `cgroup.procs` files are `procs` (writing
/// `0` means "me"). Only open, write and close: safe between fork and exec.
pub fn join_self(procs: &[std::ffi::CString]) -> std::io::Result<()> {
    for file in procs {
        // SAFETY: a NUL-terminated path; the fd is closed before the next iteration.
        let fd = unsafe { libc::open(file.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: writes one byte from a static buffer to the fd just opened.
        let written = unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) };
        let error = std::io::Error::last_os_error();
        // SAFETY: closes the fd opened above, once.
        unsafe { libc::close(fd) };
        if written != 1 {
            return Err(error);
        }
    }
    Ok(())
}

fn rmdir(dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// Removes `dir` and every cgroup below it, deepest first; returns how many could not be removed.
fn remove_tree(dir: &Path) -> usize {
    let mut left = 0;
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            // Only directories are cgroups; control files are never touched.
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                left += remove_tree(&entry.path());
            }
        }
    }
    if let Err(e) = rmdir(dir) {
        debug!("rmdir {}: {e}", dir.display());
        left += 1;
    }
    left
}

/// Whether the hierarchy mounted at `mount` has the pids controller (a v1 `pids` mount, or v2 with
/// pids among its controllers).
fn has_pids(mount: &Path) -> bool {
    mount.file_name().is_some_and(|n| n.to_string_lossy().split(',').any(|c| c == "pids"))
        || std::fs::read_to_string(mount.join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|c| c == "pids"))
}

/// The lowest numeric `pids.max` of `cgroup` (absolute within the hierarchy at `mount`) and its
/// ancestors; `None` when all say `max` or none exists. Unreadable or garbled files are skipped.
fn lowest_pids_max(mount: &Path, cgroup: &Path) -> Option<u64> {
    let relative = cgroup.strip_prefix("/").ok()?;
    relative
        .ancestors()
        .filter_map(|dir| {
            let text = read_small(&mount.join(dir).join("pids.max"))?;
            text.trim().parse::<u64>().ok()
        })
        .min()
}

/// A cgroup control file's text, at most a page of it.
fn read_small(file: &Path) -> Option<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(file).ok()?.take(4096).read_to_string(&mut text).ok()?;
    Some(text)
}

/// Mount points of every cgroup hierarchy (v1 controllers, named, and v2), from mountinfo.
pub fn cgroup_mounts() -> Vec<PathBuf> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else { return Vec::new() };
    info.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fstype = right.split(' ').next()?;
            (fstype == "cgroup" || fstype == "cgroup2").then(|| left.split(' ').nth(4).map(PathBuf::from))?
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(parent: &str, id: &str) -> PodCgroup {
        PodCgroup {
            parent: parent.into(),
            owner: ParentOwner::Caller,
            sandbox_id: id.into(),
            sandbox_name: None,
            containers: BTreeSet::new(),
        }
    }

    fn own(id: &str) -> PodCgroup {
        PodCgroup {
            parent: Path::new(OWN_ROOT).join(id),
            owner: ParentOwner::Shim,
            sandbox_id: id.into(),
            sandbox_name: None,
            containers: BTreeSet::new(),
        }
    }

    #[test]
    fn the_pods_pids_limit_is_the_lowest_on_the_way_up() {
        let root = tempfile::tempdir().unwrap();
        let pod = Path::new("/kubepods/burstable/pod1");
        let write = |dir: &str, value: &str| {
            let dir = root.path().join(dir);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("pids.max"), value).unwrap();
        };
        assert_eq!(lowest_pids_max(root.path(), pod), None, "no pids.max files");
        write("kubepods/burstable/pod1", "max\n");
        write("kubepods", "max\n");
        assert_eq!(lowest_pids_max(root.path(), pod), None, "unlimited all the way");
        write("kubepods/burstable/pod1", "1024\n");
        assert_eq!(lowest_pids_max(root.path(), pod), Some(1024), "kubelet's podPidsLimit");
        write("kubepods", "512\n");
        assert_eq!(lowest_pids_max(root.path(), pod), Some(512), "a node-wide limit above is lower");
        write("kubepods/burstable", "\u{0}garbage");
        assert_eq!(lowest_pids_max(root.path(), pod), Some(512), "garbage is skipped");
        assert_eq!(lowest_pids_max(root.path(), Path::new("relative")), None);
    }

    #[test]
    fn slices_expand_as_runc_expands_them() {
        // runc's libcontainer/cgroups/systemd ExpandSlice examples.
        for (slice, path) in [
            ("-.slice", "/"),
            ("foo.slice", "/foo.slice"),
            ("foo-bar.slice", "/foo.slice/foo-bar.slice"),
            ("foo-bar-baz.slice", "/foo.slice/foo-bar.slice/foo-bar-baz.slice"),
            (
                "kubepods-burstable-pod1234.slice",
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice",
            ),
        ] {
            assert_eq!(expand_slice(slice), Some(PathBuf::from(path)), "{slice}");
        }
        for bad in ["foo", "-foo.slice", "foo-.slice", "foo--bar.slice", "foo/bar.slice", ".slice", "test-.slice"] {
            assert_eq!(expand_slice(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_systemd_path_puts_the_sandbox_in_a_scope_of_kubelets_pod_slice() {
        let cg = PodCgroup::for_pod("sb1", "k8s.io", Some("kubepods-burstable-pod1.slice:cri-containerd:sb1"));
        assert_eq!(cg.parent, PathBuf::from("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice"));
        assert_eq!(cg.owner, ParentOwner::Caller, "kubelet owns its pod slice");
        assert_eq!(
            cg.sandbox(),
            PathBuf::from(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/cri-containerd-sb1.scope"
            )
        );
        assert_eq!(cg.systemd_unit(), Some(("kubepods-burstable-pod1.slice".to_string(), "cri-containerd-sb1.scope")));
        assert_eq!(cg.owned(), vec![cg.sandbox()], "teardown removes only the pod's own scope");
        let back: PodCgroup = serde_json::from_slice(&serde_json::to_vec(&cg).unwrap()).unwrap();
        assert_eq!(back, cg);
        // Not systemd paths, or hostile ones: the shim's own.
        for spec in
            ["kubepods.slice:cri-containerd", "bad--x.slice:cri-containerd:sb1", "a.slice:../x:sb1", "a.slice:p:sb1:x"]
        {
            assert_eq!(PodCgroup::for_pod("sb1", "k8s.io", Some(spec)), own("sb1"), "{spec}");
        }
    }

    #[test]
    fn systemd_scopes_are_asked_of_systemd_over_dbus() {
        let args = systemd_scope_args("kubepods-pod1.slice", "cri-containerd-sb1.scope", 42);
        assert_eq!(
            &args[..6],
            [
                "call",
                "org.freedesktop.systemd1",
                "/org/freedesktop/systemd1",
                "org.freedesktop.systemd1.Manager",
                "StartTransientUnit",
                "ssa(sv)a(sa(sv))"
            ]
        );
        let rest = args[6..].join(" ");
        assert!(rest.starts_with("cri-containerd-sb1.scope replace 4 Slice s kubepods-pod1.slice "), "{rest}");
        assert!(rest.ends_with("PIDs au 1 42 0"), "{rest}");
    }

    #[test]
    fn kubelet_pod_cgroup_is_the_callers_parent() {
        let cg = PodCgroup::for_pod("sb1", "k8s.io", Some("/kubepods/burstable/pod-uid/sb1"));
        assert_eq!(cg, caller("/kubepods/burstable/pod-uid", "sb1"));
        assert_eq!(cg.sandbox(), PathBuf::from("/kubepods/burstable/pod-uid/sb1"));
    }

    #[test]
    fn crictl_pods_without_a_parent_get_their_own() {
        // containerd's default for a pod without cgroup_parent: one parent shared by all such pods.
        assert_eq!(PodCgroup::for_pod("sb1", "k8s.io", Some("/k8s.io/sb1")), own("sb1"));
        // In another namespace the same rule holds.
        assert_eq!(PodCgroup::for_pod("sb1", "other", Some("/other/sb1")), own("sb1"));
        assert_eq!(own("sb1").sandbox(), PathBuf::from("/bulkhead/sb1/sb1"));
    }

    #[test]
    fn systemd_empty_and_hostile_paths_get_the_shims_own() {
        for spec in [
            None,
            Some(""),
            Some("/sb1"),
            Some("/a/../b/sb1"),
            Some("/kubepods/../../etc/sb1"),
            Some("relative/sb1"),
            // The last component must be the sandbox itself.
            Some("/kubepods/pod1/other"),
        ] {
            assert_eq!(PodCgroup::for_pod("sb1", "k8s.io", spec), own("sb1"), "{spec:?}");
        }
        // A hostile sandbox id never names a path outside its parent.
        let cg = PodCgroup::for_pod("..", "k8s.io", Some("/kubepods/pod1/.."));
        assert!(cg.owned().is_empty(), "{cg:?}");
    }

    #[test]
    fn only_what_the_pod_made_is_owned_below_a_callers_parent() {
        let mut cg = caller("/kubepods/pod1", "sb1");
        assert!(cg.add_container("c1"));
        assert!(!cg.add_container("../c2"));
        assert!(!cg.add_container("a/b"));
        assert_eq!(cg.owned(), vec![PathBuf::from("/kubepods/pod1/sb1"), PathBuf::from("/kubepods/pod1/c1")]);
        assert_eq!(own("sb1").owned(), vec![PathBuf::from("/bulkhead/sb1")]);
    }

    #[test]
    fn the_record_round_trips() {
        let mut cg = caller("/kubepods/pod1", "sb1");
        cg.add_container("c1");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("cgroup.json");
        cg.write_record(&file).unwrap();
        assert_eq!(PodCgroup::read_record(&file), Some(cg));
        std::fs::write(&file, vec![b' '; MAX_RECORD_BYTES as usize + 1]).unwrap();
        assert_eq!(PodCgroup::read_record(&file), None, "an oversized record is ignored");
        assert_eq!(PodCgroup::read_record(&dir.path().join("missing")), None);
    }

    #[test]
    fn a_process_joins_cgroups_by_their_procs_files() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            println!("SKIPPED: a_process_joins_cgroups_by_their_procs_files: creating cgroups needs root");
            return;
        }
        let cgroup = PathBuf::from(format!("/bulkhead-test-join-{}", std::process::id()));
        let (files, problems) = procs_files(&cgroup);
        assert!(problems.is_empty() && !files.is_empty(), "{problems:?}");
        let procs: Vec<std::ffi::CString> =
            files.iter().map(|f| std::ffi::CString::new(f.as_os_str().as_encoded_bytes()).unwrap()).collect();
        let mut child = std::process::Command::new("/bin/sleep");
        child.arg("30");
        // SAFETY: join_self only opens, writes and closes.
        unsafe {
            use std::os::unix::process::CommandExt;
            child.pre_exec(move || join_self(&procs));
        }
        let mut child = child.spawn().unwrap();
        let text = std::fs::read_to_string(format!("/proc/{}/cgroup", child.id())).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        for dir in cgroup_mounts().iter().map(|m| m.join(cgroup.strip_prefix("/").unwrap())) {
            let _ = std::fs::remove_dir(dir);
        }
        assert!(text.lines().any(|l| l.ends_with(&cgroup.display().to_string())), "{text}");
    }

    #[test]
    fn only_plain_absolute_paths_qualify() {
        assert!(plain_absolute(Path::new("/a/b")));
        assert!(!plain_absolute(Path::new("/")));
        assert!(!plain_absolute(Path::new("a/b")));
        assert!(!plain_absolute(Path::new("/a/../b")));
    }

    #[tokio::test]
    async fn teardown_leaves_other_pods_alone() {
        // Two fake hierarchies; a shared parent with this pod's and another pod's cgroups.
        let root = tempfile::tempdir().unwrap();
        let mounts: Vec<PathBuf> = ["memory", "pids"].iter().map(|h| root.path().join(h)).collect();
        for m in &mounts {
            for dir in ["shared/sb1", "shared/c1/sub", "shared/sb2", "shared/c2"] {
                std::fs::create_dir_all(m.join(dir)).unwrap();
            }
        }
        let mut cg = caller("/shared", "sb1");
        cg.add_container("c1");
        let left = cg.remove_in(&mounts, Duration::from_millis(100)).await;
        assert!(left.is_empty(), "{left:?}");
        for m in &mounts {
            assert!(!m.join("shared/sb1").exists() && !m.join("shared/c1").exists());
            assert!(m.join("shared/sb2").exists() && m.join("shared/c2").exists(), "another pod's cgroups stay");
            assert!(m.join("shared").exists(), "the caller's parent stays");
        }
    }

    #[tokio::test]
    async fn a_busy_cgroup_is_reported_within_the_budget() {
        let root = tempfile::tempdir().unwrap();
        let mount = root.path().join("memory");
        // A plain file stands in for a cgroup that cannot be removed (busy).
        std::fs::create_dir_all(mount.join("bulkhead/sb1/c1")).unwrap();
        std::fs::write(mount.join("bulkhead/sb1/c1/busy"), b"").unwrap();
        let started = Instant::now();
        let left = own("sb1").remove_in(std::slice::from_ref(&mount), Duration::from_millis(100)).await;
        assert!(started.elapsed() < Duration::from_secs(2));
        assert_eq!(left, vec![mount.join("bulkhead/sb1")]);
    }
}
