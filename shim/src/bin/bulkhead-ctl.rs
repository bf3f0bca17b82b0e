//! `bulkhead-ctl`: see `bulkhead_shim::ctl`.
fn main() {
    std::process::exit(bulkhead_shim::ctl::main());
}
