//! The state file: a fixed header, then the [`VmState`] encoded with postcard.
//!
//! ```text
//! offset size
//!      0    8  magic "BHKSNAP\0"
//!      8    4  format version (le32), FORMAT_VERSION
//!     12    4  reserved, 0
//!     16   32  host CPU fingerprint (SHA-256 of KVM's supported CPUID)
//!     48    8  body length (le64), at most MAX_BODY_BYTES
//!     56   32  SHA-256 of the whole file, this field taken as zeros
//!     88    8  reserved, 0
//!     96    -  body
//! ```
//!
//! Reading checks, in order: size, magic, version (a future layout is not read further),
//! length, checksum, then decodes the body and compares the CPU fingerprint; each failure is
//! its own error. The decoder never allocates more than the file's size and the body's limit.
//!
//! postcard is not self-describing: any change to a type reachable from [`VmState`] (a config
//! field, a device's state, a kvm-bindings struct's size) changes the body's layout. Such a
//! change must bump [`FORMAT_VERSION`]; a test pins the layout to the version so it cannot be
//! forgotten. (A new enum variant added last keeps old files readable, but still needs the bump
//! for older readers.)

use sha2::{Digest, Sha256};

use super::state::{StateError, VmState};

pub const MAGIC: [u8; 8] = *b"BHKSNAP\0";
pub const FORMAT_VERSION: u32 = 5;
pub const HEADER_LEN: usize = 96;
/// A VM of 32 vCPUs needs well under 1 MiB; anything near this is not ours.
pub const MAX_BODY_BYTES: u64 = 16 << 20;
/// Largest state file a reader accepts.
pub const MAX_FILE_BYTES: u64 = HEADER_LEN as u64 + MAX_BODY_BYTES;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SnapshotFileError {
    #[error("state file is truncated: {got} bytes, {want} expected")]
    Truncated { got: u64, want: u64 },
    #[error("state file has {0} bytes after its body")]
    TrailingBytes(u64),
    #[error("not a bulkhead snapshot state file (bad magic)")]
    BadMagic,
    #[error("snapshot format version {found} is not supported; this bulkhead-vmm reads version {FORMAT_VERSION}")]
    Version { found: u32 },
    #[error("state body of {0} bytes exceeds the {MAX_BODY_BYTES}-byte limit")]
    TooLarge(u64),
    #[error("state file is corrupt: checksum mismatch")]
    Checksum,
    #[error("state body does not decode: {0}")]
    Decode(String),
    #[error(
        "snapshot was taken on a different host CPU: snapshot {saved} (fingerprint {saved_fp}), this host {here} \
         (fingerprint {here_fp})"
    )]
    HostCpu { saved: String, saved_fp: String, here: String, here_fp: String },
    #[error(transparent)]
    State(#[from] StateError),
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Header fields after magic and version checks.
struct Header {
    fingerprint: [u8; 32],
    body_len: u64,
    checksum: [u8; 32],
}

/// SHA-256 of the whole file with the checksum field taken as zeros.
fn checksum(file: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(&file[..56]);
    h.update([0u8; 32]);
    h.update(&file[88..]);
    h.finalize().into()
}

/// The whole state file for `state`, taken on the host with `fingerprint`.
pub fn encode(state: &VmState, fingerprint: &[u8; 32]) -> Result<Vec<u8>, SnapshotFileError> {
    let body = postcard::to_stdvec(state).map_err(|e| SnapshotFileError::Decode(e.to_string()))?;
    if body.len() as u64 > MAX_BODY_BYTES {
        return Err(SnapshotFileError::TooLarge(body.len() as u64));
    }
    Ok(seal(&body, fingerprint))
}

/// Wraps an encoded body in a header with its checksum.
pub fn seal(body: &[u8], fingerprint: &[u8; 32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(fingerprint);
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&[0u8; 40]);
    out.extend_from_slice(body);
    let sum = checksum(&out);
    out[56..88].copy_from_slice(&sum);
    out
}

fn header(bytes: &[u8]) -> Result<Header, SnapshotFileError> {
    let seen = bytes.len().min(MAGIC.len());
    if bytes[..seen] != MAGIC[..seen] {
        return Err(SnapshotFileError::BadMagic);
    }
    if let Some(v) = bytes.get(8..12) {
        let found = u32::from_le_bytes([v[0], v[1], v[2], v[3]]);
        if found != FORMAT_VERSION {
            return Err(SnapshotFileError::Version { found });
        }
    }
    if bytes.len() < HEADER_LEN {
        return Err(SnapshotFileError::Truncated { got: bytes.len() as u64, want: HEADER_LEN as u64 });
    }
    let mut fingerprint = [0u8; 32];
    fingerprint.copy_from_slice(&bytes[16..48]);
    let mut len = [0u8; 8];
    len.copy_from_slice(&bytes[48..56]);
    let mut sum = [0u8; 32];
    sum.copy_from_slice(&bytes[56..88]);
    Ok(Header { fingerprint, body_len: u64::from_le_bytes(len), checksum: sum })
}

/// Checks and decodes a whole state file. `here` is this host's CPU (description, fingerprint).
pub fn decode(bytes: &[u8], here: (&str, &[u8; 32])) -> Result<VmState, SnapshotFileError> {
    let h = header(bytes)?;
    if h.body_len > MAX_BODY_BYTES {
        return Err(SnapshotFileError::TooLarge(h.body_len));
    }
    let want = HEADER_LEN as u64 + h.body_len;
    let got = bytes.len() as u64;
    if got < want {
        return Err(SnapshotFileError::Truncated { got, want });
    }
    if got > want {
        return Err(SnapshotFileError::TrailingBytes(got - want));
    }
    if checksum(bytes) != h.checksum {
        return Err(SnapshotFileError::Checksum);
    }
    let body = &bytes[HEADER_LEN..];
    let state: VmState = postcard::from_bytes(body).map_err(|e| SnapshotFileError::Decode(e.to_string()))?;
    if h.fingerprint != *here.1 {
        return Err(SnapshotFileError::HostCpu {
            saved: state.host_cpu.clone(),
            saved_fp: hex(&h.fingerprint[..8]),
            here: here.0.to_string(),
            here_fp: hex(&here.1[..8]),
        });
    }
    state.check()?;
    Ok(state)
}

/// Reads and decodes the state file at `path`, refusing files over [`MAX_FILE_BYTES`] before
/// reading them.
pub fn read(path: &std::path::Path, here: (&str, &[u8; 32])) -> Result<VmState, ReadError> {
    let file =
        std::fs::File::open(path).map_err(|source| ReadError::Io { path: path.display().to_string(), source })?;
    read_file(file, path, here)
}

/// [`read`] of a state file already open (`path` names it in errors).
pub fn read_file(file: std::fs::File, path: &std::path::Path, here: (&str, &[u8; 32])) -> Result<VmState, ReadError> {
    use std::io::Read;
    let io = |source| ReadError::Io { path: path.display().to_string(), source };
    let len = file.metadata().map_err(io)?.len();
    if len > MAX_FILE_BYTES {
        return Err(ReadError::File(SnapshotFileError::TooLarge(len - HEADER_LEN as u64)));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(io)?;
    decode(&bytes, here).map_err(ReadError::File)
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot read state file {path}")]
    Io { path: String, source: std::io::Error },
    #[error(transparent)]
    File(SnapshotFileError),
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::snapshot::state::*;

    use crate::snapshot::sample::sample_state;

    const FP: [u8; 32] = [5; 32];
    const HERE: (&str, &[u8; 32]) = ("TestCPU", &FP);

    /// The body layout of format version 5, as SHA-256 of a sample with every device kind.
    /// (Version 4's, without the balloon's target: 2935f045e143b63a61bf19e24a27f60eab8e07fb61c67c77c8b72ac50baf0443;
    /// version 3's, without the NIC link: 6e9537c20367e9ec653e04c74795f1b7f39c0a4b816510eb4be3f97e13758b23;
    /// version 2's, without the balloon: 23073eed23f1ddf53e95787816d55ed6924f3829bdaaaf48a73771581f455921.)
    const LAYOUT_V5: &str = "55937662d1a816b55272aa4bd92d9cc58e49675307ec7096ecd97ae1f77ced4c";

    #[test]
    fn body_layout_is_pinned_to_the_format_version() {
        use crate::config::{
            BalloonConfig, FsConfig, LinkState, NetConfig, NetRateLimiterConfig, RateLimiterConfig, TokenBucketConfig,
        };
        use crate::device_manager::persist::{VirtioDeviceState, VirtioSlotState};
        use crate::devices::virtio::balloon::metrics::BalloonCounters;
        use crate::devices::virtio::balloon::persist::BalloonState;
        use crate::devices::virtio::block::persist::BlockState;
        use crate::devices::virtio::fs::persist::FsState;
        use crate::devices::virtio::net::persist::NetState;
        use crate::devices::virtio::persist::{MmioTransportState, QueueState};
        use crate::devices::virtio::vsock::persist::VsockState;
        let mut s = sample_state();
        s.config.fs = vec![FsConfig { tag: "rootfs".into(), socket: "/f".into(), queue_size: 1024 }];
        let bucket = TokenBucketConfig { size: 1000, one_time_burst: 10, refill_time_ms: 100 };
        let limits =
            NetRateLimiterConfig { rx: Some(RateLimiterConfig { bandwidth: Some(bucket), ops: None }), tx: None };
        s.config.net = vec![NetConfig {
            tap: "tap0".into(),
            mac: "02:00:00:00:00:01".into(),
            mtu: Some(1500),
            rate_limiter: Some(limits),
            link: LinkState::Down,
        }];
        let q = QueueState { max_size: 256, size: 8, ready: true, next_avail: 3, ..Default::default() };
        let transport = MmioTransportState { device_status: 0xf, queues: vec![q], ..Default::default() };
        s.devices.virtio = vec![
            VirtioSlotState {
                name: "blk0".into(),
                transport: transport.clone(),
                device: VirtioDeviceState::Block(BlockState {
                    path: "/d".into(),
                    read_only: false,
                    capacity_sectors: 8,
                    acked_features: 1,
                    queues: vec![q],
                    broken: false,
                }),
            },
            VirtioSlotState {
                name: "vsock".into(),
                transport: transport.clone(),
                device: VirtioDeviceState::Vsock(VsockState {
                    guest_cid: 3,
                    uds_path: "/v".into(),
                    acked_features: 1,
                    queues: vec![q; 3],
                    broken: false,
                }),
            },
            VirtioSlotState {
                name: "fs0".into(),
                transport: transport.clone(),
                device: VirtioDeviceState::Fs(FsState {
                    tag: "rootfs".into(),
                    socket: "/f".into(),
                    queue_size: 1024,
                    acked_features: 1,
                    vrings: vec![q; 2],
                    broken: false,
                }),
            },
            VirtioSlotState {
                name: "net0".into(),
                transport: transport.clone(),
                device: VirtioDeviceState::Net(NetState {
                    tap: "tap0".into(),
                    mac: [2, 0, 0, 0, 0, 1],
                    mtu: Some(1500),
                    link: LinkState::Down,
                    acked_features: 1,
                    queues: vec![q; 2],
                    broken: false,
                }),
            },
            VirtioSlotState {
                name: "balloon".into(),
                transport,
                device: VirtioDeviceState::Balloon(BalloonState {
                    free_page_reporting: true,
                    acked_features: 1 << 5,
                    num_pages: 300,
                    actual: 7,
                    queues: vec![q; 3],
                    broken: false,
                    counters: BalloonCounters { reports: 2, freed_bytes: 1 << 21, ..Default::default() },
                }),
            },
        ];
        s.config.balloon = Some(BalloonConfig { free_page_reporting: true });
        s.vm.irqchip = Some(IrqchipState {
            pic_master: Default::default(),
            pic_slave: Default::default(),
            ioapic: Default::default(),
        });
        s.vm.pit = Some(Default::default());
        s.vcpus[0].lapic = Some(Default::default());
        s.vcpus[0].xcrs = Some(Default::default());
        let body = postcard::to_stdvec(&s).unwrap();
        let layout = hex(&Sha256::digest(&body));
        assert_eq!(FORMAT_VERSION, 5);
        assert_eq!(
            layout, LAYOUT_V5,
            "the state body's layout changed: bump FORMAT_VERSION and pin the new layout here"
        );
    }

    #[test]
    fn state_file_roundtrips() {
        let bytes = encode(&sample_state(), &FP).unwrap();
        assert_eq!(&bytes[..8], b"BHKSNAP\0");
        let back = decode(&bytes, HERE).unwrap();
        assert_eq!(back.vcpus[0].regs.rax, 42);
        assert_eq!(back.vcpus[0].msrs[0].data, 99);
        assert_eq!(back.vcpus[0].xsave, vec![7; XSAVE_WORDS]);
        assert_eq!(back.config, sample_state().config);
        assert_eq!(encode(&back, &FP).unwrap(), bytes, "stable encoding");
    }

    #[test]
    fn truncated_files_are_refused_at_every_length() {
        let bytes = encode(&sample_state(), &FP).unwrap();
        for cut in [0, 4, 8, 11, 40, HEADER_LEN, HEADER_LEN + 1, bytes.len() - 1] {
            let e = decode(&bytes[..cut], HERE).unwrap_err();
            assert!(matches!(e, SnapshotFileError::Truncated { .. }), "cut at {cut}: {e}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert_eq!(decode(&long, HERE).unwrap_err(), SnapshotFileError::TrailingBytes(1));
    }

    #[test]
    fn every_flipped_byte_is_refused() {
        let bytes = encode(&sample_state(), &FP).unwrap();
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x40;
            assert!(decode(&b, HERE).is_err(), "flipping byte {i} went unnoticed");
        }
        let mut b = bytes.clone();
        b[HEADER_LEN + 10] ^= 1;
        assert_eq!(decode(&b, HERE).unwrap_err(), SnapshotFileError::Checksum);
    }

    #[test]
    fn bad_magic_future_version_and_oversize_are_refused() {
        let bytes = encode(&sample_state(), &FP).unwrap();
        let mut b = bytes.clone();
        b[0] = b'X';
        assert_eq!(decode(&b, HERE).unwrap_err(), SnapshotFileError::BadMagic);
        let mut b = bytes.clone();
        b[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
        let e = decode(&b, HERE).unwrap_err();
        assert_eq!(e, SnapshotFileError::Version { found: FORMAT_VERSION + 1 });
        assert!(e.to_string().contains(&format!("version {} is not supported", FORMAT_VERSION + 1)), "{e}");
        // The previous format (body layout) is refused too, not misread.
        b[8..12].copy_from_slice(&(FORMAT_VERSION - 1).to_le_bytes());
        assert_eq!(decode(&b, HERE).unwrap_err(), SnapshotFileError::Version { found: FORMAT_VERSION - 1 });
        let mut b = bytes.clone();
        b[48..56].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(decode(&b, HERE).unwrap_err(), SnapshotFileError::TooLarge(u64::MAX));
    }

    #[test]
    fn another_host_cpu_is_refused_by_name() {
        let bytes = encode(&sample_state(), &[9; 32]).unwrap();
        let e = decode(&bytes, HERE).unwrap_err();
        assert!(matches!(e, SnapshotFileError::HostCpu { .. }));
        let msg = e.to_string();
        assert!(msg.contains("different host CPU") && msg.contains("TestCPU") && msg.contains("0909"), "{msg}");
    }

    #[test]
    fn inconsistent_state_is_refused() {
        let mut s = sample_state();
        s.config.vcpus = 2;
        assert!(matches!(decode(&encode(&s, &FP).unwrap(), HERE), Err(SnapshotFileError::State(_))));
        let mut s = sample_state();
        s.vcpus[0].xsave.pop();
        assert!(matches!(decode(&encode(&s, &FP).unwrap(), HERE), Err(SnapshotFileError::State(_))));
        let mut s = sample_state();
        s.mem_file_bytes += 4096;
        assert!(matches!(decode(&encode(&s, &FP).unwrap(), HERE), Err(SnapshotFileError::State(_))));
    }

    #[test]
    fn oversized_file_is_refused_before_reading() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state");
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(MAX_FILE_BYTES + 1).unwrap();
        assert!(matches!(read(&p, HERE), Err(ReadError::File(SnapshotFileError::TooLarge(_)))));
    }
}
