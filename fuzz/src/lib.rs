//! Fuzz bodies for bulkhead's decoders of guest- and peer-supplied bytes.
//!
//! Each `fuzz_targets/<name>.rs` is a one-line libFuzzer wrapper around the function of the same
//! name here, so the bodies also run as ordinary `cargo test` seeds (see `tests/seeds.rs`) on a
//! toolchain without sanitizer support. A body returns normally for any input; a panic (or a
//! sanitizer report) is a bug in the decoder under test, never in the input.
//!
//! The bodies are grouped by the crate whose decoder they drive: [`protocol`], [`shim`], and the
//! VMM's [`vmm_packets`], [`vmm_devices`] and [`vmm_state`]; this file holds the helpers they
//! share (guest memory, biased addresses, a current-thread executor).
//!
//! Boundaries: only PUBLIC APIs of `bulkhead-vmm`, `bulkhead-protocol` and `bulkhead-shim` are used; this crate
//! never patches them. Guest memory is a small in-memory `GuestMemoryMmap` so that fuzzed
//! addresses land inside it often enough to reach the interesting paths.

mod protocol;
mod shim;
mod vmm_devices;
mod vmm_packets;
mod vmm_state;
pub use protocol::{handshake, stream_header};
pub use shim::{agent_reply, shim_options, shim_pod_config, shim_spec};
pub use vmm_devices::{virtio_blk, virtio_net, virtio_vsock, vsock_muxer};
pub use vmm_packets::{balloon_report, block_request, desc_chain, fs_relay, net_packet, vsock_packet};
pub use vmm_state::{api_request, snapshot_state};

use std::future::Future;
use std::pin::pin;
use std::sync::Once;
use std::task::{Context, Poll, Waker};

use arbitrary::{Result, Unstructured};
use bulkhead_vmm::devices::virtio::chain::Desc;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Guest memory size for every target: small, so fuzzed addresses hit it.
pub const MEM_SIZE: usize = 64 * 1024;
pub(crate) const GUEST_CID: u64 = 3;

/// Runs `f` to completion on the current thread. The readers used here (`&[u8]`) never return
/// `Pending`, so a no-op waker suffices; a body that does pend is reported as a bug.
pub(crate) fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    for _ in 0..1_000_000 {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
    panic!("future over an in-memory reader did not finish");
}

thread_local! {
    static RT: tokio::runtime::Runtime =
        tokio::runtime::Builder::new_current_thread().enable_time().build().expect("tokio runtime");
}

/// libFuzzer's `main` is C's, so Rust's usual SIGPIPE=ignore is missing; the VMM binary has it.
pub fn ignore_sigpipe() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: setting a signal disposition to SIG_IGN has no preconditions.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
    });
}

pub(crate) fn guest_mem() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).expect("guest memory")
}

/// Copies `image` to guest address 0 (truncated to memory) and zeroes the rest.
pub(crate) fn load_image(mem: &GuestMemoryMmap, image: &[u8]) {
    let n = image.len().min(MEM_SIZE);
    mem.write_slice(&image[..n], GuestAddress(0)).expect("image fits");
    let zeros = vec![0u8; MEM_SIZE - n];
    mem.write_slice(&zeros, GuestAddress(n as u64)).expect("zero fill fits");
}

/// A guest address biased towards guest memory but able to point anywhere.
pub(crate) fn addr(u: &mut Unstructured<'_>) -> Result<u64> {
    Ok(match u.int_in_range(0u8..=7)? {
        0 => u.arbitrary()?,
        1 => (MEM_SIZE as u64).wrapping_sub(u.int_in_range(0u64..=64)?),
        _ => u.int_in_range(0..=MEM_SIZE as u64 - 1)?,
    })
}

pub(crate) fn len32(u: &mut Unstructured<'_>) -> Result<u32> {
    Ok(match u.int_in_range(0u8..=7)? {
        0 => u.arbitrary()?,
        1 => u.int_in_range(0..=MEM_SIZE as u32 * 2)?,
        _ => u.int_in_range(0..=4096)?,
    })
}

pub(crate) fn descs(u: &mut Unstructured<'_>, max: usize) -> Result<Vec<Desc>> {
    let n = u.int_in_range(0..=max)?;
    (0..n).map(|_| Ok(Desc { addr: GuestAddress(addr(u)?), len: len32(u)?, writable: u.arbitrary()? })).collect()
}
