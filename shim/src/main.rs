//! `containerd-shim-bulkhead-v2`: see the crate docs of `bulkhead_shim`.
fn main() {
    bulkhead_shim::run();
}
