//! Writes the VMM's debug-only panic probe port (0xbad), says so, then halts forever (interrupts
//! are off, so nothing wakes it): the VMM under test must exit on its own.
#![no_std]
#![no_main]

mod common;
use common::*;

#[no_mangle]
pub extern "C" fn _start() -> ! {
    puts("probe start\n");
    outb(0xbad, 1);
    puts("probe written\n");
    loop {
        unsafe { core::arch::asm!("hlt", options(nomem, nostack)) }
    }
}
