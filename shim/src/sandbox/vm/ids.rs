//! Per-pod identities of jailed VMMs: each pod's VMM runs as a uid and gid (the same number) of
//! its own, from the config's range, so a VMM that escaped its jail cannot signal or trace
//! another pod's (both need the same uid, or capabilities the jail drops).
//!
//! An id is taken by creating `<state_dir>/.ids/<id>` with O_EXCL, holding the pod's id: atomic
//! across the node's shims, and kept across a shim restart (the state dir is on /run, so a reboot
//! frees them all). The pod's teardown releases it ([`release`]); an id whose pod directory is
//! gone (its pod was never torn down) is taken over by the next pod that needs it. The pod's
//! directory must exist before [`allocate`], or another shim could take the id back at once.
//!
//! A takeover rewrites the file in place under an exclusive flock of the file itself, after
//! reading it again under that lock and checking it is still linked: two shims that both saw one
//! leftover take turns, and the second finds the first's pod there. (Removing the file and
//! creating it again let both win: the second removed the first's new file.) Writers of an id
//! file (a new one's first write, a takeover, a release) all hold its lock.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

/// Bytes of an id file read at most (a pod id is at most 128 bytes).
const MAX_RECORD: u64 = 256;

#[derive(Debug, thiserror::Error)]
pub enum IdError {
    #[error("no free VMM identity in vm.jail_id_first {first} .. +{count}: all are held by running pods; raise vm.jail_id_count")]
    Exhausted { first: u32, count: u32 },
    #[error("VMM identities in {dir}: {source}")]
    Io { dir: PathBuf, source: std::io::Error },
}

/// The range pods' ids come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdRange {
    pub first: u32,
    pub count: u32,
}

fn dir(state_dir: &Path) -> PathBuf {
    state_dir.join(".ids")
}

/// The pod id an id file names, if it can be read.
fn holder(path: &Path) -> Option<String> {
    let mut text = String::new();
    std::fs::File::open(path).ok()?.take(MAX_RECORD).read_to_string(&mut text).ok()?;
    Some(text.trim().to_string())
}

/// Where to start looking for `pod`'s id: spread over the range, so pods rarely probe the same
/// ids (FNV-1a of the pod id).
fn start(pod: &str, count: u32) -> u32 {
    let hash = pod.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    u32::try_from(hash % u64::from(count)).unwrap_or(0)
}

/// Opens an existing id file to read and write, following no link.
fn open_rw(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC).open(path)
}

/// How many times making the directory or a file in it is tried while releases elsewhere keep
/// removing the (empty) directory.
const TRIES: usize = 8;

/// Makes the ids directory, 0700 whatever the umask: whoever could delete an id file there could
/// give two pods one VMM identity. The last release on the node removes it at any moment, even
/// between the two steps here: then it is made again.
fn create_dir(dir: &Path) -> std::io::Result<()> {
    let mut tries = 1;
    loop {
        match make_dir(dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && tries < TRIES => tries += 1,
            other => return other,
        }
    }
}

fn make_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.is_dir() {
        return Err(std::io::Error::other(format!("{} is not a directory", dir.display())));
    }
    if meta.mode() & 0o7777 != 0o700 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

/// Creates `path` (mode 0600) if it does not exist; the directory too, which the last release
/// removes (and may remove again between the two steps: then the next try makes it again).
fn create_new(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut tries = 1;
    loop {
        let opened = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path);
        match opened {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && tries < TRIES => {
                tries += 1;
                if let Some(dir) = path.parent() {
                    create_dir(dir)?;
                }
            }
            other => return other,
        }
    }
}

/// `file` locked exclusively (waiting for the holder: every holder only reads or writes a few
/// bytes), if it is still linked into the directory once locked.
fn lock_linked(file: File) -> std::io::Result<Option<Flock<File>>> {
    let locked = Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, e)| std::io::Error::from(e))?;
    Ok((locked.metadata()?.nlink() > 0).then_some(locked))
}

/// The pod id `file` holds, read from its start.
fn read_holder(file: &mut File) -> std::io::Result<String> {
    let mut text = String::new();
    file.rewind()?;
    file.take(MAX_RECORD).read_to_string(&mut text)?;
    Ok(text.trim().to_string())
}

/// Takes the id file at `path` over for `pod` if, under its lock, it still names `stale`, whose
/// pod is gone. False if another shim was first (or the file went).
fn take_over(path: &Path, state_dir: &Path, stale: &str, pod: &str) -> std::io::Result<bool> {
    let file = match open_rw(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        other => other?,
    };
    let Some(mut file) = lock_linked(file)? else { return Ok(false) };
    let now = read_holder(&mut file)?;
    if now != stale || state_dir.join(&now).exists() {
        return Ok(false);
    }
    file.set_len(0)?;
    file.rewind()?;
    file.write_all(pod.as_bytes())?;
    Ok(true)
}

/// Takes a free id of `range` for `pod` (its own id again if it already holds one).
pub fn allocate(state_dir: &Path, pod: &str, range: IdRange) -> Result<u32, IdError> {
    let ids = dir(state_dir);
    let io = |source| IdError::Io { dir: ids.clone(), source };
    // Also puts right a directory an earlier release made under a looser umask.
    create_dir(&ids).map_err(io)?;
    let first = start(pod, range.count);
    for step in 0..range.count {
        let id = range.first + (first + step) % range.count;
        let path = ids.join(id.to_string());
        match create_new(&path) {
            Ok(file) => {
                // Under the lock, so a takeover never reads half a pod id.
                let mut file = Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, e)| io(e.into()))?;
                file.write_all(pod.as_bytes()).map_err(io)?;
                return Ok(id);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let held = holder(&path);
                if held.as_deref() == Some(pod) {
                    return Ok(id);
                }
                // Its pod's state is gone: a leftover, taken over by one shim (module docs).
                let gone = held.filter(|h| !h.is_empty() && !state_dir.join(h).exists());
                if let Some(h) = gone {
                    if take_over(&path, state_dir, &h, pod).map_err(io)? {
                        tracing::info!(id, pod = %h, "reclaimed the VMM identity of a pod that is gone");
                        return Ok(id);
                    }
                }
            }
            Err(e) => return Err(io(e)),
        }
    }
    Err(IdError::Exhausted { first: range.first, count: range.count })
}

/// Gives back whatever id `pod` holds; safe to call repeatedly, and after a crash (it needs no
/// record but the id files, one per running pod). The last one out removes the directory, so a
/// node without pods keeps nothing in the state dir.
pub fn release(state_dir: &Path, pod: &str) {
    let ids = dir(state_dir);
    let Ok(entries) = std::fs::read_dir(&ids) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if holder(&path).as_deref() != Some(pod) {
            continue;
        }
        // Again under the file's lock: a takeover may have given it to another pod since.
        let released = open_rw(&path).and_then(lock_linked).and_then(|locked| {
            let Some(mut file) = locked else { return Ok(()) };
            if read_holder(&mut file)? == pod {
                std::fs::remove_file(&path)?;
            }
            Ok(())
        });
        if let Err(e) = released {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %path.display(), "release the VMM identity: {e}");
            }
        }
    }
    // Fails while another pod holds an id; a concurrent allocate re-creates it.
    let _ = std::fs::remove_dir(&ids);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod_dir(state: &Path, pod: &str) {
        std::fs::create_dir_all(state.join(pod)).unwrap();
    }

    /// Pods come and go on other shims while one allocates: the last release removes the empty
    /// directory, even between allocate's steps (CI at 8bb35af: "VMM identities in .../.ids: No
    /// such file or directory" for one of twenty pods started at once).
    #[test]
    fn an_allocate_survives_releases_that_remove_the_directory() {
        let state = tempfile::tempdir().unwrap();
        let range = IdRange { first: 1000, count: 64 };
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let churn = {
            let (state, stop) = (state.path().to_path_buf(), stop.clone());
            std::thread::spawn(move || {
                pod_dir(&state, "churn");
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    allocate(&state, "churn", range).unwrap();
                    release(&state, "churn");
                }
            })
        };
        for i in 0..3000 {
            let pod = format!("pod{i}");
            pod_dir(state.path(), &pod);
            let got = allocate(state.path(), &pod, range);
            release(state.path(), &pod);
            if let Err(e) = got {
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                panic!("allocate {i}: {e}");
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        churn.join().unwrap();
    }

    #[test]
    fn pods_get_ids_of_their_own_and_the_same_id_again() {
        let state = tempfile::tempdir().unwrap();
        let range = IdRange { first: 1000, count: 8 };
        let mut taken = std::collections::HashSet::new();
        for i in 0..8 {
            let pod = format!("pod{i}");
            pod_dir(state.path(), &pod);
            let id = allocate(state.path(), &pod, range).unwrap();
            assert!((1000..1008).contains(&id), "{id}");
            assert!(taken.insert(id), "{id} given twice");
            assert_eq!(allocate(state.path(), &pod, range).unwrap(), id, "a pod asking again keeps its id");
        }
        pod_dir(state.path(), "pod8");
        let err = allocate(state.path(), "pod8", range).unwrap_err().to_string();
        assert!(err.contains("no free VMM identity") && err.contains("jail_id_count"), "{err}");
    }

    #[test]
    fn released_and_abandoned_ids_are_taken_again() {
        let state = tempfile::tempdir().unwrap();
        let range = IdRange { first: 50, count: 1 };
        pod_dir(state.path(), "a");
        let id = allocate(state.path(), "a", range).unwrap();
        release(state.path(), "someone-else");
        pod_dir(state.path(), "b");
        assert!(allocate(state.path(), "b", range).is_err(), "a release by another pod frees nothing");
        release(state.path(), "a");
        release(state.path(), "a");
        assert_eq!(allocate(state.path(), "b", range).unwrap(), id);
        // b's state goes without a release (a crash nobody cleaned up): c takes the id over.
        std::fs::remove_dir(state.path().join("b")).unwrap();
        pod_dir(state.path(), "c");
        assert_eq!(allocate(state.path(), "c", range).unwrap(), id);
        assert_eq!(holder(&dir(state.path()).join(id.to_string())).as_deref(), Some("c"));
        release(state.path(), "c");
        assert!(!dir(state.path()).exists(), "the last release leaves nothing");
    }

    #[test]
    fn under_umask_000_nobody_can_read_or_change_the_ids() {
        use crate::testing::{as_nobody, in_child, is_root, CHILD_ARG};
        use std::os::unix::fs::PermissionsExt;
        let range = IdRange { first: 900, count: 4 };
        if let Ok(state) = std::env::var(CHILD_ARG) {
            // The child, under umask 000: a shim taking an id.
            pod_dir(Path::new(&state), "pod");
            allocate(Path::new(&state), "pod", range).unwrap();
            return;
        }
        if !is_root("under_umask_000_nobody_can_read_or_change_the_ids") {
            return;
        }
        let state = tempfile::tempdir().unwrap();
        // Open to everyone, as /run is: only the ids directory's own mode may stop nobody.
        std::fs::set_permissions(state.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = state.path().display().to_string();
        in_child("sandbox::vm::ids::tests::under_umask_000_nobody_can_read_or_change_the_ids", &path, 0);
        let ids = dir(state.path());
        let taken: Vec<_> = std::fs::read_dir(&ids).unwrap().flatten().map(|e| e.path()).collect();
        assert_eq!(taken.len(), 1, "{taken:?}");
        let file = taken[0].display();
        assert!(!as_nobody(&format!("ls {}", ids.display())), "nobody lists the ids");
        assert!(!as_nobody(&format!("rm -f {file}")), "nobody frees a pod's id");
        assert!(!as_nobody(&format!("echo other > {file}")), "nobody rewrites a pod's id");
        assert!(!as_nobody(&format!("touch {}/901", ids.display())), "nobody takes an id");
        assert_eq!(holder(&taken[0]).as_deref(), Some("pod"));
    }

    #[test]
    fn shims_reclaiming_one_stale_id_at_once_never_both_get_it() {
        let range = IdRange { first: 300, count: 1 };
        for round in 0..100 {
            let state = tempfile::tempdir().unwrap();
            // The id's pod is gone without a release: whoever asks next may take it over.
            create_dir(&dir(state.path())).unwrap();
            std::fs::write(dir(state.path()).join("300"), "gone").unwrap();
            let racers = 4;
            let barrier = std::sync::Arc::new(std::sync::Barrier::new(racers));
            let threads: Vec<_> = (0..racers)
                .map(|i| {
                    let (state, barrier) = (state.path().to_owned(), barrier.clone());
                    std::thread::spawn(move || {
                        let pod = format!("p{i}");
                        pod_dir(&state, &pod);
                        barrier.wait();
                        allocate(&state, &pod, range).ok().map(|id| (id, pod))
                    })
                })
                .collect();
            let winners: Vec<_> = threads.into_iter().filter_map(|t| t.join().unwrap()).collect();
            assert_eq!(winners.len(), 1, "round {round}: {winners:?} all took the one stale id");
            let held = holder(&dir(state.path()).join("300"));
            assert_eq!(held.as_deref(), Some(winners[0].1.as_str()), "round {round}: the file names the winner");
        }
    }

    #[test]
    fn two_shims_at_once_never_share_an_id() {
        let state = tempfile::tempdir().unwrap();
        let range = IdRange { first: 7000, count: 64 };
        let threads: Vec<_> = (0..16)
            .map(|i| {
                let state = state.path().to_owned();
                std::thread::spawn(move || {
                    let pod = format!("p{i}");
                    std::fs::create_dir_all(state.join(&pod)).unwrap();
                    (0..4).map(|_| allocate(&state, &pod, range).unwrap()).collect::<Vec<_>>()
                })
            })
            .collect();
        let mut ids = Vec::new();
        for t in threads {
            let mine = t.join().unwrap();
            assert!(mine.windows(2).all(|w| w[0] == w[1]), "one pod, one id: {mine:?}");
            ids.push(mine[0]);
        }
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), 16, "every pod its own id");
    }
}
