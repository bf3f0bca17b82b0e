//! Fuzz bodies for what a `bulkhead-vmm` reads outside the guest: the snapshot state file and
//! the API socket's requests.

use std::sync::Arc;

use bulkhead_vmm::config::{BlockConfig, LinkState, NetConfig};
use bulkhead_vmm::snapshot::file as state_file;
use bulkhead_vmm::snapshot::state::VmState;

use crate::*;

/// This host's CPU as the snapshot decoder sees it in the `snapshot_state` target.
const FUZZ_CPU: (&str, &[u8; 32]) = ("FuzzCPU", &[7; 32]);

/// The VMM's own small valid state (one vCPU, no virtio devices), as this host's CPU, to mutate.
fn sample_state() -> VmState {
    let mut state = bulkhead_vmm::snapshot::sample::sample_state();
    state.host_cpu = FUZZ_CPU.0.into();
    state
}

/// The snapshot state-file decoder, three ways by the first byte: the input as a whole file
/// (header checks), as a correctly sealed body (the postcard decoder and the state checks), or
/// as XOR noise over a valid sample body (near-valid states). A decoded state must re-encode.
pub fn snapshot_state(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    let file = match mode % 3 {
        0 => rest.to_vec(),
        1 => state_file::seal(rest, FUZZ_CPU.1),
        _ => {
            let Ok(mut body) = postcard::to_stdvec(&sample_state()) else { return };
            for (b, x) in body.iter_mut().zip(rest) {
                *b ^= x;
            }
            state_file::seal(&body, FUZZ_CPU.1)
        }
    };
    if let Ok(state) = state_file::decode(&file, FUZZ_CPU) {
        state.check().expect("decode returns only checked states");
        let again = state_file::encode(&state, FUZZ_CPU.1).expect("a decoded state encodes");
        assert!(state_file::decode(&again, FUZZ_CPU).is_ok(), "re-encoded state does not decode");
    }
}

// ---------------------------------------------------------------------------------------------
// VMM: the API socket's request handling.

/// The snapshot a prepared VMM holds in the `api_request` target: vsock, a disk, a virtio-fs
/// and a net device, so a `restore`'s run settings have something to fit.
fn api_saved_config() -> bulkhead_vmm::config::ValidConfig {
    use bulkhead_vmm::config::{BootSource, FsConfig, RawFormat, RawGuestConfig, ValidConfig, VsockConfig};
    ValidConfig {
        boot: BootSource::Raw(RawGuestConfig { image: "/g".into(), format: RawFormat::Elf, load_addr: 0x10_0000 }),
        vcpus: 1,
        mem_bytes: 32 << 20,
        serial_log: None,
        vsock: Some(VsockConfig { uds_path: "/run/v.sock".into(), guest_cid: GUEST_CID }),
        block: vec![BlockConfig { path: "/snap/disk".into(), read_only: true }],
        fs: vec![FsConfig { tag: "rootfs".into(), socket: "/run/fs.sock".into(), queue_size: 1024 }],
        net: vec![NetConfig {
            tap: "tap0".into(),
            mac: "02:00:00:00:00:01".into(),
            mtu: None,
            rate_limiter: None,
            link: LinkState::Down,
        }],
        api_socket: None,
        balloon: None,
    }
}

/// The API socket's request handling, as a client's bytes arrive (the first byte picks the read
/// size): cut into bounded lines, each answered by a running VM's controller (no vCPUs, no
/// snapshotter, so nothing blocks) and decided on by a prepared VMM, whose `restore` run settings
/// are checked against a saved config. Every line gets exactly one answer line that a client's
/// parser accepts within its limit; only `shutdown` stops the VM.
pub fn api_request(data: &[u8]) {
    use bulkhead_vmm::api::{prepared_request, PreparedRequest, RequestLines, VmController};
    use bulkhead_vmm::exit::{ExitReason, ExitSignal};
    use bulkhead_vmm::vcpu::VcpuControl;
    use bulkhead_vmm_api::api::{parse_request, parse_response, Request, MAX_RESPONSE_LINE};
    use bulkhead_vmm_api::restore::restored_config;

    let Some((&mode, rest)) = data.split_first() else { return };
    let Ok(exit) = ExitSignal::new() else { return };
    let controller = VmController {
        control: Arc::new(VcpuControl::new()),
        exit: Arc::new(exit),
        vcpus: 0,
        mem_mib: bulkhead_vmm_api::memory::Mib(32),
        irqchip: true,
        start_unix_ns: 1,
        snapshots: None,
        restore: None,
        boot: None,
        // A real balloon, so a fuzzed `balloon` request reaches its target check.
        balloon: bulkhead_vmm::devices::virtio::balloon::Balloon::new(&Default::default())
            .ok()
            .map(|b| Arc::new(std::sync::Mutex::new(b))),
    };
    let saved = api_saved_config();
    let mut lines = RequestLines::default();
    for piece in rest.chunks(usize::from(mode % 64) + 1) {
        lines.push(piece);
        while let Some(line) = lines.next_line() {
            let (answer, stop) = controller.answer_line(&line);
            assert!(answer.len() <= MAX_RESPONSE_LINE && answer.ends_with(b"\n"), "answer of {} bytes", answer.len());
            let response = parse_response(&answer[..answer.len() - 1]).expect("an answer the client parses");
            let shutdown = parse_request(&line) == Ok(Request::Shutdown);
            assert_eq!(stop, shutdown.then_some(ExitReason::ApiShutdown), "only `shutdown` stops the VM");
            assert!(!shutdown || response.ok);
            match prepared_request(&line, lines.pending() > 0) {
                PreparedRequest::Restore(run) => {
                    if let Ok(cfg) = restored_config(&saved, &run) {
                        assert_eq!((cfg.net.len(), cfg.fs.len(), cfg.vcpus), (1, 1, 1), "the snapshot's shape");
                        assert!(cfg.vsock.is_some_and(|v| Some(v.uds_path) == run.vsock_uds_path));
                    }
                }
                PreparedRequest::Answer(r) => assert!(!r.ok, "a prepared VMM only refuses at once"),
                PreparedRequest::Info | PreparedRequest::Shutdown => {}
            }
        }
        if lines.overlong() {
            return;
        }
    }
}
