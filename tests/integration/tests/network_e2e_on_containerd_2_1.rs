//! `network_e2e` on containerd 2.1: the same tests (`tests/network_e2e.rs`, compiled again as a module), in a binary
//! whose name picks the containerd they start (`ContainerdVersion::for_test_binary`). So `cargo test` runs them
//! on 2.1 as well as on the run's default, and a failure names its version.

#[path = "network_e2e.rs"]
mod network_e2e;
