//! A container's bundle directory under the agent's state dir: `config.json` (the rewritten
//! spec libcontainer creates the container from), `seccomp.bpf` (the compiled filters, applied
//! to the container's execs too) and each exec's process JSON.

use std::path::{Path, PathBuf};

use oci_spec::runtime::{Process, Spec};

use crate::{
    error::{AgentError, Result},
    rollback::Rollback,
};

const SECCOMP_FILE: &str = "seccomp.bpf";

/// Makes `dir` afresh (a leftover of a failed create is removed first) and registers its removal.
pub fn create(dir: &Path, undo: &mut Rollback<'_>) -> Result<()> {
    if dir.exists() {
        let _ = std::fs::remove_dir_all(dir);
    }
    std::fs::create_dir_all(dir).map_err(|e| AgentError::internal("mkdir bundle", e))?;
    let made = dir.to_path_buf();
    undo.push(format!("remove bundle {}", dir.display()), move || std::fs::remove_dir_all(made));
    Ok(())
}

pub fn write_seccomp(dir: &Path, bpf: &[u8]) -> Result<PathBuf> {
    let f = dir.join(SECCOMP_FILE);
    std::fs::write(&f, bpf).map_err(|e| AgentError::internal("write seccomp.bpf", e))?;
    Ok(f)
}

/// The container's compiled seccomp filters, if it has a profile.
pub fn seccomp_file(dir: &Path) -> Option<PathBuf> {
    let f = dir.join(SECCOMP_FILE);
    f.exists().then_some(f)
}

pub fn write_config(dir: &Path, spec: &Spec) -> Result<()> {
    let json = serde_json::to_vec_pretty(spec).map_err(|e| AgentError::internal("spec", e))?;
    std::fs::write(dir.join("config.json"), json).map_err(|e| AgentError::internal("write config.json", e))
}

pub fn write_exec_process(dir: &Path, exec_id: &str, process: &Process) -> Result<PathBuf> {
    let path = dir.join(format!("exec-{exec_id}.json"));
    std::fs::write(&path, serde_json::to_vec(process).map_err(|e| AgentError::internal("process", e))?)
        .map_err(|e| AgentError::internal("write process.json", e))?;
    Ok(path)
}

/// Removes the bundle at container removal.
pub fn remove(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
}
