#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| bulkhead_fuzz::shim_pod_config(data));
