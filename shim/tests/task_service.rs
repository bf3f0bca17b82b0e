//! The Task service against a fake agent on a real Unix socket (CONNECT handshake, ttrpc,
//! stream headers) and a fake sandbox: the RPC semantics containerd relies on, without root
//! or containerd. The boundary is mocked (the agent peer), the logic under test is real.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bulkhead_protocol::agent as pb;
use bulkhead_protocol::agent_ttrpc::{create_agent, Agent};
use bulkhead_protocol::stream::{StreamAck, StreamHeader, StreamKind};
use bulkhead_protocol::{handshake, ports, PROTOCOL_VERSION};
use bulkhead_shim::agent::{AgentClient, Timeouts};
use bulkhead_shim::config::{Backend, Config};
use bulkhead_shim::events::{EventSink, Publish};
use bulkhead_shim::process::ExitInfo;
use bulkhead_shim::sandbox::{Backends, ContainerPlan, Sandbox, SandboxError, SandboxRequest};
use bulkhead_shim::task::TaskService;
use containerd_shim::api::{
    CheckpointTaskRequest, CreateTaskRequest, DeleteRequest, ExecProcessRequest, KillRequest, PauseRequest,
    ResumeRequest, StartRequest, StateRequest, StatsRequest, UpdateTaskRequest, WaitRequest,
};
use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::MessageDyn;
use containerd_shim::protos::types::mount::Mount;
use containerd_shim::protos::types::task::Status;
use containerd_shim::{ExitSignal, Task, TtrpcContext};
use oci_spec::runtime::Spec;
use tokio::io::AsyncWriteExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;

type Key = (String, String);

/// A scripted agent: containers whose id starts with `bad` fail to create, `oom` ones report
/// an OOM kill; signals end a process with 128+signal; execs of `/missing` fail.
#[derive(Default)]
struct FakeAgent {
    exits: Mutex<HashMap<Key, watch::Sender<Option<i32>>>>,
    oom_event_for: Mutex<Vec<String>>,
    updated: Mutex<Vec<String>>,
}

impl FakeAgent {
    fn exit_channel(&self, key: Key) -> watch::Sender<Option<i32>> {
        self.exits.lock().unwrap().entry(key).or_insert_with(|| watch::channel(None).0).clone()
    }

    fn status(code: ttrpc::Code, msg: &str) -> ttrpc::Error {
        ttrpc::Error::RpcStatus(ttrpc::get_status(code, msg))
    }
}

type Ctx = ttrpc::r#async::TtrpcContext;

#[async_trait]
impl Agent for FakeAgent {
    async fn version(&self, _: &Ctx, _: pb::VersionRequest) -> ttrpc::Result<pb::VersionResponse> {
        Ok(pb::VersionResponse { protocol_version: PROTOCOL_VERSION, mode: "fake".into(), ..Default::default() })
    }
    async fn setup_sandbox(&self, _: &Ctx, _: pb::SetupSandboxRequest) -> ttrpc::Result<pb::SetupSandboxResponse> {
        Ok(pb::SetupSandboxResponse::default())
    }
    async fn create_container(
        &self,
        _: &Ctx,
        req: pb::CreateContainerRequest,
    ) -> ttrpc::Result<pb::CreateContainerResponse> {
        if req.container_id.starts_with("bad") {
            return Err(Self::status(ttrpc::Code::FAILED_PRECONDITION, "executable '/nope' not found"));
        }
        assert_eq!(req.rootfs_mounts.len(), 1, "the rootfs is mounted by the agent");
        self.exit_channel((req.container_id, String::new()));
        Ok(pb::CreateContainerResponse { pid: 10, ..Default::default() })
    }
    async fn start_container(
        &self,
        _: &Ctx,
        _: pb::StartContainerRequest,
    ) -> ttrpc::Result<pb::StartContainerResponse> {
        Ok(pb::StartContainerResponse { pid: 10, ..Default::default() })
    }
    async fn remove_container(&self, _: &Ctx, _: pb::RemoveContainerRequest) -> ttrpc::Result<pb::Empty> {
        Ok(pb::Empty::default())
    }
    async fn exec_process(&self, _: &Ctx, req: pb::ExecProcessRequest) -> ttrpc::Result<pb::ExecProcessResponse> {
        if String::from_utf8_lossy(&req.process_json).contains("/missing") {
            return Err(Self::status(ttrpc::Code::NOT_FOUND, "exec: /missing: no such file or directory"));
        }
        // The exec ends at once with status 0.
        self.exit_channel((req.container_id, req.exec_id)).send_replace(Some(0));
        Ok(pb::ExecProcessResponse { pid: 20, ..Default::default() })
    }
    async fn signal_process(&self, _: &Ctx, req: pb::SignalProcessRequest) -> ttrpc::Result<pb::Empty> {
        self.exit_channel((req.container_id, req.exec_id)).send_replace(Some(128 + req.signal as i32));
        Ok(pb::Empty::default())
    }
    async fn wait_process(&self, _: &Ctx, req: pb::WaitProcessRequest) -> ttrpc::Result<pb::WaitProcessResponse> {
        let oom = req.container_id.starts_with("oom");
        let mut rx = self.exit_channel((req.container_id, req.exec_id)).subscribe();
        let code = loop {
            if let Some(code) = *rx.borrow_and_update() {
                break code;
            }
            rx.changed().await.map_err(|_| Self::status(ttrpc::Code::INTERNAL, "gone"))?;
        };
        Ok(pb::WaitProcessResponse { exit_code: code, oom_killed: oom, exited_at_unix_nanos: 1, ..Default::default() })
    }
    async fn update_container(&self, _: &Ctx, req: pb::UpdateContainerRequest) -> ttrpc::Result<pb::Empty> {
        self.updated.lock().unwrap().push(req.container_id);
        Ok(pb::Empty::new())
    }

    async fn list_pids(&self, _: &Ctx, _: pb::ContainerRequest) -> ttrpc::Result<pb::ListPidsResponse> {
        Ok(pb::ListPidsResponse { pids: vec![10, 11], ..Default::default() })
    }
    async fn get_oom_event(&self, _: &Ctx, req: pb::GetOomEventRequest) -> ttrpc::Result<pb::GetOomEventResponse> {
        let next = self.oom_event_for.lock().unwrap().get(req.after_seq as usize).cloned();
        match next {
            Some(id) => Ok(pb::GetOomEventResponse {
                event: Some(pb::OomEvent { seq: req.after_seq + 1, container_id: id, ..Default::default() }).into(),
                ..Default::default()
            }),
            None => {
                tokio::time::sleep(Duration::from_millis(u64::from(req.wait_ms).min(200))).await;
                Ok(pb::GetOomEventResponse::default())
            }
        }
    }
}

/// Serves `agent` on `<dir>/a.sock` with the hybrid-vsock preamble, like the real agent.
async fn serve_fake_agent(dir: &Path, agent: Arc<FakeAgent>) -> PathBuf {
    let inner = dir.join("inner.sock");
    let mut server = ttrpc::r#async::Server::new()
        .bind(&format!("unix://{}", inner.display()))
        .unwrap()
        .register_service(create_agent(agent));
    server.start().await.unwrap();
    // The server lives as long as the test process.
    std::mem::forget(server);
    let outer = dir.join("a.sock");
    let listener = UnixListener::bind(&outer).unwrap();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let inner = inner.clone();
            tokio::spawn(async move {
                let Ok(port) = handshake::accept(&mut conn, &ports::ALL, Duration::from_secs(5)).await else { return };
                if port == ports::AGENT_TTRPC {
                    if let Ok(mut backend) = UnixStream::connect(&inner).await {
                        let _ = tokio::io::copy_bidirectional(&mut conn, &mut backend).await;
                    }
                    return;
                }
                let Ok(header) = StreamHeader::read_from(&mut conn, Duration::from_secs(5)).await else { return };
                let _ = conn.write_all(&StreamAck::Attached.encode()).await;
                if header.kind == StreamKind::Stdout {
                    let _ = conn.write_all(b"hello from the fake agent\n").await;
                }
                // Dropping the connection is the stream's EOF.
            });
        }
    });
    outer
}

struct FakeSandbox {
    agent: Arc<AgentClient>,
    exited: watch::Sender<Option<ExitInfo>>,
    paused: Arc<watch::Sender<bool>>,
    rootfs_dir: PathBuf,
}

#[async_trait]
impl Sandbox for FakeSandbox {
    fn backend(&self) -> Backend {
        Backend::Namespace
    }
    fn pid(&self) -> u32 {
        4242
    }
    fn agent(&self) -> Arc<AgentClient> {
        self.agent.clone()
    }
    async fn prepare_container(
        &self,
        id: &str,
        _: &Path,
        _: &[Mount],
        spec: Spec,
    ) -> Result<ContainerPlan, SandboxError> {
        Ok(ContainerPlan {
            rootfs_path: self.rootfs_dir.join(id),
            rootfs_mounts: vec![pb::Mount { source: "overlay".into(), destination: "/".into(), ..Default::default() }],
            spec,
        })
    }
    async fn release_container(&self, _: &str) -> Result<(), SandboxError> {
        Ok(())
    }
    async fn signal(&self, signal: u32) -> Result<(), SandboxError> {
        self.exited.send_replace(Some(ExitInfo::from_agent(128 + signal, 0, false)));
        Ok(())
    }
    async fn pause(&self) -> Result<(), SandboxError> {
        self.paused.send_replace(true);
        Ok(())
    }
    async fn resume(&self) -> Result<(), SandboxError> {
        self.paused.send_replace(false);
        Ok(())
    }
    async fn stats(&self) -> Result<pb::StatsResponse, SandboxError> {
        Err(SandboxError::Unsupported { backend: "fake", what: "stats".into() })
    }
    async fn wait(&self) -> ExitInfo {
        let mut rx = self.exited.subscribe();
        loop {
            if let Some(exit) = *rx.borrow_and_update() {
                return exit;
            }
            if rx.changed().await.is_err() {
                return ExitInfo::from_agent(255, 0, false);
            }
        }
    }
    async fn destroy(&self) -> Result<(), SandboxError> {
        Ok(())
    }
}

struct FakeBackends {
    socket: PathBuf,
    rootfs_dir: PathBuf,
    /// Whether the (one) fake sandbox is paused.
    paused: Arc<watch::Sender<bool>>,
}

#[async_trait]
impl Backends for FakeBackends {
    async fn start(&self, _: &Config, _: SandboxRequest) -> Result<Arc<dyn Sandbox>, SandboxError> {
        let timeouts = Timeouts { connect: Duration::from_secs(5), rpc: Duration::from_secs(5) };
        let agent = Arc::new(AgentClient::connect(&self.socket, timeouts).await?);
        Ok(Arc::new(FakeSandbox {
            agent,
            exited: watch::channel(None).0,
            paused: self.paused.clone(),
            rootfs_dir: self.rootfs_dir.clone(),
        }))
    }
}

/// Records event topics in order.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<String>>>);

#[async_trait]
impl Publish for Recorder {
    async fn publish(&self, topic: &str, _event: Box<dyn MessageDyn>) -> Result<(), String> {
        self.0.lock().unwrap().push(topic.to_string());
        Ok(())
    }
}

impl Recorder {
    fn topics(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }

    async fn wait_for(&self, topic: &str) {
        for _ in 0..200 {
            if self.topics().iter().any(|t| t == topic) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no {topic} event; saw {:?}", self.topics());
    }
}

struct Harness {
    dir: tempfile::TempDir,
    task: TaskService,
    events: Recorder,
    agent: Arc<FakeAgent>,
    options: Any,
    paused: Arc<watch::Sender<bool>>,
}

async fn harness() -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let agent = Arc::new(FakeAgent::default());
    let socket = serve_fake_agent(dir.path(), agent.clone()).await;
    let config = dir.path().join("config.toml");
    std::fs::write(&config, format!("backend = \"namespace\"\nstate_dir = \"{}\"\n", dir.path().display())).unwrap();
    let events = Recorder::default();
    let paused = Arc::new(watch::channel(false).0);
    let backends = Arc::new(FakeBackends { socket, rootfs_dir: dir.path().join("rootfs"), paused: paused.clone() });
    let task = TaskService::with_backends(
        "k8s.io",
        "sb1",
        EventSink::to(Box::new(events.clone())),
        Arc::new(ExitSignal::default()),
        backends,
    );
    // runtimeoptions.v1.Options { config_path = 2 }
    let path = config.display().to_string();
    let mut value = vec![0x12, path.len() as u8];
    value.extend_from_slice(path.as_bytes());
    let options = Any { type_url: "runtimeoptions.v1.Options".into(), value, ..Default::default() };
    Harness { dir, task, events, agent, options, paused }
}

impl Harness {
    fn bundle(&self, id: &str, sandbox: bool, annotations: serde_json::Value) -> String {
        let bundle = self.dir.path().join("bundles").join(id);
        std::fs::create_dir_all(&bundle).unwrap();
        // CRI's shapes: the sandbox gets fresh namespaces, a container joins the sandbox's.
        let namespaces = if sandbox {
            serde_json::json!([{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}])
        } else {
            serde_json::json!([{"type": "pid"}, {"type": "mount"}, {"type": "ipc", "path": "/proc/4242/ns/ipc"}])
        };
        let spec = serde_json::json!({
            "annotations": annotations,
            "process": {"args": ["sh"], "user": {"uid": 0, "gid": 0}, "cwd": "/"},
            "linux": {"namespaces": namespaces}
        });
        std::fs::write(bundle.join("config.json"), serde_json::to_vec(&spec).unwrap()).unwrap();
        bundle.display().to_string()
    }

    async fn create(&self, id: &str, sandbox: bool) -> ttrpc::Result<u32> {
        self.create_in(id, sandbox, "sb1").await
    }

    async fn create_in(&self, id: &str, sandbox: bool, sandbox_id: &str) -> ttrpc::Result<u32> {
        let annotations = if sandbox {
            serde_json::json!({"io.kubernetes.cri.container-type": "sandbox"})
        } else {
            serde_json::json!({"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.sandbox-id": sandbox_id})
        };
        let stdout = if sandbox { String::new() } else { self.fifo(&format!("{id}-out")) };
        let req = CreateTaskRequest {
            id: id.into(),
            bundle: self.bundle(id, sandbox, annotations),
            rootfs: vec![Mount { type_: "overlay".into(), source: "overlay".into(), ..Default::default() }],
            stdout,
            options: Some(self.options.clone()).into(),
            ..Default::default()
        };
        Ok(self.task.create(&TtrpcContext::default(), req).await?.pid)
    }

    fn fifo(&self, name: &str) -> String {
        let path = self.dir.path().join(name);
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        path.display().to_string()
    }

    async fn start(&self, id: &str, exec_id: &str) -> ttrpc::Result<u32> {
        let req = StartRequest { id: id.into(), exec_id: exec_id.into(), ..Default::default() };
        Ok(self.task.start(&TtrpcContext::default(), req).await?.pid)
    }

    async fn kill(&self, id: &str, exec_id: &str, signal: u32) -> ttrpc::Result<()> {
        let req = KillRequest { id: id.into(), exec_id: exec_id.into(), signal, ..Default::default() };
        self.task.kill(&TtrpcContext::default(), req).await.map(|_| ())
    }

    async fn wait(&self, id: &str, exec_id: &str) -> u32 {
        let req = WaitRequest { id: id.into(), exec_id: exec_id.into(), ..Default::default() };
        tokio::time::timeout(Duration::from_secs(5), self.task.wait(&TtrpcContext::default(), req))
            .await
            .expect("wait returns")
            .unwrap()
            .exit_status
    }

    async fn state(&self, id: &str, exec_id: &str) -> Status {
        let req = StateRequest { id: id.into(), exec_id: exec_id.into(), ..Default::default() };
        self.task.state(&TtrpcContext::default(), req).await.unwrap().status.enum_value_or_default()
    }

    async fn delete(&self, id: &str, exec_id: &str) -> ttrpc::Result<u32> {
        let req = DeleteRequest { id: id.into(), exec_id: exec_id.into(), ..Default::default() };
        Ok(self.task.delete(&TtrpcContext::default(), req).await?.exit_status)
    }

    async fn exec(&self, id: &str, exec_id: &str, args: &[&str]) -> ttrpc::Result<()> {
        let spec = Any {
            type_url: "types.containerd.io/opencontainers/runtime-spec/1/Process".into(),
            value: serde_json::to_vec(&serde_json::json!({ "args": args, "user": {"uid": 0, "gid": 0}, "cwd": "/" }))
                .unwrap(),
            ..Default::default()
        };
        let req = ExecProcessRequest {
            id: id.into(),
            exec_id: exec_id.into(),
            spec: Some(spec).into(),
            ..Default::default()
        };
        self.task.exec(&TtrpcContext::default(), req).await.map(|_| ())
    }
}

fn code(e: ttrpc::Error) -> ttrpc::Code {
    match e {
        ttrpc::Error::RpcStatus(s) => s.code(),
        other => panic!("not a status: {other:?}"),
    }
}

#[tokio::test]
async fn container_lifecycle_follows_runc_semantics() {
    let h = harness().await;
    assert_eq!(h.create("sb1", true).await.unwrap(), 4242);
    assert_eq!(h.start("sb1", "").await.unwrap(), 4242);
    h.create("c1", false).await.unwrap();
    assert_eq!(h.state("c1", "").await, Status::CREATED);
    assert_eq!(h.start("c1", "").await.unwrap(), 10);
    assert_eq!(h.state("c1", "").await, Status::RUNNING);

    // Deleting a running container is refused.
    assert_eq!(code(h.delete("c1", "").await.unwrap_err()), ttrpc::Code::FAILED_PRECONDITION);

    // SIGKILL: exit 137, runc's 128+signal, seen by Wait and State.
    h.kill("c1", "", 9).await.unwrap();
    assert_eq!(h.wait("c1", "").await, 137);
    assert_eq!(h.state("c1", "").await, Status::STOPPED);
    // Kill on an exited task: NotFound, which containerd reads as "already finished".
    assert_eq!(code(h.kill("c1", "", 15).await.unwrap_err()), ttrpc::Code::NOT_FOUND);
    assert_eq!(h.delete("c1", "").await.unwrap(), 137);
    assert_eq!(code(h.delete("c1", "").await.unwrap_err()), ttrpc::Code::NOT_FOUND);

    let topics = h.events.topics();
    let order: Vec<&str> = topics.iter().map(String::as_str).filter(|t| *t != "/tasks/oom").collect();
    assert_eq!(
        order,
        ["/tasks/create", "/tasks/start", "/tasks/create", "/tasks/start", "/tasks/exit", "/tasks/delete"]
    );
}

#[tokio::test]
async fn execs_and_their_failures() {
    let h = harness().await;
    h.create("sb1", true).await.unwrap();
    h.create("c1", false).await.unwrap();
    h.start("c1", "").await.unwrap();

    h.exec("c1", "e1", &["echo", "hi"]).await.unwrap();
    assert_eq!(h.state("c1", "e1").await, Status::CREATED);
    assert_eq!(h.start("c1", "e1").await.unwrap(), 20);
    assert_eq!(h.wait("c1", "e1").await, 0);
    assert_eq!(h.delete("c1", "e1").await.unwrap(), 0);

    // A missing binary fails Start with the agent's words and code, and does not hang Wait.
    h.exec("c1", "e2", &["/missing"]).await.unwrap();
    let err = h.start("c1", "e2").await.unwrap_err();
    assert!(format!("{err:?}").contains("/missing"), "{err:?}");
    assert_eq!(code(err), ttrpc::Code::NOT_FOUND);
    assert_eq!(h.wait("c1", "e2").await, 255);
    h.delete("c1", "e2").await.unwrap();

    // Duplicate exec ids and execs into the sandbox are refused.
    h.exec("c1", "e3", &["true"]).await.unwrap();
    assert_eq!(code(h.exec("c1", "e3", &["true"]).await.unwrap_err()), ttrpc::Code::ALREADY_EXISTS);
    assert_eq!(code(h.exec("sb1", "e4", &["true"]).await.unwrap_err()), ttrpc::Code::FAILED_PRECONDITION);

    for topic in ["/tasks/exec-added", "/tasks/exec-started", "/tasks/exit"] {
        h.events.wait_for(topic).await;
    }
}

#[tokio::test]
async fn create_errors_and_oom_events() {
    let h = harness().await;
    // A workload before its sandbox: a clear precondition error.
    assert_eq!(code(h.create("c0", false).await.unwrap_err()), ttrpc::Code::FAILED_PRECONDITION);

    // The agent may only report OOM for this pod's containers.
    h.create("sb1", true).await.unwrap();
    h.create("oom1", false).await.unwrap();
    h.start("oom1", "").await.unwrap();
    h.agent.oom_event_for.lock().unwrap().extend(["someone-else".to_string(), "oom1".to_string()]);
    h.events.wait_for("/tasks/oom").await;
    assert_eq!(h.events.topics().iter().filter(|t| *t == "/tasks/oom").count(), 1);

    // An OOM kill reported at exit is not published twice.
    h.kill("oom1", "", 9).await.unwrap();
    assert_eq!(h.wait("oom1", "").await, 137);
    h.events.wait_for("/tasks/exit").await;
    assert_eq!(h.events.topics().iter().filter(|t| *t == "/tasks/oom").count(), 1);

    // A container of another pod is not run here.
    assert_eq!(code(h.create_in("c9", false, "sb2").await.unwrap_err()), ttrpc::Code::FAILED_PRECONDITION);

    // The agent's create error reaches containerd with its code and words.
    let err = h.create("bad1", false).await.unwrap_err();
    assert!(format!("{err:?}").contains("/nope"), "{err:?}");
    assert_eq!(code(err), ttrpc::Code::FAILED_PRECONDITION);
}

#[tokio::test]
async fn the_sandbox_task_pauses_and_measures_through_its_backend() {
    let h = harness().await;
    h.create("sb1", true).await.unwrap();
    h.start("sb1", "").await.unwrap();
    let ctx = TtrpcContext::default();
    h.task.pause(&ctx, PauseRequest { id: "sb1".into(), ..Default::default() }).await.unwrap();
    assert!(*h.paused.borrow(), "Pause of the sandbox task reached the backend");
    assert_eq!(h.state("sb1", "").await, Status::PAUSED);
    h.task.resume(&ctx, ResumeRequest { id: "sb1".into(), ..Default::default() }).await.unwrap();
    assert!(!*h.paused.borrow());
    assert_eq!(h.state("sb1", "").await, Status::RUNNING);
    // A backend that cannot measure says so; nothing reports empty numbers as success.
    let err = h.task.stats(&ctx, StatsRequest { id: "sb1".into(), ..Default::default() }).await.unwrap_err();
    assert_eq!(code(err), ttrpc::Code::UNIMPLEMENTED);
}

#[tokio::test]
async fn what_bulkhead_does_not_do_is_refused_by_name() {
    let h = harness().await;
    h.create("sb1", true).await.unwrap();
    h.start("sb1", "").await.unwrap();
    h.create("c1", false).await.unwrap();
    let ctx = TtrpcContext::default();
    // The VM keeps the shape it booted with: a pod-level update is refused, not silently dropped.
    let err = h.task.update(&ctx, UpdateTaskRequest { id: "sb1".into(), ..Default::default() }).await.unwrap_err();
    assert_eq!(code(err.clone()), ttrpc::Code::UNIMPLEMENTED);
    assert!(format!("{err:?}").contains("does not resize a running sandbox"), "{err:?}");
    let err =
        h.task.checkpoint(&ctx, CheckpointTaskRequest { id: "c1".into(), ..Default::default() }).await.unwrap_err();
    assert_eq!(code(err.clone()), ttrpc::Code::UNIMPLEMENTED);
    assert!(format!("{err:?}").contains("does not checkpoint"), "{err:?}");
    // A container's update still reaches the guest.
    h.task.update(&ctx, UpdateTaskRequest { id: "c1".into(), ..Default::default() }).await.unwrap();
    assert_eq!(*h.agent.updated.lock().unwrap(), ["c1"]);
    // Resources that are not OCI LinuxResources are refused, naming the container; the guest never sees them.
    let garbled = Any { value: b"{\"memory\": {\"limit\": \"lots\"}}".to_vec(), ..Default::default() };
    let req = UpdateTaskRequest { id: "c1".into(), resources: Some(garbled).into(), ..Default::default() };
    let err = h.task.update(&ctx, req).await.unwrap_err();
    assert_eq!(code(err.clone()), ttrpc::Code::INVALID_ARGUMENT);
    assert!(format!("{err:?}").contains("update of c1: resources"), "{err:?}");
    assert_eq!(*h.agent.updated.lock().unwrap(), ["c1"]);
}
