//! Getting a template for a pod: use the one there, or build it once for every shim that needs
//! it at the same time, or tell the pod to boot cold.
//!
//! The key's lock (flock, so it crosses shim processes and dies with its holder) makes one shim
//! the builder; the others poll for it within their wait budget and then take what it published.
//! A shim that gets the lock after waiting and still finds no template does not build: the
//! builder before it failed, and retrying a failing build in every pod would multiply its cost.
//! An unusable template is moved aside and the pod boots cold; the caller rebuilds it in the
//! background ([`build`]), so the next pod is warm again.
//!
//! A failed build is remembered ([`super::backoff`]): until its backoff has passed, pods of the
//! key boot cold at once rather than each wait for, or start, a build that fails again.

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;

use super::backoff;
use super::collect::{collect, Room};
use super::error::TemplateError;
use super::key::KeyInputs;
use super::store::{KeyLock, Lookup, Template, TemplateStore};

/// How often a waiting shim looks at the lock.
const POLL: Duration = Duration::from_millis(25);
/// The longest a build may hold a key's lock, whatever the builder does.
pub const BUILD_TIMEOUT: Duration = Duration::from_secs(300);

/// Makes a template's files: boots a VM of the inputs' shape to "agent ready", with no pod's
/// state in it, and snapshots it into `dir` (an empty directory the store then seals).
/// A build that was cut short (its future dropped: a timeout, a signal) left its VM behind; the
/// key's lock holder then calls [`discard`](TemplateBuilder::discard).
#[async_trait]
pub trait TemplateBuilder: Send + Sync {
    async fn build(&self, inputs: &KeyInputs, dir: &Path) -> Result<(), String>;
    /// Removes what an unfinished build of `inputs` left outside its staging directory (the
    /// template VM's processes, state, network). Call only while holding the key's lock.
    async fn discard(&self, inputs: &KeyInputs);
}

/// What a pod gets.
#[derive(Debug)]
pub enum Obtained {
    /// A template was there, or another shim published it while this one waited.
    Ready(Template),
    /// This shim built it.
    Built(Template),
    /// No template: boot cold, for this reason.
    Cold(ColdReason),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ColdReason {
    /// One was there but not restorable; it was moved aside. Rebuild it in the background.
    Unusable { reason: String },
    /// This shim's build failed.
    BuildFailed { error: String },
    /// Another shim's build ended without a template.
    BuiltElsewhereFailed,
    /// Another shim was still building when the wait budget ran out.
    StillBuilding { waited: Duration },
    /// The store itself failed (disk, permissions).
    Store { error: String },
    /// A build of this key failed `ago`; the next may start in `next_in`.
    BackingOff { failures: u32, ago: Duration, next_in: Duration, error: String },
}

impl ColdReason {
    /// Whether the template should be rebuilt in the background.
    pub fn wants_rebuild(&self) -> bool {
        matches!(self, ColdReason::Unusable { .. })
    }
}

impl std::fmt::Display for ColdReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ColdReason::Unusable { reason } => write!(f, "the template was unusable ({reason}); moved aside"),
            ColdReason::BuildFailed { error } => write!(f, "building the template failed: {error}"),
            ColdReason::BuiltElsewhereFailed => write!(f, "another pod's build of the template ended without one"),
            ColdReason::StillBuilding { waited } => {
                write!(f, "another pod was still building the template after {waited:?}")
            }
            ColdReason::Store { error } => write!(f, "template store: {error}"),
            ColdReason::BackingOff { failures, ago, next_in, error } => write!(
                f,
                "template build failed {} s ago ({failures} in a row: {error}); next try in {} s",
                ago.as_secs(),
                next_in.as_secs()
            ),
        }
    }
}

/// The template for `inputs`: there, built now, or a reason to boot cold. Waits at most `wait`
/// for another shim's build.
pub async fn obtain(
    store: &TemplateStore,
    inputs: &KeyInputs,
    builder: &dyn TemplateBuilder,
    wait: Duration,
) -> Obtained {
    obtain_at(store, inputs, builder, wait, SystemTime::now()).await
}

/// [`obtain`], judging an earlier failed build's backoff as of `now`.
pub async fn obtain_at(
    store: &TemplateStore,
    inputs: &KeyInputs,
    builder: &dyn TemplateBuilder,
    wait: Duration,
    now: SystemTime,
) -> Obtained {
    let key = inputs.key();
    match store.lookup(&key) {
        Lookup::Ready(t) => return Obtained::Ready(t),
        Lookup::Unusable { reason } => {
            // Whoever holds the lock is already dealing with it.
            if let Ok(Some(lock)) = store.try_lock(&key) {
                set_aside(store, &key, &lock);
            }
            return Obtained::Cold(ColdReason::Unusable { reason });
        }
        Lookup::Missing => {}
    }
    if let Some(reason) = backing_off(store, &key, now) {
        return Obtained::Cold(reason);
    }
    let started = Instant::now();
    let mut waited = false;
    loop {
        let lock = match store.try_lock(&key) {
            Ok(Some(lock)) => lock,
            Ok(None) if started.elapsed() >= wait => {
                return Obtained::Cold(ColdReason::StillBuilding { waited: started.elapsed() })
            }
            Ok(None) => {
                waited = true;
                tokio::time::sleep(POLL).await;
                continue;
            }
            Err(e) => return Obtained::Cold(ColdReason::Store { error: e.to_string() }),
        };
        match store.lookup(&key) {
            Lookup::Ready(t) => return Obtained::Ready(t),
            Lookup::Unusable { reason } => {
                set_aside(store, &key, &lock);
                return Obtained::Cold(ColdReason::Unusable { reason });
            }
            Lookup::Missing if waited => return Obtained::Cold(ColdReason::BuiltElsewhereFailed),
            Lookup::Missing => {}
        }
        // Another shim's build may have failed between the first look and the lock.
        if let Some(reason) = backing_off(store, &key, now) {
            return Obtained::Cold(reason);
        }
        return match build_locked(store, inputs, builder, &lock, std::future::pending()).await {
            Ok(t) => Obtained::Built(t),
            Err(e) => Obtained::Cold(ColdReason::BuildFailed { error: e.to_string() }),
        };
    }
}

/// A collection pass before a build of `inputs` ([`super::collect`]), leaving room for it: an
/// error if the store stays over its ceiling (what is kept is busy or recent enough).
async fn make_room(store: &TemplateStore, inputs: &KeyInputs) -> Result<(), TemplateError> {
    let key = inputs.key();
    let room = Room { templates: 1, bytes: inputs.memory_mib.bytes().unwrap_or(u64::MAX) };
    let (owned_store, owned_inputs) = (store.clone(), inputs.clone());
    let pass = tokio::task::spawn_blocking(move || {
        let ceiling = *owned_store.ceiling();
        collect(&owned_store, &owned_inputs, &ceiling, room, SystemTime::now())
    })
    .await
    .map_err(|e| TemplateError::BadBuild { key: key.clone(), why: format!("collection task: {e}") })??;
    if !pass.removed.is_empty() {
        tracing::info!(template = %key, removed = pass.removed.len(), kept = pass.kept, "template: store collected before a build");
    }
    if !pass.fits {
        return Err(TemplateError::Full { key, templates: pass.kept, mib: pass.kept_bytes >> 20 });
    }
    Ok(())
}

/// Why to boot cold while an earlier failed build of `key` holds builds off at `now`.
fn backing_off(store: &TemplateStore, key: &super::id::TemplateKey, now: SystemTime) -> Option<ColdReason> {
    let failure = backoff::last(store, key)?;
    let held = failure.held_off(now)?;
    Some(ColdReason::BackingOff {
        failures: failure.failures,
        ago: held.ago,
        next_in: held.next_in,
        error: failure.error,
    })
}

fn set_aside(store: &TemplateStore, key: &super::id::TemplateKey, lock: &KeyLock) {
    if let Lookup::Unusable { reason } = store.lookup(key) {
        if let Err(e) = store.quarantine(key, &reason, lock) {
            tracing::warn!(template = %key, error = %e, "template: unusable template not moved aside");
        }
    }
}

/// Builds `inputs`' template unless a usable one is there (an unusable one is moved aside
/// first), waiting at most `wait` for the key's lock. For background rebuilds and
/// `bulkhead-ctl template build`.
pub async fn build(
    store: &TemplateStore,
    inputs: &KeyInputs,
    builder: &dyn TemplateBuilder,
    wait: Duration,
) -> Result<Template, TemplateError> {
    build_unless(store, inputs, builder, wait, std::future::pending()).await
}

/// [`build`], ended early when `stop` completes (with the reason): a build under way then
/// discards its VM while it still holds the key's lock, so no other build or removal of the key
/// can come between.
pub async fn build_unless(
    store: &TemplateStore,
    inputs: &KeyInputs,
    builder: &dyn TemplateBuilder,
    wait: Duration,
    stop: impl Future<Output = String>,
) -> Result<Template, TemplateError> {
    let key = inputs.key();
    let started = Instant::now();
    tokio::pin!(stop);
    let lock = loop {
        if let Some(lock) = store.try_lock(&key)? {
            break lock;
        }
        if started.elapsed() >= wait {
            return Err(TemplateError::Busy { key, waited: started.elapsed() });
        }
        tokio::select! {
            _ = tokio::time::sleep(POLL) => {}
            why = &mut stop => return Err(TemplateError::Stopped { key, why }),
        }
    };
    match store.lookup(&key) {
        Lookup::Ready(t) => return Ok(t),
        Lookup::Unusable { .. } => set_aside(store, &key, &lock),
        Lookup::Missing => {}
    }
    build_locked(store, inputs, builder, &lock, stop).await
}

/// Builds and publishes under `lock`, and remembers how it went: a failure holds the key's next
/// builds off ([`backoff`]), a success forgets earlier failures. A build told to stop did not
/// fail.
async fn build_locked(
    store: &TemplateStore,
    inputs: &KeyInputs,
    builder: &dyn TemplateBuilder,
    lock: &KeyLock,
    stop: impl Future<Output = String>,
) -> Result<Template, TemplateError> {
    let key = inputs.key();
    let built = build_and_publish(store, inputs, builder, lock, stop).await;
    match &built {
        Ok(_) => backoff::clear(store, &key, lock),
        Err(TemplateError::Stopped { .. }) => {}
        Err(error) => match backoff::record(store, &key, &error.to_string(), SystemTime::now(), lock) {
            Ok(f) => tracing::warn!(
                template = %key,
                failures = f.failures,
                next_try_in_s = f.backoff().as_secs(),
                "template: build failed; pods of this key boot cold until the next try"
            ),
            Err(e) => tracing::warn!(template = %key, error = %e, "template: failed build not recorded"),
        },
    }
    built
}

async fn build_and_publish(
    store: &TemplateStore,
    inputs: &KeyInputs,
    builder: &dyn TemplateBuilder,
    lock: &KeyLock,
    stop: impl Future<Output = String>,
) -> Result<Template, TemplateError> {
    let key = inputs.key();
    make_room(store, inputs).await?;
    store.sweep_staging(&key, lock);
    let staging = store.stage(&key, lock)?;
    let started = Instant::now();
    tracing::info!(template = %key, vcpus = inputs.vcpus, memory_mib = inputs.memory_mib.get(), "template: building");
    let cut_short = tokio::select! {
        built = tokio::time::timeout(BUILD_TIMEOUT, builder.build(inputs, staging.path())) => match built {
            Ok(Ok(())) => None,
            Ok(Err(error)) => return Err(TemplateError::BadBuild { key, why: error }),
            Err(_) => Some(TemplateError::BadBuild { key: key.clone(), why: format!("not done within {BUILD_TIMEOUT:?}") }),
        },
        why = stop => Some(TemplateError::Stopped { key: key.clone(), why }),
    };
    if let Some(error) = cut_short {
        // The build's future is gone mid-way; its VM is not. Still under the lock (the staging
        // directory goes on return).
        tracing::warn!(template = %key, %error, "template: build cut short; discarding its VM");
        builder.discard(inputs).await;
        return Err(error);
    }
    // Hashing and syncing guest memory is long blocking I/O: off the runtime's threads, with
    // the key's lock carried along.
    let (owned_store, owned_inputs, owned_lock) = (store.clone(), inputs.clone(), lock.clone());
    let template = tokio::task::spawn_blocking(move || owned_store.publish(&owned_inputs, staging, &owned_lock))
        .await
        .map_err(|e| TemplateError::BadBuild { key: key.clone(), why: format!("publishing task: {e}") })??;
    tracing::info!(template = %key, bytes = template.bytes(), elapsed_ms = started.elapsed().as_millis() as u64, "template: published");
    Ok(template)
}
