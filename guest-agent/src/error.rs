//! The agent's error type and its mapping onto ttrpc status codes, so the shim can tell
//! "no such container" from "bad spec" from "agent broke".

use ttrpc::{get_status, Code};

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("{0} not found")]
    NotFound(String),
    #[error("{0} already exists")]
    AlreadyExists(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("internal: {0}")]
    Internal(String),
}

pub type Result<T> = std::result::Result<T, AgentError>;

impl AgentError {
    pub fn internal(ctx: &str, e: impl std::fmt::Display) -> Self {
        AgentError::Internal(format!("{ctx}: {e}"))
    }

    fn code(&self) -> Code {
        match self {
            AgentError::NotFound(_) => Code::NOT_FOUND,
            AgentError::AlreadyExists(_) => Code::ALREADY_EXISTS,
            AgentError::InvalidArgument(_) => Code::INVALID_ARGUMENT,
            AgentError::FailedPrecondition(_) => Code::FAILED_PRECONDITION,
            AgentError::Unsupported(_) => Code::UNIMPLEMENTED,
            AgentError::Timeout(_) => Code::DEADLINE_EXCEEDED,
            AgentError::Internal(_) => Code::INTERNAL,
        }
    }
}

impl From<AgentError> for ttrpc::Error {
    fn from(e: AgentError) -> Self {
        ttrpc::Error::RpcStatus(get_status(e.code(), e.to_string()))
    }
}

impl From<bulkhead_protocol::stream::IdError> for AgentError {
    fn from(e: bulkhead_protocol::stream::IdError) -> Self {
        AgentError::InvalidArgument(e.to_string())
    }
}
