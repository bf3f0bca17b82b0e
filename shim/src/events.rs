//! Task events to containerd. Publishing is best-effort with the library's retry queue:
//! a lost event must never fail an RPC that already did its work.

use std::time::SystemTime;

use async_trait::async_trait;
use containerd_shim::event::Event;
use containerd_shim::protos::events::task::{
    TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskIO, TaskOOM, TaskPaused, TaskResumed,
    TaskStart,
};
use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::protobuf::MessageDyn;
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::Context;
use tracing::{debug, warn};

use crate::io::StdioPaths;

pub fn timestamp(at: SystemTime) -> Timestamp {
    let d = at.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    Timestamp { seconds: d.as_secs() as i64, nanos: d.subsec_nanos() as i32, ..Default::default() }
}

/// Where events go: containerd, or a recorder in tests.
#[async_trait]
pub trait Publish: Send + Sync {
    async fn publish(&self, topic: &str, event: Box<dyn MessageDyn>) -> Result<(), String>;
}

/// containerd's event service, through the library's retrying queue.
struct Remote {
    publisher: RemotePublisher,
    namespace: String,
}

#[async_trait]
impl Publish for Remote {
    async fn publish(&self, topic: &str, event: Box<dyn MessageDyn>) -> Result<(), String> {
        self.publisher.publish(Context::default(), topic, &self.namespace, event).await.map_err(|e| e.to_string())
    }
}

pub struct EventSink {
    out: Box<dyn Publish>,
}

impl EventSink {
    /// Events to containerd in `namespace`.
    pub fn new(publisher: RemotePublisher, namespace: &str) -> Self {
        Self::to(Box::new(Remote { publisher, namespace: namespace.into() }))
    }

    pub fn to(out: Box<dyn Publish>) -> Self {
        Self { out }
    }

    async fn publish<E: Event + MessageDyn + 'static>(&self, event: E) {
        let topic = event.topic();
        debug!(%topic, "publish");
        if let Err(e) = self.out.publish(&topic, Box::new(event)).await {
            warn!(%topic, "publish event: {e}");
        }
    }

    pub async fn create(
        &self,
        id: &str,
        bundle: &str,
        rootfs: Vec<containerd_shim::protos::types::mount::Mount>,
        io: &StdioPaths,
        pid: u32,
    ) {
        self.publish(TaskCreate {
            container_id: id.into(),
            bundle: bundle.into(),
            rootfs,
            io: Some(TaskIO {
                stdin: io.stdin.clone(),
                stdout: io.stdout.clone(),
                stderr: io.stderr.clone(),
                terminal: io.terminal,
                ..Default::default()
            })
            .into(),
            pid,
            ..Default::default()
        })
        .await
    }

    pub async fn start(&self, id: &str, pid: u32) {
        self.publish(TaskStart { container_id: id.into(), pid, ..Default::default() }).await
    }

    pub async fn exec_added(&self, id: &str, exec_id: &str) {
        self.publish(TaskExecAdded { container_id: id.into(), exec_id: exec_id.into(), ..Default::default() }).await
    }

    pub async fn exec_started(&self, id: &str, exec_id: &str, pid: u32) {
        self.publish(TaskExecStarted { container_id: id.into(), exec_id: exec_id.into(), pid, ..Default::default() })
            .await
    }

    pub async fn exit(&self, id: &str, process_id: &str, pid: u32, status: u32, at: SystemTime) {
        self.publish(TaskExit {
            container_id: id.into(),
            id: process_id.into(),
            pid,
            exit_status: status,
            exited_at: Some(timestamp(at)).into(),
            ..Default::default()
        })
        .await
    }

    pub async fn oom(&self, id: &str) {
        self.publish(TaskOOM { container_id: id.into(), ..Default::default() }).await
    }

    pub async fn paused(&self, id: &str) {
        self.publish(TaskPaused { container_id: id.into(), ..Default::default() }).await
    }

    pub async fn resumed(&self, id: &str) {
        self.publish(TaskResumed { container_id: id.into(), ..Default::default() }).await
    }

    pub async fn delete(&self, id: &str, pid: u32, status: u32, at: SystemTime) {
        self.publish(TaskDelete {
            container_id: id.into(),
            pid,
            exit_status: status,
            exited_at: Some(timestamp(at)).into(),
            ..Default::default()
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn timestamps_keep_nanoseconds() {
        let at = SystemTime::UNIX_EPOCH + Duration::new(5, 7);
        let ts = timestamp(at);
        assert_eq!((ts.seconds, ts.nanos), (5, 7));
    }
}
