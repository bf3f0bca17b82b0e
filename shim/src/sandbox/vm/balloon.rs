//! The VM's balloon as a pod's memory size: at the start it holds what `vm.max_memory_mib` gives
//! a VM to grow into, and an in-place resize moves it (`resize.rs` says how far). The guest's
//! driver inflates and deflates on its own time; a resize that gives the guest memory waits,
//! bounded, until the driver has let it go, so the container's new limit is backed when
//! UpdateContainerResources returns. Taking memory back is not waited for: the guest gives it
//! as it frees it.

use std::time::{Duration, Instant};

use bulkhead_vmm_api::memory::Mib;
use tracing::warn;

use super::api::{ApiError, VmmApi};
use super::shape::VmShape;

/// How long a resize waits for the guest to let go of the balloon's memory.
pub const DEFLATE_WAIT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(50);

/// Puts what the VM has beyond the pod's memory into the balloon (nothing without headroom).
pub async fn hold_headroom(api: &VmmApi, shape: VmShape) -> Result<(), ApiError> {
    if shape.mem <= shape.mem_start {
        return Ok(());
    }
    target(api, shape.mem_start).await.map(drop)
}

/// Leaves the guest `guest` of the VM's memory, the balloon holding the rest; returns the
/// balloon's size. The VM's memory is the VMM's word: a VM restored from a template has its
/// template's, which is rounded up from the pod's (`template::key::memory_bucket`).
pub async fn target(api: &VmmApi, guest: Mib) -> Result<Mib, ApiError> {
    let vm = api.info().await?.mem_mib;
    let balloon = Mib(vm.get().saturating_sub(guest.get()));
    api.balloon(balloon).await?;
    Ok(balloon)
}

/// Waits, at most `within`, until the balloon holds no more than `target`.
pub async fn wait_deflated(api: &VmmApi, target: Mib, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let held = match api.info().await.map(|i| i.balloon) {
            Ok(Some(b)) if b.actual_mib <= target => return,
            Ok(Some(b)) => b.actual_mib,
            Ok(None) => return,
            Err(e) => {
                warn!(error = %e, "balloon: cannot read how far the guest is");
                return;
            }
        };
        if Instant::now() >= deadline {
            warn!(
                target_mib = target.get(),
                held_mib = held.get(),
                ?within,
                "balloon: the guest has not let go of the memory in time; it gets it as its driver deflates"
            );
            return;
        }
        tokio::time::sleep(POLL).await;
    }
}
