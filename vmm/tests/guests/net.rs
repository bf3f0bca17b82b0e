//! Brings up virtio-net, prints the MAC and MTU from the config space, sends one UDP datagram
//! through the device and the tap to the test's echo listener, and prints the reply. With a
//! vsock device at the template CID (`common::TEMPLATE_CID`), it is a template: it sends only
//! once restored (`wait_for_restore`).
#![no_std]
#![no_main]

mod common;
mod netdev;
use common::*;
use netdev::*;

#[no_mangle]
pub extern "C" fn _start() -> ! {
    let base = find_device(TYPE_NET);
    if base == 0 {
        puts("no net\n");
        reset();
    }
    let Some(mut net) = Net::up(base, F_MAC | F_MTU, 8) else {
        puts("net setup failed\n");
        reset()
    };
    puts("net mac ");
    put_mac(&net.mac);
    puts(" mtu=");
    put_hex(r16(base + CONFIG + 10) as u64);
    puts("\n");
    wait_for_restore();
    let len = net.build_udp(b"hello from guest");
    if !net.send(len) {
        puts("tx timeout\n");
        reset();
    }
    puts("sent\n");
    match net.recv_udp() {
        Some((payload, n)) => {
            puts("reply: ");
            for i in 0..n.min(64) {
                outb(0x3f8, r8(payload + i));
            }
            puts("\n");
        }
        None => puts("no reply\n"),
    }
    reset()
}
