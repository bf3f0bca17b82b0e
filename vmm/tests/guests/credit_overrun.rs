//! Ignores the host's vsock credit: connects to host port 5002 (a listener that never reads) and
//! sends 64 KiB packets until the host resets the connection, then proves the device still
//! serves with a second connection that sends one line.
#![no_std]
#![no_main]

mod common;
use common::*;

const RX_BUF: u64 = 0x41_0000;
const TX_HDR: u64 = 0x42_0000;
const DATA: u64 = 0x50_0000;
const CHUNK: u32 = 64 * 1024;
const NRX: u16 = 8;

struct Vs {
    rx: Vq,
    tx: Vq,
    cid: u64,
}

impl Vs {
    /// Sends a header (and `len` bytes from DATA after it, or `inline` right behind it) and
    /// waits until the device consumed it.
    fn send(&mut self, op: u16, src_port: u32, len: u32, inline: &[u8]) {
        let b = TX_HDR;
        let sent = if inline.is_empty() { len } else { inline.len() as u32 };
        let hdr = VsockHdr {
            src_cid: self.cid,
            src_port,
            dst_port: 5002,
            len: sent,
            op,
            flags: 0,
            buf_alloc: 65536,
            fwd_cnt: 0,
        };
        hdr.write(b);
        for (i, v) in inline.iter().enumerate() {
            w8(b + 44 + i as u64, *v);
        }
        if len > 0 {
            self.tx.set_desc(0, b, 44, F_NEXT, 1);
            self.tx.set_desc(1, DATA, len, 0, 0);
        } else {
            self.tx.set_desc(0, b, 44 + inline.len() as u32, 0, 0);
        }
        self.tx.publish(0);
        if self.tx.wait_used(2_000_000).is_none() {
            puts("tx stuck\n");
            reset();
        }
    }

    /// The op of the next packet for `port`, if one came within `spins` polls.
    fn recv_op(&mut self, port: u32, spins: u32) -> Option<u16> {
        for _ in 0..spins {
            let (id, _) = self.rx.poll_used()?;
            let b = RX_BUF + id as u64 * 0x1000;
            let (op, dst) = (r16(b + 30), r32(b + 20));
            self.rx.publish(id as u16);
            if dst == port {
                return Some(op);
            }
        }
        None
    }

    fn wait_op(&mut self, port: u32) -> u16 {
        for _ in 0..2_000_000u32 {
            if let Some(op) = self.recv_op(port, 1) {
                return op;
            }
        }
        puts("rx timeout\n");
        reset()
    }
}

#[no_mangle]
pub extern "C" fn _start() -> ! {
    let base = find_device(TYPE_VSOCK);
    if base == 0 || !negotiate(base) {
        puts("no vsock\n");
        reset();
    }
    let mut vs = Vs { rx: Vq::new(base, 0, 0x40_0000, NRX), tx: Vq::new(base, 1, 0x40_1000, 8), cid: 0 };
    let ev = Vq::new(base, 2, 0x40_2000, 8);
    if !vs.rx.setup() || !vs.tx.setup() || !ev.setup() || !driver_ok(base) {
        puts("vsock setup failed\n");
        reset();
    }
    vs.cid = r64(base + CONFIG);
    for i in 0..NRX {
        vs.rx.set_desc(i, RX_BUF + i as u64 * 0x1000, 4096, F_WRITE, 0);
        vs.rx.publish(i);
    }

    vs.send(OP_REQUEST, 3000, 0, &[]);
    if vs.wait_op(3000) != OP_RESPONSE {
        puts("connect refused\n");
        reset();
    }
    puts("connected\n");
    let mut sent = 0u64;
    let mut reset_seen = false;
    while sent < 64 {
        vs.send(OP_RW, 3000, CHUNK, &[]);
        sent += 1;
        if vs.recv_op(3000, 64) == Some(OP_RST) {
            reset_seen = true;
            break;
        }
    }
    while !reset_seen {
        match vs.wait_op(3000) {
            OP_RST => reset_seen = true,
            _ => continue,
        }
    }
    puts("overrun reset after ");
    put_hex(sent);
    puts(" packets\n");

    vs.send(OP_REQUEST, 3001, 0, &[]);
    if vs.wait_op(3001) != OP_RESPONSE {
        puts("second connect refused\n");
        reset();
    }
    vs.send(OP_RW, 3001, 0, b"second ok\n");
    puts("second connection ok\n");
    reset()
}
