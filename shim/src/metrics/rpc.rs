//! RPC latency histograms around the Task service: [`MeasuredTask`] is what the shim registers
//! with ttrpc; it times each call into the real service and records it in [`PodMetrics`], so the
//! RPC code itself carries no timing.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use containerd_shim::api::{
    CheckpointTaskRequest, CloseIORequest, ConnectRequest, ConnectResponse, CreateTaskRequest, CreateTaskResponse,
    DeleteRequest, ExecProcessRequest, KillRequest, PauseRequest, PidsRequest, PidsResponse, ResizePtyRequest,
    ResumeRequest, ShutdownRequest, StartRequest, StartResponse, StateRequest, StateResponse, StatsRequest,
    StatsResponse, UpdateTaskRequest, WaitRequest, WaitResponse,
};
use containerd_shim::protos::protobuf::well_known_types::empty::Empty;
use containerd_shim::{DeleteResponse, Task, TtrpcContext, TtrpcResult};

use super::PodMetrics;

/// The Task service, timed.
pub struct MeasuredTask<T> {
    inner: T,
    metrics: Arc<PodMetrics>,
}

impl<T> MeasuredTask<T> {
    pub fn new(inner: T, metrics: Arc<PodMetrics>) -> Self {
        Self { inner, metrics }
    }
}

macro_rules! measured {
    ($($method:ident($req:ty) -> $resp:ty;)*) => {
        #[async_trait]
        impl<T: Task + Send + Sync> Task for MeasuredTask<T> {
            $(
                async fn $method(&self, ctx: &TtrpcContext, req: $req) -> TtrpcResult<$resp> {
                    let started = Instant::now();
                    let result = self.inner.$method(ctx, req).await;
                    self.metrics.observe_rpc(stringify!($method), result.is_ok(), started.elapsed());
                    result
                }
            )*

            /// Not timed: it lasts as long as the process it waits for.
            async fn wait(&self, ctx: &TtrpcContext, req: WaitRequest) -> TtrpcResult<WaitResponse> {
                self.inner.wait(ctx, req).await
            }
        }
    };
}

measured! {
    state(StateRequest) -> StateResponse;
    create(CreateTaskRequest) -> CreateTaskResponse;
    start(StartRequest) -> StartResponse;
    delete(DeleteRequest) -> DeleteResponse;
    pids(PidsRequest) -> PidsResponse;
    pause(PauseRequest) -> Empty;
    resume(ResumeRequest) -> Empty;
    checkpoint(CheckpointTaskRequest) -> Empty;
    kill(KillRequest) -> Empty;
    exec(ExecProcessRequest) -> Empty;
    resize_pty(ResizePtyRequest) -> Empty;
    close_io(CloseIORequest) -> Empty;
    update(UpdateTaskRequest) -> Empty;
    stats(StatsRequest) -> StatsResponse;
    connect(ConnectRequest) -> ConnectResponse;
    shutdown(ShutdownRequest) -> Empty;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Task service that answers `state` and fails `kill`, and whose `wait` never ends.
    struct Fake;

    #[async_trait]
    impl Task for Fake {
        async fn state(&self, _: &TtrpcContext, _: StateRequest) -> TtrpcResult<StateResponse> {
            Ok(StateResponse::default())
        }
        async fn kill(&self, _: &TtrpcContext, _: KillRequest) -> TtrpcResult<Empty> {
            Err(ttrpc::Error::Others("no".into()))
        }
    }

    fn ctx() -> TtrpcContext {
        TtrpcContext::default()
    }

    #[tokio::test]
    async fn calls_are_delegated_and_timed_with_their_outcome() {
        let metrics = Arc::new(PodMetrics::new());
        let task = MeasuredTask::new(Fake, metrics.clone());
        task.state(&ctx(), StateRequest::default()).await.unwrap();
        task.state(&ctx(), StateRequest::default()).await.unwrap();
        assert!(task.kill(&ctx(), KillRequest::default()).await.is_err());
        let text = metrics.encode();
        assert!(text.contains("bulkhead_task_rpc_duration_seconds_count{rpc=\"state\",outcome=\"ok\"} 2"), "{text}");
        assert!(text.contains("bulkhead_task_rpc_duration_seconds_count{rpc=\"kill\",outcome=\"error\"} 1"), "{text}");
    }
}
