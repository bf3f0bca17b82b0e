//! `containerd-shim-bulkhead-v2`: the containerd shim v2 of bulkhead.
//!
//! Job: serve containerd's Task API for every container of one pod, and run the pod in a
//! sandbox backend (`vm`, the product, or `namespace`, the no-isolation stand-in for hosts
//! that cannot run guests). Boundaries: everything about *running* a container is the
//! agent's (`bulkhead-agent`, reached through [`agent`]); this crate owns pod grouping,
//! Task state machines, stdio plumbing, events, config and the sandbox's lifetime.
//!
//! Map (follow one RPC from [`task`] into [`sandbox`] and [`agent`]):
//! - [`service`]: the shim's own lifecycle: `start` (spawn or reuse by pod), `delete`
//!   (cleanup after a crash), serve mode.
//! - [`task`]: the Task RPCs, on top of [`container`] and [`process`]; [`watch`] follows
//!   exits and OOM events in the background.
//! - [`options`]: the runtime options (`ConfigPath`) containerd passes.
//! - [`spec`]: OCI spec validation and translation for the agent.
//! - [`io`]: containerd FIFOs / log files <-> agent stream connections.
//! - [`events`]: publishing task events to containerd.
//! - [`config`]: the TOML config; [`quantity`]: Kubernetes quantities (sizes) read as bytes.
//! - Shared vocabulary, below all of the above: [`error`] (the Task error), [`exit`] (how a
//!   process ended) and [`trans`] (every protobuf <-> domain conversion).
//! - [`network`]: the host side of the pod's network (taps and redirects for the VM, the
//!   metadata block) and the pod's DNS config.
//! - [`sandbox`]: the backend trait, `namespace` and `vm`; [`logrelay`] carries their helper
//!   processes' output into the shim log.
//! - [`annotations`]: the sandbox spec's annotations the shim reads, CRI's and bulkhead's.
//! - For operators: [`metrics`] (per-pod Prometheus endpoint, RPC timing), [`observe`] (the pod
//!   record), [`procfs`] (process usage), and [`ctl`], the library of the `bulkhead-ctl` binary,
//!   which reads the same config and state.

pub mod agent;
pub mod annotations;
pub mod config;
pub mod container;
pub mod ctl;
pub mod error;
pub mod events;
pub mod exit;
pub mod io;
pub mod logging;
pub mod logrelay;
pub mod metrics;
pub mod network;
pub mod observe;
pub mod options;
pub mod process;
pub mod procfs;
pub mod quantity;
pub mod sandbox;
pub mod sandboxer;
pub mod service;
pub mod spec;
pub mod task;
#[cfg(test)]
mod testing;
pub mod trans;
pub mod watch;

/// The runtime id containerd knows this shim by.
pub const RUNTIME_ID: &str = "io.containerd.bulkhead.v2";

/// Entry point of the binary.
pub fn run() {
    // The namespace launcher must run before any thread exists (unshare/fork rules).
    if let Some(code) = sandbox::launcher::maybe_run_launcher() {
        std::process::exit(code);
    }
    service::main();
}
