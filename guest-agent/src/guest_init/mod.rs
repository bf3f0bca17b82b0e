//! Guest init duties: the mounts PID 1 owes the sandbox, subreaping, and the sandbox-wide
//! settings of SetupSandbox. All syscalls go through [`Syscall`] so the plans are unit-tested
//! without root; the integration tests exercise [`LinuxSyscall`].

mod linux;
mod mounts;
mod setup;
mod syscall;

pub use linux::LinuxSyscall;
pub use mounts::parse_mount_options;
pub use setup::{apply_setup, GuestMount, SandboxSettings};
pub use syscall::Syscall;

use crate::cli::Mode;

/// One step of the boot plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Mkdir(&'static str),
    Mount {
        source: &'static str,
        target: &'static str,
        fstype: Option<&'static str>,
        flags: nix::mount::MsFlags,
        data: Option<&'static str>,
        /// Failure is logged, not fatal (e.g. the kernel already mounted devtmpfs).
        optional: bool,
    },
    /// Make every mount private so nothing the agent mounts leaks to the host.
    MakeRprivate,
    Symlink {
        target: &'static str,
        link: &'static str,
    },
    Write {
        path: &'static str,
        data: &'static str,
        optional: bool,
    },
    Subreaper,
}

/// What PID 1 must set up before serving, per mode.
pub fn boot_plan(mode: Mode) -> Vec<Step> {
    use nix::mount::MsFlags as F;
    let nosuid_nodev_noexec = F::MS_NOSUID | F::MS_NODEV | F::MS_NOEXEC;
    match mode {
        // The host provides /dev, /sys, cgroups, /tmp; we only need a private mount table
        // and a /proc that shows our own pid namespace (libcontainer reads /proc/<pid>).
        Mode::Namespace => vec![
            Step::MakeRprivate,
            Step::Mount {
                source: "proc",
                target: "/proc",
                fstype: Some("proc"),
                flags: nosuid_nodev_noexec,
                data: None,
                optional: false,
            },
            Step::Subreaper,
        ],
        Mode::Guest => vec![
            Step::Mkdir("/proc"),
            Step::Mount {
                source: "proc",
                target: "/proc",
                fstype: Some("proc"),
                flags: nosuid_nodev_noexec,
                data: None,
                optional: false,
            },
            Step::Mkdir("/sys"),
            Step::Mount {
                source: "sysfs",
                target: "/sys",
                fstype: Some("sysfs"),
                flags: nosuid_nodev_noexec,
                data: None,
                optional: false,
            },
            Step::Mkdir("/dev"),
            Step::Mount {
                source: "devtmpfs",
                target: "/dev",
                fstype: Some("devtmpfs"),
                flags: F::MS_NOSUID,
                data: Some("mode=0755"),
                // CONFIG_DEVTMPFS_MOUNT may have mounted it already.
                optional: true,
            },
            Step::Mkdir("/dev/pts"),
            Step::Mount {
                source: "devpts",
                target: "/dev/pts",
                fstype: Some("devpts"),
                flags: F::MS_NOSUID | F::MS_NOEXEC,
                data: Some("newinstance,ptmxmode=0666,mode=0620,gid=5"),
                optional: false,
            },
            Step::Symlink { target: "pts/ptmx", link: "/dev/ptmx" },
            Step::Mkdir("/dev/shm"),
            Step::Mount {
                source: "shm",
                target: "/dev/shm",
                fstype: Some("tmpfs"),
                flags: F::MS_NOSUID | F::MS_NODEV,
                data: Some("mode=1777"),
                optional: false,
            },
            Step::Mkdir("/tmp"),
            Step::Mount {
                source: "tmpfs",
                target: "/tmp",
                fstype: Some("tmpfs"),
                flags: F::MS_NOSUID | F::MS_NODEV,
                data: Some("mode=1777"),
                optional: false,
            },
            Step::Mkdir("/run"),
            Step::Mount {
                source: "tmpfs",
                target: "/run",
                fstype: Some("tmpfs"),
                flags: F::MS_NOSUID | F::MS_NODEV,
                data: Some("mode=0755"),
                optional: false,
            },
            Step::Mount {
                source: "cgroup2",
                target: "/sys/fs/cgroup",
                fstype: Some("cgroup2"),
                flags: nosuid_nodev_noexec,
                data: None,
                optional: false,
            },
            // Delegate the controllers containers need; the root cgroup is exempt from the
            // no-internal-processes rule, so this works with the agent still in it.
            Step::Write {
                path: "/sys/fs/cgroup/cgroup.subtree_control",
                data: "+cpu +memory +pids +io",
                optional: true,
            },
            Step::Subreaper,
        ],
    }
}

/// Runs the boot plan. Fatal steps abort the agent with the step named.
pub fn prepare(mode: Mode, sys: &dyn Syscall) -> anyhow::Result<()> {
    for step in boot_plan(mode) {
        let (res, optional) = run_step(&step, sys);
        match res {
            Ok(()) => {}
            // EBUSY on a mount: the kernel (or a host, when testing) already mounted it.
            Err(e) if matches!(step, Step::Mount { .. }) && e.raw_os_error() == Some(libc::EBUSY) => {
                tracing::info!(?step, "already mounted")
            }
            Err(e) if optional => tracing::warn!(?step, error = %e, "optional boot step failed"),
            Err(e) => anyhow::bail!("boot step {step:?} failed: {e}"),
        }
    }
    Ok(())
}

fn run_step(step: &Step, sys: &dyn Syscall) -> (std::io::Result<()>, bool) {
    use std::path::Path;
    match step {
        Step::Mkdir(p) => (sys.mkdir_all(Path::new(p)), false),
        Step::Mount { source, target, fstype, flags, data, optional } => {
            (sys.mount(Some(source), Path::new(target), *fstype, *flags, *data), *optional)
        }
        Step::MakeRprivate => (
            sys.mount(None, Path::new("/"), None, nix::mount::MsFlags::MS_REC | nix::mount::MsFlags::MS_PRIVATE, None),
            false,
        ),
        Step::Symlink { target, link } => (sys.symlink(Path::new(target), Path::new(link)), true),
        Step::Write { path, data, optional } => (sys.write_file(Path::new(path), data.as_bytes()), *optional),
        Step::Subreaper => (sys.set_child_subreaper(), false),
    }
}

#[cfg(test)]
mod tests {
    use super::syscall::test::{Call, RecordingSyscall};
    use super::*;

    #[test]
    fn guest_boot_mounts_what_pid1_owes() {
        let sys = RecordingSyscall::default();
        prepare(Mode::Guest, &sys).unwrap();
        let targets: Vec<String> = sys
            .calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::Mount { target, fstype, .. } => {
                    Some(format!("{}:{}", fstype.unwrap_or_default(), target.display()))
                }
                _ => None,
            })
            .collect();
        assert_eq!(
            targets,
            [
                "proc:/proc",
                "sysfs:/sys",
                "devtmpfs:/dev",
                "devpts:/dev/pts",
                "tmpfs:/dev/shm",
                "tmpfs:/tmp",
                "tmpfs:/run",
                "cgroup2:/sys/fs/cgroup"
            ]
        );
        assert!(sys.calls().contains(&Call::Subreaper));
    }

    #[test]
    fn namespace_boot_only_privatizes_and_remounts_proc() {
        let sys = RecordingSyscall::default();
        prepare(Mode::Namespace, &sys).unwrap();
        let calls = sys.calls();
        assert!(matches!(&calls[0], Call::Mount { target, flags, .. }
            if target == std::path::Path::new("/")
            && flags.contains(nix::mount::MsFlags::MS_PRIVATE | nix::mount::MsFlags::MS_REC)));
        assert!(matches!(&calls[1], Call::Mount { fstype: Some(t), .. } if t == "proc"));
        assert_eq!(calls.len(), 3);
    }

    #[test]
    fn optional_failures_are_tolerated_fatal_ones_are_not() {
        let sys = RecordingSyscall::failing_mount("/dev", libc::EINVAL);
        prepare(Mode::Guest, &sys).unwrap();
        let sys = RecordingSyscall::failing_mount("/sys", libc::EBUSY);
        prepare(Mode::Guest, &sys).unwrap();
        let sys = RecordingSyscall::failing_mount("/proc", libc::EINVAL);
        let err = prepare(Mode::Guest, &sys).unwrap_err().to_string();
        assert!(err.contains("/proc"), "{err}");
    }
}
