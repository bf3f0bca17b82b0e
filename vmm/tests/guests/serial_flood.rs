//! Writes 100000 bytes to the serial port as fast as it can (lines of 63 letters), then resets.
#![no_std]
#![no_main]

mod common;
use common::*;

const BYTES: u32 = 100_000;

#[no_mangle]
pub extern "C" fn _start() -> ! {
    puts("serial flood start\n");
    for i in 0..BYTES {
        outb(0x3f8, if i % 64 == 63 { b'\n' } else { b'a' + (i % 26) as u8 });
    }
    puts("serial flood done\n");
    reset()
}
