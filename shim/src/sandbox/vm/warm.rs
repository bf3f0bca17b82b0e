//! Whether a pod's VM starts warm, restored from a template (`vm.start`; `auto` where the host
//! runs ordinary guests), and which template. A template is found, or built now by this pod
//! while others wanting it wait within [`TEMPLATE_WAIT`] ([`obtain`]), or the pod boots cold.
//!
//! The guest's NICs are virtio-mmio devices, fixed at boot, so a pod with a network takes a
//! template booted with as many NICs of the same MTUs (part of the key), their links down. The
//! restore attaches the pod's own taps and raises the links (virtio-net's config interrupt tells
//! the guest); the agent gives each NIC the CNI interface's MAC and addresses at SetupSandbox, as
//! after a cold boot, and waits for its carrier.

use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn, Instrument};

use super::shape::VmShape;
use super::template::{
    memory_bucket, obtain, Ceiling, KeyInputs, KeySources, Obtained, Template, TemplateError, TemplateStore,
};
use super::template_builder::VmTemplateBuilder;
use crate::config::{Config, VmSettings};
use crate::sandbox::SandboxRequest;

/// How long a pod waits for another pod's build of its template before it boots cold.
const TEMPLATE_WAIT: Duration = Duration::from_secs(30);

/// The template to restore `req`'s VM of `shape` from, with its store; `None`: boot cold (the
/// reason is logged).
pub async fn template_for(config: &Config, req: &SandboxRequest, shape: VmShape) -> Option<(TemplateStore, Template)> {
    if !config.vm.start.warm_here() {
        return None;
    }
    let nic_mtus = match &req.netns {
        None => vec![],
        Some(netns) => match crate::network::vm_nic_mtus(netns).await {
            Ok(mtus) => mtus,
            Err(e) => {
                info!(error = %e, "template: cannot read the pod's interfaces: cold boot");
                return None;
            }
        },
    };
    // A few shared shapes, not one template per distinct limit (key.rs).
    let memory = memory_bucket(shape.mem, bulkhead_vmm_api::config::MAX_MEM)?;
    let vm = config.vm.clone();
    // Hashing the kernel, initramfs and VMM (memoised after the first time) is file I/O.
    let found = tokio::task::spawn_blocking(move || {
        let store = open_store(&vm)?;
        let sources = KeySources::of_config(&vm, shape.vcpus, memory, &nic_mtus);
        let inputs = KeyInputs::of(&sources, Some(&store.digests_dir()))?;
        Ok::<_, super::template::TemplateError>((store, inputs))
    })
    .await;
    let (store, inputs) = match found {
        Ok(Ok(found)) => found,
        Ok(Err(e)) => {
            warn!(error = %e, "template: cannot key the pod's template: cold boot");
            return None;
        }
        Err(e) => {
            warn!(error = %e, "template: keying failed: cold boot");
            return None;
        }
    };
    let builder = VmTemplateBuilder::new(Arc::new(config.clone()));
    match obtain(&store, &inputs, &builder, TEMPLATE_WAIT).await {
        Obtained::Ready(t) => {
            store.mark_used(&t.key);
            Some((store, t))
        }
        Obtained::Built(t) => {
            info!(template = %t.key, "template: built for this pod");
            store.mark_used(&t.key);
            Some((store, t))
        }
        Obtained::Cold(reason) => {
            info!(%reason, "template: cold boot");
            if reason.wants_rebuild() {
                let config = Arc::new(config.clone());
                tokio::spawn(
                    async move {
                        let builder = VmTemplateBuilder::new(config);
                        if let Err(e) = super::template::build(&store, &inputs, &builder, TEMPLATE_WAIT).await {
                            warn!(error = %e, "template: rebuild failed");
                        }
                    }
                    .in_current_span(),
                );
            }
            None
        }
    }
}

/// The node's template store, kept within the config's ceiling.
pub fn open_store(vm: &VmSettings) -> Result<TemplateStore, TemplateError> {
    let ceiling = Ceiling {
        max_templates: vm.template_max_count as usize,
        max_bytes: vm.template_max_size.0,
        max_idle: Duration::from_secs(u64::from(vm.template_max_idle_days) * 86_400),
    };
    Ok(TemplateStore::open(&vm.template_dir)?.with_ceiling(ceiling))
}

/// Moves `template` aside after the VMM would not restore it (the next pod rebuilds it), unless
/// another shim holds its lock (building or removing it).
pub fn set_aside(store: &TemplateStore, template: &Template, why: &str) {
    warn!(template = %template.key, why, "template: the restore failed; moved aside, the pod boots cold");
    match store.try_lock(&template.key) {
        Ok(Some(lock)) => {
            if let Err(e) = store.quarantine(&template.key, &format!("restore failed: {why}"), &lock) {
                warn!(template = %template.key, error = %e, "template: not moved aside");
            }
        }
        Ok(None) => {}
        Err(e) => warn!(template = %template.key, error = %e, "template: not moved aside"),
    }
}
