//! The shim's own lifecycle, as containerd drives it:
//! - `start`: called once per container with the bundle as cwd. The sandbox (or a bundle
//!   without CRI annotations) spawns a new shim server; a CRI container gets the address of
//!   its pod's shim, computed from the sandbox id, so the pod shares one shim.
//! - `delete`: called after a shim died; kills the pod's sandbox, unmounts, removes state.
//! - serve mode (no action): the ttrpc Task server until Shutdown.
//!
//! `start` is handled here rather than by `containerd_shim::run`, because that library answers
//! with the JSON of newer containerd versions while containerd 1.6 reads a bare address.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

use anyhow::Context as _;
use async_trait::async_trait;
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{DeleteResponse, ExitSignal, Flags, StartOpts};

use crate::events::{timestamp, EventSink};
use crate::sandbox::namespace::{cleanup, unmount_all};
use crate::sandbox::paths::{BundleRecord, PodPaths};
use crate::spec::{BundleSpec, Role};
use crate::task::TaskService;
use crate::RUNTIME_ID;

pub fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flags = match containerd_shim::parse(&args[1..]) {
        Ok(flags) => flags,
        Err(e) => {
            eprintln!("{RUNTIME_ID}: {e}");
            std::process::exit(1);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{RUNTIME_ID}: tokio runtime: {e}");
            std::process::exit(1);
        }
    };
    if flags.action == "start" {
        match runtime.block_on(start(&flags)) {
            Ok(address) => {
                // containerd 1.6 takes stdout (and stderr) as the address: print nothing else.
                let mut out = std::io::stdout();
                let _ = out.write_all(address.as_bytes());
                let _ = out.flush();
            }
            Err(e) => {
                eprintln!("{RUNTIME_ID} start: {e:#}");
                std::process::exit(1);
            }
        }
        return;
    }
    let config = containerd_shim::Config {
        no_setup_logger: true,
        // The shim only spawns the namespace launcher, which tokio reaps; agent descendants
        // live in the agent's PID namespace and never reparent to the shim.
        no_reaper: true,
        no_sub_reaper: true,
        ..Default::default()
    };
    runtime.block_on(containerd_shim::asynchronous::run::<Service>(RUNTIME_ID, Some(config)));
}

fn start_opts(flags: &Flags) -> StartOpts {
    StartOpts {
        id: flags.id.clone(),
        publish_binary: flags.publish_binary.clone(),
        address: flags.address.clone(),
        ttrpc_address: std::env::var("TTRPC_ADDRESS").unwrap_or_default(),
        namespace: flags.namespace.clone(),
        debug: flags.debug,
        ..Default::default()
    }
}

fn socket_alive(address: &str) -> bool {
    let path = address.strip_prefix("unix://").unwrap_or(address);
    std::os::unix::net::UnixStream::connect(path).is_ok()
}

/// `start`: spawn or reuse the pod's shim; returns its address.
async fn start(flags: &Flags) -> anyhow::Result<String> {
    let spec = BundleSpec::load(Path::new(".")).context("read bundle spec")?;
    let role = spec.role();
    let group = role.group(&flags.id).to_string();
    let opts = start_opts(flags);
    let address = opts.socket_address(&group);
    let address = if matches!(role, Role::Container { .. }) && socket_alive(&address) {
        address
    } else {
        containerd_shim::asynchronous::spawn(opts, &group, Vec::new()).await.context("spawn shim server")?
    };
    std::fs::write("address", &address).context("write address file")?;
    Ok(address)
}

pub struct Service {
    namespace: String,
    id: String,
    address: String,
    exit: Arc<ExitSignal>,
}

#[async_trait]
impl containerd_shim::asynchronous::Shim for Service {
    type T = TaskService;

    async fn new(_runtime_id: &str, args: &Flags, _config: &mut containerd_shim::Config) -> Self {
        if args.action.is_empty() {
            crate::logging::init(args.debug, &args.namespace, &args.id);
        }
        Service {
            namespace: args.namespace.clone(),
            id: args.id.clone(),
            address: args.address.clone(),
            exit: Arc::new(ExitSignal::default()),
        }
    }

    async fn start_shim(&mut self, _opts: StartOpts) -> containerd_shim::Result<String> {
        // `main` answers `start` itself (containerd 1.6 reply format).
        Err(containerd_shim::Error::InvalidArgument("start is handled before the library".into()))
    }

    async fn delete_shim(&mut self) -> containerd_shim::Result<DeleteResponse> {
        delete_after_crash(&self.namespace, &self.id, &self.address).await;
        Ok(DeleteResponse {
            pid: 0,
            exit_status: 128 + 9,
            exited_at: Some(timestamp(SystemTime::now())).into(),
            ..Default::default()
        })
    }

    async fn wait(&mut self) {
        self.exit.wait().await;
    }

    async fn create_task_service(&self, publisher: RemotePublisher) -> TaskService {
        TaskService::new(&self.namespace, EventSink::new(publisher, &self.namespace), self.exit.clone())
    }
}

/// `delete` runs in the bundle of `id` after its shim died (or a start failed).
/// The sandbox's delete tears the whole pod down; a container's delete unmounts its rootfs and
/// tears the pod down only if the pod's shim is gone too.
async fn delete_after_crash(namespace: &str, id: &str, containerd_address: &str) {
    let bundle = Path::new(".");
    let Ok(record) = BundleRecord::read(bundle) else {
        // Create never got far enough to record anything; only a rootfs may be mounted.
        unmount_all(&bundle.join("rootfs").canonicalize().unwrap_or_default());
        return;
    };
    let paths = PodPaths::new(&record.state_dir, &record.sandbox_id);
    if let Ok(rootfs) = bundle.join("rootfs").canonicalize() {
        unmount_all(&paths.rootfs(id));
        unmount_all(&rootfs);
    }
    let pod_shim = containerd_shim::socket_address(containerd_address, namespace, &record.sandbox_id);
    if record.is_sandbox || !socket_alive(&pod_shim) {
        cleanup(&paths).await;
    }
}
