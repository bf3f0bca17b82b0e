//! What the shim leaves for operators once its pod's sandbox runs: the [`PodRecord`] that
//! `bulkhead-ctl` reads (in the pod's state directory, and gone with it), and the pod's metrics
//! socket and labels (in the metrics directory, [`crate::metrics::dir`]; removed when the
//! sandbox stops, or by `delete` after a crash). Best effort: a failure is logged and never
//! fails the pod.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::warn;

use crate::config::{Backend, Config};
use crate::metrics::dir::{PodEndpoint, PodLabels};
use crate::metrics::PodMetrics;
use crate::sandbox::paths::{PodPaths, PodRecord};
use crate::sandbox::Sandbox;
use crate::spec::BundleSpec;

/// Records the running sandbox and starts serving its metrics.
pub fn pod_started(
    metrics: &Arc<PodMetrics>,
    config: &Config,
    containerd_namespace: &str,
    sandbox_id: &str,
    spec: &BundleSpec,
    sandbox: &Arc<dyn Sandbox>,
) {
    let Some(paths) = PodPaths::new(&config.state_dir, sandbox_id) else {
        return;
    };
    if let Err(e) = paths.create_dir() {
        warn!("pod directory {}: {e}; bulkhead-ctl and metrics will not see this pod", paths.dir.display());
        return;
    }
    let backend = sandbox.backend();
    let record = PodRecord {
        sandbox_id: sandbox_id.into(),
        pod_name: spec.pod_name().unwrap_or_default().into(),
        pod_namespace: spec.pod_namespace().unwrap_or_default().into(),
        containerd_namespace: containerd_namespace.into(),
        backend: match backend {
            Backend::Vm => "vm",
            Backend::Namespace => "namespace",
        }
        .into(),
        shim_pid: std::process::id(),
        pids: sandbox.host_pids(),
        started_at_unix: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or_default(),
    };
    if let Err(e) = record.write(&paths) {
        warn!("pod record {}: {e}", paths.record_file().display());
    }
    let Some(endpoint) = PodEndpoint::of(&paths, config.metrics.gid) else {
        return;
    };
    let labels = PodLabels { pod: record.pod_name.clone(), namespace: record.pod_namespace.clone() };
    if let Err(e) = endpoint.publish(&labels) {
        warn!("metrics labels {}: {e}; this pod's metrics are not served", endpoint.labels.display());
        return;
    }
    metrics.attach(backend, record.pids, sandbox.agent(), endpoint);
}
