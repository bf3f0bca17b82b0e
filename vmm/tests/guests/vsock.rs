//! Phase 1: echo server on vsock port 1024 until the host hangs up.
//! Phase 2: connect to host port 5000, send a line, shut down.
#![no_std]
#![no_main]

mod common;
use common::*;

const RX_BUF: u64 = 0x41_0000;
const TX_BUF: u64 = 0x42_0000;
const NBUF: u16 = 4;

struct Vs {
    rx: Vq,
    tx: Vq,
    cid: u64,
    sent: u16,
    fwd: u32,
}

impl Vs {
    /// Sends a packet; `data` is copied after the header.
    fn send(&mut self, op: u16, src_port: u32, dst_port: u32, data: &[u8], flags: u32) {
        while self.tx.poll_used().is_some() {}
        if self.sent.wrapping_sub(self.tx.used_seen) >= 8 && self.tx.wait_used(2_000_000).is_none() {
            puts("tx stuck\n");
            reset();
        }
        let slot = self.sent % 8;
        let b = TX_BUF + slot as u64 * 0x1000;
        let len = data.len() as u32;
        VsockHdr { src_cid: self.cid, src_port, dst_port, len, op, flags, buf_alloc: 65536, fwd_cnt: self.fwd }
            .write(b);
        for (i, v) in data.iter().enumerate() {
            w8(b + 44 + i as u64, *v);
        }
        self.tx.set_desc(slot, b, 44 + data.len() as u32, 0, 0);
        self.tx.publish(slot);
        self.sent = self.sent.wrapping_add(1);
    }

    /// Waits for the next RX packet; returns its buffer address and descriptor id.
    fn recv(&mut self) -> (u64, u16) {
        match self.rx.wait_used(5_000_000) {
            Some((id, _)) => (RX_BUF + id as u64 * 0x1000, id as u16),
            None => {
                puts("rx timeout\n");
                reset()
            }
        }
    }
}

#[no_mangle]
pub extern "C" fn _start() -> ! {
    let base = find_device(19);
    if base == 0 || !negotiate(base) {
        puts("no vsock\n");
        reset();
    }
    let mut vs = Vs {
        rx: Vq::new(base, 0, 0x40_0000, 8),
        tx: Vq::new(base, 1, 0x40_1000, 8),
        cid: r64(base + CONFIG),
        sent: 0,
        fwd: 0,
    };
    let ev = Vq::new(base, 2, 0x40_2000, 8);
    if !vs.rx.setup() || !vs.tx.setup() || !ev.setup() || !driver_ok(base) {
        puts("vsock setup failed\n");
        reset();
    }
    for i in 0..NBUF {
        vs.rx.set_desc(i, RX_BUF + i as u64 * 0x1000, 4096, F_WRITE, 0);
        vs.rx.publish(i);
    }
    puts("vsock ready cid ");
    put_hex(vs.cid);
    puts("\n");

    let mut echo = [0u8; 256];
    loop {
        let (b, id) = vs.recv();
        let op = r16(b + 30);
        let src_port = r32(b + 16);
        let dst_port = r32(b + 20);
        let len = r32(b + 24) as usize;
        if op == OP_REQUEST {
            vs.send(OP_RESPONSE, dst_port, src_port, &[], 0);
            puts("accepted\n");
        } else if op == OP_RW {
            let n = if len < echo.len() { len } else { echo.len() };
            for (i, slot) in echo.iter_mut().enumerate().take(n) {
                *slot = r8(b + 44 + i as u64);
            }
            vs.fwd = vs.fwd.wrapping_add(len as u32);
            vs.send(OP_RW, dst_port, src_port, &echo[..n], 0);
        } else if op == OP_SHUTDOWN {
            vs.send(OP_RST, dst_port, src_port, &[], 0);
            vs.rx.publish(id);
            break;
        }
        vs.rx.publish(id);
    }
    puts("echo done\n");

    vs.fwd = 0;
    vs.send(OP_REQUEST, 2000, 5000, &[], 0);
    loop {
        let (b, id) = vs.recv();
        let op = r16(b + 30);
        vs.rx.publish(id);
        if op == OP_RESPONSE {
            break;
        }
        if op == OP_RST {
            puts("connect refused\n");
            reset();
        }
    }
    vs.send(OP_RW, 2000, 5000, b"hello from guest\n", 0);
    vs.send(OP_SHUTDOWN, 2000, 5000, &[], 3);
    loop {
        let (b, id) = vs.recv();
        vs.rx.publish(id);
        if r16(b + 30) == OP_RST {
            break;
        }
    }
    puts("vsock done\n");
    reset()
}
