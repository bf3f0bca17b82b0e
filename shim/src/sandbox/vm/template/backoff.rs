//! Remembers a key's failed template build, so that its pods boot cold at once instead of each
//! waiting for a build that fails again, and the next build of the key waits for a backoff.
//!
//! ```text
//! <root>/.failures/<key>.json     {"failures": n, "at_unix": t, "error": "..."}
//! ```
//!
//! Written under the key's lock when a build fails, removed when one publishes. The n-th failure
//! in a row holds builds off for [`BACKOFF_BASE`]·2^(n-1), at most [`BACKOFF_CAP`]. A marker is
//! trusted only as a regular file owned by the store's owner (root on a node) and writable by no
//! one else, read with a size limit; anything else is ignored (and replaced at the next failure),
//! so a stray file cannot hold warm starts off.

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::error::TemplateError;
use super::id::TemplateKey;
use super::store::{KeyLock, TemplateStore};

/// How long builds of a key are held off after its first failure in a row.
pub const BACKOFF_BASE: Duration = Duration::from_secs(30);
/// The longest hold-off, however many builds failed.
pub const BACKOFF_CAP: Duration = Duration::from_secs(10 * 60);
/// A marker is a few hundred bytes; a larger one is not ours.
const MAX_MARKER_BYTES: u64 = 4096;
/// The error is kept for the log line of each pod that boots cold, not for a post-mortem.
const MAX_ERROR_CHARS: usize = 1024;
const DIR: &str = ".failures";

/// A key's last failed build.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BuildFailure {
    /// Failed builds in a row.
    pub failures: u32,
    /// When the last one failed (seconds since the epoch).
    pub at_unix: u64,
    pub error: String,
}

/// Builds are held off: the last failed `ago`, the next may start in `next_in`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldOff {
    pub ago: Duration,
    pub next_in: Duration,
}

impl BuildFailure {
    /// How long this failure holds builds off.
    pub fn backoff(&self) -> Duration {
        let doublings = self.failures.saturating_sub(1).min(16);
        BACKOFF_BASE.saturating_mul(1 << doublings).min(BACKOFF_CAP)
    }

    /// Whether builds are still held off at `now`. A failure dated in the future (the clock was
    /// set back) holds them off for one backoff at most.
    pub fn held_off(&self, now: SystemTime) -> Option<HeldOff> {
        let now = now.duration_since(UNIX_EPOCH).unwrap_or_default();
        let at = Duration::from_secs(self.at_unix);
        let ago = now.saturating_sub(at);
        let next_in = (at + self.backoff()).saturating_sub(now).min(self.backoff());
        (!next_in.is_zero()).then_some(HeldOff { ago, next_in })
    }
}

fn marker(store: &TemplateStore, key: &TemplateKey) -> PathBuf {
    store.root().join(DIR).join(format!("{key}.json"))
}

/// `key`'s last failed build, if a trusted marker records one.
pub fn last(store: &TemplateStore, key: &TemplateKey) -> Option<BuildFailure> {
    let path = marker(store, key);
    match read(&path) {
        Ok(found) => found,
        Err(why) => {
            tracing::warn!(template = %key, marker = %path.display(), why, "template: build-failure marker ignored");
            None
        }
    }
}

fn read(path: &std::path::Path) -> Result<Option<BuildFailure>, String> {
    // O_NONBLOCK: a FIFO put there must not hang the pod's start; it fails the checks below.
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("open: {e}")),
    };
    let meta = file.metadata().map_err(|e| format!("stat: {e}"))?;
    let owner = nix::unistd::geteuid().as_raw();
    if !meta.is_file() || meta.uid() != owner || meta.mode() & 0o022 != 0 {
        return Err(format!(
            "not a regular file of uid {owner} writable by no one else (uid {}, mode {:o})",
            meta.uid(),
            meta.mode()
        ));
    }
    let mut bytes = Vec::new();
    file.take(MAX_MARKER_BYTES + 1).read_to_end(&mut bytes).map_err(|e| format!("read: {e}"))?;
    if bytes.len() as u64 > MAX_MARKER_BYTES {
        return Err(format!("larger than {MAX_MARKER_BYTES} bytes"));
    }
    serde_json::from_slice(&bytes).map(Some).map_err(|e| format!("not a marker: {e}"))
}

/// Records a failed build of `key` at `now`, one more in a row than the trusted marker there.
pub fn record(
    store: &TemplateStore,
    key: &TemplateKey,
    error: &str,
    now: SystemTime,
    _lock: &KeyLock,
) -> Result<BuildFailure, TemplateError> {
    let io = |what: String| move |source| TemplateError::Io { what, source };
    let dir = store.root().join(DIR);
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io(format!("create {}", dir.display()))(e)),
    }
    let meta = std::fs::symlink_metadata(&dir).map_err(io(format!("stat {}", dir.display())))?;
    if !meta.is_dir() || meta.uid() != nix::unistd::geteuid().as_raw() {
        return Err(TemplateError::UnsafeRoot {
            root: store.root().to_owned(),
            why: format!("{} is not this user's directory", dir.display()),
        });
    }
    let failure = BuildFailure {
        failures: last(store, key).map_or(1, |f| f.failures.saturating_add(1)),
        at_unix: now.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs(),
        error: error.chars().take(MAX_ERROR_CHARS).collect(),
    };
    let json = serde_json::to_vec(&failure).map_err(|e| TemplateError::Io {
        what: "encode the build-failure marker".into(),
        source: std::io::Error::other(e),
    })?;
    // Written beside, then renamed over: a reader sees the old marker or the new one whole.
    let path = marker(store, key);
    let tmp = dir.join(format!(".{key}.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&tmp)
        .and_then(|mut f| f.write_all(&json))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(format!("write {}", path.display()))(e));
    }
    Ok(failure)
}

/// Forgets `key`'s failed builds: one has just published.
pub fn clear(store: &TemplateStore, key: &TemplateKey, _lock: &KeyLock) {
    let path = marker(store, key);
    match std::fs::remove_file(&path) {
        Ok(()) => tracing::info!(template = %key, "template: earlier failed builds forgotten"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(template = %key, error = %e, "template: build-failure marker not removed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn failure(failures: u32, at_unix: u64) -> BuildFailure {
        BuildFailure { failures, at_unix, error: "boom".into() }
    }

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn the_backoff_doubles_per_failure_up_to_its_cap() {
        let secs: Vec<u64> = (1..=7).map(|n| failure(n, 0).backoff().as_secs()).collect();
        assert_eq!(secs, [30, 60, 120, 240, 480, 600, 600]);
        assert_eq!(failure(u32::MAX, 0).backoff(), BACKOFF_CAP);
    }

    #[test]
    fn builds_are_held_off_until_the_backoff_has_passed() {
        let f = failure(2, 1_000);
        assert_eq!(
            f.held_off(at(1_010)),
            Some(HeldOff { ago: Duration::from_secs(10), next_in: Duration::from_secs(50) })
        );
        assert_eq!(f.held_off(at(1_060)), None);
        assert_eq!(f.held_off(at(5_000)), None);
        // The clock set back an hour: one backoff at most, not an hour and one.
        let held = failure(2, 10_000).held_off(at(10_000 - 3_600)).unwrap();
        assert_eq!((held.ago, held.next_in), (Duration::ZERO, Duration::from_secs(60)));
    }

    fn store() -> (tempfile::TempDir, TemplateStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = TemplateStore::open(&dir.path().join("templates")).unwrap();
        (dir, store)
    }

    fn key() -> TemplateKey {
        TemplateKey::parse(&"ab".repeat(32)).unwrap()
    }

    #[test]
    fn failures_count_up_and_a_publish_clears_them() {
        let (_dir, store) = store();
        let lock = store.try_lock(&key()).unwrap().unwrap();
        assert_eq!(last(&store, &key()), None);
        let first = record(&store, &key(), "copy state: EXDEV", at(100), &lock).unwrap();
        assert_eq!(first, BuildFailure { failures: 1, at_unix: 100, error: "copy state: EXDEV".into() });
        let long = "x".repeat(10_000);
        let second = record(&store, &key(), &long, at(200), &lock).unwrap();
        assert_eq!((second.failures, second.at_unix, second.error.len()), (2, 200, MAX_ERROR_CHARS));
        assert_eq!(last(&store, &key()), Some(second));
        clear(&store, &key(), &lock);
        assert_eq!(last(&store, &key()), None);
        assert_eq!(record(&store, &key(), "again", at(300), &lock).unwrap().failures, 1, "counted afresh");
    }

    #[test]
    fn an_untrusted_marker_is_ignored() {
        let (_dir, store) = store();
        let lock = store.try_lock(&key()).unwrap().unwrap();
        record(&store, &key(), "boom", at(100), &lock).unwrap();
        let path = marker(&store, &key());
        let good = std::fs::read(&path).unwrap();
        type Spoil = fn(&std::path::Path, &[u8]);
        let cases: [(&str, Spoil); 5] = [
            ("writable by others", |p, _| std::fs::set_permissions(p, PermissionsExt::from_mode(0o666)).unwrap()),
            ("too large", |p, good| {
                let mut v: serde_json::Value = serde_json::from_slice(good).unwrap();
                v["error"] = "x".repeat(MAX_MARKER_BYTES as usize).into();
                std::fs::write(p, serde_json::to_vec(&v).unwrap()).unwrap();
            }),
            ("not JSON", |p, _| std::fs::write(p, "{").unwrap()),
            ("a link", |p, _| {
                let target = p.with_extension("target");
                std::fs::rename(p, &target).unwrap();
                std::os::unix::fs::symlink(&target, p).unwrap();
            }),
            ("a FIFO", |p, _| nix::unistd::mkfifo(p, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap()),
        ];
        for (what, spoil) in cases {
            let _ = std::fs::remove_file(&path);
            std::fs::write(&path, &good).unwrap();
            std::fs::set_permissions(&path, PermissionsExt::from_mode(0o600)).unwrap();
            assert!(last(&store, &key()).is_some(), "{what}: the good marker is read");
            if what == "a FIFO" {
                std::fs::remove_file(&path).unwrap();
            }
            spoil(&path, &good);
            assert_eq!(last(&store, &key()), None, "{what}");
        }
        // The next failure replaces whatever was there.
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, "{").unwrap();
        assert_eq!(record(&store, &key(), "boom", at(100), &lock).unwrap().failures, 1);
    }
}
