//! Speaks FUSE to the virtio-fs device's backend over the request queue: INIT, then LOOKUP, OPEN
//! and READ of `hello.txt`, printing what it read; then LOOKUP of `..` from the root and of names
//! through it. If the shared directory holds `reset`, it then resets the device, sets it up again
//! and looks the file up once more. If it holds `loop`, it re-reads the file until the device
//! fails (the test kills the backend) and prints heartbeats, showing it still runs.
//!
//! With a vsock device at the template CID, it is a template: once the fs driver is ready (and nothing sent),
//! it posts vsock event buffers, says `waiting for restore` and sends FUSE only after the
//! device reports a transport reset, which a restored VM's vsock does.
#![no_std]
#![no_main]

mod common;
use common::*;

const TYPE_FS: u32 = 26;
const STATUS_NEEDS_RESET: u32 = 0x40;
const IN: u64 = 0x41_0000;
const OUT: u64 = 0x42_0000;
const OUT_LEN: u32 = 4096;
const BODY: u64 = IN + 40;
const FUSE_LOOKUP: u32 = 1;
const FUSE_OPEN: u32 = 14;
const FUSE_READ: u32 = 15;
const FUSE_INIT: u32 = 26;
const ROOT: u64 = 1;
/// Polls between two status reads, and status reads before a request times out.
const POLLS: u32 = 100;
const ROUNDS: u32 = 100_000;
const LOOP_READS: u32 = 1_000_000;

enum Reply {
    /// The FUSE error (0 or a negative errno) and the reply's length.
    Done(i32, u32),
    DeviceFailed(u32),
    Timeout,
}

struct Fuse {
    base: u64,
    rq: Vq,
    unique: u64,
}

impl Fuse {
    /// Sends the request whose body (`body_len` bytes) is already at BODY; waits for the reply
    /// at OUT, the device failing, or the guest's own timeout.
    fn call(&mut self, opcode: u32, nodeid: u64, body_len: u32) -> Reply {
        self.unique += 1;
        w32(IN, 40 + body_len);
        w32(IN + 4, opcode);
        w64(IN + 8, self.unique);
        w64(IN + 16, nodeid);
        w64(IN + 24, 0); // uid, gid
        w64(IN + 32, 1); // pid, extension length
        w64(OUT, 0);
        self.rq.set_desc(0, IN, 40 + body_len, F_NEXT, 1);
        self.rq.set_desc(1, OUT, OUT_LEN, F_WRITE, 0);
        self.rq.publish(0);
        for _ in 0..ROUNDS {
            if self.rq.wait_used(POLLS).is_some() {
                if r64(OUT + 8) != self.unique {
                    puts("reply for another request\n");
                    reset();
                }
                return Reply::Done(r32(OUT + 4) as i32, r32(OUT));
            }
            let s = r32(self.base + STATUS);
            if s & STATUS_NEEDS_RESET != 0 {
                return Reply::DeviceFailed(s);
            }
        }
        Reply::Timeout
    }

    fn lookup(&mut self, parent: u64, name: &[u8]) -> Reply {
        for (i, b) in name.iter().enumerate() {
            w8(BODY + i as u64, *b);
        }
        w8(BODY + name.len() as u64, 0);
        self.call(FUSE_LOOKUP, parent, name.len() as u32 + 1)
    }

    fn read(&mut self, nodeid: u64, fh: u64, size: u32) -> Reply {
        w64(BODY, fh);
        w64(BODY + 8, 0); // offset
        w32(BODY + 16, size);
        w32(BODY + 20, 0);
        w64(BODY + 24, 0);
        w64(BODY + 32, 0);
        self.call(FUSE_READ, nodeid, 40)
    }

    /// Prints the outcome of a request that had to succeed; on failure keeps running (heartbeat).
    fn expect_ok(&self, what: &str, reply: Reply) -> u32 {
        match reply {
            Reply::Done(0, len) => return len,
            Reply::Done(err, _) => {
                puts(what);
                puts(" error ");
                put_hex(err.unsigned_abs() as u64);
                puts("\n");
                reset()
            }
            Reply::DeviceFailed(s) => device_failed(self.base, what, s),
            Reply::Timeout => {
                puts(what);
                puts(" timed out\n");
                heartbeat(self.base)
            }
        }
    }
}

fn device_failed(base: u64, what: &str, status: u32) -> ! {
    puts(what);
    puts(": device failed status ");
    put_hex(status as u64);
    puts("\n");
    heartbeat(base)
}

/// Shows the vCPU still runs after the device failed; the test stops the VM meanwhile.
fn heartbeat(base: u64) -> ! {
    for i in 0..300u64 {
        puts("heartbeat ");
        put_hex(i);
        puts("\n");
        for _ in 0..20_000 {
            r32(base + STATUS);
        }
    }
    reset()
}

/// Prints `label` then the outcome of a LOOKUP: the node it found, or the errno.
fn show_lookup(fuse: &Fuse, label: &str, reply: Reply) -> u64 {
    puts(label);
    match reply {
        Reply::Done(0, _) => {
            let node = r64(OUT + 16);
            puts(" nodeid ");
            put_hex(node);
            puts("\n");
            node
        }
        Reply::Done(err, _) => {
            puts(" error ");
            put_hex(err.unsigned_abs() as u64);
            puts("\n");
            0
        }
        Reply::DeviceFailed(s) => device_failed(fuse.base, label, s),
        Reply::Timeout => {
            puts(" timed out\n");
            heartbeat(fuse.base)
        }
    }
}

#[no_mangle]
pub extern "C" fn _start() -> ! {
    let base = find_device(TYPE_FS);
    if base == 0 || !negotiate(base) {
        puts("no fs\n");
        reset();
    }
    puts("fs tag ");
    for i in 0..36 {
        let b = r8(base + CONFIG + i);
        if b == 0 {
            break;
        }
        outb(0x3f8, b);
    }
    puts(" queues ");
    put_hex(r32(base + CONFIG + 36) as u64);
    puts("\n");
    let hiprio = Vq::new(base, 0, 0x40_0000, 8);
    let rq = Vq::new(base, 1, 0x40_1000, 8);
    if !hiprio.setup() || !rq.setup() || !driver_ok(base) {
        puts("fs setup failed\n");
        reset();
    }
    let status = r32(base + STATUS);
    if status & STATUS_NEEDS_RESET != 0 {
        device_failed(base, "driver ok", status);
    }
    puts("driver ok\n");
    wait_for_restore();
    let mut fuse = Fuse { base, rq, unique: 0 };

    w32(BODY, 7); // major
    w32(BODY + 4, 31); // minor
    w32(BODY + 8, 0); // max_readahead
    w32(BODY + 12, 0); // flags
    let reply = fuse.call(FUSE_INIT, 0, 16);
    fuse.expect_ok("init", reply);
    puts("init ");
    put_hex(r32(OUT + 16) as u64);
    puts(".");
    put_hex(r32(OUT + 20) as u64);
    puts("\n");

    let reply = fuse.lookup(ROOT, b"hello.txt");
    let file = show_lookup(&fuse, "hello.txt", reply);
    w32(BODY, 0); // O_RDONLY
    w32(BODY + 4, 0);
    let reply = fuse.call(FUSE_OPEN, file, 8);
    fuse.expect_ok("open", reply);
    let fh = r64(OUT + 16);
    let reply = fuse.read(file, fh, 256);
    let len = fuse.expect_ok("read", reply);
    puts("data<");
    for i in 0..len.saturating_sub(16) as u64 {
        outb(0x3f8, r8(OUT + 16 + i));
    }
    puts(">\n");

    let reply = fuse.lookup(ROOT, b"..");
    let up = show_lookup(&fuse, "..", reply);
    let reply = fuse.lookup(up, b"hello.txt");
    show_lookup(&fuse, "../hello.txt", reply);
    let reply = fuse.lookup(up, b"outside.txt");
    show_lookup(&fuse, "../outside.txt", reply);

    if let Reply::Done(0, _) = fuse.lookup(ROOT, b"reset") {
        // A driver reset stops the vrings; fresh ones on the same backend session serve again.
        if !negotiate(base) {
            puts("renegotiation refused\n");
            reset();
        }
        let hiprio = Vq::new(base, 0, 0x40_2000, 8);
        fuse.rq = Vq::new(base, 1, 0x40_3000, 8);
        if !hiprio.setup() || !fuse.rq.setup() || !driver_ok(base) {
            puts("fs setup after reset failed\n");
            reset();
        }
        let reply = fuse.lookup(ROOT, b"hello.txt");
        show_lookup(&fuse, "after reset hello.txt", reply);
    }
    if let Reply::Done(0, _) = fuse.lookup(ROOT, b"loop") {
        puts("looping\n");
        for _ in 0..LOOP_READS {
            let reply = fuse.read(file, fh, 256);
            fuse.expect_ok("loop read", reply);
        }
        puts("loop bound reached\n");
    }
    puts("fs done\n");
    reset()
}
