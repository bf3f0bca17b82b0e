//! What still uses the installed versions: the processes that execute a file under `<prefix>/<version>/`, and the
//! pods the shims list in their state directories. Read-only: `versions` decides from it what to collect, and
//! `installer` refuses an uninstall with it.
//!
//! **A version is in use while a process executes one of its files** (`/proc/<pid>/exe`). That is the kernel's own
//! record: it cannot go stale or be left behind by a crash, and it depends on no file format and no configured state
//! dir. containerd starts a pod's shim through `current`, but the kernel resolves the link at exec, so the shim runs
//! its version's file; the shim then re-executes itself by its resolved path (its `start` spawns the server) and
//! starts the VMM and virtiofsd by the resolved paths of its config. So the shim of every live pod, a `start` or
//! `delete` containerd runs right now, and an operator's `bulkhead-ctl` all name their version here. A process
//! that ended holds nothing: whatever containerd runs later for its pod goes through `current`.
//!
//! **The pods** come from where `bulkhead-ctl ps` finds them: one directory per sandbox under each shim state dir,
//! holding the shim's record (`pod.json`) once the sandbox runs. A pod counts while its shim lives (the record's
//! `shim_pid`, or a shim process serving that sandbox id while it starts). They are what an uninstall would strand,
//! and the cross-check of the process scan: a live pod whose shim runs from a path that names no installed version
//! holds every version, so an installer that sees paths differently (another mount namespace) cannot collect a
//! version in use.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;

use crate::error::{io, Result};
use crate::node_paths::{self, NodePaths, SHIM_BINARY, SHIM_CONFIG, SHIM_STATE_DIR};

/// The shim's pod record (`pod.json`) and cmdline are read with a bound: nothing larger comes from a shim.
const MAX_READ: u64 = 64 * 1024;
/// How the kernel marks the link of an executable whose file was unlinked.
const DELETED: &str = " (deleted)";

/// A process executing a file of an installed version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Process {
    pub pid: u32,
    pub version: String,
    pub exe: PathBuf,
}

/// A pod whose shim is alive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pod {
    pub id: String,
    /// `namespace/name` from the record, else the sandbox id.
    pub label: String,
    pub shim_pid: u32,
    /// The version of the shim's binary; `None` when its path names no installed version.
    pub version: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub processes: Vec<Process>,
    pub pods: Vec<Pod>,
    /// Processes whose executable could not be read for another reason than their exit: what they run is unknown.
    pub unreadable: Vec<u32>,
}

impl Usage {
    /// Nothing of bulkhead runs: no live pod, no process executing an installed file.
    pub fn is_idle(&self) -> bool {
        self.pods.is_empty() && self.processes.is_empty()
    }

    /// Versions with a process executing one of their files, and the PIDs.
    pub fn by_version(&self) -> BTreeMap<&str, Vec<u32>> {
        let mut out: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
        for p in &self.processes {
            out.entry(p.version.as_str()).or_default().push(p.pid);
        }
        out
    }

    /// One sentence for logs and the uninstall refusal: how many pods, which, and what runs from which version.
    pub fn summary(&self) -> String {
        let mut parts = vec![];
        if !self.pods.is_empty() {
            let n = self.pods.len();
            let names: Vec<String> = self.pods.iter().take(10).map(|p| p.label.clone()).collect();
            let more = if n > names.len() { format!(", and {} more", n - names.len()) } else { String::new() };
            parts.push(format!(
                "{n} bulkhead pod{} run{} on this node ({}{more})",
                if n == 1 { "" } else { "s" },
                if n == 1 { "s" } else { "" },
                names.join(", ")
            ));
        } else {
            parts.push("0 bulkhead pods run on this node".to_string());
        }
        if !self.processes.is_empty() {
            let versions: Vec<String> =
                self.by_version().into_iter().map(|(v, pids)| format!("{v}: pids {pids:?}")).collect();
            parts.push(format!(
                "{} process{} execute{} installed files ({})",
                self.processes.len(),
                if self.processes.len() == 1 { "" } else { "es" },
                if self.processes.len() == 1 { "s" } else { "" },
                versions.join("; ")
            ));
        }
        parts.join("; ")
    }
}

/// Looks at the node's processes and the shims' state dirs.
///
/// An unreadable `/proc` is an error (nothing can be told); so is a state dir that exists but cannot be listed.
pub fn scan(layout: &NodePaths) -> Result<Usage> {
    let roots = version_roots(layout);
    let procs = processes(&layout.proc_dir, &roots)?;
    let mut usage = Usage { unreadable: procs.unreadable, ..Usage::default() };
    for dir in state_dirs(layout) {
        usage.pods.extend(pods(&dir, &layout.proc_dir, &roots, &procs.shims)?);
    }
    usage.processes = procs.installed;
    Ok(usage)
}

/// The prefix as the processes' paths may show it: containerd's view (it and the shims exec what the config names)
/// and the installer's (the same files, if the kernel prints the path relative to our root).
fn version_roots(layout: &NodePaths) -> Vec<PathBuf> {
    let mut roots = vec![layout.view(&layout.prefix), layout.install_dir()];
    roots.dedup();
    roots
}

/// The version directory an executable's path lies in, if any.
pub fn version_of(exe: &Path, roots: &[PathBuf]) -> Option<String> {
    let exe = strip_deleted(exe);
    roots.iter().find_map(|root| {
        let mut rest = exe.strip_prefix(root).ok()?.components();
        let (Some(Component::Normal(dir)), Some(_)) = (rest.next(), rest.next()) else { return None };
        let dir = dir.to_str()?;
        node_paths::check_version(dir).ok().map(|()| dir.to_string())
    })
}

fn strip_deleted(exe: &Path) -> PathBuf {
    let s = exe.to_string_lossy();
    PathBuf::from(s.strip_suffix(DELETED).unwrap_or(&s))
}

fn is_shim(exe: &Path) -> bool {
    strip_deleted(exe).file_name().is_some_and(|n| n == SHIM_BINARY)
}

/// A shim process, by the sandbox it serves (`-id` on its command line).
#[derive(Debug)]
struct Shim {
    pid: u32,
    id: Option<String>,
    version: Option<String>,
}

#[derive(Debug, Default)]
struct Procs {
    installed: Vec<Process>,
    shims: Vec<Shim>,
    unreadable: Vec<u32>,
}

fn processes(proc_dir: &Path, roots: &[PathBuf]) -> Result<Procs> {
    let mut out = Procs::default();
    for entry in fs::read_dir(proc_dir).map_err(io("read dir", proc_dir))? {
        let entry = entry.map_err(io("read dir", proc_dir))?;
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let exe = match executable(&entry.path()) {
            Executable::Gone => continue,
            Executable::Unknown => {
                out.unreadable.push(pid);
                continue;
            }
            Executable::Known(exe) => exe,
            // Claimed by argv[0] only: ours if it names an installed file or the shim; anything else is not.
            Executable::Claimed(exe) => {
                if version_of(&exe, roots).is_none() && (is_shim(&exe) || roots.iter().any(|r| exe.starts_with(r))) {
                    out.unreadable.push(pid);
                }
                exe
            }
        };
        let version = version_of(&exe, roots);
        if is_shim(&exe) {
            let id = shim_id(&entry.path().join("cmdline"));
            out.shims.push(Shim { pid, id, version: version.clone() });
        }
        if let Some(version) = version {
            out.installed.push(Process { pid, version, exe });
        }
    }
    out.installed.sort_by_key(|p| p.pid);
    Ok(out)
}

/// What a process executes, as far as `/proc/<pid>` tells.
enum Executable {
    /// The `exe` link: the file the kernel executes.
    Known(PathBuf),
    /// `exe` cannot be read (no ptrace access to that process), but its argv[0] says this. A shim's server,
    /// spawned by the resolved path of its own binary, names its version there.
    Claimed(PathBuf),
    /// Neither can be read.
    Unknown,
    /// Exited since the listing, a zombie, or a kernel thread: runs nothing of ours.
    Gone,
}

fn executable(pid_dir: &Path) -> Executable {
    match fs::read_link(pid_dir.join("exe")) {
        Ok(exe) => Executable::Known(exe),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Executable::Gone,
        Err(_) => match argv(&pid_dir.join("cmdline")).and_then(|a| a.into_iter().next()) {
            Some(argv0) => Executable::Claimed(PathBuf::from(argv0)),
            _ if !pid_dir.exists() => Executable::Gone,
            _ => Executable::Unknown,
        },
    }
}

/// A command line (NUL-separated, as /proc gives it), read with a bound.
fn argv(cmdline: &Path) -> Option<Vec<String>> {
    let mut bytes = vec![];
    fs::File::open(cmdline).ok()?.take(MAX_READ).read_to_end(&mut bytes).ok()?;
    Some(bytes.split(|b| *b == 0).filter(|a| !a.is_empty()).map(|a| String::from_utf8_lossy(a).into_owned()).collect())
}

/// The value after `-id` on a shim's command line: the sandbox it serves.
fn shim_id(cmdline: &Path) -> Option<String> {
    let args = argv(cmdline)?;
    let at = args.iter().position(|a| a == "-id")?;
    args.get(at + 1).cloned()
}

/// The shim state dirs, as the installer sees them: the shim's default and every `state_dir` an installed
/// version's config names (a config that moved it must not hide its pods).
fn state_dirs(layout: &NodePaths) -> Vec<PathBuf> {
    let mut dirs = vec![layout.host(Path::new(SHIM_STATE_DIR))];
    let root = layout.install_dir();
    let versions = fs::read_dir(&root).into_iter().flatten().flatten();
    for entry in versions.filter(|e| e.file_type().is_ok_and(|t| t.is_dir())) {
        let config = entry.path().join(SHIM_CONFIG);
        let Ok(text) = fs::read_to_string(&config) else { continue };
        let state_dir = match text.parse::<toml::Table>() {
            Ok(doc) => doc.get("state_dir").and_then(toml::Value::as_str).map(PathBuf::from),
            Err(e) => {
                tracing::warn!(config = %config.display(), error = %e, "shim config unreadable; its state_dir is not scanned");
                None
            }
        };
        match state_dir.map(|d| (layout.host_from_view(&d), d)) {
            Some((Some(host), _)) => dirs.push(host),
            Some((None, d)) => {
                tracing::warn!(state_dir = %d.display(), config = %config.display(), "state_dir is outside the node's root; not scanned")
            }
            None => {}
        }
    }
    dirs.sort();
    dirs.dedup();
    dirs
}

/// The fields of the shim's `PodRecord` the installer reads; others are ignored, so the shim may add fields.
#[derive(Debug, Deserialize)]
struct Record {
    #[serde(default)]
    pod_name: String,
    #[serde(default)]
    pod_namespace: String,
    shim_pid: u32,
}

fn read_record(path: &Path) -> Option<Record> {
    let mut bytes = vec![];
    fs::File::open(path).ok()?.take(MAX_READ + 1).read_to_end(&mut bytes).ok()?;
    if bytes.len() as u64 > MAX_READ {
        return None;
    }
    serde_json::from_slice(&bytes).ok()
}

/// containerd's id rule (the shim's `PodPaths` applies the same): anything else in a state dir is not a pod.
fn is_pod_id(name: &str) -> bool {
    let mut bytes = name.bytes();
    name.len() <= 256
        && bytes.next().is_some_and(|b| b.is_ascii_alphanumeric())
        && bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// The live pods of one state dir. A pod dir whose shim is gone is left for containerd's `delete` and not counted.
fn pods(state_dir: &Path, proc_dir: &Path, roots: &[PathBuf], shims: &[Shim]) -> Result<Vec<Pod>> {
    let entries = match fs::read_dir(state_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(io("read dir", state_dir)(e)),
    };
    let mut out = vec![];
    for entry in entries {
        let entry = entry.map_err(io("read dir", state_dir))?;
        let Some(id) = entry.file_name().to_str().map(str::to_string) else { continue };
        if !is_pod_id(&id) || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let (label, shim) = match read_record(&entry.path().join("pod.json")) {
            Some(r) => {
                let label =
                    if r.pod_name.is_empty() { id.clone() } else { format!("{}/{}", r.pod_namespace, r.pod_name) };
                (label, live_shim(proc_dir, r.shim_pid, roots))
            }
            // Still starting (the shim writes the record once the sandbox runs): alive if a shim serves it.
            None => (
                id.clone(),
                shims.iter().find(|s| s.id.as_deref() == Some(id.as_str())).map(|s| (s.pid, s.version.clone())),
            ),
        };
        if let Some((shim_pid, version)) = shim {
            out.push(Pod { id, label, shim_pid, version });
        }
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

/// The record's shim, if that PID still runs a shim binary (a PID reused by anything else is not the pod's).
/// A process whose executable cannot be told at all counts as the pod's shim, with no known version.
fn live_shim(proc_dir: &Path, pid: u32, roots: &[PathBuf]) -> Option<(u32, Option<String>)> {
    match executable(&proc_dir.join(pid.to_string())) {
        Executable::Known(exe) | Executable::Claimed(exe) => is_shim(&exe).then(|| (pid, version_of(&exe, roots))),
        Executable::Unknown => Some((pid, None)),
        Executable::Gone => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake procfs: `<pid>/exe` symlinks and `<pid>/cmdline` files, read the way the kernel's are.
    fn proc_entry(proc: &Path, pid: u32, exe: &str, args: &[&str]) {
        let d = proc.join(pid.to_string());
        fs::create_dir_all(&d).unwrap();
        std::os::unix::fs::symlink(exe, d.join("exe")).unwrap();
        let mut cmdline = vec![];
        for a in std::iter::once(exe).chain(args.iter().copied()) {
            cmdline.extend_from_slice(a.as_bytes());
            cmdline.push(0);
        }
        fs::write(d.join("cmdline"), cmdline).unwrap();
    }

    fn record(state: &Path, id: &str, name: &str, shim_pid: u32) {
        fs::create_dir_all(state.join(id)).unwrap();
        let r = serde_json::json!({"sandbox_id": id, "pod_name": name, "pod_namespace": "default",
            "containerd_namespace": "k8s.io", "backend": "vm", "shim_pid": shim_pid,
            "pids": {"sandbox": 1, "vmm": null, "virtiofsd": null}, "started_at_unix": 1, "added_later": true});
        fs::write(state.join(id).join("pod.json"), r.to_string()).unwrap();
    }

    fn node() -> (tempfile::TempDir, NodePaths) {
        let d = tempfile::tempdir().unwrap();
        let mut l = NodePaths::new(d.path().join("host"), "/");
        l.proc_dir = d.path().join("proc");
        for v in ["1.0", "2.0"] {
            fs::create_dir_all(l.version_dir(v)).unwrap();
        }
        fs::create_dir_all(&l.proc_dir).unwrap();
        (d, l)
    }

    #[test]
    fn executables_map_to_their_version_directory() {
        let roots = [PathBuf::from("/opt/bulkhead"), PathBuf::from("/host/opt/bulkhead")];
        let v = |p: &str| version_of(Path::new(p), &roots);
        assert_eq!(v("/opt/bulkhead/1.0/containerd-shim-bulkhead-v2").as_deref(), Some("1.0"));
        assert_eq!(v("/host/opt/bulkhead/1.0/bulkhead-vmm").as_deref(), Some("1.0"));
        assert_eq!(v("/opt/bulkhead/0.9+abc/bulkhead-vmm (deleted)").as_deref(), Some("0.9+abc"));
        assert_eq!(v("/opt/bulkhead/1.0/sub/tool").as_deref(), Some("1.0"));
        for other in [
            "/opt/bulkhead/1.0",
            "/opt/bulkhead/current/containerd-shim-bulkhead-v2",
            "/opt/bulkhead/state/x",
            "/opt/bulkhead/.1.0.bulkhead-gc/bulkhead-vmm",
            "/opt/bulkhead-artifacts/bulkhead-ctl",
            "/usr/bin/containerd",
        ] {
            assert_eq!(v(other), None, "{other}");
        }
    }

    #[test]
    fn processes_and_pods_are_read_from_proc_and_the_state_dir() {
        let (_d, mut l) = node();
        let state = l.host(Path::new(SHIM_STATE_DIR));
        let shim1 = "/opt/bulkhead/1.0/containerd-shim-bulkhead-v2";
        let shim2 = "/opt/bulkhead/2.0/containerd-shim-bulkhead-v2";
        proc_entry(&l.proc_dir, 10, shim1, &["-namespace", "k8s.io", "-id", "aaa", "-socket", "x"]);
        proc_entry(&l.proc_dir, 11, "/opt/bulkhead/1.0/bulkhead-vmm (deleted)", &[]);
        proc_entry(&l.proc_dir, 20, shim2, &["-id", "bbb"]);
        proc_entry(&l.proc_dir, 30, "/usr/bin/sleep", &[]);
        fs::create_dir_all(l.proc_dir.join("31")).unwrap(); // a kernel thread: no exe
        record(&state, "aaa", "web", 10);
        fs::create_dir_all(state.join("bbb")).unwrap(); // starting: no record yet, its shim serves it
        fs::create_dir_all(state.join("ccc")).unwrap(); // a leftover: no record, no shim
        record(&state, "ddd", "gone", 30); // its PID now runs something else
        fs::create_dir_all(state.join(".ids")).unwrap();
        fs::write(state.join("installer.lock"), "").unwrap();

        let u = scan(&l).unwrap();
        let pids: Vec<(u32, &str)> = u.processes.iter().map(|p| (p.pid, p.version.as_str())).collect();
        assert_eq!(pids, [(10, "1.0"), (11, "1.0"), (20, "2.0")]);
        let pods: Vec<(&str, &str, Option<&str>)> =
            u.pods.iter().map(|p| (p.id.as_str(), p.label.as_str(), p.version.as_deref())).collect();
        assert_eq!(pods, [("aaa", "default/web", Some("1.0")), ("bbb", "bbb", Some("2.0"))]);
        assert!(u.unreadable.is_empty());
        let s = u.summary();
        assert!(s.starts_with("2 bulkhead pods run on this node (default/web, bbb)"), "{s}");
        assert!(s.contains("3 processes execute installed files (1.0: pids [10, 11]; 2.0: pids [20])"), "{s}");

        // A state_dir moved by a version's config is scanned too.
        let moved = l.host(Path::new("/var/run/bh"));
        fs::write(l.version_dir("2.0").join(SHIM_CONFIG), "state_dir = \"/var/run/bh\"\n").unwrap();
        record(&moved, "eee", "db", 20);
        let ids: Vec<String> = scan(&l).unwrap().pods.into_iter().map(|p| p.id).collect();
        assert_eq!(ids, ["aaa", "bbb", "eee"]);

        // A shim outside every version dir still counts as a pod, of unknown version.
        proc_entry(&l.proc_dir, 40, "/usr/local/bin/containerd-shim-bulkhead-v2", &[]);
        record(&state, "fff", "", 40);
        let u = scan(&l).unwrap();
        assert_eq!(u.pods.iter().find(|p| p.id == "fff").map(|p| p.version.clone()), Some(None));
        l.proc_dir = l.proc_dir.join("missing");
        assert!(scan(&l).is_err(), "no /proc: nothing can be told");
    }

    #[test]
    fn an_idle_node_says_so() {
        let (_d, l) = node();
        let u = scan(&l).unwrap();
        assert!(u.is_idle());
        assert_eq!(u.summary(), "0 bulkhead pods run on this node");
    }
}
