//! The shim's own lifecycle, as containerd drives it:
//! - `start`: called once per container with the bundle as cwd. The sandbox (or a bundle
//!   without CRI annotations) spawns a new shim server; a CRI container gets the address of
//!   its pod's shim, computed from the sandbox id, so the pod shares one shim.
//! - `delete`: called after a shim died; tears the pod's sandbox down through its backend (the
//!   bundle record says which and where): processes, mounts, cgroups, state.
//! - serve mode (no action): the ttrpc Task server until Shutdown.
//! - `-info` (containerd 1.7+ introspection, `PluginInfo` of the runtime): what the runtime is.
//!
//! The bootstrap is ours rather than `containerd_shim::run`'s: that library answers `start`
//! with the JSON of newer containerd versions (1.6 reads a bare address) and registers the
//! Task service only as `containerd.task.v3.Task` (1.6 calls `containerd.task.v2.Task`).
//!
//! `start` prints a bare address on every containerd version, and that is deliberate on 2.x too:
//! 2.x reads it as bootstrap version 2 (ttrpc, Task API v2). A version 3 answer would make 2.x
//! stop running `start` and `delete` for a pod's containers and reach them on the pod's socket
//! instead; this shim relies on both (pod grouping, cleanup after a crash).
//!
//! On 2.x with `sandboxer = "shim"`, containerd runs `start` for the pod itself, in a bundle with
//! no spec, and then drives the pod through the sandbox API (`crate::sandboxer`), which serve
//! mode offers beside the Task API.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

use anyhow::Context as _;
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{DeleteResponse, ExitSignal, Flags, StartOpts};

use crate::events::{timestamp, EventSink};
use crate::metrics::rpc::MeasuredTask;
use crate::sandbox::cleanup;
use crate::sandbox::mounts::unmount_all;
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
    if flags.version {
        println!("containerd-shim-bulkhead-v2 {}", env!("CARGO_PKG_VERSION"));
        return;
    }
    if flags.info {
        // Before any action: containerd runs `-info` with no action and the runtime options on stdin.
        let options = read_info_options();
        if let Err(e) = runtime_info(&options).and_then(|bytes| {
            let mut out = std::io::stdout();
            out.write_all(&bytes).and_then(|()| out.flush()).context("write runtime info")
        }) {
            eprintln!("{RUNTIME_ID} -info: {e:#}");
            std::process::exit(1);
        }
        return;
    }
    let runtime = match runtime_for(&flags.action) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{RUNTIME_ID}: tokio runtime: {e}");
            std::process::exit(1);
        }
    };
    let result = match flags.action.as_str() {
        "start" => runtime.block_on(start(&flags)).map(|address| {
            // containerd 1.6 takes stdout (and stderr) as the address: print nothing else.
            let mut out = std::io::stdout();
            let _ = out.write_all(address.as_bytes());
            let _ = out.flush();
        }),
        "delete" => runtime.block_on(delete(&flags)),
        "" => runtime.block_on(serve(&flags)),
        other => Err(anyhow::anyhow!("unknown action {other:?}")),
    };
    if let Err(e) = result {
        eprintln!("{RUNTIME_ID} {}: {e:#}", flags.action);
        std::process::exit(1);
    }
}

/// Worker threads of a shim that serves its pod (serve mode, for the pod's whole life). A shim
/// serves one pod: containerd's RPCs, the agent connection, a few stdio relays and the metrics
/// socket. Two workers keep one slow RPC from holding the others. tokio's default, one per core,
/// gave every pod's shim a thread per host core (a stack, a malloc arena, a kernel stack), idle
/// for the pod's whole life: on a 64-core node, 64 threads per pod.
const SERVE_WORKERS: usize = 2;

/// The runtime an action runs on: `start` and `delete` are short-lived commands that need no
/// thread of their own; serve mode gets [`SERVE_WORKERS`].
fn runtime_for(action: &str) -> std::io::Result<tokio::runtime::Runtime> {
    match action {
        "" => tokio::runtime::Builder::new_multi_thread().worker_threads(SERVE_WORKERS).enable_all().build(),
        _ => tokio::runtime::Builder::new_current_thread().enable_all().build(),
    }
}

/// The type URL containerd registers the OCI runtime-spec `features` document under (a JSON value).
const FEATURES_TYPE_URL: &str = "types.containerd.io/opencontainers/runtime-spec/1/features/Features";

/// The runtime options containerd writes to `-info`'s stdin (a protobuf `Any`; nothing when the handler has none),
/// bounded; a terminal is not read.
fn read_info_options() -> Vec<u8> {
    use std::io::{IsTerminal, Read};
    let mut bytes = Vec::new();
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        let _ = stdin.lock().take(1 << 20).read_to_end(&mut bytes);
    }
    bytes
}

/// Whether the handler `-info` describes runs `hostUsers: false` pods: one whose config loads, found without
/// runtime options (both backends run them). containerd 2.x starts a user-namespaced container only on a handler
/// without them: it sets the console's owner in them as runc's and fails on any other type.
fn runs_user_namespaces(options: &[u8], config: &Path) -> bool {
    use containerd_shim::protos::protobuf::Message;
    let has_options = !options.is_empty()
        && containerd_shim::protos::protobuf::well_known_types::any::Any::parse_from_bytes(options)
            .map_or(true, |any| !any.value.is_empty());
    if has_options {
        return false;
    }
    crate::config::Config::load(config).is_ok()
}

/// The OCI features document `-info` reports: idmapped mounts (a user-namespaced pod's, which the shim makes:
/// crate::sandbox::idmap), and the namespaces, `user` only where [`runs_user_namespaces`].
/// containerd 2.x checks the first before it creates a container with idmapped mounts; from 2.4 CRI reports
/// both together to kubelet as the handler's user namespace support (2.1 reports none for non-runc runtimes).
fn features(user_namespaces: bool) -> serde_json::Value {
    let mut namespaces = vec!["cgroup", "ipc", "mount", "network", "pid", "uts"];
    if user_namespaces {
        namespaces.push("user");
    }
    serde_json::json!({ "linux": { "namespaces": namespaces, "mountExtensions": { "idmap": { "enabled": true } } } })
}

/// `-info`: the runtime's name and version, and its [`features`] for the handler whose options are `options`.
fn runtime_info(options: &[u8]) -> anyhow::Result<Vec<u8>> {
    use containerd_shim::protos::protobuf::well_known_types::any::Any;
    use containerd_shim::protos::protobuf::Message;
    use containerd_shim::protos::types::introspection::{RuntimeInfo, RuntimeVersion};
    let features = features(runs_user_namespaces(options, &crate::config::config_path(None)));
    let info = RuntimeInfo {
        name: RUNTIME_ID.into(),
        version: Some(RuntimeVersion { version: env!("CARGO_PKG_VERSION").into(), ..Default::default() }).into(),
        features: Some(Any {
            type_url: FEATURES_TYPE_URL.into(),
            value: serde_json::to_vec(&features)?,
            ..Default::default()
        })
        .into(),
        ..Default::default()
    };
    info.write_to_bytes().context("encode RuntimeInfo")
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
    // containerd writes a task's spec into its bundle before `start`, on every version. Only 2.x's sandbox
    // controller (a runtime configured with `sandboxer = "shim"`) starts a shim in a bundle without one: the pod's
    // own shim, which CreateSandbox then gives its spec.
    if !Path::new("config.json").exists() {
        let opts = start_opts(flags);
        let address =
            containerd_shim::asynchronous::spawn(opts, &flags.id, Vec::new()).await.context("spawn shim server")?;
        std::fs::write("address", &address).context("write address file")?;
        return Ok(address);
    }
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

/// The ttrpc service names containerd looks the Task API up by: 1.6/1.7 use `v2`, 2.x `v3`;
/// the messages are the same on the wire.
const TASK_SERVICE_V2: &str = "containerd.task.v2.Task";
const TASK_SERVICE_V3: &str = "containerd.task.v3.Task";

/// Serve mode: the Task API on `-socket` until Shutdown leaves the shim with nothing to do.
async fn serve(flags: &Flags) -> anyhow::Result<()> {
    anyhow::ensure!(!flags.socket.is_empty(), "-socket is required in serve mode");
    crate::logging::init(flags.debug, &flags.namespace, &flags.id);
    // A session and process group of our own: however containerd is stopped (a terminal's ^C,
    // a process-group kill), its pods' shims stay, and containerd finds them again through the
    // bundle's address file when it returns.
    if let Err(e) = nix::unistd::setsid() {
        tracing::warn!("setsid: {e}; the shim shares containerd's session");
    }
    // stderr is /dev/null once serving: a panic must reach the shim log.
    std::panic::set_hook(Box::new(|info| tracing::error!("panic: {info}")));
    let socket_path = flags.socket.strip_prefix("unix://").unwrap_or(&flags.socket).to_string();
    let listener = match bind(&socket_path) {
        Ok(listener) => listener,
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && socket_alive(&flags.socket) => {
            // Another shim already serves this pod: hand containerd its address.
            std::fs::write("address", &flags.socket).context("write address file")?;
            signal_started();
            return Ok(());
        }
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            let _ = std::fs::remove_file(&socket_path);
            bind(&socket_path).context("bind shim socket")?
        }
        Err(e) => return Err(e).context("bind shim socket"),
    };
    let ttrpc_address = std::env::var("TTRPC_ADDRESS").context("TTRPC_ADDRESS is not set")?;
    let publisher = RemotePublisher::new(&ttrpc_address).await.context("connect to containerd's event service")?;
    let exit = Arc::new(ExitSignal::default());
    let service =
        TaskService::new(&flags.namespace, &flags.id, EventSink::new(publisher, &flags.namespace), exit.clone());
    let metrics = service.metrics();
    let task: Arc<dyn containerd_shim::Task + Send + Sync> = Arc::new(MeasuredTask::new(service, metrics));
    let mut v2 = containerd_shim::protos::shim_async::create_task(task.clone());
    let mut services = containerd_shim::protos::shim_async::create_task(task.clone());
    if let Some(service) = v2.remove(TASK_SERVICE_V3) {
        services.insert(TASK_SERVICE_V2.to_string(), service);
    }
    // containerd 1.x never calls it; 2.x only for a runtime with `sandboxer = "shim"`.
    let sandbox_api = Arc::new(crate::sandboxer::SandboxService::new(&flags.id, task));
    services.extend(containerd_shim::protos::sandbox_async::create_sandbox(sandbox_api));
    let listener = ttrpc::asynchronous::transport::Listener::try_from(listener).context("ttrpc listener")?;
    let mut server = ttrpc::asynchronous::Server::new().add_listener(listener).register_service(services);
    server.start().await.context("start ttrpc server")?;
    signal_started();
    tracing::info!(socket = %flags.socket, "serving the Task and sandbox APIs");
    exit.wait().await;
    tracing::info!("shutting down");
    let _ = server.shutdown().await;
    let _ = std::fs::remove_file(&socket_path);
    Ok(())
}

/// Binds the Task API socket, mode 0600 whatever umask containerd gave us: whoever can connect
/// controls the pod. Made with a private umask (no thread creates files yet), so there is no
/// moment at which the socket is more open, and then set explicitly.
fn bind(path: &str) -> std::io::Result<std::os::unix::net::UnixListener> {
    use nix::sys::stat::{umask, Mode};
    use std::os::unix::fs::PermissionsExt;
    if let Some(parent) = Path::new(path).parent() {
        std::fs::create_dir_all(parent)?;
    }
    let previous = umask(Mode::from_bits_truncate(0o177));
    let bound = std::os::unix::net::UnixListener::bind(path);
    umask(previous);
    let listener = bound?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// `start` waits for our stdout to close: point it at stderr (containerd's /dev/null).
fn signal_started() {
    // SAFETY: dup2 on the process's own standard descriptors.
    unsafe {
        libc::dup2(libc::STDERR_FILENO, libc::STDOUT_FILENO);
    }
}

/// `delete`: clean up after a dead shim and report the task as killed.
async fn delete(flags: &Flags) -> anyhow::Result<()> {
    use containerd_shim::protos::protobuf::Message;
    delete_after_crash(&flags.namespace, &flags.id, &flags.address).await;
    let response = DeleteResponse {
        pid: 0,
        exit_status: 128 + 9,
        exited_at: Some(timestamp(SystemTime::now())).into(),
        ..Default::default()
    };
    let bytes = response.write_to_bytes().context("encode DeleteResponse")?;
    std::io::stdout().write_all(&bytes).context("write DeleteResponse")?;
    Ok(())
}

/// `delete` runs in the bundle of `id` after its shim died (or a start failed).
/// The sandbox's delete tears the whole pod down; a container's delete unmounts its rootfs and
/// tears the pod down only if the pod's shim is gone too.
async fn delete_after_crash(namespace: &str, id: &str, containerd_address: &str) {
    let bundle = Path::new(".");
    let Ok(record) = BundleRecord::read(bundle) else {
        // Create never got far enough to record anything; only a rootfs may be mounted.
        if let Ok(rootfs) = bundle.join("rootfs").canonicalize() {
            unmount_all(&rootfs);
        }
        return;
    };
    let Some(paths) = PodPaths::new(&record.state_dir, &record.sandbox_id) else {
        return;
    };
    if let Ok(rootfs) = bundle.join("rootfs").canonicalize() {
        unmount_all(&paths.rootfs(id));
        unmount_all(&rootfs);
    }
    let pod_shim = containerd_shim::socket_address(containerd_address, namespace, &record.sandbox_id);
    if record.is_sandbox || !socket_alive(&pod_shim) {
        cleanup(record.backend, &paths).await;
        // A shim killed with SIGKILL could not remove its socket.
        let socket = pod_shim.strip_prefix("unix://").unwrap_or(&pod_shim);
        if Path::new(socket).exists() && !socket_alive(&pod_shim) {
            let _ = std::fs::remove_file(socket);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use containerd_shim::protos::protobuf::Message;
    use containerd_shim::protos::types::introspection::RuntimeInfo;

    #[test]
    fn info_names_the_runtime_and_says_idmapped_mounts_are_supported() {
        let info = RuntimeInfo::parse_from_bytes(&runtime_info(&[]).unwrap()).unwrap();
        assert_eq!(info.name, RUNTIME_ID);
        assert_eq!(info.version.version, env!("CARGO_PKG_VERSION"));
        assert_eq!(info.features.type_url, FEATURES_TYPE_URL);
        let features: serde_json::Value = serde_json::from_slice(&info.features.value).unwrap();
        assert_eq!(features.pointer("/linux/mountExtensions/idmap/enabled"), Some(&serde_json::json!(true)));
    }

    #[test]
    fn only_a_handler_without_options_claims_user_namespaces() {
        let names = |f: serde_json::Value| f["linux"]["namespaces"].as_array().unwrap().len();
        assert_eq!((names(features(false)), names(features(true))), (6, 7));
        assert_eq!(features(true)["linux"]["namespaces"][6], "user");
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("bulkhead.toml");
        let claims = |toml: &str, options: &[u8]| {
            std::fs::write(&config, toml).unwrap();
            runs_user_namespaces(options, &config)
        };
        assert!(claims("backend = \"namespace\"\n", &[]));
        assert!(claims("backend = \"vm\"\n", &[]));
        assert!(!claims("not toml [", &[]), "an unreadable config claims nothing");
        let any = containerd_shim::protos::protobuf::well_known_types::any::Any {
            type_url: "runtimeoptions.v1.Options".into(),
            value: vec![0x12, 0x01, b'x'],
            ..Default::default()
        };
        let options = any.write_to_bytes().unwrap();
        assert!(!claims("backend = \"namespace\"\n", &options), "containerd fails them on a handler with options");
    }
}
