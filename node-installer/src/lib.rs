//! bulkhead-node-installer: runs on every node (DaemonSet, host `/` mounted) and makes the node ready for
//! `runtimeClassName: bulkhead`, or says on the node why it cannot.
//!
//! Boundaries: it touches only `<prefix>` (/opt/bulkhead), one drop-in file, the `imports` line of containerd's
//! config (original bytes kept for uninstall), containerd's restart, and its own Node's label, annotations and one
//! startup taint; and, only when asked, the shim's template cache, through the installed `bulkhead-ctl`. Module per job: `probe`, `artifacts`, `containerd`, `restart`, `cri`, `kube`, `usage` (what runs
//! from which installed version), `versions` (collecting old ones), `templates` (pre-building warm
//! pods' snapshot templates, if asked); `installer` sequences them.

pub mod artifacts;
pub mod bounded;
pub mod containerd;
pub mod cri;
pub mod error;
pub mod failpoint;
pub mod fsutil;
pub mod installer;
pub mod kube;
pub mod lock;
pub mod node_paths;
pub mod probe;
pub mod restart;
pub mod templates;
pub mod usage;
pub mod versions;

pub use error::{Error, Result};
