//! The ttrpc `bulkhead.agent.v1.Agent` service: message conversion only; the work is in
//! [`Sandbox`].

use std::{sync::Arc, time::Duration, time::UNIX_EPOCH};

use async_trait::async_trait;
use bulkhead_protocol::{
    agent::{self as pb},
    agent_ttrpc::{create_agent, Agent},
    PROTOCOL_VERSION,
};
use ttrpc::r#async::{transport::Listener, Server, TtrpcContext};

use crate::{
    error::AgentError,
    guest_init::SandboxSettings,
    mount::GuestMount,
    process_io::StdioRequest,
    sandbox::{CreateRequest, Sandbox},
    transport::TtrpcConn,
};

type R<T> = ttrpc::Result<T>;

pub struct AgentService {
    sandbox: Arc<Sandbox>,
    shutdown: tokio::sync::mpsc::Sender<()>,
}

pub fn server(
    sandbox: Arc<Sandbox>,
    conns: tokio::sync::mpsc::Receiver<std::io::Result<TtrpcConn>>,
    shutdown: tokio::sync::mpsc::Sender<()>,
) -> anyhow::Result<Server> {
    let incoming = futures::stream::unfold(conns, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
    let svc = Arc::new(AgentService { sandbox, shutdown });
    Ok(Server::new().add_listener(Listener::new(incoming)).register_service(create_agent(svc)))
}

fn id_maps(ms: &[pb::IdMapping]) -> Vec<crate::pod_userns::IdMap> {
    ms.iter()
        .map(|m| crate::pod_userns::IdMap { container_id: m.container_id, host_id: m.host_id, size: m.size })
        .collect()
}

fn mounts(ms: &[pb::Mount]) -> Vec<GuestMount> {
    ms.iter()
        .map(|m| GuestMount {
            source: m.source.clone(),
            destination: m.destination.clone().into(),
            fstype: m.fstype.clone(),
            options: m.options.clone(),
        })
        .collect()
}

fn stdio(s: &protobuf::MessageField<pb::StdioConfig>) -> StdioRequest {
    StdioRequest { terminal: s.as_ref().is_some_and(|s| s.terminal), stdin: s.as_ref().is_some_and(|s| s.stdin) }
}

fn nanos(t: std::time::SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)).unwrap_or(0)
}

fn pid(p: i32) -> u32 {
    u32::try_from(p).unwrap_or(0)
}

#[async_trait]
impl Agent for AgentService {
    async fn version(&self, _c: &TtrpcContext, req: pb::VersionRequest) -> R<pb::VersionResponse> {
        if req.protocol_version != PROTOCOL_VERSION {
            return Err(AgentError::FailedPrecondition(format!(
                "protocol version mismatch: client {} speaks {}, agent speaks {PROTOCOL_VERSION}",
                req.client, req.protocol_version
            ))
            .into());
        }
        Ok(pb::VersionResponse {
            protocol_version: PROTOCOL_VERSION,
            agent_version: env!("CARGO_PKG_VERSION").into(),
            mode: self.sandbox.mode.as_str().into(),
            dropped_output_bytes: crate::stdio::dropped_output_bytes(),
            ..Default::default()
        })
    }

    async fn setup_sandbox(&self, _c: &TtrpcContext, req: pb::SetupSandboxRequest) -> R<pb::SetupSandboxResponse> {
        let mut sysctls: Vec<(String, String)> = req.sysctls.into_iter().collect();
        sysctls.sort();
        let s = SandboxSettings {
            hostname: req.hostname,
            resolv_conf: req.resolv_conf,
            sysctls,
            wall_clock_unix_nanos: req.wall_clock_unix_nanos,
            entropy_seed: req.entropy_seed,
            mounts: mounts(&req.guest_mounts),
            pids_limit: u64::try_from(req.pids_limit).ok().filter(|&limit| limit > 0),
            uid_mappings: id_maps(&req.uid_mappings),
            gid_mappings: id_maps(&req.gid_mappings),
        };
        let interfaces = crate::network::parse_interfaces(
            &req.interfaces
                .iter()
                .map(|i| (i.name.clone(), i.mac.clone(), i.mtu, i.addresses.clone()))
                .collect::<Vec<_>>(),
        )?;
        let routes = crate::network::parse_routes(
            &req.routes
                .iter()
                .map(|r| (r.destination.clone(), r.gateway.clone(), r.device.clone()))
                .collect::<Vec<_>>(),
        )?;
        if self.sandbox.confined && !(interfaces.is_empty() && routes.is_empty()) {
            return Err(AgentError::InvalidArgument(
                "interfaces and routes in namespace mode: the pod's network is CNI's (or the node's), and the agent \
                 keeps no CAP_NET_ADMIN to change it"
                    .into(),
            )
            .into());
        }
        let pod_user_namespace = self.sandbox.setup(&s)?;
        if !interfaces.is_empty() || !routes.is_empty() || self.sandbox.mode == crate::cli::Mode::Guest {
            crate::network::apply(&interfaces, &routes).await?;
        }
        if req.online_cpus > 0 {
            let online = self.sandbox.set_online_cpus(req.online_cpus).await?;
            tracing::info!(online, "the pod's CPUs are online");
        }
        Ok(pb::SetupSandboxResponse { pod_user_namespace, ..Default::default() })
    }

    async fn set_online_cpus(&self, _c: &TtrpcContext, req: pb::SetOnlineCpusRequest) -> R<pb::SetOnlineCpusResponse> {
        let online = self.sandbox.set_online_cpus(req.count).await?;
        Ok(pb::SetOnlineCpusResponse { online, ..Default::default() })
    }

    async fn destroy_sandbox(&self, _c: &TtrpcContext, req: pb::DestroySandboxRequest) -> R<pb::Empty> {
        let grace = Duration::from_millis(u64::from(req.timeout_ms.clamp(0, 60_000)));
        self.sandbox.destroy(grace).await;
        let _ = self.shutdown.try_send(());
        Ok(pb::Empty::default())
    }

    async fn create_container(
        &self,
        _c: &TtrpcContext,
        req: pb::CreateContainerRequest,
    ) -> R<pb::CreateContainerResponse> {
        let span = tracing::info_span!("create", container = %req.container_id);
        let _g = span.enter();
        let p = self
            .sandbox
            .create_container(CreateRequest {
                stdio: stdio(&req.stdio),
                rootfs_mounts: mounts(&req.rootfs_mounts),
                id: req.container_id,
                spec_json: req.oci_spec_json,
                rootfs_path: req.rootfs_path,
            })
            .await?;
        Ok(pb::CreateContainerResponse { pid: pid(p), ..Default::default() })
    }

    async fn start_container(
        &self,
        _c: &TtrpcContext,
        req: pb::StartContainerRequest,
    ) -> R<pb::StartContainerResponse> {
        let p = self.sandbox.start_container(&req.container_id).await?;
        Ok(pb::StartContainerResponse { pid: pid(p), ..Default::default() })
    }

    async fn remove_container(&self, _c: &TtrpcContext, req: pb::RemoveContainerRequest) -> R<pb::Empty> {
        self.sandbox.remove(&req.container_id, req.force).await?;
        Ok(pb::Empty::default())
    }

    async fn exec_process(&self, _c: &TtrpcContext, req: pb::ExecProcessRequest) -> R<pb::ExecProcessResponse> {
        let p =
            self.sandbox.exec_process(&req.container_id, &req.exec_id, &req.process_json, stdio(&req.stdio)).await?;
        Ok(pb::ExecProcessResponse { pid: pid(p), ..Default::default() })
    }

    async fn signal_process(&self, _c: &TtrpcContext, req: pb::SignalProcessRequest) -> R<pb::Empty> {
        self.sandbox.signal(&req.container_id, &req.exec_id, req.signal, req.all)?;
        Ok(pb::Empty::default())
    }

    async fn wait_process(&self, _c: &TtrpcContext, req: pb::WaitProcessRequest) -> R<pb::WaitProcessResponse> {
        let r = self.sandbox.wait(&req.container_id, &req.exec_id).await?;
        Ok(pb::WaitProcessResponse {
            exit_code: r.info.code,
            signal: r.info.signal,
            oom_killed: r.oom_killed,
            exited_at_unix_nanos: nanos(r.info.at),
            ..Default::default()
        })
    }

    async fn resize_pty(&self, _c: &TtrpcContext, req: pb::ResizePtyRequest) -> R<pb::Empty> {
        self.sandbox.resize(&req.container_id, &req.exec_id, req.rows, req.cols)?;
        Ok(pb::Empty::default())
    }

    async fn close_stdin(&self, _c: &TtrpcContext, req: pb::CloseStdinRequest) -> R<pb::Empty> {
        self.sandbox.close_stdin(&req.container_id, &req.exec_id)?;
        Ok(pb::Empty::default())
    }

    async fn stats(&self, _c: &TtrpcContext, req: pb::StatsRequest) -> R<pb::StatsResponse> {
        let c = self.sandbox.container(&req.container_id)?;
        Ok(c.cgroup.stats()?)
    }

    async fn pause_container(&self, _c: &TtrpcContext, req: pb::ContainerRequest) -> R<pb::Empty> {
        self.sandbox.pause(&req.container_id).await?;
        Ok(pb::Empty::default())
    }

    async fn resume_container(&self, _c: &TtrpcContext, req: pb::ContainerRequest) -> R<pb::Empty> {
        self.sandbox.resume(&req.container_id).await?;
        Ok(pb::Empty::default())
    }

    async fn update_container(&self, _c: &TtrpcContext, req: pb::UpdateContainerRequest) -> R<pb::Empty> {
        self.sandbox.update(&req.container_id, &req.resources_json)?;
        Ok(pb::Empty::default())
    }

    async fn list_pids(&self, _c: &TtrpcContext, req: pb::ContainerRequest) -> R<pb::ListPidsResponse> {
        let pids = self.sandbox.container(&req.container_id)?.cgroup.pids()?;
        Ok(pb::ListPidsResponse { pids, ..Default::default() })
    }

    async fn get_oom_event(&self, _c: &TtrpcContext, req: pb::GetOomEventRequest) -> R<pb::GetOomEventResponse> {
        let ev = self.sandbox.oom.next_after(req.after_seq, Duration::from_millis(u64::from(req.wait_ms))).await;
        Ok(pb::GetOomEventResponse {
            event: ev
                .map(|e| pb::OomEvent {
                    seq: e.seq,
                    container_id: e.container_id,
                    at_unix_nanos: nanos(e.at),
                    ..Default::default()
                })
                .into(),
            ..Default::default()
        })
    }
}
