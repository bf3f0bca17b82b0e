//! The pod's DNS config for its containers. SetupSandbox brings the pod's resolv.conf (the file
//! containerd wrote for the sandbox); the agent keeps it as `<state-dir>/resolv.conf`
//! (guest_init/setup.rs writes it) and points every container's `/etc/resolv.conf` bind mount at
//! that file: the source the container spec names is a host path, which a guest does not have.
//! Pure functions; nothing here touches a file.

use std::path::{Path, PathBuf};

use oci_spec::runtime::Spec;

const RESOLV_CONF: &str = "/etc/resolv.conf";

/// Where the agent keeps the pod's resolv.conf.
pub fn pod_file(state_dir: &Path) -> PathBuf {
    state_dir.join("resolv.conf")
}

/// Points every `/etc/resolv.conf` bind mount of `spec` at `pod_file`; returns how many.
/// A mount of another kind at that path is the workload's own choice and stays.
pub fn point_at_pod_file(spec: &mut Spec, pod_file: &Path) -> usize {
    let Some(mut mounts) = spec.mounts().clone() else {
        return 0;
    };
    let mut pointed = 0;
    for m in mounts.iter_mut().filter(|m| m.destination() == Path::new(RESOLV_CONF)) {
        let is_bind = m.typ().as_deref() == Some("bind")
            || m.options().as_ref().is_some_and(|o| o.iter().any(|o| o == "bind" || o == "rbind"));
        if is_bind {
            m.set_source(Some(pod_file.to_path_buf()));
            pointed += 1;
        }
    }
    spec.set_mounts(Some(mounts));
    pointed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(mounts: serde_json::Value) -> Spec {
        serde_json::from_value(serde_json::json!({
            "ociVersion": "1.0.2",
            "root": {"path": "/r"},
            "mounts": mounts,
        }))
        .unwrap()
    }

    #[test]
    fn resolv_conf_binds_point_at_the_pod_file() {
        let mut s = spec(serde_json::json!([
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/etc/resolv.conf", "type": "bind",
             "source": "/var/lib/containerd/io.containerd.grpc.v1.cri/sandboxes/sb/resolv.conf",
             "options": ["rbind", "rprivate", "ro"]},
        ]));
        assert_eq!(point_at_pod_file(&mut s, Path::new("/run/bulkhead-agent/resolv.conf")), 1);
        let mounts = s.mounts().clone().unwrap();
        assert_eq!(mounts[1].source().as_deref(), Some(Path::new("/run/bulkhead-agent/resolv.conf")));
        assert_eq!(mounts[1].options().as_ref().unwrap(), &["rbind", "rprivate", "ro"]);
        assert_eq!(mounts[0].source().as_deref(), Some(Path::new("proc")));
    }

    #[test]
    fn other_mounts_at_the_path_and_specs_without_one_stay() {
        let mut s = spec(serde_json::json!([
            {"destination": "/etc/resolv.conf", "type": "tmpfs", "source": "tmpfs"},
        ]));
        assert_eq!(point_at_pod_file(&mut s, Path::new("/x")), 0);
        assert_eq!(s.mounts().clone().unwrap()[0].source().as_deref(), Some(Path::new("tmpfs")));
        let mut s = spec(serde_json::json!([]));
        assert_eq!(point_at_pod_file(&mut s, Path::new("/x")), 0);
    }
}
