//! Brings up virtio-net, prints the MAC, MTU and link from the config space, sends one UDP
//! datagram through the device and the tap to the test's echo listener, and prints the reply.
//! With a vsock device at the template CID (`common::TEMPLATE_CID`), it is a template: it sends
//! only once restored (`wait_for_restore`); a template whose link was down waits for the config
//! interrupt that says it is up.
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
    let Some(mut net) = Net::up(base, F_MAC | F_MTU | F_STATUS, 8) else {
        puts("net setup failed\n");
        reset()
    };
    puts("net mac ");
    put_mac(&net.mac);
    puts(" mtu=");
    put_hex(r16(base + CONFIG + 10) as u64);
    let was_up = link_up(base);
    puts(if was_up { " link up\n" } else { " link down\n" });
    wait_for_restore();
    if !was_up {
        await_link_up(base);
    }
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

fn link_up(base: u64) -> bool {
    r16(base + LINK_STATUS) & 1 == 1
}

/// Until the device says the config changed and the link is up (acking the interrupt), or stops.
fn await_link_up(base: u64) {
    for _ in 0..LINK_SPINS {
        if r32(base + INTERRUPT_STATUS) & INT_CONFIG != 0 {
            w32(base + INTERRUPT_ACK, INT_CONFIG);
            if link_up(base) {
                puts("link up\n");
                return;
            }
            puts("config changed, link still down\n");
            reset();
        }
    }
    puts("no link change\n");
    reset()
}
