//! The pod's DNS config as containerd made it: the CRI plugin writes the pod's resolv.conf next
//! to its sandbox state and names it in the sandbox spec as the bind-mount source for
//! `/etc/resolv.conf` ("for katacontainers to setup the DNS of pod VM properly"); each container
//! spec bind-mounts the same file. The shim reads it here and hands the bytes to the agent in
//! SetupSandbox; the agent serves them to every container (on the vm backend the host path does
//! not exist in the guest).

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::spec::BundleSpec;

/// The agent's limit for SetupSandbox's resolv.conf.
pub const MAX_RESOLV_CONF: u64 = 64 << 10;

const RESOLV_CONF: &str = "/etc/resolv.conf";

#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    #[error("pod resolv.conf {path}: {message}")]
    Read { path: PathBuf, message: String },
}

/// The host file the sandbox spec mounts at /etc/resolv.conf, if any.
pub fn resolv_conf_source(spec: &BundleSpec) -> Option<PathBuf> {
    // The last mount of a destination is the one a container sees.
    let mounts = spec.spec().mounts().as_ref()?;
    let mount = mounts.iter().rev().find(|m| m.destination().as_os_str() == RESOLV_CONF)?;
    mount.source().clone()
}

/// The pod's resolv.conf bytes; empty when the spec names none (the agent then leaves DNS alone).
pub fn pod_resolv_conf(spec: &BundleSpec) -> Result<Vec<u8>, DnsError> {
    let Some(path) = resolv_conf_source(spec) else {
        return Ok(Vec::new());
    };
    read_bounded(&path)
}

fn read_bounded(path: &Path) -> Result<Vec<u8>, DnsError> {
    let err = |message: String| DnsError::Read { path: path.to_path_buf(), message };
    let file = std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
    let mut bytes = Vec::new();
    file.take(MAX_RESOLV_CONF + 1).read_to_end(&mut bytes).map_err(|e| err(e.to_string()))?;
    if bytes.len() as u64 > MAX_RESOLV_CONF {
        return Err(err(format!("larger than {MAX_RESOLV_CONF} bytes")));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(mounts: impl serde::Serialize) -> BundleSpec {
        BundleSpec::from_bytes(&serde_json::to_vec(&json!({ "mounts": mounts })).unwrap()).unwrap()
    }

    #[test]
    fn the_sandbox_specs_resolv_conf_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("resolv.conf");
        std::fs::write(&file, b"nameserver 10.96.0.10\nsearch default.svc.cluster.local\n").unwrap();
        let s = spec(json!([
            {"destination": "/dev/shm", "source": "/run/shm", "type": "bind"},
            {"destination": "/etc/resolv.conf", "source": file, "type": "bind", "options": ["rbind", "ro"]}
        ]));
        assert_eq!(resolv_conf_source(&s), Some(file.clone()));
        assert_eq!(pod_resolv_conf(&s).unwrap(), b"nameserver 10.96.0.10\nsearch default.svc.cluster.local\n");
    }

    #[test]
    fn no_mount_means_no_dns_config() {
        assert!(pod_resolv_conf(&spec(json!([]))).unwrap().is_empty());
        assert!(pod_resolv_conf(&BundleSpec::from_bytes(b"{}").unwrap()).unwrap().is_empty());
    }

    #[test]
    fn a_missing_or_oversized_file_is_an_error() {
        let s = spec(json!([{"destination": "/etc/resolv.conf", "source": "/nonexistent/resolv.conf"}]));
        assert!(pod_resolv_conf(&s).unwrap_err().to_string().contains("/nonexistent/resolv.conf"));
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("resolv.conf");
        std::fs::write(&file, vec![b'#'; (MAX_RESOLV_CONF + 1) as usize]).unwrap();
        let s = spec(json!([{"destination": "/etc/resolv.conf", "source": file}]));
        assert!(pod_resolv_conf(&s).unwrap_err().to_string().contains("larger than"));
    }
}
