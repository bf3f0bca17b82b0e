//! containerd 2.x's sandbox API (`containerd.runtime.sandbox.v1.Sandbox`), served beside the Task
//! API when a runtime is configured with `sandboxer = "shim"`: CRI's RunPodSandbox then starts
//! the pod's VM through this service, with no pause container (no pause image to pull, unpack
//! and mount, and no pause task to create).
//!
//! Each call maps onto the sandbox task that the `podsandbox` path creates from the pause
//! container, so both paths share one sandbox lifecycle: CreateSandbox writes the spec the pause
//! container would have had (`pod_spec`) into the sandbox bundle and creates the sandbox task
//! from it; Start, Wait, Status and Stop are that task's. Shutdown deletes it and ends the shim.
//!
//! The shim answers `start` with bootstrap version 2 (a bare address) on this path too, so
//! containerd still runs `start` and `delete` for each container (pod grouping, cleanup after a
//! crash), as on the `podsandbox` path.

pub mod pod_spec;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use async_trait::async_trait;
use containerd_shim::api::{
    CreateTaskRequest, DeleteRequest, KillRequest, ShutdownRequest, StartRequest, StateRequest, WaitRequest,
};
use containerd_shim::protos::sandbox_api::{
    CreateSandboxRequest, CreateSandboxResponse, PingRequest, PingResponse, PlatformRequest, PlatformResponse,
    SandboxMetricsRequest, SandboxMetricsResponse, SandboxStatusRequest, SandboxStatusResponse, ShutdownSandboxRequest,
    ShutdownSandboxResponse, StartSandboxRequest, StartSandboxResponse, StopSandboxRequest, StopSandboxResponse,
    WaitSandboxRequest, WaitSandboxResponse,
};
use containerd_shim::protos::types::platform::Platform;
use containerd_shim::protos::types::task::Status;
use containerd_shim::Task;
use tracing::{info, Instrument};
use ttrpc::r#async::TtrpcContext;

use crate::events::timestamp;

/// The CRI state names containerd reads from `SandboxStatusResponse.state`.
const SANDBOX_READY: &str = "SANDBOX_READY";
const SANDBOX_NOTREADY: &str = "SANDBOX_NOTREADY";

/// SIGKILL: a pod VM has no graceful stop of its own; its containers were stopped before.
const SIGKILL: u32 = 9;

fn invalid(message: impl Into<String>) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(ttrpc::Code::INVALID_ARGUMENT, message.into()))
}

fn not_found(id: &str) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(ttrpc::Code::NOT_FOUND, format!("sandbox {id} not found")))
}

fn internal(message: impl Into<String>) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(ttrpc::Code::INTERNAL, message.into()))
}

fn is_not_found(e: &ttrpc::Error) -> bool {
    matches!(e, ttrpc::Error::RpcStatus(s) if s.code() == ttrpc::Code::NOT_FOUND)
}

/// The sandbox API of one shim, whose pod is `pod_id`.
pub struct SandboxService {
    pod_id: String,
    task: Arc<dyn Task + Send + Sync>,
    created_at: Mutex<Option<SystemTime>>,
}

impl SandboxService {
    pub fn new(pod_id: &str, task: Arc<dyn Task + Send + Sync>) -> Self {
        Self { pod_id: pod_id.into(), task, created_at: Mutex::new(None) }
    }

    /// A shim serves the one pod it was started for.
    fn check_id(&self, id: &str) -> ttrpc::Result<()> {
        if id == self.pod_id {
            Ok(())
        } else {
            Err(not_found(id))
        }
    }

    fn created_at(&self) -> Option<SystemTime> {
        *self.created_at.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn span(&self, op: &'static str) -> tracing::Span {
        tracing::info_span!("sandbox_api", op, pod = %self.pod_id)
    }

    async fn state(&self, ctx: &TtrpcContext) -> ttrpc::Result<containerd_shim::api::StateResponse> {
        self.task.state(ctx, StateRequest { id: self.pod_id.clone(), ..Default::default() }).await
    }

    async fn do_create(&self, ctx: &TtrpcContext, req: CreateSandboxRequest) -> ttrpc::Result<CreateSandboxResponse> {
        let pod = pod_spec::decode(req.options.as_ref()).map_err(|e| invalid(e.to_string()))?;
        let bundle = Path::new(&req.bundle_path);
        if !bundle.is_absolute() || !bundle.is_dir() {
            return Err(invalid(format!("bundle_path {:?} is not an existing absolute directory", req.bundle_path)));
        }
        if !req.rootfs.is_empty() {
            return Err(invalid("a sandbox rootfs is not supported: bulkhead's pod sandbox is its VM"));
        }
        // containerd's sandbox bundle is ours to fill: it holds no spec, and goes at delete.
        let resolv_conf = match pod_spec::resolv_conf(pod.dns_config.as_ref()) {
            Some(text) => {
                let path = bundle.join("resolv.conf");
                std::fs::write(&path, text).map_err(|e| internal(format!("write {}: {e}", path.display())))?;
                Some(path)
            }
            None => None,
        };
        let spec = pod_spec::sandbox_spec(&self.pod_id, &req.netns_path, &pod, resolv_conf.as_deref());
        let bytes = serde_json::to_vec(&spec).map_err(|e| internal(format!("encode sandbox spec: {e}")))?;
        let config = bundle.join("config.json");
        std::fs::write(&config, bytes).map_err(|e| internal(format!("write {}: {e}", config.display())))?;
        info!(netns = %req.netns_path, "creating the pod sandbox from its pod config");
        let create =
            CreateTaskRequest { id: self.pod_id.clone(), bundle: req.bundle_path.clone(), ..Default::default() };
        self.task.create(ctx, create).await?;
        Ok(CreateSandboxResponse::default())
    }
}

#[async_trait]
impl containerd_shim::protos::sandbox_async::Sandbox for SandboxService {
    async fn create_sandbox(
        &self,
        ctx: &TtrpcContext,
        req: CreateSandboxRequest,
    ) -> ttrpc::Result<CreateSandboxResponse> {
        self.check_id(&req.sandbox_id)?;
        self.do_create(ctx, req).instrument(self.span("create")).await
    }

    async fn start_sandbox(&self, ctx: &TtrpcContext, req: StartSandboxRequest) -> ttrpc::Result<StartSandboxResponse> {
        self.check_id(&req.sandbox_id)?;
        let span = self.span("start");
        async move {
            let started = self.task.start(ctx, StartRequest { id: self.pod_id.clone(), ..Default::default() }).await?;
            let now = SystemTime::now();
            *self.created_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(now);
            info!(pid = started.pid, "pod sandbox started");
            Ok(StartSandboxResponse { pid: started.pid, created_at: Some(timestamp(now)).into(), ..Default::default() })
        }
        .instrument(span)
        .await
    }

    async fn platform(&self, _ctx: &TtrpcContext, req: PlatformRequest) -> ttrpc::Result<PlatformResponse> {
        self.check_id(&req.sandbox_id)?;
        let architecture = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            other => other,
        };
        let platform = Platform { os: "linux".into(), architecture: architecture.into(), ..Default::default() };
        Ok(PlatformResponse { platform: Some(platform).into(), ..Default::default() })
    }

    /// Idempotent: containerd calls it on StopPodSandbox and again on RemovePodSandbox.
    async fn stop_sandbox(&self, ctx: &TtrpcContext, req: StopSandboxRequest) -> ttrpc::Result<StopSandboxResponse> {
        self.check_id(&req.sandbox_id)?;
        let span = self.span("stop");
        async move {
            let state = match self.state(ctx).await {
                Ok(state) => state,
                Err(e) if is_not_found(&e) => return Ok(StopSandboxResponse::default()),
                Err(e) => return Err(e),
            };
            if matches!(state.status.enum_value(), Ok(Status::STOPPED)) {
                return Ok(StopSandboxResponse::default());
            }
            let kill = KillRequest { id: self.pod_id.clone(), signal: SIGKILL, all: true, ..Default::default() };
            self.task.kill(ctx, kill).await?;
            // Answered once the sandbox has exited, so a Status after Stop says NOTREADY.
            self.task.wait(ctx, WaitRequest { id: self.pod_id.clone(), ..Default::default() }).await?;
            info!("pod sandbox stopped");
            Ok(StopSandboxResponse::default())
        }
        .instrument(span)
        .await
    }

    /// Blocks for the sandbox's whole life: containerd marks the pod NOTREADY when it returns.
    async fn wait_sandbox(&self, ctx: &TtrpcContext, req: WaitSandboxRequest) -> ttrpc::Result<WaitSandboxResponse> {
        self.check_id(&req.sandbox_id)?;
        let exit = self.task.wait(ctx, WaitRequest { id: self.pod_id.clone(), ..Default::default() }).await?;
        Ok(WaitSandboxResponse { exit_status: exit.exit_status, exited_at: exit.exited_at, ..Default::default() })
    }

    async fn sandbox_status(
        &self,
        ctx: &TtrpcContext,
        req: SandboxStatusRequest,
    ) -> ttrpc::Result<SandboxStatusResponse> {
        self.check_id(&req.sandbox_id)?;
        let state = self.state(ctx).await?;
        let ready = matches!(state.status.enum_value(), Ok(Status::RUNNING | Status::CREATED));
        let stopped = matches!(state.status.enum_value(), Ok(Status::STOPPED));
        Ok(SandboxStatusResponse {
            sandbox_id: self.pod_id.clone(),
            pid: state.pid,
            state: if ready { SANDBOX_READY } else { SANDBOX_NOTREADY }.into(),
            created_at: self.created_at().map(timestamp).into(),
            exited_at: if stopped { state.exited_at } else { None.into() },
            ..Default::default()
        })
    }

    async fn ping_sandbox(&self, ctx: &TtrpcContext, req: PingRequest) -> ttrpc::Result<PingResponse> {
        self.check_id(&req.sandbox_id)?;
        self.state(ctx).await?;
        Ok(PingResponse::default())
    }

    /// Deletes the sandbox and ends the shim: containerd then runs `delete` for the pod, which
    /// finds nothing left, and does not kill the shim itself.
    async fn shutdown_sandbox(
        &self,
        ctx: &TtrpcContext,
        req: ShutdownSandboxRequest,
    ) -> ttrpc::Result<ShutdownSandboxResponse> {
        self.check_id(&req.sandbox_id)?;
        let span = self.span("shutdown");
        async move {
            match self.task.delete(ctx, DeleteRequest { id: self.pod_id.clone(), ..Default::default() }).await {
                Ok(_) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(e),
            }
            self.task.shutdown(ctx, ShutdownRequest { id: self.pod_id.clone(), ..Default::default() }).await?;
            info!("pod sandbox shut down");
            Ok(ShutdownSandboxResponse::default())
        }
        .instrument(span)
        .await
    }

    /// Pod stats come from the pod's host cgroup on this path (containerd 2.1 never calls this).
    async fn sandbox_metrics(
        &self,
        _ctx: &TtrpcContext,
        req: SandboxMetricsRequest,
    ) -> ttrpc::Result<SandboxMetricsResponse> {
        self.check_id(&req.sandbox_id)?;
        Err(ttrpc::Error::RpcStatus(ttrpc::get_status(
            ttrpc::Code::UNIMPLEMENTED,
            "SandboxMetrics: bulkhead reports pod stats through the pod's cgroup and the Task API's Stats",
        )))
    }
}
