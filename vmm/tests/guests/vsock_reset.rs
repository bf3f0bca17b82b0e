//! Sets up vsock with event buffers posted, says so, then waits (bounded) for an event on the
//! event queue and prints its id: after a snapshot and restore, the device sends
//! TRANSPORT_RESET (id 0). Resets when done or when no event came in time.
#![no_std]
#![no_main]

mod common;
use common::*;

const EV_BUF: u64 = 0x43_0000;
const EV_BUFS: u16 = 2;
/// Polls of the event queue before giving up (tens of seconds under the PVM emulator).
const SPINS: u32 = 2_000_000;

#[no_mangle]
pub extern "C" fn _start() -> ! {
    let base = find_device(19);
    if base == 0 || !negotiate(base) {
        puts("no vsock\n");
        reset();
    }
    let rx = Vq::new(base, 0, 0x40_0000, 8);
    let tx = Vq::new(base, 1, 0x40_1000, 8);
    let mut ev = Vq::new(base, 2, 0x40_2000, 8);
    if !rx.setup() || !tx.setup() || !ev.setup() || !driver_ok(base) {
        puts("vsock setup failed\n");
        reset();
    }
    for i in 0..EV_BUFS {
        w32(EV_BUF + i as u64 * 0x100, 0xffff_ffff);
        ev.set_desc(i, EV_BUF + i as u64 * 0x100, 8, F_WRITE, 0);
        ev.publish(i);
    }
    // The agent's words once it listens, so that the shim's template builder takes this guest too.
    puts("listening (vsock): vsock ready\n");
    match ev.wait_used(SPINS) {
        Some((id, len)) => {
            puts("event ");
            put_hex(r32(EV_BUF + id as u64 * 0x100) as u64);
            puts(" len ");
            put_hex(len as u64);
            puts("\n");
        }
        None => puts("no event\n"),
    }
    reset()
}
