#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| bulkhead_fuzz::fs_relay(data));
