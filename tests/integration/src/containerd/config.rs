//! The private containerd's `config.toml`, in the format its version reads.
//!
//! - Format 2 (1.6, 1.7): one CRI plugin, `io.containerd.grpc.v1.cri`, holding everything: `sandbox_image`,
//!   `restrict_oom_score_adj`, the stream server, `cni`, and `containerd.{snapshotter,default_runtime_name,runtimes}`.
//! - Format 3 (2.x): CRI split in three (keys as 2.1's own `containerd config default` prints them):
//!   `io.containerd.cri.v1.images` (`snapshotter`, `pinned_images.sandbox`: the pause image),
//!   `io.containerd.cri.v1.runtime` (`restrict_oom_score_adj`, `enable_selinux`, `disable_apparmor`, `cni` with
//!   `bin_dirs`, `containerd.{default_runtime_name,runtimes}`, each runtime's `base_runtime_spec`, annotations,
//!   `sandboxer`, `options`), and `io.containerd.grpc.v1.cri` keeps only the stream server. 2.x also enables NRI
//!   by default on one host-wide socket, which the harness's concurrent containerds would fight over: disabled.
//!
//! The runc runtime gets the version's runc as `BinaryName` where the version has one (2.1: sid's runc 1.3).

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Result;

use super::{ContainerdConfig, ContainerdVersion};

/// The runtime type of runc's shim; the handler that gets the version's runc.
const RUNC_TYPE: &str = "io.containerd.runc.v2";

/// Plugins the tests never use (snapshotters needing other filesystems, tracing exporters), off to keep start-up
/// quick and the log quiet. A name a version does not have is ignored.
const DISABLED: &[&str] = &[
    "io.containerd.snapshotter.v1.aufs",
    "io.containerd.snapshotter.v1.btrfs",
    "io.containerd.snapshotter.v1.zfs",
    "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.snapshotter.v1.blockfile",
    "io.containerd.snapshotter.v1.erofs",
    "io.containerd.differ.v1.erofs",
    "io.containerd.tracing.processor.v1.otlp",
    "io.containerd.internal.v1.tracing",
];

/// Renders the config of a containerd living in `dir`, its CRI stream server on loopback `stream_port`.
pub(super) fn render(
    version: ContainerdVersion,
    dir: &Path,
    stream_port: u16,
    pause_image: &str,
    config: &ContainerdConfig,
) -> Result<String> {
    let d = dir.display();
    let disabled: Vec<String> = DISABLED.iter().map(|p| toml_str(p)).collect();
    let mut toml = format!(
        r#"version = {format}
root = "{d}/root"
state = "{d}/state"
disabled_plugins = [{disabled}]

[grpc]
  address = "{d}/containerd.sock"

[ttrpc]
  address = "{d}/containerd.sock.ttrpc"

[debug]
  address = "{d}/debug.sock"
  level = "info"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
"#,
        format = version.config_format(),
        disabled = disabled.join(", "),
    );
    // containerd refuses a default that names no configured runtime.
    let default_runtime = config.handlers.first().map_or("runc", |h| h.name.as_str());
    // The prefix of the table that holds `containerd.runtimes` (and `cni`).
    let runtime_plugin = if version.config_format() == 3 {
        writeln!(
            toml,
            r#"
[plugins."io.containerd.nri.v1.nri"]
  disable = true

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "{stream_port}"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"

[plugins."io.containerd.cri.v1.images".pinned_images]
  sandbox = {pause}

[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  enable_selinux = false
  disable_apparmor = true

[plugins."io.containerd.cri.v1.runtime".cni]
  bin_dirs = ["/usr/lib/cni"]
  conf_dir = "{d}/cni"

[plugins."io.containerd.cri.v1.runtime".containerd]
  default_runtime_name = {default}"#,
            pause = toml_str(pause_image),
            default = toml_str(default_runtime),
        )?;
        r#"plugins."io.containerd.cri.v1.runtime""#
    } else {
        writeln!(
            toml,
            r#"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = {pause}
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "{stream_port}"
  enable_selinux = false
  disable_apparmor = true

[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = "{d}/cni"

[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "overlayfs"
  default_runtime_name = {default}"#,
            pause = toml_str(pause_image),
            default = toml_str(default_runtime),
        )?;
        r#"plugins."io.containerd.grpc.v1.cri""#
    };
    for h in &config.handlers {
        let base = format!("[{runtime_plugin}.containerd.runtimes.{}]", toml_key(&h.name));
        writeln!(toml, "\n{base}\n  runtime_type = {}", toml_str(&h.runtime_type))?;
        if let Some(spec) = &h.base_runtime_spec {
            writeln!(toml, "  base_runtime_spec = {}", toml_str(&spec.to_string_lossy()))?;
        }
        if !h.pod_annotations.is_empty() {
            let list: Vec<String> = h.pod_annotations.iter().map(|a| toml_str(a)).collect();
            writeln!(toml, "  pod_annotations = [{}]", list.join(", "))?;
            writeln!(toml, "  container_annotations = [{}]", list.join(", "))?;
        }
        for (k, v) in &h.settings {
            writeln!(toml, "  {} = {}", toml_key(k), toml_str(v))?;
        }
        let mut options = h.options.clone();
        if let Some(runc) = version.runc() {
            if h.runtime_type == RUNC_TYPE && !options.iter().any(|(k, _)| k == "BinaryName") {
                options.push(("BinaryName".into(), runc.to_string_lossy().into_owned()));
            }
        }
        if !options.is_empty() {
            writeln!(toml, "[{runtime_plugin}.containerd.runtimes.{}.options]", toml_key(&h.name))?;
            for (k, v) in &options {
                writeln!(toml, "  {} = {}", toml_key(k), toml_str(v))?;
            }
        }
    }
    toml.push('\n');
    toml.push_str(&config.extra_toml);
    Ok(toml)
}

pub(super) fn toml_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

pub(super) fn toml_key(s: &str) -> String {
    if s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
        s.to_string()
    } else {
        toml_str(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RuntimeHandler;
    use std::path::PathBuf;
    use std::process::Command;

    fn config() -> ContainerdConfig {
        let mut bulkhead = RuntimeHandler::bulkhead(Some(Path::new("/etc/bulkhead/x.toml")));
        bulkhead.base_runtime_spec = Some(PathBuf::from("/tmp/base.json"));
        ContainerdConfig {
            handlers: vec![RuntimeHandler::runc(), bulkhead],
            version: ContainerdVersion::V1_6,
            ..Default::default()
        }
    }

    #[test]
    fn toml_strings_are_quoted_and_escaped() {
        assert_eq!(toml_str(r#"a"b\c"#), r#""a\"b\\c""#);
        assert_eq!(toml_key("runc"), "runc");
        assert_eq!(toml_key("a.b"), r#""a.b""#);
    }

    #[test]
    fn format_3_puts_the_cri_keys_in_the_split_plugins() {
        let text = render(ContainerdVersion::V2_1, Path::new("/x"), 1234, "p:1", &config()).unwrap();
        let doc: toml::Table = text.parse().unwrap();
        let plugin = |name: &str| doc["plugins"][name].clone();
        assert_eq!(doc["version"].as_integer(), Some(3));
        assert_eq!(plugin("io.containerd.cri.v1.images")["pinned_images"]["sandbox"].as_str(), Some("p:1"));
        let rt = plugin("io.containerd.cri.v1.runtime");
        assert_eq!(rt["restrict_oom_score_adj"].as_bool(), Some(true));
        assert_eq!(rt["cni"]["conf_dir"].as_str(), Some("/x/cni"));
        let bulkhead = &rt["containerd"]["runtimes"]["bulkhead"];
        assert_eq!(bulkhead["base_runtime_spec"].as_str(), Some("/tmp/base.json"));
        assert_eq!(bulkhead["options"]["ConfigPath"].as_str(), Some("/etc/bulkhead/x.toml"));
        let runc = &rt["containerd"]["runtimes"]["runc"]["options"]["BinaryName"];
        assert!(runc.as_str().is_some_and(|p| p.ends_with("runc-1.3/usr/sbin/runc")), "{runc:?}");
        assert_eq!(plugin("io.containerd.grpc.v1.cri")["stream_server_port"].as_str(), Some("1234"));
        assert!(plugin("io.containerd.grpc.v1.cri").get("sandbox_image").is_none());
    }

    #[test]
    fn format_2_keeps_everything_in_the_one_cri_plugin() {
        let text = render(ContainerdVersion::V1_7, Path::new("/x"), 1234, "p:1", &config()).unwrap();
        let doc: toml::Table = text.parse().unwrap();
        let cri = &doc["plugins"]["io.containerd.grpc.v1.cri"];
        assert_eq!(doc["version"].as_integer(), Some(2));
        assert_eq!(cri["sandbox_image"].as_str(), Some("p:1"));
        assert!(cri["containerd"]["runtimes"]["runc"].get("options").is_none(), "1.7 keeps the system's runc");
        assert!(doc["plugins"].get("io.containerd.cri.v1.runtime").is_none());
    }

    /// What containerd itself makes of the rendered file: `config dump` prints the merged config it would run with.
    /// A key in the wrong table would be dropped or left at its default there.
    #[test]
    fn each_containerd_reads_the_keys_where_they_are_written() {
        for version in ContainerdVersion::ALL {
            if version.missing().is_some()
                || (version == ContainerdVersion::V1_6 && crate::which("containerd").is_none())
            {
                println!("containerd {version} is not here; not checked");
                continue;
            }
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("config.toml");
            std::fs::write(&path, render(version, dir.path(), 4321, "p:9", &config()).unwrap()).unwrap();
            let out = Command::new(version.containerd()).arg("--config").arg(&path).args(["config", "dump"]).output();
            let out = out.unwrap();
            assert!(out.status.success(), "{version}: {}", String::from_utf8_lossy(&out.stderr));
            let dump: toml::Table = String::from_utf8_lossy(&out.stdout).parse().unwrap();
            let plugins = &dump["plugins"];
            let (sandbox, runtime, stream) = if version.config_format() == 3 {
                let images = &plugins["io.containerd.cri.v1.images"];
                (
                    &images["pinned_images"]["sandbox"],
                    &plugins["io.containerd.cri.v1.runtime"],
                    &plugins["io.containerd.grpc.v1.cri"],
                )
            } else {
                let cri = &plugins["io.containerd.grpc.v1.cri"];
                (&cri["sandbox_image"], cri, cri)
            };
            assert_eq!(sandbox.as_str(), Some("p:9"), "{version}");
            assert_eq!(runtime["restrict_oom_score_adj"].as_bool(), Some(true), "{version}");
            assert_eq!(stream["stream_server_port"].as_str(), Some("4321"), "{version}");
            let bulkhead = &runtime["containerd"]["runtimes"]["bulkhead"];
            assert_eq!(bulkhead["base_runtime_spec"].as_str(), Some("/tmp/base.json"), "{version}");
            assert_eq!(bulkhead["options"]["ConfigPath"].as_str(), Some("/etc/bulkhead/x.toml"), "{version}");
            let conf_dir = dir.path().join("cni").display().to_string();
            assert_eq!(runtime["cni"]["conf_dir"].as_str(), Some(conf_dir.as_str()), "{version}");
        }
    }
}
