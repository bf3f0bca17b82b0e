//! Reads sector 0 of a virtio-blk disk, prints it, and writes it back to sector 1 with "GUEST"
//! over its first bytes.
#![no_std]
#![no_main]

mod common;
use common::*;

const HDR: u64 = 0x41_0000;
const DATA: u64 = 0x41_1000;
const STATUS_BYTE: u64 = 0x41_2000;

fn request(vq: &mut Vq, kind: u32, sector: u64) -> u8 {
    w32(HDR, kind);
    w32(HDR + 4, 0);
    w64(HDR + 8, sector);
    w8(STATUS_BYTE, 0xff);
    let data_flags = if kind == 0 { F_NEXT | F_WRITE } else { F_NEXT };
    vq.set_desc(0, HDR, 16, F_NEXT, 1);
    vq.set_desc(1, DATA, 512, data_flags, 2);
    vq.set_desc(2, STATUS_BYTE, 1, F_WRITE, 0);
    vq.publish(0);
    if vq.wait_used(2_000_000).is_none() {
        puts("blk timeout\n");
        reset();
    }
    r8(STATUS_BYTE)
}

#[no_mangle]
pub extern "C" fn _start() -> ! {
    let base = find_device(2);
    if base == 0 || !negotiate(base) {
        puts("no blk\n");
        reset();
    }
    let mut vq = Vq::new(base, 0, 0x40_0000, 8);
    if !vq.setup() || !driver_ok(base) {
        puts("blk setup failed\n");
        reset();
    }
    if request(&mut vq, 0, 0) != 0 {
        puts("read failed\n");
        reset();
    }
    puts("read ok: ");
    for i in 0..16 {
        outb(0x3f8, r8(DATA + i));
    }
    puts("\n");
    for (i, b) in b"GUEST".iter().enumerate() {
        w8(DATA + i as u64, *b);
    }
    if request(&mut vq, 1, 1) != 0 {
        puts("write failed\n");
        reset();
    }
    puts("write ok\n");
    reset()
}
