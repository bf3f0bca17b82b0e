//! Stands in for the agent where a test or bench needs a pod sandbox that gets ready: listens on
//! vsock port 1024 and answers the shim's ttrpc calls as an agent with nothing to run would.
//! - `Version`: protocol 1, mode "stub".
//! - `GetOomEvent` and `WaitProcess` (long polls): never answered.
//! - every other call: OK, with an empty message (which protobuf decodes as all defaults).
//!
//! Other ports are refused. A transport reset (what a restored VM's vsock sends first) drops
//! every connection. Stops the VM after `IDLE_TSC` TSC ticks with no packet, so a VM nobody
//! stops does not spin forever; a pause or snapshot in between does not count.
#![no_std]
#![no_main]

mod common;
use common::*;

const RX_BUF: u64 = 0x41_0000;
const TX_BUF: u64 = 0x42_0000;
const EV_BUF: u64 = 0x43_0000;
/// Each connection's reassembly buffer: ttrpc frames arrive split across packets.
const CONN_BUF: u64 = 0x50_0000;
const CONN_BUF_SIZE: usize = 0x4000;
const CONNS: usize = 4;
const QSIZE: u16 = 8;
const RX_BUFS: u16 = 4;
const EV_BUFS: u16 = 2;
const HDR: u64 = VSOCK_HDR;

const AGENT_PORT: u32 = 1024;
/// What the stub tells the host it can buffer per connection.
const BUF_ALLOC: u32 = CONN_BUF_SIZE as u32;

const TTRPC_HDR: usize = 10;
const TTRPC_REQUEST: u8 = 1;
const TTRPC_RESPONSE: u8 = 2;

/// About 30 s at a 3.3 GHz TSC, longer at slower ones.
const IDLE_TSC: u64 = 100_000_000_000;
/// A gap this long between two polls means the VM was paused or snapshotted, not idle.
const PAUSE_TSC: u64 = 1_000_000_000;

fn rdtsc() -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: rdtsc reads the time-stamp counter into two registers and touches no memory.
    unsafe { core::arch::asm!("rdtsc", out("eax") lo, out("edx") hi, options(nomem, nostack)) }
    (hi as u64) << 32 | lo as u64
}

#[derive(Clone, Copy)]
struct Conn {
    live: bool,
    /// The host's port.
    port: u32,
    /// Bytes of this connection taken from the host so far (the vsock `fwd_cnt`).
    fwd: u32,
    /// Bytes waiting in the reassembly buffer.
    held: usize,
}

const NO_CONN: Conn = Conn { live: false, port: 0, fwd: 0, held: 0 };

struct Vs {
    rx: Vq,
    tx: Vq,
    ev: Vq,
    cid: u64,
    sent: u16,
    conns: [Conn; CONNS],
}

impl Vs {
    /// Sends a packet from the agent's port to the host's `port`; `data` follows the header.
    fn send(&mut self, op: u16, port: u32, fwd: u32, data: &[u8]) {
        while self.tx.poll_used().is_some() {}
        if self.sent.wrapping_sub(self.tx.used_seen) >= QSIZE && self.tx.wait_used(2_000_000).is_none() {
            puts("tx stuck\n");
            reset();
        }
        let slot = self.sent % QSIZE;
        let b = TX_BUF + slot as u64 * 0x1000;
        let len = data.len() as u32;
        VsockHdr {
            src_cid: self.cid,
            src_port: AGENT_PORT,
            dst_port: port,
            len,
            op,
            flags: 0,
            buf_alloc: BUF_ALLOC,
            fwd_cnt: fwd,
        }
        .write(b);
        for (i, v) in data.iter().enumerate() {
            w8(b + HDR + i as u64, *v);
        }
        self.tx.set_desc(slot, b, HDR as u32 + data.len() as u32, 0, 0);
        self.tx.publish(slot);
        self.sent = self.sent.wrapping_add(1);
    }

    fn find(&self, port: u32) -> Option<usize> {
        self.conns.iter().position(|c| c.live && c.port == port)
    }

    /// Handles one packet from the host (header at `b`).
    fn packet(&mut self, b: u64) {
        let op = r16(b + 30);
        let port = r32(b + 16);
        let dst = r32(b + 20);
        let len = r32(b + 24) as usize;
        let conn = self.find(port);
        match (op, conn) {
            (OP_REQUEST, _) => {
                let free = conn.or_else(|| self.conns.iter().position(|c| !c.live));
                match free {
                    Some(i) if dst == AGENT_PORT => {
                        self.conns[i] = Conn { live: true, port, fwd: 0, held: 0 };
                        self.send(OP_RESPONSE, port, 0, &[]);
                    }
                    _ => self.send(OP_RST, port, 0, &[]),
                }
            }
            (OP_RW, Some(i)) => {
                let c = &mut self.conns[i];
                c.fwd = c.fwd.wrapping_add(len as u32);
                if c.held + len > CONN_BUF_SIZE || len > 0x1000 - HDR as usize {
                    // More than a frame this stub takes: the host gets a reset, not a reply.
                    self.conns[i] = NO_CONN;
                    self.send(OP_RST, port, 0, &[]);
                    return;
                }
                let at = CONN_BUF + (i * CONN_BUF_SIZE) as u64;
                for k in 0..len {
                    w8(at + (c.held + k) as u64, r8(b + HDR + k as u64));
                }
                c.held += len;
                if !self.serve_frames(i) {
                    self.conns[i] = NO_CONN;
                    self.send(OP_RST, port, 0, &[]);
                }
            }
            (OP_CREDIT_REQUEST, Some(i)) => {
                let fwd = self.conns[i].fwd;
                self.send(OP_CREDIT_UPDATE, port, fwd, &[]);
            }
            (OP_SHUTDOWN, Some(i)) => {
                self.conns[i] = NO_CONN;
                self.send(OP_RST, port, 0, &[]);
            }
            (OP_RST, Some(i)) => self.conns[i] = NO_CONN,
            (OP_RST | OP_CREDIT_UPDATE, None) | (OP_CREDIT_UPDATE, Some(_)) => {}
            (_, _) => self.send(OP_RST, port, 0, &[]),
        }
    }

    /// Answers every whole ttrpc frame at the front of connection `i`'s buffer; false if the
    /// host broke the framing.
    fn serve_frames(&mut self, i: usize) -> bool {
        let at = CONN_BUF + (i * CONN_BUF_SIZE) as u64;
        loop {
            let held = self.conns[i].held;
            if held < TTRPC_HDR {
                return true;
            }
            let len = be32(at) as usize;
            if len > CONN_BUF_SIZE - TTRPC_HDR {
                return false;
            }
            if held < TTRPC_HDR + len {
                return true;
            }
            let stream = be32(at + 4);
            if r8(at + 8) == TTRPC_REQUEST {
                if let Some(reply) = reply_to(method(at + TTRPC_HDR as u64, len)) {
                    let mut frame = [0u8; TTRPC_HDR + 16];
                    frame[..4].copy_from_slice(&(reply.len() as u32).to_be_bytes());
                    frame[4..8].copy_from_slice(&stream.to_be_bytes());
                    frame[8] = TTRPC_RESPONSE;
                    frame[TTRPC_HDR..TTRPC_HDR + reply.len()].copy_from_slice(reply);
                    let (port, fwd) = (self.conns[i].port, self.conns[i].fwd);
                    self.send(OP_RW, port, fwd, &frame[..TTRPC_HDR + reply.len()]);
                }
            }
            let used = TTRPC_HDR + len;
            for k in 0..held - used {
                w8(at + k as u64, r8(at + (used + k) as u64));
            }
            self.conns[i].held = held - used;
        }
    }
}

fn be32(addr: u64) -> u32 {
    u32::from_be_bytes([r8(addr), r8(addr + 1), r8(addr + 2), r8(addr + 3)])
}

/// Reads a protobuf varint at `*pos` (below `end`).
fn varint(pos: &mut u64, end: u64) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        if *pos >= end {
            return None;
        }
        let b = r8(*pos);
        *pos += 1;
        v |= ((b & 0x7f) as u64) << shift;
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// Where the `method` field (2) of the ttrpc `Request` at `at` (`len` bytes) is, and its length.
fn method(at: u64, len: usize) -> Option<(u64, usize)> {
    let (mut pos, end) = (at, at + len as u64);
    while pos < end {
        let tag = varint(&mut pos, end)?;
        match tag & 7 {
            0 => {
                varint(&mut pos, end)?;
            }
            1 => pos += 8,
            2 => {
                let n = varint(&mut pos, end)?;
                if n > end - pos {
                    return None;
                }
                if tag >> 3 == 2 {
                    return Some((pos, n as usize));
                }
                pos += n;
            }
            5 => pos += 4,
            _ => return None,
        }
    }
    None
}

fn is(found: (u64, usize), name: &[u8]) -> bool {
    found.1 == name.len() && name.iter().enumerate().all(|(k, c)| r8(found.0 + k as u64) == *c)
}

/// A ttrpc `Response` for the call to `method`: its status (OK) and payload. `None`: no answer.
fn reply_to(method: Option<(u64, usize)>) -> Option<&'static [u8]> {
    // status {} then payload VersionResponse { protocol_version: 1, mode: "stub" }
    const VERSION: &[u8] = &[0x0a, 0x00, 0x12, 0x08, 0x08, 0x01, 0x1a, 0x04, b's', b't', b'u', b'b'];
    const EMPTY: &[u8] = &[0x0a, 0x00];
    let found = method?;
    if is(found, b"Version") {
        Some(VERSION)
    } else if is(found, b"GetOomEvent") || is(found, b"WaitProcess") {
        None
    } else {
        Some(EMPTY)
    }
}

#[no_mangle]
pub extern "C" fn _start() -> ! {
    let base = find_device(TYPE_VSOCK);
    if base == 0 || !negotiate(base) {
        puts("no vsock\n");
        reset();
    }
    let mut vs = Vs {
        rx: Vq::new(base, 0, 0x40_0000, QSIZE),
        tx: Vq::new(base, 1, 0x40_1000, QSIZE),
        ev: Vq::new(base, 2, 0x40_2000, QSIZE),
        cid: r32(base + CONFIG) as u64 | (r32(base + CONFIG + 4) as u64) << 32,
        sent: 0,
        conns: [NO_CONN; CONNS],
    };
    if !vs.rx.setup() || !vs.tx.setup() || !vs.ev.setup() || !driver_ok(base) {
        puts("vsock setup failed\n");
        reset();
    }
    for i in 0..RX_BUFS {
        vs.rx.set_desc(i, RX_BUF + i as u64 * 0x1000, 0x1000, F_WRITE, 0);
        vs.rx.publish(i);
    }
    for i in 0..EV_BUFS {
        vs.ev.set_desc(i, EV_BUF + i as u64 * 0x100, 8, F_WRITE, 0);
        vs.ev.publish(i);
    }
    // The agent's words once it listens: the shim's template builder snapshots a VM here.
    puts("listening (vsock) port=1024 (agent stub)\n");
    let (mut last, mut active) = (rdtsc(), rdtsc());
    loop {
        let now = rdtsc();
        if now.wrapping_sub(last) > PAUSE_TSC {
            active = now;
        }
        last = now;
        if let Some((id, _)) = vs.ev.poll_used() {
            puts("transport reset\n");
            vs.conns = [NO_CONN; CONNS];
            vs.ev.publish(id as u16);
            active = now;
        }
        if let Some((id, _)) = vs.rx.poll_used() {
            vs.packet(RX_BUF + id as u64 * 0x1000);
            vs.rx.publish(id as u16);
            active = now;
        }
        if now.wrapping_sub(active) > IDLE_TSC {
            puts("agent stub: idle, stopping\n");
            reset();
        }
    }
}
