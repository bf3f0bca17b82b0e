//! `bulkhead-ctl doctor`: one pass/fail line per thing a bulkhead pod depends on on this node:
//! - the host probe (`bulkhead_vmm_api::probe`, the one probe): can the `vm` backend run here;
//! - containerd, asked over CRI (`Version`, and `Status` with the effective CRI config): which
//!   containerd answers, does it know the handler, which shim does it run (its `runtime_path` on 1.7
//!   and 2.x, which 1.6 ignores) and with which `ConfigPath`, through which sandboxer (2.x);
//! - the shim config, parsed with the shim's own parser (the config containerd passes unless
//!   `--config` names another);
//! - the artifacts that config names, present and with their versions.
//!
//! Any failing line makes the exit code 1.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{StatusRequest, VersionRequest};
use serde::Serialize;
use serde_json::Value;
use tonic::transport::{Endpoint, Uri};

use super::default_config_path;
use super::error::Outcome;
use crate::config::{Backend, Config};
use bulkhead_vmm_api::probe::KvmKind;

/// Upper bound for a CRI call and for running an artifact's `--version`.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// containerd's config JSON is a few KiB; more is not a config.
const MAX_CONFIG_JSON: usize = 1 << 20;
/// How much of a kernel image is searched for its version string.
const MAX_KERNEL_SCAN: u64 = 128 << 20;

#[derive(Debug, Serialize)]
pub struct Check {
    pub name: String,
    pub ok: bool,
    pub detail: String,
}

fn check(name: impl Into<String>, result: Result<String, String>) -> Check {
    match result {
        Ok(detail) => Check { name: name.into(), ok: true, detail },
        Err(detail) => Check { name: name.into(), ok: false, detail },
    }
}

/// What containerd's CRI plugin says about the handler.
#[derive(Debug, Default, PartialEq)]
struct Handler {
    runtime_type: String,
    /// `runtime_path`: the shim binary 1.7 and 2.x run instead of resolving `runtime_type`.
    runtime_path: Option<String>,
    config_path: Option<String>,
    /// 2.x: who runs the pod's sandbox (`podsandbox`: a task of this shim; `shim`: the sandbox API).
    sandboxer: Option<String>,
    /// Whether the runtime has an `options` table.
    has_options: bool,
}

pub async fn run(explicit_config: Option<&Path>, containerd_socket: &Path, handler_name: &str) -> Outcome {
    let mut checks = Vec::new();
    let handler = match cri_config(containerd_socket).await {
        Ok((version, config)) => {
            checks.push(Check {
                name: "containerd".into(),
                ok: true,
                detail: format!("{version} answers CRI at {}", containerd_socket.display()),
            });
            let handler = find_handler(&config, handler_name);
            checks.push(check(
                "containerd handler",
                handler.as_ref().map_or_else(
                    || Err(format!("containerd's CRI config has no runtime {handler_name:?} (is the node installed?)")),
                    |h| {
                        Ok(format!(
                            "{handler_name}: runtime_type {}, ConfigPath {}",
                            h.runtime_type,
                            h.config_path.clone().unwrap_or_else(|| format!(
                                "(none: the shim reads {})",
                                default_config_path().display()
                            ))
                        ))
                    },
                ),
            ));
            if let Some(h) = &handler {
                checks.push(check("shim binary", shim_binary(h, honours_runtime_path(&version)).await));
                if let Some(result) = sandboxer_check(handler_name, h) {
                    checks.push(check("sandboxer", result));
                }
            }
            handler
        }
        Err(e) => {
            checks.push(Check { name: "containerd".into(), ok: false, detail: e });
            None
        }
    };

    let containerd_path = handler.as_ref().and_then(|h| h.config_path.as_ref()).map(PathBuf::from);
    let path =
        explicit_config.map(Path::to_path_buf).or_else(|| containerd_path.clone()).unwrap_or_else(default_config_path);
    if let (Some(theirs), Some(ours)) = (&containerd_path, explicit_config) {
        if theirs != ours {
            checks.push(Check {
                name: "config path".into(),
                ok: false,
                detail: format!(
                    "containerd passes ConfigPath {}, but {} was checked",
                    theirs.display(),
                    ours.display()
                ),
            });
        }
    }
    let config = Config::load(&path);
    checks.push(check(
        "shim config",
        config
            .as_ref()
            .map(|c| format!("{}: backend {:?}, state_dir {}", path.display(), c.backend, c.state_dir.display()))
            .map_err(|e| e.to_string()),
    ));
    let backend = config.as_ref().ok().map(|c| c.backend);
    checks.push(probe_check(KvmKind::probe(), backend));
    if let Ok(config) = &config {
        checks.extend(artifacts(config).await);
    }

    let ok = checks.iter().all(|c| c.ok);
    let text: String =
        checks.iter().map(|c| format!("[{}] {}: {}\n", if c.ok { "pass" } else { "FAIL" }, c.name, c.detail)).collect();
    Outcome { json: serde_json::json!({ "ok": ok, "checks": checks }), text, ok }
}

/// The vm backend needs ordinary guests; the namespace backend runs anywhere.
fn probe_check(kind: KvmKind, backend: Option<Backend>) -> Check {
    let result = match (kind.ordinary_guests(), backend) {
        (Ok(()), _) => Ok(format!("/dev/kvm is {}: the vm backend can run here", kind.name())),
        (Err(why), Some(Backend::Namespace)) => {
            Ok(format!("{} ({why}); the config selects the namespace backend (no VM isolation)", kind.name()))
        }
        (Err(why), _) => Err(format!("{}: {why}; the vm backend cannot start pods here", kind.name())),
    };
    check("host probe", result)
}

/// containerd's version as its CRI reports it (`containerd 2.1.9`, ...) and its effective CRI config.
async fn cri_config(socket: &Path) -> Result<(String, Value), String> {
    let path = socket.to_path_buf();
    // The URI is a placeholder: the connector always dials the Unix socket.
    let channel = Endpoint::try_from("http://[::1]:1")
        .map_err(|e| e.to_string())?
        .connect_timeout(CALL_TIMEOUT)
        .timeout(CALL_TIMEOUT)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { tokio::net::UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|e| format!("cannot reach containerd's CRI at {}: {}", socket.display(), chain(&e)))?;
    let mut client = RuntimeServiceClient::new(channel);
    let version = client
        .version(VersionRequest { version: "v1".into() })
        .await
        .map_err(|e| format!("CRI Version at {}: {}", socket.display(), e.message()))?
        .into_inner();
    let version: String = format!("{} {}", version.runtime_name, version.runtime_version).chars().take(200).collect();
    let status = client
        .status(StatusRequest { verbose: true })
        .await
        .map_err(|e| format!("CRI Status at {}: {}", socket.display(), e.message()))?
        .into_inner();
    let json = status.info.get("config").ok_or("CRI Status has no verbose config (is this containerd?)")?;
    if json.len() > MAX_CONFIG_JSON {
        return Err(format!("containerd's config JSON is over {MAX_CONFIG_JSON} bytes"));
    }
    let config = serde_json::from_str(json).map_err(|e| format!("containerd's config JSON: {e}"))?;
    Ok((version, config))
}

/// Whether this containerd (`containerd 1.6.20~ds1`, `containerd 2.1.9+unknown`...) runs a runtime's
/// `runtime_path`: 1.7 and later do; 1.6 accepts the key and ignores it (measured on 1.6.20).
fn honours_runtime_path(version: &str) -> bool {
    let number = version.rsplit(' ').next().unwrap_or_default().trim_start_matches('v');
    let mut parts = number.split(|c: char| !c.is_ascii_digit()).map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (1, 7)
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// A 2.x handler's `sandboxer`, where it is not the default `podsandbox`.
fn sandboxer_check(handler_name: &str, h: &Handler) -> Option<Result<String, String>> {
    match h.sandboxer.as_deref().filter(|s| !s.is_empty() && *s != "podsandbox")? {
        // containerd 2.1 decodes such a runtime's options as runc's when it starts a container.
        "shim" if h.has_options => Some(Err(format!(
            "{handler_name} has sandboxer \"shim\" and an options table: containerd 2.x then fails every \
             StartContainer (it reads the options as runc's); remove the options and name the config with the shim \
             manager's env {}=<path>, or install it at {}",
            crate::config::CONFIG_ENV,
            crate::config::INSTALLED_CONFIG_PATH
        ))),
        "shim" => Some(Ok(format!(
            "{handler_name}: sandboxer \"shim\": RunPodSandbox starts the pod's sandbox through the shim's sandbox \
             API, with no pause container (host-network pods need containerd 2.3 or later on this path)"
        ))),
        other => Some(Err(format!(
            "{handler_name} has sandboxer {other:?}: bulkhead's pods need \"podsandbox\" or \"shim\" (its own \
             sandbox API)"
        ))),
    }
}

fn find_handler(config: &Value, name: &str) -> Option<Handler> {
    let runtime = config.pointer("/containerd/runtimes")?.get(name)?;
    let text = |key: &str| runtime.pointer(key).and_then(Value::as_str).filter(|s| !s.is_empty()).map(str::to_string);
    Some(Handler {
        runtime_type: text("/runtimeType").unwrap_or_default(),
        runtime_path: text("/runtimePath"),
        config_path: text("/options/ConfigPath"),
        sandboxer: text("/sandboxer"),
        has_options: runtime.get("options").is_some_and(|o| o.as_object().is_some_and(|m| !m.is_empty())),
    })
}

/// The shim containerd runs: the `runtime_path` where containerd honours it, an absolute `runtime_type`, or the
/// binary containerd finds on its PATH.
async fn shim_binary(handler: &Handler, honours_runtime_path: bool) -> Result<String, String> {
    let runtime_type = handler.runtime_type.as_str();
    let path = if let Some(path) = handler.runtime_path.as_ref().filter(|_| honours_runtime_path) {
        PathBuf::from(path)
    } else if runtime_type.starts_with('/') {
        PathBuf::from(runtime_type)
    } else if runtime_type == crate::RUNTIME_ID {
        let on_path = std::env::var_os("PATH").and_then(|p| {
            std::env::split_paths(&p).map(|d| d.join("containerd-shim-bulkhead-v2")).find(|p| p.is_file())
        });
        on_path.ok_or("runtime_type io.containerd.bulkhead.v2 but no containerd-shim-bulkhead-v2 on PATH")?
    } else {
        return Err(format!("runtime_type {runtime_type:?} is not bulkhead's shim"));
    };
    executable(&path)?;
    Ok(format!("{} ({})", path.display(), version_of(&path, "-v").await?))
}

fn executable(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Err(format!("{} is not an executable file", path.display()));
    }
    Ok(())
}

/// The first line a binary prints for its version flag.
async fn version_of(path: &Path, flag: &str) -> Result<String, String> {
    let run = tokio::process::Command::new(path).arg(flag).kill_on_drop(true).output();
    let out = tokio::time::timeout(CALL_TIMEOUT, run)
        .await
        .map_err(|_| format!("{} {flag}: no answer within {CALL_TIMEOUT:?}", path.display()))?
        .map_err(|e| format!("{} {flag}: {e}", path.display()))?;
    let line = String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or_default().trim().to_string();
    if !out.status.success() || line.is_empty() {
        return Err(format!("{} {flag} failed ({})", path.display(), out.status));
    }
    Ok(line.chars().take(200).collect())
}

/// The artifacts the config's backend uses.
async fn artifacts(config: &Config) -> Vec<Check> {
    match config.backend {
        Backend::Namespace => {
            let agent = &config.namespace.agent_path;
            let result = match executable(agent) {
                Ok(()) => version_of(agent, "--version").await.map(|v| format!("{} ({v})", agent.display())),
                Err(e) => Err(e),
            };
            vec![check("agent", result)]
        }
        Backend::Vm => {
            let vmm = &config.vm.vmm_path;
            let vmm_result = match executable(vmm) {
                Ok(()) => version_of(vmm, "--version").await.map(|v| format!("{} ({v})", vmm.display())),
                Err(e) => Err(e),
            };
            // The one the shim runs (the installer puts it beside the VMM and names it so).
            let virtiofsd = &config.vm.virtiofsd_path;
            let virtiofsd_result = match executable(virtiofsd) {
                Ok(()) => version_of(virtiofsd, "--version").await.map(|v| format!("{} ({v})", virtiofsd.display())),
                Err(e) => Err(e),
            };
            vec![
                check("vmm", vmm_result),
                check("virtiofsd", virtiofsd_result),
                check("kernel", kernel_version(&config.vm.kernel_path)),
                check("initramfs", initramfs(&config.vm.initramfs_path)),
                mkfs_check(config),
            ]
        }
    }
}

/// `emptydir.mkfs_path`: needed by every pod when a default emptyDir size limit is set, else only
/// by pods that ask for one (`bulkhead.io/emptydir-size-limits`), which fail at start without it.
fn mkfs_check(config: &Config) -> Check {
    let mkfs = &config.emptydir.mkfs_path;
    match executable(mkfs) {
        Ok(()) => check("mkfs.ext4", Ok(format!("{} (size-limited emptyDirs)", mkfs.display()))),
        Err(e) if config.emptydir.default_size_limit.is_some() => check(
            "mkfs.ext4",
            Err(format!("{e}; every pod's emptyDirs are size-limited (emptydir.default_size_limit)")),
        ),
        Err(e) => check(
            "mkfs.ext4",
            Ok(format!("{e}: only pods that ask for emptyDir size limits need it, and they would fail to start")),
        ),
    }
}

/// The `Linux version ...` banner a kernel image carries.
fn kernel_version(path: &Path) -> Result<String, String> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut bytes = Vec::new();
    file.take(MAX_KERNEL_SCAN).read_to_end(&mut bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(format!("{} ({})", path.display(), banner(&bytes).unwrap_or_else(|| "no version banner found".into())))
}

fn banner(bytes: &[u8]) -> Option<String> {
    let needle = b"Linux version ";
    let start = bytes.windows(needle.len()).position(|w| w == needle)?;
    let rest = &bytes[start..];
    let end = rest.iter().take(200).position(|b| *b == 0 || *b == b'\n').unwrap_or(rest.len().min(200));
    let text = String::from_utf8_lossy(&rest[..end]);
    Some(text.split(" (").next().unwrap_or_default().trim().to_string())
}

fn initramfs(path: &Path) -> Result<String, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if meta.len() == 0 {
        return Err(format!("{} is empty", path.display()));
    }
    Ok(format!("{} ({} bytes)", path.display(), meta.len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_vmm_api::probe::HwVirt;

    #[test]
    fn probe_line_depends_on_the_backend() {
        assert!(probe_check(KvmKind::Hardware(HwVirt::Vmx), Some(Backend::Vm)).ok);
        let pvm_vm = probe_check(KvmKind::Pvm, Some(Backend::Vm));
        assert!(!pvm_vm.ok && pvm_vm.detail.contains("PVM"), "{pvm_vm:?}");
        let pvm_ns = probe_check(KvmKind::Pvm, Some(Backend::Namespace));
        assert!(pvm_ns.ok && pvm_ns.detail.contains("namespace backend"), "{pvm_ns:?}");
        assert!(!probe_check(KvmKind::Absent, None).ok);
    }

    #[test]
    fn handler_is_read_from_containerds_config() {
        let config = serde_json::json!({"containerd": {"runtimes": {
            "bulkhead": {"runtimeType": "/opt/bulkhead/current/containerd-shim-bulkhead-v2",
                         "options": {"ConfigPath": "/opt/bulkhead/current/config.toml"}},
            "runc": {"runtimeType": "io.containerd.runc.v2"}}}});
        let h = find_handler(&config, "bulkhead").unwrap();
        assert_eq!(h.config_path.as_deref(), Some("/opt/bulkhead/current/config.toml"));
        assert_eq!(find_handler(&config, "runc").unwrap().config_path, None);
        assert_eq!(find_handler(&config, "kata"), None);
    }

    #[test]
    fn a_2x_handler_carries_its_runtime_path_and_sandboxer() {
        let config = serde_json::json!({"containerd": {"runtimes": {"bulkhead": {
            "runtimeType": "io.containerd.bulkhead.v2", "runtimePath": "/opt/bulkhead/current/containerd-shim-bulkhead-v2",
            "sandboxer": "podsandbox", "options": {"ConfigPath": "/opt/bulkhead/current/config.toml"}}}}});
        let h = find_handler(&config, "bulkhead").unwrap();
        assert_eq!(h.runtime_path.as_deref(), Some("/opt/bulkhead/current/containerd-shim-bulkhead-v2"));
        assert_eq!(h.sandboxer.as_deref(), Some("podsandbox"));
        assert!(h.has_options);
        assert_eq!(sandboxer_check("bulkhead", &h), None);
    }

    #[test]
    fn a_shim_sandboxer_is_fine_without_options_and_fails_with_them() {
        let h = |sandboxer: &str, has_options: bool| Handler {
            sandboxer: Some(sandboxer.into()),
            has_options,
            ..Default::default()
        };
        assert!(sandboxer_check("bulkhead", &h("shim", false)).unwrap().unwrap().contains("no pause container"));
        let err = sandboxer_check("bulkhead", &h("shim", true)).unwrap().unwrap_err();
        assert!(err.contains("StartContainer") && err.contains("BULKHEAD_CONFIG"), "{err}");
        let err = sandboxer_check("bulkhead", &h("other", false)).unwrap().unwrap_err();
        assert!(err.contains("\"podsandbox\" or \"shim\""), "{err}");
    }

    #[test]
    fn mkfs_is_required_only_when_every_pod_gets_size_limited_emptydirs() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("mkfs.ext4");
        let config = |default_limit: &str| {
            let text = format!("[emptydir]\nmkfs_path = {missing:?}\n{default_limit}");
            Config::parse(Path::new("t.toml"), &text).unwrap()
        };
        let line = mkfs_check(&config(""));
        assert!(line.ok && line.detail.contains("only pods that ask"), "{}", line.detail);
        let line = mkfs_check(&config("default_size_limit = \"1Gi\"\n"));
        assert!(!line.ok && line.detail.contains("default_size_limit"), "{}", line.detail);
        std::fs::write(&missing, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&missing, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        assert!(mkfs_check(&config("default_size_limit = \"1Gi\"\n")).ok);
    }

    #[test]
    fn only_1_7_and_later_run_the_runtime_path() {
        assert!(!honours_runtime_path("containerd 1.6.20~ds1"));
        assert!(honours_runtime_path("containerd 1.7.24~ds1"));
        assert!(honours_runtime_path("containerd v2.1.9"));
        assert!(honours_runtime_path("containerd 2.1.9+unknown"));
        assert!(!honours_runtime_path("containerd garbage"));
    }

    #[test]
    fn kernel_banner_is_found() {
        let mut image = vec![0u8; 100];
        image.extend_from_slice(b"Linux version 6.12.57 (root@build) (gcc 12) #1\0rest");
        assert_eq!(banner(&image).as_deref(), Some("Linux version 6.12.57"));
        assert_eq!(banner(b"nothing here"), None);
    }

    #[tokio::test]
    async fn unreachable_containerd_and_broken_config_are_failing_lines() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.toml");
        std::fs::write(&config, "backend = \"namespace\"\nbakend = 1\n").unwrap();
        let outcome = run(Some(&config), &dir.path().join("no.sock"), "bulkhead").await;
        assert!(!outcome.ok);
        let checks = outcome.json["checks"].as_array().unwrap();
        let line = |name: &str| checks.iter().find(|c| c["name"] == name).unwrap().clone();
        assert_eq!(line("containerd")["ok"], false);
        let shim_config = line("shim config");
        assert_eq!(shim_config["ok"], false);
        assert!(shim_config["detail"].as_str().unwrap().contains("bakend"), "{shim_config}");
        assert!(outcome.text.contains("[FAIL] shim config"), "{}", outcome.text);
    }
}
