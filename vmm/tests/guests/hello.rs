//! Writes a line to the serial port and resets through the i8042.
#![no_std]
#![no_main]

mod common;

#[no_mangle]
pub extern "C" fn _start() -> ! {
    common::puts("hello from the bulkhead test guest\n");
    common::reset()
}
