//! A template's key: everything that must match for a snapshot to be restorable as a pod's VM.
//! The guest kernel, the initramfs (the agent), the VMM build (its snapshot format and device
//! models), the VM shape (vCPUs, memory, and the MTU of each NIC: virtio-mmio NICs are fixed at
//! boot, and the guest takes its largest MTU from the device) and the agent's protocol version;
//! a change in any gives a new key, so a stale template is never restored, only left unused.
//!
//! Hashing a 30 MiB kernel on every pod start would cost more than a restore, so each file's
//! digest is remembered under the store's `.digests/`, keyed by the file's identity (device,
//! inode) and checked against its size, mtime and ctime: a rewritten file changes its ctime,
//! which no user can set. A file changed within the last [`RACY_WINDOW`] is not remembered
//! (git's "racily clean" case: a rewrite within one timestamp tick keeps the ctime).

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::error::TemplateError;
use bulkhead_vmm_api::memory::Mib;

use super::id::TemplateKey;

/// Bumped when what a key covers changes.
const KEY_SCHEME: &str = "bulkhead-template-key-v2";
/// A memo entry is one short JSON line; anything larger is not ours.
const MAX_MEMO_BYTES: u64 = 1024;
/// Files whose ctime is younger than this are hashed every time.
const RACY_WINDOW: std::time::Duration = std::time::Duration::from_secs(2);

/// The guest memory of the template a pod needing `exact` MiB restores: the next step of a fixed
/// ladder, so that pods whose limits differ a little share one template instead of each
/// building its own (a tenant varying its limit by 1 MiB must not cost the node a build per
/// pod). Steps: 64 MiB up to 1 GiB, 256 MiB up to 4 GiB, 1 GiB above. The pod's own limits
/// still hold inside the guest (its containers' cgroups); what the bucket adds is memory the
/// guest has but no container may use, and that costs the host nothing until touched (the
/// restored memory is mapped copy-on-write). `None` when the step would pass `max` and
/// `exact` does too; a step above `max` is cut to it.
pub fn memory_bucket(exact: Mib, max: Mib) -> Option<Mib> {
    let (exact, max) = (exact.get(), max.get());
    let step = match exact {
        0..=1024 => 64,
        1025..=4096 => 256,
        _ => 1024,
    };
    let bucket = exact.max(1).div_ceil(step) * step;
    let bucket = if bucket > max && exact <= max { max } else { bucket };
    (bucket <= max).then_some(Mib(bucket))
}

/// What a template is built from; its [`TemplateKey`] is their hash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyInputs {
    pub kernel_sha256: String,
    pub initramfs_sha256: String,
    pub vmm_sha256: String,
    pub vcpus: u8,
    pub memory_mib: Mib,
    /// One per NIC, in order (empty: a host-network pod's VM, with none).
    #[serde(default)]
    pub nic_mtus: Vec<u16>,
    pub agent_protocol: u32,
}

/// The files a template is built from, and the VM shape.
#[derive(Debug, Clone, Copy)]
pub struct KeySources<'a> {
    pub kernel: &'a Path,
    pub initramfs: &'a Path,
    pub vmm: &'a Path,
    pub vcpus: u8,
    pub memory_mib: Mib,
    pub nic_mtus: &'a [u16],
}

impl<'a> KeySources<'a> {
    /// The node's files as the shim config names them, with a VM shape.
    pub fn of_config(vm: &'a crate::config::VmSettings, vcpus: u8, memory_mib: Mib, nic_mtus: &'a [u16]) -> Self {
        Self { kernel: &vm.kernel_path, initramfs: &vm.initramfs_path, vmm: &vm.vmm_path, vcpus, memory_mib, nic_mtus }
    }
}

impl KeyInputs {
    /// Hashes the sources' files (through the digest memo in `memo_dir`, when given) and takes
    /// the agent protocol version this shim speaks.
    pub fn of(sources: &KeySources<'_>, memo_dir: Option<&Path>) -> Result<Self, TemplateError> {
        Ok(Self {
            kernel_sha256: file_sha256(sources.kernel, memo_dir)?,
            initramfs_sha256: file_sha256(sources.initramfs, memo_dir)?,
            vmm_sha256: file_sha256(sources.vmm, memo_dir)?,
            vcpus: sources.vcpus,
            memory_mib: sources.memory_mib,
            nic_mtus: sources.nic_mtus.to_vec(),
            agent_protocol: bulkhead_protocol::PROTOCOL_VERSION,
        })
    }

    pub fn key(&self) -> TemplateKey {
        let nics: Vec<String> = self.nic_mtus.iter().map(u16::to_string).collect();
        let text = format!(
            "{KEY_SCHEME}\nkernel={}\ninitramfs={}\nvmm={}\nvcpus={}\nmemory_mib={}\nnic_mtus={}\nagent_protocol={}\n",
            self.kernel_sha256,
            self.initramfs_sha256,
            self.vmm_sha256,
            self.vcpus,
            self.memory_mib.get(),
            nics.join(","),
            self.agent_protocol
        );
        TemplateKey(hex::encode(Sha256::digest(text.as_bytes())))
    }
}

/// What the memo holds for one file.
#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct MemoEntry {
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
    sha256: String,
}

fn ns(secs: i64, nanos: i64) -> i128 {
    i128::from(secs) * 1_000_000_000 + i128::from(nanos)
}

impl MemoEntry {
    fn of(meta: &std::fs::Metadata, sha256: String) -> Self {
        Self {
            size: meta.size(),
            mtime_ns: ns(meta.mtime(), meta.mtime_nsec()),
            ctime_ns: ns(meta.ctime(), meta.ctime_nsec()),
            sha256,
        }
    }

    fn matches(&self, meta: &std::fs::Metadata) -> bool {
        self.size == meta.size()
            && self.mtime_ns == ns(meta.mtime(), meta.mtime_nsec())
            && self.ctime_ns == ns(meta.ctime(), meta.ctime_nsec())
    }
}

fn memo_path(dir: &Path, meta: &std::fs::Metadata) -> PathBuf {
    dir.join(format!("{}-{}.json", meta.dev(), meta.ino()))
}

/// SHA-256 of the file at `path` in hex, from the memo when the file is unchanged.
pub fn file_sha256(path: &Path, memo_dir: Option<&Path>) -> Result<String, TemplateError> {
    file_sha256_racy(path, memo_dir, RACY_WINDOW)
}

fn file_sha256_racy(path: &Path, memo_dir: Option<&Path>, racy: std::time::Duration) -> Result<String, TemplateError> {
    let io = |source| TemplateError::Io { what: format!("hash {}", path.display()), source };
    let mut file = File::open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(TemplateError::Io {
            what: format!("hash {}", path.display()),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file"),
        });
    }
    let memo = memo_dir.map(|dir| memo_path(dir, &meta));
    if let Some(entry) = memo.as_deref().and_then(read_memo) {
        if entry.matches(&meta) {
            return Ok(entry.sha256);
        }
    }
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    let sha256 = hex::encode(hasher.finalize());
    // Remember the digest only if the file did not change while it was read and is not
    // racily new.
    let after = file.metadata().map_err(io)?;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let settled = ns(meta.ctime(), meta.ctime_nsec()) + racy.as_nanos() as i128 <= now.as_nanos() as i128;
    if let (Some(memo), true) = (memo, settled) {
        let entry = MemoEntry::of(&meta, sha256.clone());
        if entry.matches(&after) {
            if let Err(e) = write_memo(&memo, &entry) {
                // Only an optimisation: the next start hashes again.
                tracing::debug!(memo = %memo.display(), error = %e, "template: digest memo not written");
            }
        }
    }
    Ok(sha256)
}

fn read_memo(path: &Path) -> Option<MemoEntry> {
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path).ok()?;
    let mut text = String::new();
    file.take(MAX_MEMO_BYTES + 1).read_to_string(&mut text).ok()?;
    if text.len() as u64 > MAX_MEMO_BYTES {
        return None;
    }
    serde_json::from_str(&text).ok()
}

fn write_memo(path: &Path, entry: &MemoEntry) -> std::io::Result<()> {
    let tmp: PathBuf = path.with_extension(format!("tmp-{}", std::process::id()));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)?;
    let line = serde_json::to_string(entry).map_err(std::io::Error::other)?;
    file.write_all(line.as_bytes())?;
    drop(file);
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sources(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
        let (k, i, v) = (dir.join("vmlinux"), dir.join("initramfs"), dir.join("vmm"));
        std::fs::write(&k, b"kernel").unwrap();
        std::fs::write(&i, b"initramfs").unwrap();
        std::fs::write(&v, b"vmm").unwrap();
        (k, i, v)
    }

    #[test]
    fn pods_of_nearby_limits_share_a_few_memory_buckets() {
        let max = 1 << 20;
        // 50 pods of 100..149 MiB on 256 MiB of guest overhead: two templates, not fifty.
        let bucket_of = |exact: u64, max: u64| memory_bucket(Mib(exact), Mib(max)).map(Mib::get);
        let buckets: std::collections::BTreeSet<u64> =
            (100..150).map(|limit| bucket_of(limit + 256, max).unwrap()).collect();
        assert_eq!(buckets.into_iter().collect::<Vec<_>>(), [384, 448]);
        for (exact, bucket) in [(1, 64), (256, 256), (257, 320), (1024, 1024), (1025, 1280), (4097, 5120)] {
            assert_eq!(bucket_of(exact, max), Some(bucket), "{exact} MiB");
            assert!(bucket_of(exact, max).unwrap() >= exact, "never smaller than the pod");
        }
        // Near the largest VM, the bucket is cut to it; beyond it there is none.
        assert_eq!(bucket_of(1000, 1010), Some(1010));
        assert_eq!(bucket_of(1011, 1010), None);
    }

    fn inputs(k: &Path, i: &Path, v: &Path, vcpus: u8, memory_mib: u64, memo: Option<&Path>) -> KeyInputs {
        with_nics(k, i, v, vcpus, memory_mib, &[], memo)
    }

    fn with_nics(
        k: &Path,
        i: &Path,
        v: &Path,
        vcpus: u8,
        memory_mib: u64,
        nic_mtus: &[u16],
        memo: Option<&Path>,
    ) -> KeyInputs {
        let memory_mib = Mib(memory_mib);
        KeyInputs::of(&KeySources { kernel: k, initramfs: i, vmm: v, vcpus, memory_mib, nic_mtus }, memo).unwrap()
    }

    #[test]
    fn a_changed_kernel_or_shape_gives_a_new_key() {
        let dir = tempfile::tempdir().unwrap();
        let (k, i, v) = sources(dir.path());
        let base = inputs(&k, &i, &v, 1, 256, None).key();
        assert_eq!(inputs(&k, &i, &v, 1, 256, None).key(), base, "the same inputs give the same key");
        assert_ne!(inputs(&k, &i, &v, 2, 256, None).key(), base, "vCPUs");
        assert_ne!(inputs(&k, &i, &v, 1, 512, None).key(), base, "memory");
        let one_nic = with_nics(&k, &i, &v, 1, 256, &[1500], None).key();
        assert_ne!(one_nic, base, "a NIC");
        assert_ne!(with_nics(&k, &i, &v, 1, 256, &[9001], None).key(), one_nic, "its MTU");
        assert_ne!(with_nics(&k, &i, &v, 1, 256, &[1500, 1500], None).key(), one_nic, "a second NIC");
        assert_eq!(with_nics(&k, &i, &v, 1, 256, &[1500], None).key(), one_nic);
        std::fs::write(&k, b"another kernel").unwrap();
        assert_ne!(inputs(&k, &i, &v, 1, 256, None).key(), base, "kernel");
    }

    #[test]
    fn the_memo_serves_an_unchanged_file_and_not_a_changed_one() {
        let dir = tempfile::tempdir().unwrap();
        let memo = dir.path().join("memo");
        std::fs::create_dir(&memo).unwrap();
        let (k, _, _) = sources(dir.path());
        let real = hex::encode(Sha256::digest(b"kernel"));
        assert_eq!(file_sha256_racy(&k, Some(&memo), std::time::Duration::ZERO).unwrap(), real);
        assert_eq!(std::fs::read_dir(&memo).unwrap().count(), 1, "the digest is remembered");
        // A memo that matches the file's stat is believed (so it is what answers)...
        let meta = std::fs::metadata(&k).unwrap();
        let planted = "f".repeat(64);
        let entry = serde_json::to_string(&MemoEntry::of(&meta, planted.clone())).unwrap();
        std::fs::write(memo_path(&memo, &meta), &entry).unwrap();
        assert_eq!(file_sha256(&k, Some(&memo)).unwrap(), planted);
        // ...and one whose ctime differs (a rewrite of the same size) is not.
        let mut stale = MemoEntry::of(&meta, planted.clone());
        stale.ctime_ns -= 1;
        std::fs::write(memo_path(&memo, &meta), serde_json::to_string(&stale).unwrap()).unwrap();
        assert_eq!(file_sha256(&k, Some(&memo)).unwrap(), real);
    }

    #[test]
    fn a_racily_new_file_is_not_remembered() {
        let dir = tempfile::tempdir().unwrap();
        let memo = dir.path().join("memo");
        std::fs::create_dir(&memo).unwrap();
        let (k, _, _) = sources(dir.path());
        file_sha256(&k, Some(&memo)).unwrap();
        assert_eq!(std::fs::read_dir(&memo).unwrap().count(), 0);
    }

    #[test]
    fn a_corrupt_memo_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let memo = dir.path().join("memo");
        std::fs::create_dir(&memo).unwrap();
        let (k, _, _) = sources(dir.path());
        let meta = std::fs::metadata(&k).unwrap();
        std::fs::write(memo_path(&memo, &meta), "{not json").unwrap();
        assert_eq!(file_sha256(&k, Some(&memo)).unwrap(), hex::encode(Sha256::digest(b"kernel")));
        std::fs::write(memo_path(&memo, &meta), "x".repeat(4096)).unwrap();
        assert_eq!(file_sha256(&k, Some(&memo)).unwrap(), hex::encode(Sha256::digest(b"kernel")));
    }

    #[test]
    fn keys_parse_only_as_64_hex_digits() {
        let key = TemplateKey::parse(&"a".repeat(64)).unwrap();
        assert_eq!(key.short(), "aaaaaaaaaaaa");
        for bad in ["", "abc", &"A".repeat(64), &"g".repeat(64), &format!("../{}", "a".repeat(61))] {
            assert!(TemplateKey::parse(bad).is_err(), "{bad:?}");
        }
        assert!(serde_json::from_str::<TemplateKey>("\"zz\"").is_err());
    }
}
