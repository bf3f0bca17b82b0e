//! The Kubernetes side: one small trait over the two Node calls we make, an in-cluster client for it, and the
//! label / annotation / taint operations built on top.
//!
//! RBAC cannot restrict a DaemonSet to "its own" node, so the ClusterRole grants only `get` and `patch` on nodes
//! and the installer only ever names `NODE_NAME` (downward API).

use std::time::Duration;

use async_trait::async_trait;
use serde_json::{json, Value};

use crate::error::{Error, Result};

pub const LABEL: &str = "bulkhead.io/runtime";
pub const LABEL_READY: &str = "ready";
pub const ANNOT_REASON: &str = "bulkhead.io/runtime-reason";
pub const ANNOT_VERSION: &str = "bulkhead.io/runtime-version";

/// Node reads and JSON merge patches (RFC 7386). Tests use an in-memory fake.
#[async_trait]
pub trait NodeApi: Send + Sync {
    async fn get(&self, node: &str) -> Result<Value>;
    /// Errors with `Conflict` when the patch carries a stale `metadata.resourceVersion`.
    async fn merge_patch(&self, node: &str, patch: &Value) -> Result<Value, PatchError>;
}

#[derive(Debug, thiserror::Error)]
pub enum PatchError {
    #[error("conflict (resourceVersion changed)")]
    Conflict,
    #[error(transparent)]
    Other(#[from] Error),
}

/// RFC 7386 JSON merge patch, as the API server applies it (used by the fake and unit-tested here).
pub fn apply_merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = json!({});
            }
            if let Value::Object(t) = target {
                for (k, v) in p {
                    if v.is_null() {
                        t.remove(k);
                    } else {
                        apply_merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                    }
                }
            }
        }
        other => *target = other.clone(),
    }
}

/// Mark the node ready for `runtimeClassName: bulkhead`.
pub async fn label_ready(api: &dyn NodeApi, node: &str, reason: &str, version: &str) -> Result<()> {
    let patch = json!({"metadata": {
        "labels": {LABEL: LABEL_READY},
        "annotations": {ANNOT_REASON: reason, ANNOT_VERSION: version},
    }});
    patch_plain(api, node, &patch).await?;
    tracing::info!(node, label = LABEL, value = LABEL_READY, reason, "node labelled");
    Ok(())
}

/// Refuse: no label, and say why on the node.
pub async fn mark_refused(api: &dyn NodeApi, node: &str, reason: &str) -> Result<()> {
    let patch = json!({"metadata": {"labels": {LABEL: null}, "annotations": {ANNOT_REASON: reason}}});
    patch_plain(api, node, &patch).await?;
    tracing::warn!(node, annotation = ANNOT_REASON, reason, "node not labelled");
    Ok(())
}

/// Uninstall's first step: stop new bulkhead pods landing here.
pub async fn unlabel(api: &dyn NodeApi, node: &str) -> Result<()> {
    let patch = json!({"metadata": {
        "labels": {LABEL: null},
        "annotations": {ANNOT_REASON: null, ANNOT_VERSION: null},
    }});
    patch_plain(api, node, &patch).await?;
    tracing::info!(node, label = LABEL, "node label removed");
    Ok(())
}

async fn patch_plain(api: &dyn NodeApi, node: &str, patch: &Value) -> Result<()> {
    api.merge_patch(node, patch).await.map(|_| ()).map_err(|e| match e {
        PatchError::Conflict => Error::Kube("unexpected conflict on a patch without resourceVersion".into()),
        PatchError::Other(e) => e,
    })
}

/// Remove the taint with `key` (e.g. a Karpenter startup taint). A merge patch replaces the whole taint list,
/// so it carries the resourceVersion it was computed from and retries on conflict.
pub async fn remove_taint(api: &dyn NodeApi, node: &str, key: &str) -> Result<()> {
    for _ in 0..5 {
        let n = api.get(node).await?;
        let taints: Vec<Value> = n.pointer("/spec/taints").and_then(Value::as_array).cloned().unwrap_or_default();
        let kept: Vec<Value> =
            taints.iter().filter(|t| t.get("key").and_then(Value::as_str) != Some(key)).cloned().collect();
        if kept.len() == taints.len() {
            tracing::info!(node, taint = key, "startup taint not present");
            return Ok(());
        }
        let rv = n.pointer("/metadata/resourceVersion").cloned().unwrap_or(Value::Null);
        let patch = json!({"metadata": {"resourceVersion": rv}, "spec": {"taints": kept}});
        match api.merge_patch(node, &patch).await {
            Ok(_) => {
                tracing::info!(node, taint = key, "startup taint removed");
                return Ok(());
            }
            Err(PatchError::Conflict) => {
                tracing::info!(node, taint = key, "node changed while removing taint; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(PatchError::Other(e)) => return Err(e),
        }
    }
    Err(Error::Kube(format!("could not remove taint {key} after 5 conflicts")))
}

/// In-cluster client: service-account token and CA from the standard mount, API server from the env.
pub struct InCluster {
    http: reqwest::Client,
    base: String,
    token_path: std::path::PathBuf,
}

const SA_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// Bound on a Node object we read back (they are tens of KiB).
const MAX_BODY: usize = 4 << 20;

impl InCluster {
    pub fn from_env() -> Result<Self> {
        let host = std::env::var("KUBERNETES_SERVICE_HOST")
            .map_err(|_| Error::Kube("KUBERNETES_SERVICE_HOST unset: not in a cluster".into()))?;
        let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
        let host = if host.contains(':') { format!("[{host}]") } else { host };
        let ca_path = format!("{SA_DIR}/ca.crt");
        let ca = std::fs::read(&ca_path).map_err(|e| Error::Kube(format!("read {ca_path}: {e}")))?;
        Self::new(format!("https://{host}:{port}"), &ca, format!("{SA_DIR}/token").into())
    }

    /// `base` like `https://10.0.0.1:443`; only `ca_pem` is trusted (no system roots).
    pub fn new(base: String, ca_pem: &[u8], token_path: std::path::PathBuf) -> Result<Self> {
        let cert = reqwest::Certificate::from_pem(ca_pem).map_err(|e| Error::Kube(format!("CA: {e}")))?;
        let http = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(cert)
            .timeout(Duration::from_secs(15))
            .build()
            .map_err(|e| Error::Kube(format!("http client: {e}")))?;
        Ok(Self { http, base, token_path })
    }

    /// Re-read on every call: projected tokens rotate.
    fn token(&self) -> Result<String> {
        std::fs::read_to_string(&self.token_path)
            .map(|t| t.trim().to_string())
            .map_err(|e| Error::Kube(format!("read {}: {e}", self.token_path.display())))
    }

    async fn body(resp: reqwest::Response) -> Result<Value, PatchError> {
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(|e| Error::Kube(format!("read response: {e}")))?;
        if bytes.len() > MAX_BODY {
            return Err(Error::Kube(format!("response of {} bytes over limit", bytes.len())).into());
        }
        if status == reqwest::StatusCode::CONFLICT {
            return Err(PatchError::Conflict);
        }
        if !status.is_success() {
            let msg = String::from_utf8_lossy(&bytes[..bytes.len().min(512)]).into_owned();
            return Err(Error::Kube(format!("{status}: {msg}")).into());
        }
        serde_json::from_slice(&bytes).map_err(|e| Error::Kube(format!("response JSON: {e}")).into())
    }
}

#[async_trait]
impl NodeApi for InCluster {
    async fn get(&self, node: &str) -> Result<Value> {
        let resp = self
            .http
            .get(format!("{}/api/v1/nodes/{node}", self.base))
            .bearer_auth(self.token()?)
            .send()
            .await
            .map_err(|e| Error::Kube(format!("GET node {node}: {e}")))?;
        Self::body(resp).await.map_err(|e| match e {
            PatchError::Conflict => Error::Kube("conflict on GET".into()),
            PatchError::Other(e) => e,
        })
    }

    async fn merge_patch(&self, node: &str, patch: &Value) -> Result<Value, PatchError> {
        let resp = self
            .http
            .patch(format!("{}/api/v1/nodes/{node}", self.base))
            .bearer_auth(self.token()?)
            .header("Content-Type", "application/merge-patch+json")
            .body(patch.to_string())
            .send()
            .await
            .map_err(|e| Error::Kube(format!("PATCH node {node}: {e}")))?;
        Self::body(resp).await
    }
}

/// In-memory API server for one node, applying merge patches like the real one (resourceVersion included).
#[derive(Default)]
pub struct FakeNodes {
    pub node: std::sync::Mutex<Value>,
    pub patches: std::sync::Mutex<Vec<Value>>,
}

impl FakeNodes {
    pub fn new(node: Value) -> Self {
        Self { node: std::sync::Mutex::new(node), patches: Default::default() }
    }

    pub fn snapshot(&self) -> Value {
        self.node.lock().map(|n| n.clone()).unwrap_or(Value::Null)
    }
}

#[async_trait]
impl NodeApi for FakeNodes {
    async fn get(&self, _node: &str) -> Result<Value> {
        Ok(self.snapshot())
    }

    async fn merge_patch(&self, _node: &str, patch: &Value) -> Result<Value, PatchError> {
        let mut n = self.node.lock().map_err(|_| Error::Kube("fake poisoned".into()))?;
        if let Some(rv) = patch.pointer("/metadata/resourceVersion").filter(|v| !v.is_null()) {
            if n.pointer("/metadata/resourceVersion") != Some(rv) {
                return Err(PatchError::Conflict);
            }
        }
        let mut p = patch.clone();
        if let Some(m) = p.get_mut("metadata").and_then(Value::as_object_mut) {
            m.remove("resourceVersion");
        }
        apply_merge_patch(&mut n, &p);
        let next = n
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0)
            + 1;
        apply_merge_patch(&mut n, &json!({"metadata": {"resourceVersion": next.to_string()}}));
        if let Ok(mut log) = self.patches.lock() {
            log.push(patch.clone());
        }
        Ok(n.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_patch_follows_rfc7386() {
        let mut t = json!({"a": {"b": 1, "c": 2}, "l": [1, 2]});
        apply_merge_patch(&mut t, &json!({"a": {"b": null, "d": 3}, "l": [3]}));
        assert_eq!(t, json!({"a": {"c": 2, "d": 3}, "l": [3]}));
    }

    fn node() -> Value {
        json!({"metadata": {"name": "n1", "resourceVersion": "7", "labels": {"other": "x"}},
               "spec": {"taints": [
                   {"key": "bulkhead.io/not-ready", "effect": "NoSchedule"},
                   {"key": "keep", "effect": "NoExecute"}]}})
    }

    #[tokio::test]
    async fn label_then_unlabel_leaves_other_labels() {
        let api = FakeNodes::new(node());
        label_ready(&api, "n1", "ok", "0.1.0").await.unwrap();
        let n = api.snapshot();
        assert_eq!(n.pointer("/metadata/labels/bulkhead.io~1runtime"), Some(&json!("ready")));
        unlabel(&api, "n1").await.unwrap();
        let n = api.snapshot();
        assert_eq!(n.pointer("/metadata/labels"), Some(&json!({"other": "x"})));
        assert_eq!(n.pointer("/metadata/annotations"), Some(&json!({})));
    }

    #[tokio::test]
    async fn taint_removal_keeps_other_taints_and_is_idempotent() {
        let api = FakeNodes::new(node());
        remove_taint(&api, "n1", "bulkhead.io/not-ready").await.unwrap();
        remove_taint(&api, "n1", "bulkhead.io/not-ready").await.unwrap();
        let n = api.snapshot();
        assert_eq!(n.pointer("/spec/taints"), Some(&json!([{"key": "keep", "effect": "NoExecute"}])));
        assert_eq!(api.patches.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn stale_resource_version_conflicts() {
        let api = FakeNodes::new(node());
        let r = api.merge_patch("n1", &json!({"metadata": {"resourceVersion": "6"}, "spec": {"taints": []}})).await;
        assert!(matches!(r, Err(PatchError::Conflict)));
    }
}
