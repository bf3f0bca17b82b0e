//! Guest init duties: the mounts PID 1 owes the sandbox, subreaping, and the sandbox-wide
//! settings of SetupSandbox. All syscalls go through [`Syscall`] so the plans are unit-tested
//! without root.

mod loader;
pub mod minimal_root;
mod setup;
pub mod switch_root;
pub mod user_ns;

pub use setup::{apply_setup, check_namespaced, SandboxSettings};

use crate::{cli::Mode, syscall::Syscall};

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

/// A required mount of a filesystem whose type is known.
fn mount(
    source: &'static str,
    target: &'static str,
    fstype: &'static str,
    flags: nix::mount::MsFlags,
    data: Option<&'static str>,
) -> Step {
    Step::Mount { source, target, fstype: Some(fstype), flags, data, optional: false }
}

/// Enables one controller for the guest's cgroups below the root.
fn delegate(controller: &'static str) -> Step {
    Step::Write { path: "/sys/fs/cgroup/cgroup.subtree_control", data: controller, optional: true }
}

/// What PID 1 must set up before serving, per mode. A confined agent (namespace mode, see
/// [`minimal_root`]) already has its /proc, and its mounts must stay slaves (making them private
/// would cut the pod's container mounts off), so it only becomes a subreaper.
pub fn boot_plan(mode: Mode, confined: bool) -> Vec<Step> {
    use nix::mount::MsFlags as F;
    let nosuid_nodev_noexec = F::MS_NOSUID | F::MS_NODEV | F::MS_NOEXEC;
    let nosuid_nodev = F::MS_NOSUID | F::MS_NODEV;
    let proc = mount("proc", "/proc", "proc", nosuid_nodev_noexec, None);
    match mode {
        // The host provides /dev, /sys, cgroups, /tmp; we only need a private mount table
        // and a /proc that shows our own pid namespace (libcontainer reads /proc/<pid>).
        Mode::Namespace if confined => vec![Step::Subreaper],
        Mode::Namespace => vec![Step::MakeRprivate, proc, Step::Subreaper],
        Mode::Guest => vec![
            Step::Mkdir("/proc"),
            proc,
            Step::Mkdir("/sys"),
            mount("sysfs", "/sys", "sysfs", nosuid_nodev_noexec, None),
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
            mount(
                "devpts",
                "/dev/pts",
                "devpts",
                F::MS_NOSUID | F::MS_NOEXEC,
                Some("newinstance,ptmxmode=0666,mode=0620,gid=5"),
            ),
            Step::Symlink { target: "pts/ptmx", link: "/dev/ptmx" },
            Step::Mkdir("/dev/shm"),
            mount("shm", "/dev/shm", "tmpfs", nosuid_nodev, Some("mode=1777")),
            Step::Mkdir("/tmp"),
            mount("tmpfs", "/tmp", "tmpfs", nosuid_nodev, Some("mode=1777")),
            Step::Mkdir("/run"),
            mount("tmpfs", "/run", "tmpfs", nosuid_nodev, Some("mode=0755")),
            mount("cgroup2", "/sys/fs/cgroup", "cgroup2", nosuid_nodev_noexec, None),
            // Delegate the controllers kubelet sets limits with, one by one (a write naming a
            // controller the kernel lacks fails whole); the root cgroup is exempt from the
            // no-internal-processes rule, so this works with the agent still in it.
            delegate("+cpu"),
            delegate("+cpuset"),
            delegate("+memory"),
            delegate("+pids"),
            delegate("+io"),
            delegate("+hugetlb"),
            Step::Subreaper,
        ],
    }
}

/// Runs the boot plan. Fatal steps abort the agent with the step named.
pub fn prepare(mode: Mode, confined: bool, sys: &dyn Syscall) -> anyhow::Result<()> {
    for step in boot_plan(mode, confined) {
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
    use super::*;
    use crate::syscall::test::{Call, RecordingSyscall};

    #[test]
    fn guest_boot_mounts_what_pid1_owes() {
        let sys = RecordingSyscall::default();
        prepare(Mode::Guest, false, &sys).unwrap();
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
        prepare(Mode::Namespace, false, &sys).unwrap();
        let calls = sys.calls();
        assert!(matches!(&calls[0], Call::Mount { target, flags, .. }
            if target == std::path::Path::new("/")
            && flags.contains(nix::mount::MsFlags::MS_PRIVATE | nix::mount::MsFlags::MS_REC)));
        assert!(matches!(&calls[1], Call::Mount { fstype: Some(t), .. } if t == "proc"));
        assert_eq!(calls.len(), 3);
    }

    #[test]
    fn a_confined_namespace_boot_keeps_its_root_and_only_subreaps() {
        let sys = RecordingSyscall::default();
        prepare(Mode::Namespace, true, &sys).unwrap();
        assert_eq!(sys.calls(), [Call::Subreaper]);
        // A guest is confined by its VM: the flag changes nothing there.
        assert_eq!(boot_plan(Mode::Guest, true), boot_plan(Mode::Guest, false));
    }

    #[test]
    fn optional_failures_are_tolerated_fatal_ones_are_not() {
        let sys = RecordingSyscall::failing_mount("/dev", libc::EINVAL);
        prepare(Mode::Guest, false, &sys).unwrap();
        let sys = RecordingSyscall::failing_mount("/sys", libc::EBUSY);
        prepare(Mode::Guest, false, &sys).unwrap();
        let sys = RecordingSyscall::failing_mount("/proc", libc::EINVAL);
        let err = prepare(Mode::Guest, false, &sys).unwrap_err().to_string();
        assert!(err.contains("/proc"), "{err}");
    }
}
