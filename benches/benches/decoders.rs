//! `decoders`: criterion micro-benchmarks of the hot host-side decoders of guest- and
//! peer-supplied bytes: the stdio stream header (encode/decode) and ack, the hybrid-vsock
//! handshake line, the vsock packet header and TX chain parse, the virtio-blk request parse, and
//! the bounded descriptor-chain walk on a split virtqueue in in-memory guest memory.
//!
//! Measurement time is kept at 2 s per benchmark so `make bench` stays quick.
// A benchmark harness, like a test: broken fixtures should stop it loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::time::Duration;

use bulkhead_protocol::{handshake, stream};
use bulkhead_vmm::devices::virtio::block::packet::{Request, REQ_IN};
use bulkhead_vmm::devices::virtio::chain::{self, Desc};
use bulkhead_vmm::devices::virtio::vsock::packet::{TxPacket, VsockHeader, HDR_LEN, OP_RW, TYPE_STREAM};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const MEM: usize = 1 << 20;
const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;

fn mem() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM)]).expect("guest memory")
}

fn stream_header(c: &mut Criterion) {
    let mut g = c.benchmark_group("stream_header");
    let h = stream::StreamHeader::new(
        "4f1c2a7d9e3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5",
        Some("exec-7f3a"),
        stream::StreamKind::Stdout,
    );
    let bytes = h.encode().expect("valid header");
    g.throughput(Throughput::Bytes(bytes.len() as u64));
    g.bench_function("encode", |b| b.iter(|| black_box(&h).encode()));
    g.bench_function("decode", |b| b.iter(|| stream::StreamHeader::decode(black_box(&bytes))));
    let garbage = vec![0x47u8; stream::MAX_HEADER_LEN];
    g.bench_function("decode_garbage", |b| b.iter(|| stream::StreamHeader::decode(black_box(&garbage))));
    let ack = stream::StreamAck::Rejected("no such container".into()).encode();
    g.bench_function("ack_read", |b| {
        b.iter(|| {
            let mut r = black_box(&ack[..]);
            poll_ready(stream::StreamAck::read_from(&mut r))
        })
    });
    g.finish();
}

/// The readers here are `&[u8]`, which never pend, so one poll completes the future.
fn poll_ready<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    match f.as_mut().poll(&mut std::task::Context::from_waker(std::task::Waker::noop())) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => panic!("in-memory read pended"),
    }
}

fn handshake_line(c: &mut Criterion) {
    let mut g = c.benchmark_group("handshake");
    g.bench_function("parse_connect", |b| b.iter(|| handshake::parse_connect(black_box(b"CONNECT 1024\n"))));
    g.bench_function("parse_ok", |b| b.iter(|| handshake::parse_ok(black_box(b"OK 1073741824\n"))));
    g.bench_function("parse_connect_malformed", |b| {
        b.iter(|| handshake::parse_connect(black_box(b"CONNECT 99999999999\n")))
    });
    g.bench_function("vmm_parse_connect", |b| {
        b.iter(|| bulkhead_vmm::devices::virtio::vsock::unix::muxer::parse_connect(black_box(b"CONNECT 1024")))
    });
    g.bench_function("read_line", |b| {
        b.iter(|| {
            let mut r = black_box(&b"CONNECT 1024\nttrpc..."[..]);
            poll_ready(handshake::read_line(&mut r, handshake::MAX_LINE))
        })
    });
    g.finish();
}

fn vsock_packet(c: &mut Criterion) {
    let mut g = c.benchmark_group("vsock_packet");
    let hdr = VsockHeader {
        src_cid: 3,
        dst_cid: 2,
        src_port: 1025,
        dst_port: 1024,
        type_: TYPE_STREAM,
        op: OP_RW,
        buf_alloc: 256 * 1024,
        ..Default::default()
    };
    let raw = hdr.to_bytes();
    g.bench_function("header_from_bytes", |b| b.iter(|| VsockHeader::from_bytes(black_box(&raw))));
    let m = mem();
    for payload in [0usize, 4096, 65536] {
        let h = VsockHeader { len: payload as u32, ..hdr };
        m.write_slice(&h.to_bytes(), GuestAddress(0x1000)).expect("in memory");
        m.write_slice(&vec![0x5au8; payload], GuestAddress(0x10000)).expect("in memory");
        let mut descs = vec![Desc { addr: GuestAddress(0x1000), len: HDR_LEN as u32, writable: false }];
        if payload > 0 {
            descs.push(Desc { addr: GuestAddress(0x10000), len: payload as u32, writable: false });
        }
        g.throughput(Throughput::Bytes((HDR_LEN + payload) as u64));
        g.bench_with_input(BenchmarkId::new("tx_parse", payload), &descs, |b, d| {
            b.iter(|| TxPacket::parse(black_box(d), &m).expect("valid packet"))
        });
    }
    g.finish();
}

fn block_request(c: &mut Criterion) {
    let m = mem();
    m.write_obj(REQ_IN, GuestAddress(0x1000)).expect("in memory");
    m.write_obj(8u64, GuestAddress(0x1008)).expect("in memory");
    let descs = [
        Desc { addr: GuestAddress(0x1000), len: 16, writable: false },
        Desc { addr: GuestAddress(0x2000), len: 4096, writable: true },
        Desc { addr: GuestAddress(0x3000), len: 1, writable: true },
    ];
    c.bench_function("block_request/parse", |b| b.iter(|| Request::parse(black_box(&descs), &m).expect("valid")));
}

/// A split virtqueue at 0x1000 whose first available chain is `n` descriptors long.
fn queue_with_chain(m: &GuestMemoryMmap, n: u16) -> Queue {
    let size = 256u16;
    let desc = 0x1000u64;
    let avail = desc + 16 * u64::from(size);
    let used = (avail + 6 + 2 * u64::from(size) + 3) & !3;
    for i in 0..n {
        let last = i + 1 == n;
        let flags = if last { F_WRITE } else { F_NEXT };
        let d = RawDescriptor::from(SplitDescriptor::new(0x20000 + 0x1000 * u64::from(i), 512, flags, i + 1));
        m.write_obj(d, GuestAddress(desc + 16 * u64::from(i))).expect("in memory");
    }
    m.write_obj(0u16, GuestAddress(avail + 4)).expect("in memory");
    m.write_obj(1u16, GuestAddress(avail + 2)).expect("in memory");
    let mut q = Queue::new(size).expect("queue");
    q.set_desc_table_address(Some(desc as u32), Some(0));
    q.set_avail_ring_address(Some(avail as u32), Some(0));
    q.set_used_ring_address(Some(used as u32), Some(0));
    q.set_ready(true);
    assert!(q.is_valid(m));
    q
}

fn desc_chain(c: &mut Criterion) {
    let mut g = c.benchmark_group("desc_chain");
    for n in [1u16, 3, 16, 64] {
        let m = mem();
        let mut q = queue_with_chain(&m, n);
        g.throughput(Throughput::Elements(u64::from(n)));
        g.bench_function(BenchmarkId::new("walk_collect", n), |b| {
            b.iter(|| {
                // Rewind so every iteration pops the same chain.
                q.set_next_avail(0);
                let chain = q.iter(&m).expect("avail ring").next().expect("one chain");
                let descs = chain::collect(chain, &m, 1 << 20).expect("valid chain");
                black_box(descs.len())
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = decoders;
    config = Criterion::default()
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(50);
    targets = stream_header, handshake_line, vsock_packet, block_request, desc_chain
}
criterion_main!(decoders);
