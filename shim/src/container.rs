//! One container of the pod: its role, its init process and its execs, and where its rootfs
//! is mounted. The Task RPCs in [`crate::task`] look containers up here.

use std::collections::HashMap;
use std::sync::Arc;

use crate::error::TaskError;
use crate::process::Process;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContainerKind {
    /// The pod sandbox (CRI's pause container): its process is the sandbox itself.
    Sandbox,
    /// A workload container run by the agent.
    Workload,
}

pub struct Container {
    pub id: String,
    pub bundle: String,
    pub kind: ContainerKind,
    pub init: Arc<dyn Process>,
    pub execs: HashMap<String, Arc<dyn Process>>,
}

impl Container {
    /// The init process (`exec_id` empty) or one exec.
    pub fn process(&self, exec_id: &str) -> Result<Arc<dyn Process>, TaskError> {
        if exec_id.is_empty() {
            return Ok(self.init.clone());
        }
        self.execs.get(exec_id).cloned().ok_or_else(|| TaskError::NotFound(format!("exec {exec_id} of {}", self.id)))
    }
}
