//! tracing setup for serve mode: lines go to the `log` FIFO containerd created in the bundle
//! (it copies them into its own log), else to stderr. Spans name pod, container and exec.

use std::fs::OpenOptions;

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber. `debug` is containerd's `-debug` flag.
pub fn init(debug: bool, namespace: &str, id: &str) {
    let level = if debug { "debug" } else { "info" };
    let filter =
        EnvFilter::try_from_env("BULKHEAD_SHIM_LOG").unwrap_or_else(|_| EnvFilter::new(format!("{level},ttrpc=warn")));
    // O_RDWR: opening never blocks, even if containerd has not opened its end yet.
    let fifo = OpenOptions::new().read(true).write(true).open("log");
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(false).with_target(false);
    // BULKHEAD_SHIM_LOG_FORMAT=json for log pipelines; plain lines otherwise (containerd's log).
    let json = std::env::var("BULKHEAD_SHIM_LOG_FORMAT").is_ok_and(|f| f == "json");
    let result = match (fifo, json) {
        (Ok(file), true) => builder.json().with_writer(std::sync::Mutex::new(file)).try_init(),
        (Ok(file), false) => builder.with_writer(std::sync::Mutex::new(file)).try_init(),
        (Err(_), true) => builder.json().with_writer(std::io::stderr).try_init(),
        (Err(_), false) => builder.with_writer(std::io::stderr).try_init(),
    };
    if result.is_ok() {
        tracing::info!(namespace, id, "bulkhead shim serving");
    }
}
