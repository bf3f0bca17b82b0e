//! The node's metrics directory, `<state_dir>/.metrics`: each running pod's metrics socket
//! (`<sandbox id>.sock`) and its Kubernetes labels (`<sandbox id>.json`). It is the one part of
//! the shims' state the node exporter reads, so it alone is open to the metrics group
//! (`[metrics] gid`): the directory is 0750, the socket 0660 and the labels 0640, all owned by
//! root and that group whatever the umask. The exporter then runs as an unprivileged user in that
//! group, and a compromise of it reaches the pods' metrics, not their agents, VMMs or records.
//!
//! The name starts with a dot, which no sandbox id does, so it never meets a pod's directory.

use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::sandbox::paths::PodPaths;

/// The directory's name in the state dir.
pub const DIR_NAME: &str = ".metrics";
/// Upper bound for one pod's labels file.
const MAX_LABELS_BYTES: u64 = 4096;

/// The labels the exporter puts on a pod's series.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodLabels {
    pub pod: String,
    pub namespace: String,
}

/// Where one pod's metrics are served, and to which group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodEndpoint {
    pub socket: PathBuf,
    pub labels: PathBuf,
    pub gid: u32,
}

impl PodEndpoint {
    /// The pod's entries in the metrics directory beside its pod directory.
    pub fn of(paths: &PodPaths, gid: u32) -> Option<Self> {
        let state_dir = paths.dir.parent()?;
        let id = paths.dir.file_name()?.to_str()?;
        let dir = state_dir.join(DIR_NAME);
        Some(Self { socket: dir.join(format!("{id}.sock")), labels: dir.join(format!("{id}.json")), gid })
    }

    /// Makes the directory (or puts its owner and mode right) and writes the labels, atomically.
    pub fn publish(&self, labels: &PodLabels) -> std::io::Result<()> {
        let dir = self.socket.parent().ok_or_else(|| std::io::Error::other("metrics socket has no directory"))?;
        create_dir(dir, self.gid)?;
        let text = serde_json::to_vec(labels).map_err(std::io::Error::other)?;
        let tmp = self.labels.with_extension("json.tmp");
        let _ = std::fs::remove_file(&tmp);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        file.write_all(&text)?;
        std::os::unix::fs::fchown(&file, Some(owner()), Some(self.gid))?;
        file.set_permissions(std::fs::Permissions::from_mode(0o640))?;
        drop(file);
        std::fs::rename(&tmp, &self.labels)
    }

    /// Gives a socket just bound at [`Self::socket`] to root and the metrics group, mode 0660.
    pub fn open_socket(&self) -> std::io::Result<()> {
        std::os::unix::fs::lchown(&self.socket, Some(owner()), Some(self.gid))?;
        std::fs::set_permissions(&self.socket, std::fs::Permissions::from_mode(0o660))
    }

    /// Removes the socket and the labels; what is already gone is fine.
    pub fn remove(&self) {
        for path in [&self.socket, &self.labels] {
            match std::fs::remove_file(path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    tracing::warn!("remove {}: {e}", path.display())
                }
                _ => {}
            }
        }
    }
}

/// The files' owner: this process's user, root for a shim.
fn owner() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Makes `dir` root's and `gid`'s, mode 0750, whatever the umask or an earlier owner; refuses
/// anything that is not a plain directory (a link there would move the sockets elsewhere).
pub fn create_dir(dir: &Path, gid: u32) -> std::io::Result<()> {
    match std::fs::DirBuilder::new().mode(0o750).create(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.is_dir() {
        return Err(std::io::Error::other(format!("{} is not a directory", dir.display())));
    }
    if meta.uid() != owner() || meta.gid() != gid {
        std::os::unix::fs::lchown(dir, Some(owner()), Some(gid))?;
    }
    if meta.mode() & 0o7777 != 0o750 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750))?;
    }
    Ok(())
}

/// A pod the exporter can scrape: its id, socket, and labels if they could be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub id: String,
    pub socket: PathBuf,
    pub labels: Option<PodLabels>,
}

/// Every pod with a socket in `<state_dir>/.metrics`, by id. A missing directory is no pods.
pub fn entries(state_dir: &Path) -> std::io::Result<Vec<Entry>> {
    let dir = state_dir.join(DIR_NAME);
    let read = match std::fs::read_dir(&dir) {
        Ok(read) => read,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out: Vec<Entry> = read
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            let id = name.strip_suffix(".sock")?;
            bulkhead_protocol::stream::validate_id(id).ok()?;
            let labels = match read_labels(&dir.join(format!("{id}.json"))) {
                Ok(labels) => Some(labels),
                Err(err) => {
                    tracing::warn!(pod = %id, "metrics labels: {err}");
                    None
                }
            };
            Some(Entry { id: id.to_string(), socket: e.path(), labels })
        })
        .collect();
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

/// One labels file, bounded, not through a link.
fn read_labels(path: &Path) -> std::io::Result<PodLabels> {
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other(format!("{} is not a file", path.display())));
    }
    let mut text = Vec::new();
    file.take(MAX_LABELS_BYTES + 1).read_to_end(&mut text)?;
    if text.len() as u64 > MAX_LABELS_BYTES {
        return Err(std::io::Error::other(format!("{} is larger than {MAX_LABELS_BYTES} bytes", path.display())));
    }
    serde_json::from_slice(&text).map_err(|e| std::io::Error::other(format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{in_child, is_root, CHILD_ARG};

    const GID: u32 = 40_464;

    fn endpoint(state: &Path, id: &str) -> PodEndpoint {
        PodEndpoint::of(&PodPaths::new(state, id).unwrap(), GID).unwrap()
    }

    #[test]
    fn a_pod_is_named_by_its_id_in_the_dot_directory() {
        let e = endpoint(Path::new("/run/bulkhead"), "abc");
        assert_eq!(e.socket, Path::new("/run/bulkhead/.metrics/abc.sock"));
        assert_eq!(e.labels, Path::new("/run/bulkhead/.metrics/abc.json"));
        let long = "a".repeat(64);
        assert!(endpoint(Path::new("/run/bulkhead"), &long).socket.as_os_str().len() < 108);
    }

    #[test]
    fn entries_are_the_sockets_with_their_labels_and_bad_labels_are_none() {
        let state = tempfile::tempdir().unwrap();
        let dir = state.path().join(DIR_NAME);
        std::fs::create_dir(&dir).unwrap();
        let a = endpoint(state.path(), "a");
        let labels = PodLabels { pod: "web".into(), namespace: "default".into() };
        std::fs::write(&a.labels, serde_json::to_vec(&labels).unwrap()).unwrap();
        std::fs::write(&a.socket, "").unwrap();
        // b: labels not JSON; c: labels far too large; d: labels a link; no socket: not listed.
        std::fs::write(dir.join("b.sock"), "").unwrap();
        std::fs::write(dir.join("b.json"), "{").unwrap();
        std::fs::write(dir.join("c.sock"), "").unwrap();
        std::fs::write(dir.join("c.json"), format!("{{\"pod\":\"{}\",\"namespace\":\"x\"}}", "p".repeat(5000)))
            .unwrap();
        std::fs::write(dir.join("d.sock"), "").unwrap();
        std::os::unix::fs::symlink(&a.labels, dir.join("d.json")).unwrap();
        std::fs::write(dir.join("e.json"), "{}").unwrap();
        std::fs::write(dir.join(".x.sock"), "").unwrap();
        let got = entries(state.path()).unwrap();
        let ids: Vec<&str> = got.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(ids, ["a", "b", "c", "d"]);
        assert_eq!(got[0].labels.as_ref(), Some(&labels));
        assert!(got[1..].iter().all(|e| e.labels.is_none()), "{got:?}");
        assert!(entries(&state.path().join("missing")).unwrap().is_empty());
    }

    /// Under umask 000, as containerd may run the shim: the directory, labels and socket are
    /// root's and the metrics group's, and nobody outside the group can list or open them.
    #[test]
    fn the_group_alone_reads_the_metrics_whatever_the_umask() {
        if !is_root("the_group_alone_reads_the_metrics_whatever_the_umask") {
            return;
        }
        let Ok(state) = std::env::var(CHILD_ARG) else {
            let state = tempfile::tempdir().unwrap();
            std::fs::set_permissions(state.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
            let name = "metrics::dir::tests::the_group_alone_reads_the_metrics_whatever_the_umask";
            in_child(name, state.path().to_str().unwrap(), 0o000);
            let e = endpoint(state.path(), "pod");
            let dir = e.socket.parent().unwrap();
            for (path, mode) in [(dir, 0o750), (e.socket.as_path(), 0o660), (e.labels.as_path(), 0o640)] {
                let meta = std::fs::symlink_metadata(path).unwrap();
                assert_eq!((meta.mode() & 0o7777, meta.uid(), meta.gid()), (mode, 0, GID), "{}", path.display());
            }
            // The child's listener went with it: bind again, as the shim does, to try connects.
            std::fs::remove_file(&e.socket).unwrap();
            let _listener = std::os::unix::net::UnixListener::bind(&e.socket).unwrap();
            e.open_socket().unwrap();
            let (socket, labels) = (e.socket.clone(), e.labels.clone());
            let outside = as_user(65534, &[], move || {
                (std::os::unix::net::UnixStream::connect(&socket).is_ok(), std::fs::File::open(&labels).is_ok())
            });
            assert_eq!(outside, (false, false), "nobody outside the group");
            let (socket, labels) = (e.socket.clone(), e.labels.clone());
            let inside = as_user(65534, &[GID], move || {
                (std::os::unix::net::UnixStream::connect(&socket).is_ok(), std::fs::File::open(&labels).is_ok())
            });
            assert_eq!(inside, (true, true), "nobody in the metrics group");
            return;
        };
        // The child, under umask 000: publish and bind as the shim does.
        let e = endpoint(Path::new(&state), "pod");
        e.publish(&PodLabels { pod: "p".into(), namespace: "n".into() }).unwrap();
        let _listener = std::os::unix::net::UnixListener::bind(&e.socket).unwrap();
        e.open_socket().unwrap();
    }

    /// Runs `f` on a thread of its own as `uid` with `groups` (raw system calls change only
    /// the calling thread's credentials).
    fn as_user<T: Send + 'static>(uid: u32, groups: &[u32], f: impl FnOnce() -> T + Send + 'static) -> T {
        let groups: Vec<libc::gid_t> = groups.to_vec();
        std::thread::spawn(move || {
            // SAFETY: raw setgroups/setresgid/setresuid on this thread only, with a list that
            // outlives the call; every result is checked.
            unsafe {
                assert_eq!(libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()), 0);
                assert_eq!(libc::syscall(libc::SYS_setresgid, uid, uid, uid), 0);
                assert_eq!(libc::syscall(libc::SYS_setresuid, uid, uid, uid), 0);
            }
            f()
        })
        .join()
        .unwrap()
    }
}
