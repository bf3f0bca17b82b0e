//! What every `bulkhead-ctl` command returns: its [`Outcome`], or a [`CtlError`].

use std::path::PathBuf;

use serde_json::Value;

use crate::config::ConfigError;

#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    #[error("{0}")]
    Config(#[from] ConfigError),
    #[error("no pod matches {query:?} in {state_dir} (known: {known})")]
    NoPod { query: String, state_dir: PathBuf, known: String },
    #[error("{query:?} matches several pods: {matches}; give more of the id")]
    Ambiguous { query: String, matches: String },
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("{0}")]
    Failed(String),
}

pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> CtlError {
    let what = what.into();
    move |source| CtlError::Io { what, source }
}

/// What a command found: JSON for `--json`, text otherwise; `ok` false makes the exit code 1.
pub struct Outcome {
    pub json: Value,
    pub text: String,
    pub ok: bool,
}
