//! The install and uninstall sequences, as explicit step machines. Every step checks the disk (or the API) for
//! what is already done, so a rerun after any interruption converges to the same end state.

use std::path::PathBuf;
use std::time::Duration;

use crate::artifacts;
use crate::containerd::{self, ConfigVersion};
use crate::cri;
use crate::error::{Error, Result};
use crate::failpoint::FailPoints;
use crate::kube::{self, NodeApi};
use crate::lock::{InstallLock, LOCK_WAIT};
use crate::node_paths::{self, NodePaths, HANDLER};
use crate::probe::{self, Verdict};
use crate::restart::Restarter;
use crate::usage;
use crate::versions;

#[derive(Clone, Debug)]
pub struct Settings {
    pub layout: NodePaths,
    /// Where the image keeps the artifacts (a path inside the installer's own filesystem).
    pub artifacts_dir: PathBuf,
    pub version: String,
    /// containerd's CRI socket as a host path (resolved under the host root).
    pub containerd_socket: PathBuf,
    /// Karpenter startup taint to remove once ready.
    pub startup_taint: Option<String>,
    /// The guest kernel is PVM-aware, so a PVM host counts as capable.
    pub allow_pvm: bool,
    pub cri_timeout: Duration,
    /// How long after `current` switched away from a version it may be collected (see `versions`).
    pub gc_grace: Duration,
    /// Snapshot templates to build once the node is ready (none by default), and to remove at uninstall.
    pub templates: crate::templates::Templates,
}

/// Default for [`Settings::gc_grace`]: far longer than a shim's `start` takes to re-execute itself.
pub const GC_GRACE: Duration = Duration::from_secs(60);

/// What uninstall does while bulkhead pods still run on the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WhileInUse {
    /// Change nothing and fail with [`Error::InUse`], naming the pods.
    Refuse,
    /// Uninstall anyway (the operator's explicit choice).
    Force,
}

/// How long uninstall lets processes without a live pod finish: a pod's shim exits moments after containerd removed
/// the pod, and a `start` or `delete` containerd runs ends in moments too. Live pods are never waited for.
const SETTLE: Duration = Duration::from_secs(10);

/// What runs, once processes that belong to no live pod have had [`SETTLE`] to end.
async fn settled_usage(layout: &NodePaths) -> Result<usage::Usage> {
    let deadline = tokio::time::Instant::now() + SETTLE;
    loop {
        let u = usage::scan(layout)?;
        if !u.pods.is_empty() || u.processes.is_empty() || tokio::time::Instant::now() >= deadline {
            return Ok(u);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Install steps, in order. `run_install` walks them; each is idempotent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    /// A labelled node whose containerd lost the handler (reboot regenerated the config, manual edit) must stop
    /// attracting pods before anything else happens.
    Guard,
    Probe,
    CopyArtifacts,
    /// Old versions nothing runs from any more go (never `current`): on every install, so also on every resync.
    CollectVersions,
    WireContainerd,
    RestartContainerd,
    CheckCri,
    Label,
    RemoveTaint,
    /// After the node is ready, since a pod needs no template to start (it builds one or boots cold).
    PrebuildTemplates,
    Done,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Handler registered in containerd and (when a node API is given) the node labelled.
    Ready { config_version: ConfigVersion },
    /// The node cannot run the `vm` backend; nothing was wired and the node carries the reason.
    Refused { reason: String },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub outcome: Outcome,
    pub restarted: bool,
    pub artifacts_changed: bool,
    /// Old versions this run removed.
    pub collected: Vec<String>,
}

pub struct Installer<'a> {
    pub settings: Settings,
    pub restarter: &'a dyn Restarter,
    /// `None` runs without Kubernetes (no label, no taint): for tests and plain hosts.
    pub nodes: Option<(&'a dyn NodeApi, String)>,
    pub fail: FailPoints,
}

impl Installer<'_> {
    fn socket(&self) -> PathBuf {
        self.settings.layout.host(&self.settings.containerd_socket)
    }

    async fn refuse(&self, reason: String) -> Result<Report> {
        if let Some((api, node)) = &self.nodes {
            kube::mark_refused(*api, node, &reason).await?;
        } else {
            tracing::warn!(reason = %reason, "node cannot run the vm backend; not wiring bulkhead");
        }
        Ok(Report {
            outcome: Outcome::Refused { reason },
            restarted: false,
            artifacts_changed: false,
            collected: vec![],
        })
    }

    /// Run the install steps. On failure the node is left unlabelled with the error as its reason annotation
    /// (best effort: the API may be what failed), so `kubectl get node` explains what the pod log says.
    pub async fn install(&self) -> Result<Report> {
        let _lock = InstallLock::acquire(&self.settings.layout.lock_dir(), LOCK_WAIT).await?;
        let result = self.install_steps().await;
        if let (Err(e), Some((api, node))) = (&result, &self.nodes) {
            if !matches!(e, Error::Interrupted(_) | Error::Kube(_) | Error::Locked { .. }) {
                if let Err(k) = kube::mark_refused(*api, node, &format!("install failed: {e}")).await {
                    tracing::warn!(error = %k, "could not record the failure on the node");
                }
            }
        }
        result
    }

    async fn install_steps(&self) -> Result<Report> {
        let s = &self.settings;
        node_paths::check_version(&s.version)?;
        let (mut restarted, mut artifacts_changed, mut collected) = (false, false, vec![]);
        let (mut config_version, mut ready_reason) = (None, String::new());
        let mut step = Step::Guard;
        loop {
            tracing::debug!(?step, "install step");
            step = match step {
                Step::Guard => {
                    if let Some((api, node)) = &self.nodes {
                        let labelled = api
                            .get(node)
                            .await?
                            .pointer(&format!("/metadata/labels/{}", kube::LABEL.replace('/', "~1")))
                            .and_then(serde_json::Value::as_str)
                            == Some(kube::LABEL_READY);
                        if labelled && !matches!(cri::handler_registered(&self.socket(), HANDLER).await, Ok(true)) {
                            tracing::warn!(node = %node, "labelled ready but containerd lacks the handler; unlabelling until repaired");
                            kube::unlabel(*api, node).await?;
                        }
                    }
                    Step::Probe
                }
                Step::Probe => match probe::verdict(&s.layout.host_root, s.allow_pvm) {
                    Verdict::Capable { kvm, reason } => {
                        tracing::info!(kvm = kvm.name(), reason = %reason, "host can run the vm backend");
                        ready_reason = reason;
                        Step::CopyArtifacts
                    }
                    Verdict::Refused { kvm, reason } => {
                        tracing::warn!(kvm = kvm.name(), reason = %reason, "host probe refused");
                        return self.refuse(reason).await;
                    }
                },
                Step::CopyArtifacts => {
                    let r = artifacts::install(&s.layout, &s.artifacts_dir, &s.version, &self.fail)?;
                    artifacts_changed = r.changed;
                    if !r.missing.is_empty() {
                        let reason = format!("image lacks vm backend artifacts: {}", r.missing.join(", "));
                        return self.refuse(reason).await;
                    }
                    Step::CollectVersions
                }
                Step::CollectVersions => {
                    // An old version left on disk costs only space, so a failure here is logged, never fatal.
                    match versions::collect(&s.layout, &s.version, s.gc_grace) {
                        Ok(r) => collected = r.removed,
                        Err(e) => tracing::warn!(error = %e, "old versions not collected; the next run retries"),
                    }
                    Step::WireContainerd
                }
                Step::WireContainerd => {
                    config_version = Some(containerd::install(&s.layout, &self.fail)?);
                    Step::RestartContainerd
                }
                Step::RestartContainerd => {
                    if containerd::restart_pending(&s.layout) {
                        if let Err(e) = self.restarter.restart() {
                            return Err(self.roll_back_after_failed_restart(e));
                        }
                        restarted = true;
                        self.fail.check("restarted")?;
                        containerd::clear_restart_pending(&s.layout)?;
                    } else {
                        tracing::info!("containerd config unchanged; no restart");
                    }
                    Step::CheckCri
                }
                Step::CheckCri => {
                    cri::wait_for_handler(&self.socket(), HANDLER, s.cri_timeout).await?;
                    Step::Label
                }
                Step::Label => {
                    if let Some((api, node)) = &self.nodes {
                        kube::label_ready(*api, node, &ready_reason, &s.version).await?;
                        self.fail.check("labelled")?;
                    }
                    Step::RemoveTaint
                }
                Step::RemoveTaint => {
                    if let (Some((api, node)), Some(taint)) = (&self.nodes, &s.startup_taint) {
                        kube::remove_taint(*api, node, taint).await?;
                    }
                    Step::PrebuildTemplates
                }
                Step::PrebuildTemplates => {
                    if !s.templates.shapes.is_empty() {
                        let (templates, layout) = (s.templates.clone(), s.layout.clone());
                        // The installer's SIGTERM drops this step: the build under way is then
                        // asked to end (and remove its VM) instead of running on unseen.
                        let stop = crate::bounded::Stop::default();
                        let _stop_if_dropped = stop.on_drop();
                        let ready = tokio::task::spawn_blocking(move || templates.prebuild(&layout, &stop))
                            .await
                            .map_err(|e| Error::Setting(format!("template pre-build: {e}")))?;
                        tracing::info!(ready, asked = s.templates.shapes.len(), "templates pre-built");
                    }
                    Step::Done
                }
                Step::Done => {
                    let config_version =
                        config_version.ok_or_else(|| Error::Setting("containerd step skipped".into()))?;
                    tracing::info!(version = %s.version, restarted, artifacts_changed, ?collected, "install complete");
                    return Ok(Report {
                        outcome: Outcome::Ready { config_version },
                        restarted,
                        artifacts_changed,
                        collected,
                    });
                }
            }
        }
    }

    /// containerd did not restart with our drop-in (it may be down with it): take the drop-in and
    /// our imports entry out again and restart once more, so the node keeps its previous containerd.
    /// The install fails either way; the next attempt (with backoff) writes the drop-in again.
    fn roll_back_after_failed_restart(&self, e: Error) -> Error {
        tracing::error!(error = %e, "containerd restart failed; rolling back the drop-in");
        let rolled_back = containerd::uninstall(&self.settings.layout, &self.fail)
            .and_then(|()| self.restarter.restart())
            .and_then(|()| containerd::clear_restart_pending(&self.settings.layout));
        match rolled_back {
            Ok(()) => {
                tracing::warn!("rolled back: containerd runs its previous config");
                Error::Restart(format!("{e}; the drop-in was rolled back and containerd restarted without it"))
            }
            Err(r) => Error::Restart(format!("{e}; rolling back failed too: {r}")),
        }
    }

    /// Uninstall, refusing while bulkhead pods run on the node.
    pub async fn uninstall(&self) -> Result<()> {
        self.uninstall_with(WhileInUse::Refuse).await
    }

    /// Check for running pods (and refuse, unless forced), then label (no new pods), then containerd (drop-in,
    /// imports, restart), then files.
    pub async fn uninstall_with(&self, policy: WhileInUse) -> Result<()> {
        let _lock = InstallLock::acquire(&self.settings.layout.lock_dir(), LOCK_WAIT).await?;
        let s = &self.settings;
        // Under the lock, so no install starts a version between the check and the removal. A pod that starts in
        // between (the handler is still wired) is the same as one started a moment before a forced uninstall.
        match (settled_usage(&s.layout).await, policy) {
            (Ok(u), WhileInUse::Refuse) if !u.is_idle() => {
                let prefix = s.layout.view(&s.layout.prefix);
                return Err(Error::InUse { pods: u.pods.len(), summary: u.summary(), prefix });
            }
            (Ok(u), WhileInUse::Force) if !u.is_idle() => {
                tracing::warn!(usage = %u.summary(), "uninstall forced while bulkhead runs on this node");
            }
            (Ok(_), _) => {}
            (Err(e), WhileInUse::Refuse) => return Err(e),
            (Err(e), WhileInUse::Force) => tracing::warn!(error = %e, "cannot tell what runs; uninstall forced anyway"),
        }
        // If the API refuses (e.g. RBAC deleted together with the DaemonSet), the node is still unwired: a labelled
        // node whose pods fail to start beats a node left wired forever. The error is returned at the end.
        let mut api_error = None;
        if let Some((api, node)) = &self.nodes {
            if let Err(e) = kube::unlabel(*api, node).await {
                tracing::error!(error = %e, "could not remove the node label; unwiring the node anyway");
                api_error = Some(e);
            }
        }
        self.fail.check("uninstall-label-removed")?;
        containerd::uninstall(&s.layout, &self.fail)?;
        if containerd::restart_pending(&s.layout) {
            self.restarter.restart()?;
            self.fail.check("uninstall-restarted")?;
            containerd::clear_restart_pending(&s.layout)?;
        } else {
            tracing::info!("containerd config unchanged by uninstall; no restart");
        }
        let (templates, layout) = (s.templates.clone(), s.layout.clone());
        if let Err(e) = tokio::task::spawn_blocking(move || templates.remove_all(&layout)).await {
            tracing::warn!(error = %e, "templates not removed");
        }
        artifacts::remove_all(&s.layout)?;
        match api_error {
            Some(e) => Err(e),
            None => {
                tracing::info!("uninstall complete");
                Ok(())
            }
        }
    }
}
