//! Keeps the template store within its ceiling: templates of another build of the node's files
//! (an update changed the kernel, initramfs, VMM or agent protocol: no pod can use them again),
//! templates no pod restored for `max_idle`, and then the least recently used ones until the
//! store holds at most `max_templates` using at most `max_bytes` of disk, with room for the
//! build about to start.
//!
//! A pass runs before every build (under the new key's lock, so a store at its ceiling refuses
//! the build and the pod boots cold) and from `bulkhead-ctl template gc`. Removing a template
//! takes its key's lock, so one being built or removed elsewhere is left alone; a VMM restored
//! from one keeps its open files. Last use is the time of a usage mark (`.used/<key>`, touched
//! by each warm start), else the template's creation.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::error::TemplateError;
use super::id::TemplateKey;
use super::key::KeyInputs;
use super::store::{Ceiling, TemplateStore};

/// Room a pass must leave for a template about to be built: one more template of about
/// `bytes` (its guest memory: the memory file's upper bound).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Room {
    pub templates: usize,
    pub bytes: u64,
}

/// Why a template went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Why {
    /// Made from other node files or another agent protocol than the current ones.
    OtherBuild,
    /// Not restored for longer than the ceiling's `max_idle`.
    Idle { days: u64 },
    /// The least recently used while the store was over its ceiling.
    OverCeiling,
}

impl std::fmt::Display for Why {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Why::OtherBuild => f.write_str("made from other node files (kernel, initramfs, VMM or agent protocol)"),
            Why::Idle { days } => write!(f, "not used for {days} days"),
            Why::OverCeiling => f.write_str("least recently used while the store was over its ceiling"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removed {
    pub key: TemplateKey,
    pub bytes: u64,
    pub why: Why,
}

/// What a pass did and left.
#[derive(Debug, Default)]
pub struct Collection {
    pub removed: Vec<Removed>,
    pub kept: usize,
    pub kept_bytes: u64,
    /// Whether the store, as left, has the room asked for.
    pub fits: bool,
}

/// One template as a pass sees it.
struct Entry {
    key: TemplateKey,
    inputs: KeyInputs,
    /// Disk use: allocated blocks (the memory file is sparse).
    bytes: u64,
    last_used: SystemTime,
}

/// Whether `inputs` were made from the same node files and agent protocol as `current`.
fn same_build(inputs: &KeyInputs, current: &KeyInputs) -> bool {
    inputs.kernel_sha256 == current.kernel_sha256
        && inputs.initramfs_sha256 == current.initramfs_sha256
        && inputs.vmm_sha256 == current.vmm_sha256
        && inputs.agent_protocol == current.agent_protocol
}

/// One pass over `store` (module docs); `current` carries the node's files' digests (its shape
/// is not used). Templates whose lock someone holds are kept.
pub fn collect(
    store: &TemplateStore,
    current: &KeyInputs,
    ceiling: &Ceiling,
    room: Room,
    now: SystemTime,
) -> Result<Collection, TemplateError> {
    let mut entries = Vec::new();
    for key in store.keys()? {
        // A template that does not read as one is the lookup's to move aside, not ours.
        let Ok(manifest) = store.manifest(&key) else { continue };
        let bytes = store.disk_bytes(&key);
        let created = UNIX_EPOCH + Duration::from_secs(manifest.created_unix);
        let last_used = store.last_used(&key).unwrap_or(created);
        entries.push(Entry { key, inputs: manifest.inputs, bytes, last_used });
    }
    let mut collection = Collection::default();
    let mut kept = Vec::new();
    for entry in entries {
        let idle = now.duration_since(entry.last_used).unwrap_or_default();
        let why = if !same_build(&entry.inputs, current) {
            Some(Why::OtherBuild)
        } else if idle > ceiling.max_idle {
            Some(Why::Idle { days: idle.as_secs() / 86_400 })
        } else {
            None
        };
        match why {
            Some(why) if remove(store, &entry, why.clone(), &mut collection)? => {}
            _ => kept.push(entry),
        }
    }
    // Least recently used first.
    kept.sort_by_key(|e| e.last_used);
    let over = |kept: &[Entry]| {
        let bytes: u64 = kept.iter().map(|e| e.bytes).sum();
        kept.len() + room.templates > ceiling.max_templates || bytes.saturating_add(room.bytes) > ceiling.max_bytes
    };
    let mut i = 0;
    while over(&kept[i..]) && i < kept.len() {
        if remove(store, &kept[i], Why::OverCeiling, &mut collection)? {
            kept.remove(i);
        } else {
            // Busy: it stays, and counts.
            i += 1;
        }
    }
    collection.fits = !over(&kept);
    collection.kept = kept.len();
    collection.kept_bytes = kept.iter().map(|e| e.bytes).sum();
    Ok(collection)
}

/// Removes `entry` under its key's lock; false if someone else holds the lock.
fn remove(store: &TemplateStore, entry: &Entry, why: Why, collection: &mut Collection) -> Result<bool, TemplateError> {
    let Some(lock) = store.try_lock(&entry.key)? else { return Ok(false) };
    if store.remove(&entry.key, &lock)? {
        tracing::info!(template = %entry.key, bytes = entry.bytes, %why, "template: collected");
        collection.removed.push(Removed { key: entry.key.clone(), bytes: entry.bytes, why });
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::vm::template::store::Template;

    /// A published template of `inputs` whose memory file holds `bytes` of data.
    fn publish_fake(store: &TemplateStore, inputs: &KeyInputs, bytes: usize) -> Template {
        let key = inputs.key();
        let lock = store.try_lock(&key).unwrap().unwrap();
        let staging = store.stage(&key, &lock).unwrap();
        std::fs::write(staging.path().join("memory"), vec![7u8; bytes]).unwrap();
        store.publish(inputs, staging, &lock).unwrap()
    }

    fn inputs(memory_mib: u64, vmm: &str) -> KeyInputs {
        KeyInputs {
            kernel_sha256: "k".repeat(64),
            initramfs_sha256: "i".repeat(64),
            vmm_sha256: vmm.repeat(64),
            vcpus: 1,
            memory_mib: bulkhead_vmm_api::memory::Mib(memory_mib),
            nic_mtus: vec![],
            agent_protocol: bulkhead_protocol::PROTOCOL_VERSION,
        }
    }

    fn keys(c: &Collection) -> Vec<(u32, Why)> {
        c.removed.iter().map(|r| (r.bytes as u32, r.why.clone())).collect()
    }

    #[test]
    fn other_builds_idle_and_least_recently_used_templates_go() {
        let dir = tempfile::tempdir().unwrap();
        let store = TemplateStore::open(&dir.path().join("t")).unwrap();
        let now = SystemTime::now();
        // Four of the current build, used 4, 3, 2 and 1 hours ago; one of an older VMM; one idle.
        let mut current = Vec::new();
        for (i, mib) in [384u64, 448, 512, 576].into_iter().enumerate() {
            let t = publish_fake(&store, &inputs(mib, "v"), 4096);
            store.mark_used_at(&t.key, now - Duration::from_secs(3600 * (4 - i as u64))).unwrap();
            current.push(t.key);
        }
        let old = publish_fake(&store, &inputs(384, "o"), 4096).key;
        let idle = publish_fake(&store, &inputs(640, "v"), 4096).key;
        store.mark_used_at(&idle, now - Duration::from_secs(30 * 86_400)).unwrap();
        let ceiling = Ceiling { max_templates: 3, max_bytes: 1 << 40, max_idle: Duration::from_secs(14 * 86_400) };
        let this = inputs(256, "v");
        let pass = collect(&store, &this, &ceiling, Room { templates: 1, bytes: 0 }, now).unwrap();
        let gone: Vec<&TemplateKey> = pass.removed.iter().map(|r| &r.key).collect();
        assert!(gone.contains(&&old) && gone.contains(&&idle), "{:?}", keys(&pass));
        let why_of = |k: &TemplateKey| pass.removed.iter().find(|r| &r.key == k).map(|r| r.why.clone());
        assert_eq!(why_of(&old), Some(Why::OtherBuild));
        assert_eq!(why_of(&idle), Some(Why::Idle { days: 30 }));
        // Room for one more within three: the two least recently used of the current four go.
        assert_eq!(why_of(&current[0]), Some(Why::OverCeiling));
        assert_eq!(why_of(&current[1]), Some(Why::OverCeiling));
        assert!(pass.fits && pass.kept == 2, "{pass:?}");
        assert!(store.keys().unwrap().iter().all(|k| k == &current[2] || k == &current[3]));
    }

    #[test]
    fn a_busy_template_stays_and_a_full_store_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let store = TemplateStore::open(&dir.path().join("t")).unwrap();
        let t = publish_fake(&store, &inputs(384, "v"), 1 << 20);
        assert!(store.disk_bytes(&t.key) > 1 << 20, "its data and its manifest");
        let ceiling = Ceiling { max_templates: 1, ..Ceiling::default() };
        let held = store.try_lock(&t.key).unwrap().unwrap();
        let pass =
            collect(&store, &inputs(256, "v"), &ceiling, Room { templates: 1, bytes: 0 }, SystemTime::now()).unwrap();
        assert!(!pass.fits && pass.removed.is_empty() && pass.kept == 1, "{pass:?}");
        drop(held);
        // A disk ceiling: the template's allocated bytes plus the room asked for.
        let ceiling = Ceiling { max_templates: 10, max_bytes: 3 << 20, max_idle: Ceiling::default().max_idle };
        let pass =
            collect(&store, &inputs(256, "v"), &ceiling, Room { templates: 1, bytes: 1 << 20 }, SystemTime::now())
                .unwrap();
        assert!(pass.fits && pass.kept == 1, "1 MiB and a bit + 1 MiB fit in 3 MiB: {pass:?}");
        let pass =
            collect(&store, &inputs(256, "v"), &ceiling, Room { templates: 1, bytes: 2 << 20 }, SystemTime::now())
                .unwrap();
        assert!(pass.fits && pass.kept == 0 && pass.removed[0].why == Why::OverCeiling, "{pass:?}");
    }
}
