//! Floods the host with vsock connection requests, 64 per notify, never reading its RX queue:
//! even source ports ask for host port 5000 (a listener that never accepts), odd ones for 5001
//! (no listener). Says when it starts and when every request was consumed, then resets.
#![no_std]
#![no_main]

mod common;
use common::*;

const BATCH: u16 = 64;
const ROUNDS: u32 = 400;
const HDRS: u64 = 0x42_0000;

#[no_mangle]
pub extern "C" fn _start() -> ! {
    let base = find_device(TYPE_VSOCK);
    if base == 0 || !negotiate(base) {
        puts("no vsock\n");
        reset();
    }
    let rx = Vq::new(base, 0, 0x40_0000, 8);
    let tx = Vq::new(base, 1, 0x40_1000, BATCH);
    let ev = Vq::new(base, 2, 0x40_2000, 8);
    if !rx.setup() || !tx.setup() || !ev.setup() || !driver_ok(base) {
        puts("vsock setup failed\n");
        reset();
    }
    let cid = r64(base + CONFIG);
    for i in 0..BATCH {
        let b = HDRS + i as u64 * 64;
        // The source port is filled in per round.
        let dst_port = if i % 2 == 0 { 5000 } else { 5001 };
        VsockHdr {
            src_cid: cid,
            src_port: 0,
            dst_port,
            len: 0,
            op: OP_REQUEST,
            flags: 0,
            buf_alloc: 65536,
            fwd_cnt: 0,
        }
        .write(b);
        tx.set_desc(i, b, VSOCK_HDR as u32, 0, 0);
    }
    puts("flood start\n");
    let mut idx: u16 = 0;
    for round in 0..ROUNDS {
        for i in 0..BATCH {
            w32(HDRS + i as u64 * 64 + 16, 10_000 + round * BATCH as u32 + i as u32);
            w16(tx.avail + 4 + 2 * (idx % BATCH) as u64, i);
            idx = idx.wrapping_add(1);
        }
        w16(tx.avail + 2, idx);
        w32(base + QUEUE_NOTIFY, 1);
        let mut spins = 0u32;
        while r16(tx.used + 2) != idx {
            spins += 1;
            if spins > 2_000_000 {
                puts("tx stuck\n");
                reset();
            }
        }
    }
    puts("flood done\n");
    reset()
}
