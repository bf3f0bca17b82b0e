//! `shim_e2e` on containerd 1.7: the same tests (`tests/shim_e2e.rs`, compiled again as a module), in a binary
//! whose name picks the containerd they start (`ContainerdVersion::for_test_binary`). So `cargo test` runs them
//! on 1.7 as well as on the run's default, and a failure names its version.

#[path = "shim_e2e.rs"]
mod shim_e2e;
