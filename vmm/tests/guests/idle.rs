//! Says it is up, then halts forever (interrupts are off, so nothing wakes it).
#![no_std]
#![no_main]

mod common;

#[no_mangle]
pub extern "C" fn _start() -> ! {
    common::puts("idle guest up\n");
    loop {
        unsafe { core::arch::asm!("hlt", options(nomem, nostack)) }
    }
}
