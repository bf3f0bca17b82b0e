//! What goes wrong with templates: one error for the cache's modules and its callers.

use std::path::PathBuf;
use std::time::Duration;

use super::id::{BadKey, TemplateKey};

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error(transparent)]
    BadKey(#[from] BadKey),
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
