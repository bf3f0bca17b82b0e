//! tracing setup for serve mode: lines go to the `log` FIFO containerd created in the bundle
//! (it copies them into its own log), else to stderr. Spans name pod, container and exec.
//!
//! The level comes from, in order: `BULKHEAD_SHIM_LOG` (an `EnvFilter`, fixed for the shim's
//! life), else the config's `log_level` once the sandbox's Create has read the config, raised
//! to `debug` by containerd's `-debug`. Until the config is read the shim logs at `info`.

use std::fs::OpenOptions;
use std::sync::OnceLock;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{fmt, reload, EnvFilter, Layer, Registry};

/// Reloads the level set by [`init`]; absent when `BULKHEAD_SHIM_LOG` fixed it.
struct Level {
    handle: reload::Handle<EnvFilter, Registry>,
    debug: bool,
}

static LEVEL: OnceLock<Level> = OnceLock::new();

const LEVELS: [&str; 5] = ["error", "warn", "info", "debug", "trace"];

/// The level to log at: the config's, raised to `debug` by containerd's `-debug`.
fn effective(config_level: &str, debug: bool) -> &str {
    let rank = |l: &str| LEVELS.iter().position(|x| *x == l).unwrap_or(2);
    if debug && rank(config_level) < rank("debug") {
        "debug"
    } else {
        config_level
    }
}

fn filter(level: &str) -> EnvFilter {
    // ttrpc's own chatter stays at warn whatever our level.
    EnvFilter::new(format!("{level},ttrpc=warn"))
}

/// Installs the global subscriber. `debug` is containerd's `-debug` flag.
pub fn init(debug: bool, namespace: &str, id: &str) {
    let from_env = EnvFilter::try_from_env("BULKHEAD_SHIM_LOG").ok();
    let fixed = from_env.is_some();
    let (filter, handle) = reload::Layer::new(from_env.unwrap_or_else(|| filter(effective("info", debug))));
    // O_RDWR: opening never blocks, even if containerd has not opened its end yet.
    let fifo = OpenOptions::new().read(true).write(true).open("log");
    // BULKHEAD_SHIM_LOG_FORMAT=json for log pipelines; plain lines otherwise (containerd's log).
    let json = std::env::var("BULKHEAD_SHIM_LOG_FORMAT").is_ok_and(|f| f == "json");
    let base = fmt::layer().with_ansi(false).with_target(false);
    let output = match (fifo, json) {
        (Ok(file), true) => base.json().with_writer(std::sync::Mutex::new(file)).boxed(),
        (Ok(file), false) => base.with_writer(std::sync::Mutex::new(file)).boxed(),
        (Err(_), true) => base.json().with_writer(std::io::stderr).boxed(),
        (Err(_), false) => base.with_writer(std::io::stderr).boxed(),
    };
    if tracing_subscriber::registry().with(filter).with(output).try_init().is_ok() {
        if !fixed {
            let _ = LEVEL.set(Level { handle, debug });
        }
        tracing::info!(namespace, id, "bulkhead shim serving");
    }
}

/// Applies the config's `log_level` (already validated), unless `BULKHEAD_SHIM_LOG` fixed it.
pub fn set_config_level(level: &str) {
    if let Some(current) = LEVEL.get() {
        let level = effective(level, current.debug);
        if let Err(e) = current.handle.reload(filter(level)) {
            tracing::warn!("cannot change the log level to {level}: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_flag_only_raises_the_level() {
        assert_eq!(effective("warn", false), "warn");
        assert_eq!(effective("warn", true), "debug");
        assert_eq!(effective("trace", true), "trace");
        assert_eq!(effective("error", false), "error");
    }
}
