//! Finds each virtio-mmio device by magic and id, negotiates features and sets up its queues.
#![no_std]
#![no_main]

mod common;
use common::*;

fn bring_up(id: u32, queues: u32) {
    let base = find_device(id);
    if base == 0 {
        puts("missing device ");
        put_hex(id as u64);
        puts("\n");
        return;
    }
    puts("found id ");
    put_hex(id as u64);
    puts(" at ");
    put_hex(base);
    puts(" version ");
    put_hex(r32(base + VERSION) as u64);
    puts("\n");
    if !negotiate(base) {
        puts("features refused\n");
        return;
    }
    puts("features ok\n");
    for q in 0..queues {
        let vq = Vq::new(base, q, 0x40_0000 + (id as u64) * 0x1_0000 + (q as u64) * 0x1000, 8);
        if !vq.setup() {
            puts("queue setup failed\n");
            return;
        }
    }
    puts("queues ok\n");
    if driver_ok(base) {
        puts("driver ok\n");
    }
}

#[no_mangle]
pub extern "C" fn _start() -> ! {
    bring_up(2, 1);
    bring_up(19, 3);
    reset()
}
