//! Snapshot templates for warm pods (issue 22): a VM booted to "agent ready" with no pod's state,
//! snapshotted once per [`key`] and restored by every pod of that key.
//!
//! This part is the cache: [`key`] (what a template depends on, hashed, into an [`id`]), [`store`] (the
//! directory layout, atomic publication, checks on lookup, quarantine), [`flight`] (one build
//! per key across all shims, the others waiting within their budget or booting cold),
//! [`backoff`] (a failed build holds the key's next ones off) and [`collect`] (the store's
//! ceiling: old builds', idle and least recently used templates go), with one [`error`]. Building a
//! template is [`super::template_builder`]'s job; choosing one for a pod, or booting cold, is
//! `warm.rs`'s; `bulkhead-ctl template ls|build|rm|gc` manages them on a node.

pub mod backoff;
pub mod collect;
pub mod error;
pub mod flight;
pub mod id;
pub mod key;
pub mod store;

pub use backoff::{BuildFailure, BACKOFF_BASE, BACKOFF_CAP};
pub use collect::{collect, Collection, Room};
pub use error::TemplateError;
pub use flight::{build, build_unless, obtain, obtain_at, ColdReason, Obtained, TemplateBuilder, BUILD_TIMEOUT};
pub use id::{BadKey, TemplateKey};
pub use key::{memory_bucket, KeyInputs, KeySources};
pub use store::{Ceiling, Listed, Lookup, Template, TemplateStore};
