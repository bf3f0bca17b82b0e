//! The Task service's error vocabulary, below every module that fails a Task RPC. How each
//! error reaches containerd (code and text) is decided in [`crate::trans`].

use crate::agent::AgentClientError;
use crate::config::ConfigError;
use crate::io::IoError;
use crate::sandbox::SandboxError;
use crate::spec::SpecError;

#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    #[error("{0}: not found")]
    NotFound(String),
    #[error("{0}: already exists")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    InvalidArgument(String),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error(transparent)]
    Agent(#[from] AgentClientError),
    #[error(transparent)]
    Io(#[from] IoError),
    /// What bulkhead does not do, and why: never a silent success.
    #[error("{0}")]
    Unimplemented(String),
    #[error("{0}")]
    Internal(String),
}
