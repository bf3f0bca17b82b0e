//! Counts: keeps a counter in guest memory and prints `count <hex>` after each step, with a short
//! busy wait between steps; stops with a reset after LIMIT steps. Snapshot tests restore it
//! mid-count and check that it carries on from where it was.
#![no_std]
#![no_main]

mod common;
use common::*;

/// The counter lives in guest RAM, not only in a register, so a restore must bring memory back.
const COUNTER: u64 = 0x50_0000;
const LIMIT: u64 = 100_000;
/// Busy-wait iterations between lines (a few ms each under the PVM instruction emulator).
const DELAY: u32 = 2_000;

#[no_mangle]
pub extern "C" fn _start() -> ! {
    w64(COUNTER, 0);
    puts("counter up\n");
    loop {
        let n = r64(COUNTER) + 1;
        w64(COUNTER, n);
        puts("count ");
        put_hex(n);
        puts("\n");
        if n >= LIMIT {
            puts("count done\n");
            reset();
        }
        for _ in 0..DELAY {
            unsafe { core::arch::asm!("nop", options(nomem, nostack)) }
        }
    }
}
