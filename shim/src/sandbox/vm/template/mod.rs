//! Snapshot templates for warm pods (issue 22): a VM booted to "agent ready" with no pod's state,
//! snapshotted once per [`key`] and restored by every pod of that key.
//!
//! This part is the cache: [`key`] (what a template depends on, hashed), [`store`] (the
//! directory layout, atomic publication, checks on lookup, quarantine), [`flight`] (one build
//! per key across all shims, the others waiting within their budget or booting cold),
//! [`backoff`] (a failed build holds the key's next ones off) and [`collect`] (the store's
//! ceiling: old builds', idle and least recently used templates go). Building a
//! template is [`super::template_builder`]'s job; choosing one for a pod, or booting cold, is
//! `warm.rs`'s; `bulkhead-ctl template ls|build|rm|gc` manages them on a node.

pub mod backoff;
pub mod collect;
pub mod flight;
pub mod key;
pub mod store;

use std::path::PathBuf;
use std::time::Duration;

pub use backoff::{BuildFailure, BACKOFF_BASE, BACKOFF_CAP};
pub use collect::{collect, Collection, Room};
pub use flight::{build, build_unless, obtain, obtain_at, ColdReason, Obtained, TemplateBuilder, BUILD_TIMEOUT};
pub use key::{memory_bucket_mib, KeyInputs, KeySources, TemplateKey};
pub use store::{Ceiling, Listed, Lookup, Template, TemplateStore};

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("{0:?} is not a template key (64 lowercase hex digits)")]
    BadKey(String),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("template store {root}: {why}")]
    UnsafeRoot { root: PathBuf, why: String },
    #[error("template {key}: {why}")]
    BadBuild { key: TemplateKey, why: String },
    #[error("template {key}: another build still held it after {waited:?}")]
    Busy { key: TemplateKey, waited: Duration },
    #[error("template {key}: {why}: the build was stopped before it published anything")]
    Stopped { key: TemplateKey, why: String },
    #[error(
        "template {key}: the store is full ({templates} templates, {mib} MiB kept, busy ones included); \
         raise vm.template_max_count or vm.template_max_size, or remove templates (bulkhead-ctl template rm)"
    )]
    Full { key: TemplateKey, templates: usize, mib: u64 },
}
