//! The Task service containerd calls. Each RPC looks up a [`Container`] and one of its
//! [`Process`]es and calls the trait; what differs between an init, an exec and the sandbox
//! lives in the process implementations, not here.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bulkhead_protocol::agent as pb;
use containerd_shim::api::{
    CheckpointTaskRequest, CloseIORequest, ConnectRequest, ConnectResponse, CreateTaskRequest, CreateTaskResponse,
    DeleteRequest, ExecProcessRequest, KillRequest, PauseRequest, PidsRequest, PidsResponse, ResizePtyRequest,
    ResumeRequest, ShutdownRequest, StartRequest, StartResponse, StateRequest, StateResponse, StatsRequest,
    StatsResponse, UpdateTaskRequest, WaitRequest, WaitResponse,
};
use containerd_shim::protos::cgroups::metrics::Metrics;
use containerd_shim::protos::protobuf::well_known_types::empty::Empty;
use containerd_shim::protos::types::task::{ProcessInfo, Status};
use containerd_shim::{DeleteResponse, ExitSignal, Task, TtrpcContext, TtrpcResult};
use oci_spec::runtime::LinuxResources;
use tracing::{info, info_span, warn, Instrument};

use crate::agent::AgentClient;
use crate::config::Config;
use crate::container::{Container, ContainerKind};
use crate::error::TaskError;
use crate::events::{timestamp, EventSink};
use crate::io::{IoSession, Stdio, StdioPaths};
use crate::metrics::PodMetrics;
use crate::process::{
    ContainerInit, ExecProcess, ExitInfo, Process, ProcessCore, ProcessEvent, ProcessState, SandboxInit,
};
use crate::sandbox::paths::BundleRecord;
use crate::sandbox::{self, Sandbox, SandboxRequest};
use crate::spec::{self, BundleSpec, Role};

/// Workload ids remembered per pod for OOM attribution (pods restart containers; bounded).
const MAX_POD_WORKLOADS: usize = 4096;
/// Longest Update resources / exec process JSON accepted from containerd.
const MAX_JSON: usize = 1 << 20;
/// How long an RPC that found the agent unreachable waits for the pod's exits before it fails.
const END_SETTLE: Duration = Duration::from_secs(5);

/// The pod's sandbox, as seen by the task service.
enum PodSandbox {
    None,
    Running(Arc<dyn Sandbox>),
}

/// Everything one shim serves: a pod.
pub struct TaskService {
    namespace: String,
    events: Arc<EventSink>,
    containers: Arc<tokio::sync::Mutex<HashMap<String, Container>>>,
    sandbox: tokio::sync::Mutex<PodSandbox>,
    /// Containers for which TaskOOM was published since they last started.
    oom_reported: Arc<Mutex<HashSet<String>>>,
    exit: Arc<ExitSignal>,
    /// Every workload container this pod has had (bounded), for attributing late OOM events.
    pod_workloads: Arc<Mutex<HashSet<String>>>,
    /// Processes whose TaskExit is still to come; the sandbox's exit is published after them.
    pending_exits: Arc<crate::watch::PendingExits>,
    /// The config the pod's sandbox was created with ([`TaskService::config`]).
    config: tokio::sync::Mutex<Option<Arc<Config>>>,
    /// Parent of every RPC's span: the pod this shim serves.
    pod_span: tracing::Span,
    backends: Arc<dyn sandbox::Backends>,
    metrics: Arc<PodMetrics>,
}

fn status_of(state: ProcessState) -> Status {
    match state {
        ProcessState::Created { .. } => Status::CREATED,
        ProcessState::Running { .. } => Status::RUNNING,
        ProcessState::Paused { .. } => Status::PAUSED,
        ProcessState::Exited { .. } => Status::STOPPED,
    }
}

impl TaskService {
    pub fn new(namespace: &str, pod_id: &str, events: EventSink, exit: Arc<ExitSignal>) -> Self {
        Self::with_backends(namespace, pod_id, events, exit, Arc::new(sandbox::ConfiguredBackends))
    }

    pub fn with_backends(
        namespace: &str,
        pod_id: &str,
        events: EventSink,
        exit: Arc<ExitSignal>,
        backends: Arc<dyn sandbox::Backends>,
    ) -> Self {
        Self {
            backends,
            pod_span: info_span!("pod", id = %pod_id),
            namespace: namespace.into(),
            events: Arc::new(events),
            containers: Default::default(),
            sandbox: tokio::sync::Mutex::new(PodSandbox::None),
            oom_reported: Default::default(),
            pod_workloads: Default::default(),
            pending_exits: Default::default(),
            config: Default::default(),
            exit,
            metrics: Arc::new(PodMetrics::new()),
        }
    }

    /// The pod's metrics, for the RPC timing around this service ([`crate::metrics::rpc`]).
    pub fn metrics(&self) -> Arc<PodMetrics> {
        self.metrics.clone()
    }

    async fn container_process(&self, id: &str, exec_id: &str) -> Result<(ContainerKind, Arc<dyn Process>), TaskError> {
        let containers = self.containers.lock().await;
        let c = containers.get(id).ok_or_else(|| TaskError::NotFound(format!("container {id}")))?;
        Ok((c.kind, c.process(exec_id)?))
    }

    async fn running_sandbox(&self) -> Option<Arc<dyn Sandbox>> {
        match &*self.sandbox.lock().await {
            PodSandbox::Running(s) => Some(s.clone()),
            PodSandbox::None => None,
        }
    }

    async fn agent(&self) -> Result<Arc<AgentClient>, TaskError> {
        self.running_sandbox()
            .await
            .map(|s| s.agent())
            .ok_or_else(|| TaskError::FailedPrecondition("the pod sandbox is not running".into()))
    }

    /// The shim's config: read once, at the first Create (the pod's sandbox), and kept for the
    /// shim's life. A changed file applies to new pods; a pod's later containers never meet a
    /// config (or a release's new keys) their sandbox was not started with.
    async fn config(&self, req: &CreateTaskRequest) -> Result<Arc<Config>, TaskError> {
        let mut loaded = self.config.lock().await;
        if let Some(config) = loaded.as_ref() {
            return Ok(config.clone());
        }
        let config_path = crate::config::config_path(crate::options::config_path_from_options(req.options.as_ref())?);
        let config = Arc::new(Config::load(&config_path)?);
        *loaded = Some(config.clone());
        Ok(config)
    }

    async fn do_create(&self, req: CreateTaskRequest) -> Result<CreateTaskResponse, TaskError> {
        let config = self.config(&req).await?;
        let bundle = PathBuf::from(&req.bundle);
        let spec = BundleSpec::load(&bundle)?;
        let stdio = Stdio::parse(StdioPaths {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        })?;
        if self.containers.lock().await.contains_key(&req.id) {
            return Err(TaskError::AlreadyExists(format!("container {}", req.id)));
        }
        let container = match spec.role() {
            Role::Sandbox => self.create_sandbox(&req, &config, &spec, stdio.clone()).await?,
            Role::Container { sandbox_id } => {
                self.create_workload(&req, &config, &spec, &sandbox_id, stdio.clone()).await?
            }
        };
        let pid = container.init.core().state().pid();
        self.containers.lock().await.insert(req.id.clone(), container);
        self.events.create(&req.id, &req.bundle, req.rootfs.clone(), &stdio.paths, pid).await;
        Ok(CreateTaskResponse { pid, ..Default::default() })
    }

    async fn create_sandbox(
        &self,
        req: &CreateTaskRequest,
        config: &Config,
        spec: &BundleSpec,
        stdio: Stdio,
    ) -> Result<Container, TaskError> {
        let netns = spec.validate_sandbox(config.backend)?;
        let id_maps = spec.pod_id_maps()?;
        // Before anything starts: a bad size-limit annotation fails the pod here, naming it.
        let emptydirs = crate::sandbox::emptydir::EmptyDirPolicy::for_pod(&config.emptydir, spec)?;
        let resolv_conf = crate::network::dns::pod_resolv_conf(spec).map_err(|e| TaskError::Internal(e.to_string()))?;
        // The pod's config is known from here on; it sets the shim's log level.
        crate::logging::set_config_level(&config.log_level);
        let mut slot = self.sandbox.lock().await;
        if let PodSandbox::Running(_) = &*slot {
            return Err(TaskError::AlreadyExists(format!("a sandbox in the shim of {}", req.id)));
        }
        BundleRecord {
            state_dir: config.state_dir.clone(),
            sandbox_id: req.id.clone(),
            is_sandbox: true,
            backend: config.backend,
        }
        .write(Path::new(&req.bundle))
        .map_err(|e| TaskError::Internal(format!("write bundle record: {e}")))?;
        let sandbox = self
            .backends
            .start(
                config,
                SandboxRequest {
                    sandbox_id: req.id.clone(),
                    netns,
                    cgroup: crate::sandbox::cgroups::PodCgroup::for_pod(&req.id, &self.namespace, spec.cgroups_path()),
                    resources: spec.pod_resources(),
                    log_dir: spec.log_directory(),
                    emptydirs,
                    oom_score_adj: spec.oom_score_adj(),
                    id_maps: id_maps.clone(),
                },
            )
            .await?;
        let agent = sandbox.agent();
        let mut setup = pb::SetupSandboxRequest {
            hostname: spec.hostname().unwrap_or_default().into(),
            sysctls: spec.sysctls().into_iter().collect(),
            resolv_conf,
            ..Default::default()
        };
        if let Some(maps) = &id_maps {
            setup.uid_mappings = maps.uid.iter().map(id_mapping).collect();
            setup.gid_mappings = maps.gid.iter().map(id_mapping).collect();
        }
        sandbox.guest_setup(&mut setup);
        match agent.setup_sandbox(setup).await {
            // An agent that does not know pod user namespaces would run the pod as the host's ids.
            Ok(answer) if id_maps.is_some() && !answer.pod_user_namespace => {
                let _ = sandbox.destroy().await;
                return Err(TaskError::FailedPrecondition(
                    "the agent did not give the hostUsers: false pod a user namespace (an agent older than the \
                     shim?); the pod is not started"
                        .into(),
                ));
            }
            Ok(_) => {}
            Err(e) => {
                let _ = sandbox.destroy().await;
                return Err(e.into());
            }
        }
        *slot = PodSandbox::Running(sandbox.clone());
        drop(slot);
        crate::observe::pod_started(&self.metrics, config, &self.namespace, &req.id, spec, &sandbox);
        tokio::spawn(
            crate::watch::oom_watch(
                agent,
                self.events.clone(),
                self.oom_reported.clone(),
                self.pod_workloads.clone(),
                sandbox.clone(),
            )
            .in_current_span(),
        );
        let init = SandboxInit { core: ProcessCore::created(&req.id, None, stdio, sandbox.pid()), sandbox };
        // The sandbox runs from Create on; Start only reports it.
        Ok(Container {
            id: req.id.clone(),
            bundle: req.bundle.clone(),
            kind: ContainerKind::Sandbox,
            init: Arc::new(init),
            execs: HashMap::new(),
        })
    }

    async fn create_workload(
        &self,
        req: &CreateTaskRequest,
        config: &Config,
        spec: &BundleSpec,
        sandbox_id: &str,
        stdio: Stdio,
    ) -> Result<Container, TaskError> {
        let not_here =
            || TaskError::FailedPrecondition(format!("pod sandbox {sandbox_id} is not running in this shim"));
        let ours = self.containers.lock().await.get(sandbox_id).is_some_and(|c| c.kind == ContainerKind::Sandbox);
        if !ours {
            return Err(not_here());
        }
        let sandbox = self.running_sandbox().await.ok_or_else(not_here)?;
        let spec = spec.translate_container(sandbox.pid(), sandbox.backend())?;
        let bundle = Path::new(&req.bundle);
        BundleRecord {
            state_dir: config.state_dir.clone(),
            sandbox_id: sandbox_id.into(),
            is_sandbox: false,
            backend: sandbox.backend(),
        }
        .write(bundle)
        .map_err(|e| TaskError::Internal(format!("write bundle record: {e}")))?;

        let plan = sandbox.prepare_container(&req.id, &bundle.join("rootfs"), &req.rootfs, spec).await?;
        let agent = sandbox.agent();
        let attach = async {
            let create = pb::CreateContainerRequest {
                container_id: req.id.clone(),
                oci_spec_json: spec::encode(&plan.spec)?,
                rootfs_path: plan.rootfs_path.display().to_string(),
                rootfs_mounts: plan.rootfs_mounts,
                stdio: Some(crate::trans::stdio_config(&stdio)).into(),
                ..Default::default()
            };
            let pid = agent.create_container(create).await?;
            let session = IoSession::attach(&agent, &req.id, None, &stdio, self.metrics.output_drops())
                .await
                .map_err(TaskError::from)?;
            Ok::<_, TaskError>((pid, session))
        };
        let (pid, session) = match attach.await {
            Ok(created) => created,
            Err(e) => {
                let _ = agent.remove_container(&req.id, true).await;
                let _ = sandbox.release_container(&req.id).await;
                return Err(e);
            }
        };
        let core = ProcessCore::created(&req.id, None, stdio, pid);
        *core.io.lock().await = session;
        {
            let mut known = self.pod_workloads.lock().unwrap_or_else(|p| p.into_inner());
            if known.len() < MAX_POD_WORKLOADS {
                known.insert(req.id.clone());
            }
        }
        Ok(Container {
            id: req.id.clone(),
            bundle: req.bundle.clone(),
            kind: ContainerKind::Workload,
            init: Arc::new(ContainerInit { core, agent, sandbox }),
            execs: HashMap::new(),
        })
    }

    async fn do_start(&self, req: StartRequest) -> Result<StartResponse, TaskError> {
        let (_, process) = self.container_process(&req.id, &req.exec_id).await?;
        let core = process.core();
        if req.exec_id.is_empty() {
            self.oom_reported.lock().unwrap_or_else(|p| p.into_inner()).remove(&req.id);
        }
        // Counted before it starts, so the sandbox's exit cannot overtake this process's.
        let pending = match process.exit_source() {
            crate::process::ExitSource::Agent { .. } => Some(self.pending_exits.add()),
            crate::process::ExitSource::Sandbox(_) => None,
        };
        let pid = match process.start().await {
            Ok(pid) => pid,
            Err(e) => {
                // As runc: a process that failed to start has ended; its waiters are released
                // and its stdio closed, so containerd's kill-then-delete cleanup does not hang.
                let _ = core.transition(ProcessEvent::Exited(ExitInfo::from_agent(255, 0, false)));
                core.io.lock().await.finish(Duration::ZERO).await;
                drop(pending);
                if let TaskError::Agent(agent_error) = &e {
                    if agent_error.is_transport() {
                        self.end_unreachable_pod(agent_error).await;
                    }
                }
                return Err(e);
            }
        };
        let mut attach_error = None;
        if let Some(exec_id) = &core.exec_id {
            // The agent holds the process's output until its streams attach.
            let agent = self.agent().await?;
            let drops = self.metrics.output_drops();
            match IoSession::attach(&agent, &core.container_id, Some(exec_id), &core.stdio, drops).await {
                Ok(session) => *core.io.lock().await = session,
                Err(e) => {
                    // An exec whose output nobody can read must not run on unseen.
                    let _ = process.kill(9, false).await;
                    attach_error = Some(TaskError::from(e));
                }
            }
        }
        // Start before Exit: the watcher publishes only after this event is queued.
        match &core.exec_id {
            None => self.events.start(&req.id, pid).await,
            Some(exec_id) => self.events.exec_started(&req.id, exec_id, pid).await,
        }
        tokio::spawn(
            crate::watch::watch_exit(
                process.clone(),
                self.events.clone(),
                self.oom_reported.clone(),
                self.pending_exits.clone(),
                pending,
            )
            .in_current_span(),
        );
        if let Some(e) = attach_error {
            return Err(e);
        }
        Ok(StartResponse { pid, ..Default::default() })
    }

    /// The agent is unreachable: the pod ends (its processes report 137), and the caller's error
    /// goes back only once their exits are out, so containerd learns of the pod's end from
    /// its own exit handling before it learns of the failure that caused it.
    async fn end_unreachable_pod(&self, cause: &crate::agent::AgentClientError) {
        let Some(sandbox) = self.running_sandbox().await else { return };
        if let Err(e) = crate::process::end_unreachable_pod(&sandbox, cause).await {
            warn!("end the sandbox: {e}");
        }
        if !self.pending_exits.settled(END_SETTLE).await {
            warn!("the pod's processes did not report their exits within {END_SETTLE:?}");
        }
    }

    async fn do_delete(&self, req: DeleteRequest) -> Result<DeleteResponse, TaskError> {
        if !req.exec_id.is_empty() {
            let mut containers = self.containers.lock().await;
            let c = containers.get_mut(&req.id).ok_or_else(|| TaskError::NotFound(format!("container {}", req.id)))?;
            let process = c.process(&req.exec_id)?;
            let state = process.core().state();
            if matches!(state, ProcessState::Running { .. } | ProcessState::Paused { .. }) {
                return Err(TaskError::FailedPrecondition(format!("exec {} is still running", req.exec_id)));
            }
            c.execs.remove(&req.exec_id);
            return Ok(delete_response(state));
        }
        let container = {
            let containers = self.containers.lock().await;
            let c = containers.get(&req.id).ok_or_else(|| TaskError::NotFound(format!("container {}", req.id)))?;
            let state = c.init.core().state();
            if matches!(state, ProcessState::Running { .. } | ProcessState::Paused { .. }) {
                return Err(TaskError::FailedPrecondition(format!("container {} is still running", req.id)));
            }
            (c.kind, state)
        };
        let (kind, state) = container;
        match kind {
            ContainerKind::Workload => {
                if let Some(sandbox) = self.running_sandbox().await {
                    if let Err(e) = sandbox.agent().remove_container(&req.id, true).await {
                        if e.code() != Some(ttrpc::Code::NOT_FOUND) {
                            warn!(container = %req.id, "agent remove: {e}");
                        }
                    }
                    sandbox.release_container(&req.id).await?;
                }
            }
            ContainerKind::Sandbox => {
                let mut slot = self.sandbox.lock().await;
                if let PodSandbox::Running(sandbox) = &*slot {
                    self.metrics.detach();
                    sandbox.destroy().await?;
                }
                *slot = PodSandbox::None;
            }
        }
        let resp = delete_response(state);
        let at = state.exit().map(|e| e.at).unwrap_or_else(SystemTime::now);
        self.events.delete(&req.id, resp.pid, resp.exit_status, at).await;
        // Last: until containerd has this answer, State must find the container (stopped), not
        // "not found", which containerd's StopPodSandbox takes as "already gone" and skips
        // waiting for the container's stop while its exit handling is still under way.
        self.containers.lock().await.remove(&req.id);
        Ok(resp)
    }

    async fn do_exec(&self, req: ExecProcessRequest) -> Result<(), TaskError> {
        let value = req
            .spec
            .as_ref()
            .map(|any| any.value.as_slice())
            .ok_or_else(|| TaskError::InvalidArgument("exec without a process spec".into()))?;
        if value.len() > MAX_JSON {
            return Err(TaskError::InvalidArgument("exec process spec too large".into()));
        }
        let stdio = Stdio::parse(StdioPaths {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        })?;
        let agent = self.agent().await?;
        let sandbox = self
            .running_sandbox()
            .await
            .ok_or_else(|| TaskError::FailedPrecondition("the pod sandbox is not running in this shim".into()))?;
        let process_json = spec::exec_process_json(value, sandbox.backend())?;
        let mut containers = self.containers.lock().await;
        let c = containers.get_mut(&req.id).ok_or_else(|| TaskError::NotFound(format!("container {}", req.id)))?;
        if c.kind == ContainerKind::Sandbox {
            return Err(TaskError::FailedPrecondition(
                "exec into the pod sandbox is not supported (no pause process runs)".into(),
            ));
        }
        if c.execs.contains_key(&req.exec_id) {
            return Err(TaskError::AlreadyExists(format!("exec {}", req.exec_id)));
        }
        let exec =
            ExecProcess { core: ProcessCore::new(&req.id, Some(&req.exec_id), stdio), agent, sandbox, process_json };
        c.execs.insert(req.exec_id.clone(), Arc::new(exec));
        drop(containers);
        self.events.exec_added(&req.id, &req.exec_id).await;
        Ok(())
    }

    async fn workload_agent(&self, id: &str) -> Result<Option<Arc<AgentClient>>, TaskError> {
        let (kind, _) = self.container_process(id, "").await?;
        match kind {
            ContainerKind::Sandbox => Ok(None),
            ContainerKind::Workload => Ok(Some(self.agent().await?)),
        }
    }

    async fn do_pause(&self, id: &str, pause: bool) -> Result<(), TaskError> {
        let (_, init) = self.container_process(id, "").await?;
        match (self.workload_agent(id).await?, pause) {
            (Some(agent), true) => agent.pause_container(id).await?,
            (Some(agent), false) => agent.resume_container(id).await?,
            // The sandbox task stands for the whole pod: its backend pauses the pod (or says it cannot).
            (None, true) => self.sandbox_for(id).await?.pause().await?,
            (None, false) => self.sandbox_for(id).await?.resume().await?,
        }
        let event = if pause { ProcessEvent::Paused } else { ProcessEvent::Resumed };
        init.core().transition(event)?;
        if pause {
            self.events.paused(id).await;
        } else {
            self.events.resumed(id).await;
        }
        Ok(())
    }

    async fn do_stats(&self, id: &str) -> Result<Metrics, TaskError> {
        let stats = match self.workload_agent(id).await? {
            Some(agent) => agent.stats(id).await?,
            // The sandbox's own usage on the host: the VMM, or the launcher and agent.
            None => self.sandbox_for(id).await?.stats().await?,
        };
        Ok(crate::trans::metrics(&stats))
    }

    /// The running sandbox, for the sandbox task `id`.
    async fn sandbox_for(&self, id: &str) -> Result<Arc<dyn Sandbox>, TaskError> {
        self.running_sandbox()
            .await
            .ok_or_else(|| TaskError::FailedPrecondition(format!("the pod sandbox {id} is not running")))
    }
}

/// One line of a pod's id map as the agent takes it.
fn id_mapping(m: &oci_spec::runtime::LinuxIdMapping) -> pb::IdMapping {
    pb::IdMapping { container_id: m.container_id(), host_id: m.host_id(), size: m.size(), ..Default::default() }
}

fn delete_response(state: ProcessState) -> DeleteResponse {
    let exit = state.exit();
    DeleteResponse {
        pid: state.pid(),
        exit_status: exit.map(|e| e.status).unwrap_or_default(),
        exited_at: exit.map(|e| timestamp(e.at)).into(),
        ..Default::default()
    }
}

impl TaskService {
    fn span(&self, op: &'static str, id: &str, exec_id: &str) -> tracing::Span {
        if exec_id.is_empty() {
            info_span!(parent: &self.pod_span, "container", op, id = %id)
        } else {
            info_span!(parent: &self.pod_span, "exec", op, id = %id, exec_id = %exec_id)
        }
    }
}

#[async_trait]
impl Task for TaskService {
    async fn create(&self, _ctx: &TtrpcContext, req: CreateTaskRequest) -> TtrpcResult<CreateTaskResponse> {
        let span = self.span("create", &req.id, "");
        async move {
            info!(bundle = %req.bundle, "create");
            self.do_create(req).await.map_err(|e| {
                warn!("create failed: {e}");
                e.into()
            })
        }
        .instrument(span)
        .await
    }

    async fn start(&self, _ctx: &TtrpcContext, req: StartRequest) -> TtrpcResult<StartResponse> {
        let span = self.span("start", &req.id, &req.exec_id);
        async move {
            self.do_start(req).await.map_err(|e| {
                warn!("start failed: {e}");
                e.into()
            })
        }
        .instrument(span)
        .await
    }

    async fn state(&self, _ctx: &TtrpcContext, req: StateRequest) -> TtrpcResult<StateResponse> {
        let (bundle, process) = {
            let containers = self.containers.lock().await;
            let c = containers.get(&req.id).ok_or_else(|| TaskError::NotFound(format!("container {}", req.id)))?;
            (c.bundle.clone(), c.process(&req.exec_id)?)
        };
        let core = process.core();
        let state = core.state();
        let exit = state.exit();
        Ok(StateResponse {
            id: req.id,
            bundle,
            pid: state.pid(),
            status: status_of(state).into(),
            stdin: core.stdio.paths.stdin.clone(),
            stdout: core.stdio.paths.stdout.clone(),
            stderr: core.stdio.paths.stderr.clone(),
            terminal: core.stdio.terminal,
            exit_status: exit.map(|e| e.status).unwrap_or_default(),
            exited_at: exit.map(|e| timestamp(e.at)).into(),
            exec_id: req.exec_id,
            ..Default::default()
        })
    }

    async fn delete(&self, _ctx: &TtrpcContext, req: DeleteRequest) -> TtrpcResult<DeleteResponse> {
        let span = self.span("delete", &req.id, &req.exec_id);
        async move { self.do_delete(req).await.map_err(Into::into) }.instrument(span).await
    }

    async fn pids(&self, _ctx: &TtrpcContext, req: PidsRequest) -> TtrpcResult<PidsResponse> {
        let (kind, init) = self.container_process(&req.id, "").await?;
        let pids = match kind {
            ContainerKind::Sandbox => vec![init.core().state().pid()],
            ContainerKind::Workload => self.agent().await?.list_pids(&req.id).await.map_err(TaskError::from)?,
        };
        Ok(PidsResponse {
            processes: pids.into_iter().map(|pid| ProcessInfo { pid, ..Default::default() }).collect(),
            ..Default::default()
        })
    }

    async fn pause(&self, _ctx: &TtrpcContext, req: PauseRequest) -> TtrpcResult<Empty> {
        self.do_pause(&req.id, true).await?;
        Ok(Empty::new())
    }

    async fn resume(&self, _ctx: &TtrpcContext, req: ResumeRequest) -> TtrpcResult<Empty> {
        self.do_pause(&req.id, false).await?;
        Ok(Empty::new())
    }

    async fn kill(&self, _ctx: &TtrpcContext, req: KillRequest) -> TtrpcResult<Empty> {
        let span = self.span("kill", &req.id, &req.exec_id);
        async move {
            let (_, process) = self.container_process(&req.id, &req.exec_id).await?;
            info!(signal = req.signal, all = req.all, "kill");
            process.kill(req.signal, req.all).await?;
            Ok(Empty::new())
        }
        .instrument(span)
        .await
    }

    async fn exec(&self, _ctx: &TtrpcContext, req: ExecProcessRequest) -> TtrpcResult<Empty> {
        let span = self.span("exec", &req.id, &req.exec_id);
        async move {
            self.do_exec(req).await?;
            Ok(Empty::new())
        }
        .instrument(span)
        .await
    }

    async fn resize_pty(&self, _ctx: &TtrpcContext, req: ResizePtyRequest) -> TtrpcResult<Empty> {
        let (_, process) = self.container_process(&req.id, &req.exec_id).await?;
        process.resize_pty(req.width, req.height).await?;
        Ok(Empty::new())
    }

    async fn close_io(&self, _ctx: &TtrpcContext, req: CloseIORequest) -> TtrpcResult<Empty> {
        if req.stdin {
            let (_, process) = self.container_process(&req.id, &req.exec_id).await?;
            process.close_stdin().await?;
        }
        Ok(Empty::new())
    }

    async fn update(&self, _ctx: &TtrpcContext, req: UpdateTaskRequest) -> TtrpcResult<Empty> {
        let Some(agent) = self.workload_agent(&req.id).await? else {
            // The sandbox task stands for the pod: its VM (or namespace sandbox) keeps the shape
            // it started with, so nothing here could honour new limits.
            return Err(TaskError::Unimplemented(format!(
                "update of the pod sandbox {}: bulkhead does not resize a running sandbox; update \
                 the containers' resources, which the guest applies",
                req.id
            ))
            .into());
        };
        let resources = req.resources.as_ref().map(|any| any.value.clone()).unwrap_or_default();
        if resources.len() > MAX_JSON {
            return Err(TaskError::InvalidArgument("resources too large".into()).into());
        }
        // No resources at all asks for nothing the VM must hold.
        let parsed: LinuxResources = match resources.is_empty() {
            true => LinuxResources::default(),
            false => serde_json::from_slice(&resources)
                .map_err(|e| TaskError::InvalidArgument(format!("update of {}: resources: {e}", req.id)))?,
        };
        let sandbox = self.sandbox_for(&req.id).await?;
        if let Err(e) = sandbox.check_resize(&req.id, &parsed) {
            warn!(container = %req.id, "resize refused: {e}");
            return Err(TaskError::from(e).into());
        }
        agent.update_container(&req.id, resources).await.map_err(TaskError::from)?;
        sandbox.resized(&req.id, &parsed).await.map_err(TaskError::from)?;
        Ok(Empty::new())
    }

    async fn checkpoint(&self, _ctx: &TtrpcContext, req: CheckpointTaskRequest) -> TtrpcResult<Empty> {
        Err(TaskError::Unimplemented(format!("checkpoint of {}: bulkhead does not checkpoint containers", req.id))
            .into())
    }

    async fn wait(&self, _ctx: &TtrpcContext, req: WaitRequest) -> TtrpcResult<WaitResponse> {
        let (_, process) = self.container_process(&req.id, &req.exec_id).await?;
        let exit = process.core().wait().await;
        Ok(WaitResponse { exit_status: exit.status, exited_at: Some(timestamp(exit.at)).into(), ..Default::default() })
    }

    async fn stats(&self, _ctx: &TtrpcContext, req: StatsRequest) -> TtrpcResult<StatsResponse> {
        let metrics = self.do_stats(&req.id).await?;
        let any = containerd_shim::util::convert_to_any(Box::new(metrics))
            .map_err(|e| TaskError::Internal(format!("encode stats: {e}")))?;
        Ok(StatsResponse { stats: Some(any).into(), ..Default::default() })
    }

    async fn connect(&self, _ctx: &TtrpcContext, req: ConnectRequest) -> TtrpcResult<ConnectResponse> {
        let task_pid = match self.container_process(&req.id, "").await {
            Ok((_, init)) => init.core().state().pid(),
            Err(_) => 0,
        };
        Ok(ConnectResponse {
            shim_pid: std::process::id(),
            task_pid,
            version: env!("CARGO_PKG_VERSION").into(),
            ..Default::default()
        })
    }

    async fn shutdown(&self, _ctx: &TtrpcContext, _req: ShutdownRequest) -> TtrpcResult<Empty> {
        if !self.containers.lock().await.is_empty() {
            return Ok(Empty::new());
        }
        if let Some(sandbox) = self.running_sandbox().await {
            self.metrics.detach();
            let _ = sandbox.destroy().await;
        }
        info!(namespace = %self.namespace, "no containers left; shim exits");
        self.exit.signal();
        Ok(Empty::new())
    }
}
