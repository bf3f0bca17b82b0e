//! Stands in for the agent at the moment a template is snapshotted: says what the agent says
//! once it listens, then halts forever (interrupts are off, so nothing wakes it).
#![no_std]
#![no_main]

mod common;

#[no_mangle]
pub extern "C" fn _start() -> ! {
    common::puts("[    1.55]  INFO bulkhead_agent::transport: listening (vsock) port=1024\n");
    loop {
        // SAFETY: hlt touches no memory; with interrupts off the vCPU stays halted until the VMM
        // pauses, snapshots or stops it.
        unsafe { core::arch::asm!("hlt", options(nomem, nostack)) }
    }
}
