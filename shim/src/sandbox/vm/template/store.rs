//! The template cache on disk: one directory per key, published whole or not at all.
//!
//! ```text
//! <root>/                          0700, root's: a template's memory image holds what every warm
//!                                  pod of its key shares (KASLR slide, stack canaries, the CRNG
//!                                  state before its reseed), so no other local user reads it
//!   <key>/                         a template (0700): the VMM's snapshot files and template.json
//!                                  (0400; the jailed VMM opens them before it drops root)
//!   .staging-<key>-<pid>-<ns>/     a build in progress; never loaded, swept by the next builder
//!   .quarantine/<key>-<ns>/        templates found unusable, with reason.txt (the newest few kept)
//!   .locks/<key>.lock              flock: one builder (or remover) per key across all shims
//!   .digests/                      the key's file-digest memo (key.rs)
//!   .used/<key>                    empty; its mtime is the template's last warm start (collect.rs)
//! ```
//!
//! A build writes into its staging directory, then the store hashes every file, writes the
//! manifest, syncs, and renames the directory to its key with RENAME_NOREPLACE: a build killed at
//! any point leaves at most a staging directory, which no lookup loads. A lookup checks the
//! manifest against the key and every file against the manifest (type, owner, read-only mode,
//! size, and the digest of the small ones) before it answers Ready.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use bulkhead_vmm_api::memory::Mib;
use nix::fcntl::{Flock, FlockArg, RenameFlags};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::error::TemplateError;
use super::id::TemplateKey;
use super::key::KeyInputs;

/// The manifest's name in a template directory.
pub const MANIFEST: &str = "template.json";
/// The manifest's format; another value is a template of another shim release.
const FORMAT: u32 = 1;
const MAX_MANIFEST_BYTES: u64 = 64 * 1024;
/// A snapshot is a handful of files (state, memory, devices); more is not one of ours.
const MAX_FILES: usize = 16;
/// Files up to this size are hashed at every lookup; larger ones (guest memory) are checked by
/// size and left to the VMM's own snapshot checks, since hashing them would cost a warm start
/// more than it saves.
const VERIFY_AT_LOOKUP_BYTES: u64 = 4 << 20;
/// Quarantined templates kept for a post-mortem; older ones are deleted.
const KEEP_QUARANTINED: usize = 4;

const STAGING_PREFIX: &str = ".staging-";
const QUARANTINE: &str = ".quarantine";
const LOCKS: &str = ".locks";
const DIGESTS: &str = ".digests";
const USED: &str = ".used";
const TRASH_PREFIX: &str = ".removing-";

/// What a template directory says of itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: u32,
    pub key: TemplateKey,
    pub inputs: KeyInputs,
    pub files: Vec<ManifestFile>,
    pub created_unix: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestFile {
    pub name: String,
    pub size: u64,
    pub sha256: String,
}

/// A template that passed its checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    pub key: TemplateKey,
    pub dir: PathBuf,
    pub manifest: Manifest,
}

impl Template {
    /// Bytes of all its files.
    pub fn bytes(&self) -> u64 {
        self.manifest.files.iter().map(|f| f.size).sum()
    }
}

/// What a lookup found.
#[derive(Debug)]
pub enum Lookup {
    Ready(Template),
    Missing,
    /// There, but not restorable: corrupt, mismatched, unreadable or not ours alone.
    Unusable {
        reason: String,
    },
}

/// One row of [`TemplateStore::list`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum Listed {
    Ready { key: TemplateKey, bytes: u64, created_unix: u64, vcpus: u8, memory_mib: Mib, nic_mtus: Vec<u16> },
    Unusable { name: String, reason: String },
    Building { key: String, pid: u32 },
}

/// A build's directory; removed on drop unless published.
#[derive(Debug)]
pub struct Staging {
    name: String,
    path: PathBuf,
}

impl Staging {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.path.exists() {
            if let Err(e) = std::fs::remove_dir_all(&self.path) {
                tracing::warn!(dir = %self.path.display(), error = %e, "template: staging directory not removed");
            }
        }
    }
}

/// The exclusive right to build, quarantine or remove one key's template; released when the
/// last clone is dropped (and by the kernel when the holder dies). Clones let a blocking task
/// (publishing) carry the right with it.
#[derive(Debug, Clone)]
pub struct KeyLock {
    _lock: std::sync::Arc<Flock<File>>,
}

/// What the store may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ceiling {
    pub max_templates: usize,
    pub max_bytes: u64,
    pub max_idle: Duration,
}

impl Default for Ceiling {
    fn default() -> Self {
        Self { max_templates: 32, max_bytes: 32 << 30, max_idle: Duration::from_secs(14 * 24 * 3600) }
    }
}

/// Disk use of the files in `dir` (allocated blocks), not following links.
fn allocated_bytes(dir: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries.flatten().filter_map(|e| std::fs::symlink_metadata(e.path()).ok()).map(|m| m.blocks() * 512).sum()
}

/// The template cache at one root.
#[derive(Debug, Clone)]
pub struct TemplateStore {
    root: PathBuf,
    owner: u32,
    ceiling: Ceiling,
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> TemplateError {
    let what = what.into();
    move |source| TemplateError::Io { what, source }
}

fn now_ns() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos()
}

fn open_nofollow(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC).open(path)
}

/// A file name a manifest may list: one plain component, not the manifest, not hidden.
/// A manifest read from `file`, bounded by [`MAX_MANIFEST_BYTES`], and parsed.
fn read_manifest(file: &mut File) -> Result<Manifest, String> {
    let mut text = String::new();
    file.take(MAX_MANIFEST_BYTES + 1).read_to_string(&mut text).map_err(|e| format!("{MANIFEST}: {e}"))?;
    if text.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(format!("{MANIFEST}: larger than {MAX_MANIFEST_BYTES} bytes"));
    }
    serde_json::from_str(&text).map_err(|e| format!("{MANIFEST}: {e}"))
}

fn valid_file_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name != MANIFEST
        && !name.starts_with('.')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

fn sha256_of(file: &mut File) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            return Ok(hex::encode(hasher.finalize()));
        }
        hasher.update(&buf[..n]);
    }
}

impl TemplateStore {
    /// Opens the store at `root`, making it and its private directories if needed. `root` must
    /// be a real directory owned by this process's euid (root in production), writable by no one
    /// else; it is made 0700 (an earlier release's 0755 included): the VMMs open its files
    /// before they drop root, and no one else reads them.
    pub fn open(root: &Path) -> Result<Self, TemplateError> {
        let owner = nix::unistd::geteuid().as_raw();
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(root)
            .map_err(io(format!("create {}", root.display())))?;
        let meta = std::fs::symlink_metadata(root).map_err(io(format!("stat {}", root.display())))?;
        if !meta.is_dir() || meta.uid() != owner || meta.mode() & 0o022 != 0 {
            return Err(TemplateError::UnsafeRoot {
                root: root.to_owned(),
                why: format!(
                    "must be a directory (not a link) owned by uid {owner} and writable by no one else; it is {} uid {} mode {:o}",
                    if meta.is_symlink() { "a link" } else if meta.is_dir() { "a directory" } else { "a file" },
                    meta.uid(),
                    meta.mode() & 0o7777
                ),
            });
        }
        if meta.mode() & 0o077 != 0 {
            std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700))
                .map_err(io(format!("chmod {}", root.display())))?;
        }
        for private in [QUARANTINE, LOCKS, DIGESTS, USED] {
            let dir = root.join(private);
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io(format!("create {}", dir.display()))(e)),
            }
        }
        Ok(Self { root: root.to_owned(), owner, ceiling: Ceiling::default() })
    }

    /// The same store, kept within `ceiling` by the passes before each build.
    pub fn with_ceiling(self, ceiling: Ceiling) -> Self {
        Self { ceiling, ..self }
    }

    pub fn ceiling(&self) -> &Ceiling {
        &self.ceiling
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The digest memo for [`KeyInputs::of`].
    pub fn digests_dir(&self) -> PathBuf {
        self.root.join(DIGESTS)
    }

    fn root_dir(&self) -> Result<File, TemplateError> {
        File::open(&self.root).map_err(io(format!("open {}", self.root.display())))
    }

    /// Takes `key`'s lock if no one holds it.
    pub fn try_lock(&self, key: &TemplateKey) -> Result<Option<KeyLock>, TemplateError> {
        let path = self.root.join(LOCKS).join(format!("{key}.lock"));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(io(format!("open {}", path.display())))?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(Some(KeyLock { _lock: std::sync::Arc::new(lock) })),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, errno)) => Err(io(format!("flock {}", path.display()))(errno.into())),
        }
    }

    /// Looks `key` up and checks what is there.
    pub fn lookup(&self, key: &TemplateKey) -> Lookup {
        let dir = self.root.join(key.as_str());
        match std::fs::symlink_metadata(&dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Lookup::Missing,
            Err(e) => Lookup::Unusable { reason: format!("stat: {e}") },
            Ok(_) => match self.check(key, &dir) {
                Ok(manifest) => Lookup::Ready(Template { key: key.clone(), dir, manifest }),
                Err(reason) => Lookup::Unusable { reason },
            },
        }
    }

    fn check(&self, key: &TemplateKey, dir: &Path) -> Result<Manifest, String> {
        let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("stat: {e}"))?;
        if !meta.is_dir() {
            return Err("not a directory".into());
        }
        self.check_owned(&meta, "the directory", 0o022)?;
        let mut file = open_nofollow(&dir.join(MANIFEST)).map_err(|e| format!("{MANIFEST}: {e}"))?;
        let fmeta = file.metadata().map_err(|e| format!("{MANIFEST}: {e}"))?;
        if !fmeta.is_file() {
            return Err(format!("{MANIFEST}: not a regular file"));
        }
        self.check_owned(&fmeta, MANIFEST, 0o222)?;
        let manifest = read_manifest(&mut file)?;
        if manifest.format != FORMAT {
            return Err(format!("{MANIFEST}: format {} (this shim reads {FORMAT})", manifest.format));
        }
        if manifest.key != *key || manifest.inputs.key() != *key {
            return Err(format!("{MANIFEST}: its key or inputs do not give {key}"));
        }
        if manifest.files.is_empty() || manifest.files.len() > MAX_FILES {
            return Err(format!("{MANIFEST}: {} files (1..={MAX_FILES})", manifest.files.len()));
        }
        let mut listed = BTreeSet::new();
        for f in &manifest.files {
            if !valid_file_name(&f.name) || !listed.insert(f.name.as_str()) {
                return Err(format!("{MANIFEST}: bad or repeated file name {:?}", f.name));
            }
        }
        let mut present = BTreeSet::new();
        for entry in std::fs::read_dir(dir).map_err(|e| format!("read directory: {e}"))? {
            let entry = entry.map_err(|e| format!("read directory: {e}"))?;
            present.insert(entry.file_name().to_string_lossy().into_owned());
        }
        let expected: BTreeSet<String> =
            listed.iter().map(|n| n.to_string()).chain(std::iter::once(MANIFEST.to_string())).collect();
        if present != expected {
            let missing: Vec<_> = expected.difference(&present).collect();
            let extra: Vec<_> = present.difference(&expected).collect();
            return Err(format!("files differ from the manifest: missing {missing:?}, unexpected {extra:?}"));
        }
        for f in &manifest.files {
            let mut file = open_nofollow(&dir.join(&f.name)).map_err(|e| format!("{}: {e}", f.name))?;
            let meta = file.metadata().map_err(|e| format!("{}: {e}", f.name))?;
            if !meta.is_file() {
                return Err(format!("{}: not a regular file", f.name));
            }
            self.check_owned(&meta, &f.name, 0o222)?;
            if meta.len() != f.size {
                return Err(format!("{}: {} bytes, the manifest says {}", f.name, meta.len(), f.size));
            }
            if f.size <= VERIFY_AT_LOOKUP_BYTES {
                let digest = sha256_of(&mut file).map_err(|e| format!("{}: {e}", f.name))?;
                if digest != f.sha256 {
                    return Err(format!("{}: content differs from the manifest's digest", f.name));
                }
            }
        }
        Ok(manifest)
    }

    /// `forbidden`: mode bits that must be clear (write bits).
    fn check_owned(&self, meta: &std::fs::Metadata, what: &str, forbidden: u32) -> Result<(), String> {
        if meta.uid() != self.owner {
            return Err(format!("{what}: owned by uid {}, not {}", meta.uid(), self.owner));
        }
        if meta.mode() & forbidden != 0 {
            return Err(format!("{what}: mode {:o} is writable beyond the store's owner", meta.mode() & 0o7777));
        }
        Ok(())
    }

    /// Every name in the store that is a template key (checked or not).
    pub fn keys(&self) -> Result<Vec<TemplateKey>, TemplateError> {
        let entries = std::fs::read_dir(&self.root).map_err(io(format!("read {}", self.root.display())))?;
        let mut keys: Vec<TemplateKey> =
            entries.flatten().filter_map(|e| TemplateKey::parse(&e.file_name().to_string_lossy()).ok()).collect();
        keys.sort();
        Ok(keys)
    }

    /// `key`'s manifest, read (bounded) without checking the files against it: for collection,
    /// which needs the inputs and not a restorable template.
    pub fn manifest(&self, key: &TemplateKey) -> Result<Manifest, String> {
        let path = self.root.join(key.as_str()).join(MANIFEST);
        let mut file = open_nofollow(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        read_manifest(&mut file)
    }

    /// Disk use of `key`'s template (allocated blocks of its files).
    pub fn disk_bytes(&self, key: &TemplateKey) -> u64 {
        allocated_bytes(&self.root.join(key.as_str()))
    }

    /// Records a warm start from `key`'s template now (best effort: collection falls back to the
    /// template's creation time).
    pub fn mark_used(&self, key: &TemplateKey) {
        if let Err(e) = self.mark_used_at(key, std::time::SystemTime::now()) {
            tracing::debug!(template = %key, error = %e, "template: use not recorded");
        }
    }

    /// Records a use of `key`'s template at `at`.
    pub fn mark_used_at(&self, key: &TemplateKey, at: std::time::SystemTime) -> std::io::Result<()> {
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(self.root.join(USED).join(key.as_str()))?;
        file.set_modified(at)
    }

    /// When `key`'s template was last used, if that was recorded.
    pub fn last_used(&self, key: &TemplateKey) -> Option<std::time::SystemTime> {
        std::fs::symlink_metadata(self.root.join(USED).join(key.as_str())).and_then(|m| m.modified()).ok()
    }

    /// Removes what builds of `key` that died left behind. Call with `key`'s lock held: no live
    /// build of it can then exist.
    pub fn sweep_staging(&self, key: &TemplateKey, _lock: &KeyLock) {
        let prefix = format!("{STAGING_PREFIX}{key}-");
        let Ok(entries) = std::fs::read_dir(&self.root) else { return };
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                tracing::info!(dir = %entry.path().display(), "template: removing a dead build's staging directory");
                if let Err(e) = std::fs::remove_dir_all(entry.path()) {
                    tracing::warn!(dir = %entry.path().display(), error = %e, "template: staging directory not removed");
                }
            }
        }
    }

    /// A fresh, empty directory for a build of `key`.
    pub fn stage(&self, key: &TemplateKey, _lock: &KeyLock) -> Result<Staging, TemplateError> {
        let name = format!("{STAGING_PREFIX}{key}-{}-{}", std::process::id(), now_ns());
        let path = self.root.join(&name);
        std::fs::DirBuilder::new().mode(0o700).create(&path).map_err(io(format!("create {}", path.display())))?;
        // Whatever the umask: the directory is published as it is.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700))
            .map_err(io(format!("chmod {}", path.display())))?;
        Ok(Staging { name, path })
    }

    /// Seals `staging` (every file read-only and root's alone, hashed into the manifest, synced) and renames it
    /// to `key`; fails if a template of that key is already there.
    pub fn publish(&self, inputs: &KeyInputs, staging: Staging, _lock: &KeyLock) -> Result<Template, TemplateError> {
        let key = inputs.key();
        let bad = |why: String| TemplateError::BadBuild { key: key.clone(), why };
        let mut files = Vec::new();
        for entry in std::fs::read_dir(staging.path()).map_err(io(format!("read {}", staging.path().display())))? {
            let entry = entry.map_err(io(format!("read {}", staging.path().display())))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if !valid_file_name(&name) {
                return Err(bad(format!("the build left {name:?}, not a plain file name")));
            }
            let path = entry.path();
            let mut file = open_nofollow(&path).map_err(io(format!("open {}", path.display())))?;
            let meta = file.metadata().map_err(io(format!("stat {}", path.display())))?;
            if !meta.is_file() {
                return Err(bad(format!("the build left {name:?}, not a regular file")));
            }
            if meta.uid() != self.owner {
                return Err(bad(format!("{name:?} is owned by uid {}, not {}", meta.uid(), self.owner)));
            }
            file.set_permissions(std::fs::Permissions::from_mode(0o400))
                .map_err(io(format!("chmod {}", path.display())))?;
            let sha256 = sha256_of(&mut file).map_err(io(format!("hash {}", path.display())))?;
            file.sync_all().map_err(io(format!("sync {}", path.display())))?;
            files.push(ManifestFile { name, size: meta.len(), sha256 });
        }
        if files.is_empty() || files.len() > MAX_FILES {
            return Err(bad(format!("the build left {} files (1..={MAX_FILES})", files.len())));
        }
        files.sort_by(|a, b| a.name.cmp(&b.name));
        let created_unix = (now_ns() / 1_000_000_000) as u64;
        let manifest = Manifest { format: FORMAT, key: key.clone(), inputs: inputs.clone(), files, created_unix };
        let text = serde_json::to_vec_pretty(&manifest).map_err(|e| bad(format!("manifest: {e}")))?;
        let path = staging.path().join(MANIFEST);
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o400)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(io(format!("create {}", path.display())))?;
        file.write_all(&text).map_err(io(format!("write {}", path.display())))?;
        file.sync_all().map_err(io(format!("sync {}", path.display())))?;
        File::open(staging.path())
            .and_then(|d| d.sync_all())
            .map_err(io(format!("sync {}", staging.path().display())))?;
        let root = self.root_dir()?;
        nix::fcntl::renameat2(&root, staging.name.as_str(), &root, key.as_str(), RenameFlags::RENAME_NOREPLACE)
            .map_err(|e| io(format!("publish {} as {key}", staging.path().display()))(e.into()))?;
        root.sync_all().map_err(io(format!("sync {}", self.root.display())))?;
        let dir = self.root.join(key.as_str());
        // Published: the staging directory no longer exists, so its drop has nothing to do.
        drop(staging);
        Ok(Template { key, dir, manifest })
    }

    /// Moves `key`'s directory aside with `reason`, keeping the newest few such.
    pub fn quarantine(&self, key: &TemplateKey, reason: &str, _lock: &KeyLock) -> Result<PathBuf, TemplateError> {
        let name = format!("{key}-{}", now_ns());
        let root = self.root_dir()?;
        let target = Path::new(QUARANTINE).join(&name);
        nix::fcntl::renameat2(&root, key.as_str(), &root, &target, RenameFlags::RENAME_NOREPLACE)
            .map_err(|e| io(format!("quarantine {key}"))(e.into()))?;
        let moved = self.root.join(&target);
        tracing::warn!(template = %key, to = %moved.display(), reason, "template: unusable, moved aside");
        if let Err(e) = std::fs::write(moved.join("reason.txt"), format!("{reason}\n")) {
            tracing::debug!(error = %e, "template: reason.txt not written");
        }
        self.prune_quarantine();
        Ok(moved)
    }

    fn prune_quarantine(&self) {
        let dir = self.root.join(QUARANTINE);
        let Ok(entries) = std::fs::read_dir(&dir) else { return };
        // Names end in their quarantine time: sort by it, newest first.
        let mut names: Vec<(u128, PathBuf)> = entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let at = name.rsplit('-').next()?.parse().ok()?;
                Some((at, e.path()))
            })
            .collect();
        names.sort_by_key(|n| std::cmp::Reverse(n.0));
        for (_, old) in names.into_iter().skip(KEEP_QUARANTINED) {
            if let Err(e) = std::fs::remove_dir_all(&old) {
                tracing::warn!(dir = %old.display(), error = %e, "template: old quarantined template not removed");
            }
        }
    }

    /// Removes `key`'s template (a VMM restored from it keeps its open files). False if there
    /// was none.
    pub fn remove(&self, key: &TemplateKey, _lock: &KeyLock) -> Result<bool, TemplateError> {
        let trash = format!("{TRASH_PREFIX}{key}-{}", now_ns());
        let root = self.root_dir()?;
        match nix::fcntl::renameat2(&root, key.as_str(), &root, trash.as_str(), RenameFlags::RENAME_NOREPLACE) {
            Ok(()) => {}
            Err(nix::errno::Errno::ENOENT) => return Ok(false),
            Err(e) => return Err(io(format!("remove {key}"))(e.into())),
        }
        let path = self.root.join(&trash);
        std::fs::remove_dir_all(&path).map_err(io(format!("remove {}", path.display())))?;
        let _ = std::fs::remove_file(self.root.join(USED).join(key.as_str()));
        Ok(true)
    }

    /// Every template, unusable entry and build in progress, ordered by name.
    pub fn list(&self) -> Result<Vec<Listed>, TemplateError> {
        let mut rows = Vec::new();
        let mut names: Vec<String> = std::fs::read_dir(&self.root)
            .map_err(io(format!("read {}", self.root.display())))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        for name in names {
            if let Some(rest) = name.strip_prefix(STAGING_PREFIX) {
                let mut parts = rest.split('-');
                let (key, pid) = (parts.next().unwrap_or_default(), parts.next().and_then(|p| p.parse().ok()));
                rows.push(Listed::Building { key: key.to_string(), pid: pid.unwrap_or_default() });
                continue;
            }
            if name.starts_with('.') {
                continue;
            }
            let row = match TemplateKey::parse(&name) {
                Err(_) => Listed::Unusable { name, reason: "not a template key".into() },
                Ok(key) => match self.lookup(&key) {
                    Lookup::Ready(t) => Listed::Ready {
                        bytes: t.bytes(),
                        created_unix: t.manifest.created_unix,
                        vcpus: t.manifest.inputs.vcpus,
                        memory_mib: t.manifest.inputs.memory_mib,
                        nic_mtus: t.manifest.inputs.nic_mtus.clone(),
                        key,
                    },
                    Lookup::Unusable { reason } => Listed::Unusable { name, reason },
                    Lookup::Missing => continue,
                },
            };
            rows.push(row);
        }
        Ok(rows)
    }
}
