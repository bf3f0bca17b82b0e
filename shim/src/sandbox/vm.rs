//! The `vm` backend's shape: spawn `bulkhead-vmm` for the pod, dial the agent through the
//! VMM's hybrid-vsock Unix socket (same handshake as the namespace backend), share rootfs
//! with virtio-fs. The VM issue fills it in; until then starting one is a clear error.

use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;

use super::{RootfsPlan, Sandbox, SandboxError, SandboxRequest};
use crate::agent::AgentClient;
use crate::config::{Backend, Config};
use crate::exit::ExitInfo;
use containerd_shim::protos::types::mount::Mount;

pub struct VmSandbox {
    _never: std::convert::Infallible,
}

impl VmSandbox {
    pub async fn start(_config: &Config, req: SandboxRequest) -> Result<Arc<Self>, SandboxError> {
        Err(SandboxError::NotImplemented {
            backend: "vm",
            reason: format!(
                "pod {}: the VMM integration is not built yet; set backend = \"namespace\" \
                 in the bulkhead config to run without VM isolation",
                req.sandbox_id
            ),
        })
    }
}

#[async_trait]
impl Sandbox for VmSandbox {
    fn backend(&self) -> Backend {
        Backend::Vm
    }
    fn pid(&self) -> u32 {
        match self._never {}
    }
    fn agent(&self) -> Arc<AgentClient> {
        match self._never {}
    }
    async fn prepare_container(&self, _: &str, _: &Path, _: &[Mount]) -> Result<RootfsPlan, SandboxError> {
        match self._never {}
    }
    async fn release_container(&self, _: &str) -> Result<(), SandboxError> {
        match self._never {}
    }
    async fn signal(&self, _: u32) -> Result<(), SandboxError> {
        match self._never {}
    }
    async fn wait(&self) -> ExitInfo {
        match self._never {}
    }
    async fn destroy(&self) -> Result<(), SandboxError> {
        match self._never {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn vm_backend_is_a_clear_error() {
        let err = VmSandbox::start(
            &Config::parse(Path::new("/c"), "").unwrap(),
            SandboxRequest {
                sandbox_id: "sb".into(),
                netns: None,
                cgroup: crate::sandbox::cgroups::PodCgroup::for_pod("sb", "k8s.io", None),
            },
        )
        .await
        .err()
        .unwrap();
        let text = err.to_string();
        assert!(text.contains("not implemented on this host"), "{text}");
    }
}
