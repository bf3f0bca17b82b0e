//! `bulkhead-agent`: PID 1 of a bulkhead sandbox. See the crate README for the job and boundaries.

mod bundle;
mod cgroup_v1_devices;
mod cgroups;
mod cli;
mod console;
mod container;
mod dns;
mod error;
mod guest_init;
mod host_view;
mod mount;
mod network;
mod online_cpus;
mod oom;
mod pod_userns;
mod privileges;
mod process_io;
mod reaper;
mod rollback;
mod rootfs;
mod runtime;
mod sandbox;
mod seccomp;
mod serve;
mod service;
mod shared_fs;
mod spec;
mod stdio;
mod stream_attach;
mod syscall;
mod transport;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let args = cli::Cli::parse();
    match args.command {
        // The libcontainer helper must run single-threaded (it clones), so it is dispatched
        // before any runtime starts.
        Some(cli::Command::Libcontainer(op)) => runtime::helper::main(op),
        None => {
            let mode = args.agent.mode;
            match run(args.agent, &args.kernel_words) {
                Ok(()) => std::process::ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("bulkhead-agent: {e:#}");
                    if mode == cli::Mode::Guest {
                        // PID 1 must not just exit (kernel panic); power the VM off instead.
                        nix::unistd::sync();
                        let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_POWER_OFF);
                    }
                    std::process::ExitCode::FAILURE
                }
            }
        }
    }
}

fn run(opts: cli::AgentOpts, kernel_words: &[String]) -> anyhow::Result<()> {
    cli::init_tracing(&opts);
    if !kernel_words.is_empty() {
        tracing::warn!(?kernel_words, "ignoring command-line words the kernel passed to /init");
    }
    if opts.mode == cli::Mode::Guest {
        // pivot_root(2) refuses the initramfs; containers need a real root under them. Returns
        // only once the agent runs from a tmpfs root (it re-executes itself there).
        guest_init::switch_root::leave_initramfs()?;
    }
    let confined = opts.confined();
    if confined && !opts.in_minimal_root {
        // Namespace mode: off the host's filesystem into a root of its own, then executed again
        // from there; returns only on failure.
        match guest_init::minimal_root::enter(&opts)? {}
    }
    if confined {
        guest_init::minimal_root::check_entered()?;
    }
    // Mounts and subreaper status come before any thread exists.
    guest_init::prepare(opts.mode, confined, &syscall::LinuxSyscall)?;
    if confined {
        // Capabilities are per thread: dropped while this is the only one.
        let held = privileges::confine()?;
        let mut names: Vec<String> = held.iter().map(ToString::to_string).collect();
        names.sort();
        tracing::info!(
            cap_eff = format!("{:016x}", privileges::mask(&held)),
            kept = names.join(","),
            "namespace mode: in the minimal root, capabilities dropped to the kept set; no_new_privs left unset \
             (containers that allow privilege escalation keep their setuid binaries)"
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(serve::serve(opts))
}
