//! The contract between the installer and the shim: the shim config the installer renders parses with the shim's
//! own parser (unknown keys are errors there), and every path it names is a file the installer copies into the
//! version directory.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::path::{Path, PathBuf};

use bulkhead_node_installer::artifacts::{default_shim_config, ARTIFACTS};
use bulkhead_node_installer::node_paths::{NodePaths, SHIM_CONFIG};
use bulkhead_shim::config::{Backend, Config};

/// Every string value of a TOML document that is an absolute path, with its key.
fn paths_in(value: &toml::Value, key: &str, out: &mut Vec<(String, PathBuf)>) {
    match value {
        toml::Value::String(s) if s.starts_with('/') => out.push((key.to_string(), PathBuf::from(s))),
        toml::Value::Table(t) => t.iter().for_each(|(k, v)| paths_in(v, &format!("{key}.{k}"), out)),
        toml::Value::Array(a) => a.iter().for_each(|v| paths_in(v, key, out)),
        _ => {}
    }
}

#[test]
fn the_rendered_shim_config_parses_and_names_only_copied_artifacts() {
    let layout = NodePaths::new("/host", "/");
    let version = "1.2.3";
    let text = default_shim_config(&layout, version);
    let config = Config::parse(Path::new(SHIM_CONFIG), &text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(config.backend, Backend::Vm);

    let version_dir = Path::new("/opt/bulkhead").join(version);
    let copied: Vec<PathBuf> = ARTIFACTS.iter().map(|a| version_dir.join(a.name)).collect();
    let mut named = Vec::new();
    paths_in(&toml::from_str(&text).unwrap(), "", &mut named);
    assert!(!named.is_empty(), "the config names the VM's files: {text}");
    for (key, path) in &named {
        assert!(copied.contains(path), "{key} = {} is not an artifact the installer copies", path.display());
    }
    // The vm backend's files are the installed ones, not the shim's built-in defaults.
    for path in [&config.vm.vmm_path, &config.vm.kernel_path, &config.vm.initramfs_path, &config.vm.virtiofsd_path] {
        assert!(copied.contains(path), "{} is not an installed artifact", path.display());
    }
}

#[test]
fn paths_follow_the_view_root() {
    // containerd may see the host under another root than the installer: the config uses containerd's view.
    let layout = NodePaths::new("/host", "/node");
    let text = default_shim_config(&layout, "v1");
    let config = Config::parse(Path::new(SHIM_CONFIG), &text).unwrap();
    assert_eq!(config.vm.vmm_path, PathBuf::from("/node/opt/bulkhead/v1/bulkhead-vmm"));
}
