//! Misbehaves on virtio-net: a TX descriptor outside guest memory, a chain longer than the
//! cap, a vnet header whose checksum offset lies beyond the frame, and an avail index jump.
//! After each fault it expects DEVICE_NEEDS_RESET and resets; then it proves the device serves
//! again with a datagram the test's listener must receive, and idles so the test can talk to
//! the VMM's API.
#![no_std]
#![no_main]

mod common;
mod netdev;
use common::*;
use netdev::*;

/// Big enough for a chain one descriptor longer than the device's cap of 64.
const TX_SIZE: u16 = 128;

fn up(base: u64) -> Net {
    match Net::up(base, F_MAC | F_CSUM, TX_SIZE) {
        Some(n) => n,
        None => {
            puts("net setup failed\n");
            reset()
        }
    }
}

/// Waits until the device reports NEEDS_RESET and prints the status.
fn expect_needs_reset(base: u64, what: &str) {
    let mut s = 0;
    for _ in 0..200_000 {
        s = r32(base + STATUS);
        if s & 0x40 != 0 {
            break;
        }
    }
    puts(what);
    puts(" status=");
    put_hex(s as u64);
    puts("\n");
}

#[no_mangle]
pub extern "C" fn _start() -> ! {
    let base = find_device(TYPE_NET);
    if base == 0 {
        puts("no net\n");
        reset();
    }

    let mut net = up(base);
    net.tx.set_desc(0, 0x7fff_ffff_f000, 64, 0, 0);
    net.tx.publish(0);
    expect_needs_reset(base, "net out-of-range");

    let mut net = up(base);
    let n = 65u16;
    for i in 0..n {
        let flags = if i + 1 < n { F_NEXT } else { 0 };
        net.tx.set_desc(i, TX_BUF + i as u64 * 16, 16, flags, i + 1);
    }
    net.tx.publish(0);
    expect_needs_reset(base, "net long chain");

    let mut net = up(base);
    if net.features & F_CSUM == 0 {
        puts("csum not offered\n");
    }
    let len = net.build_udp(b"lie");
    w8(TX_BUF, 1); // NEEDS_CSUM
    w16(TX_BUF + 6, 1000); // csum_start
    w16(TX_BUF + 8, 6); // csum_offset
    net.tx.set_desc(0, TX_BUF, len, 0, 0);
    net.tx.publish(0);
    expect_needs_reset(base, "net lying header");

    let net = up(base);
    w16(net.tx.avail + 2, 1000);
    w32(base + QUEUE_NOTIFY, 1);
    expect_needs_reset(base, "net avail jump");

    let mut net = up(base);
    let len = net.build_udp(b"still alive");
    if net.send(len) {
        puts("net recovered\n");
    }
    puts("net hostile done\n");
    loop {
        unsafe { core::arch::asm!("hlt", options(nomem, nostack)) }
    }
}
