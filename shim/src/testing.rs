//! Test helpers for host-safety checks: running a step under another umask (in a child process,
//! since the umask is the whole process's and tests run on threads) and trying something as an
//! unprivileged local user.

use std::os::unix::process::CommandExt;
use std::process::Command;

/// The uid and gid of `nobody`.
pub const NOBODY: u32 = 65534;

/// Whether this test process is root; prints why the test is skipped if not.
pub fn is_root(test: &str) -> bool {
    let root = nix::unistd::geteuid().is_root();
    if !root {
        println!("SKIPPED: {test}: needs root");
    }
    root
}

/// Whether `script` (sh) succeeds as uid and gid [`NOBODY`], without supplementary groups.
pub fn as_nobody(script: &str) -> bool {
    let status = Command::new("sh").args(["-c", script]).uid(NOBODY).gid(NOBODY).status();
    status.unwrap_or_else(|e| panic!("run sh as nobody: {e}")).success()
}

/// The environment variable that tells a re-executed test it is the child of [`in_child`].
pub const CHILD_ARG: &str = "BULKHEAD_TEST_CHILD_ARG";

/// Runs the unit test `name` (its full path, `sandbox::vm::ids::tests::x`) again in a new process
/// under `umask`, with `arg` in [`CHILD_ARG`]; panics unless it passes. The test tells the two
/// runs apart by that variable.
pub fn in_child(name: &str, arg: &str, umask: u32) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut command = Command::new(exe);
    command.args([name, "--exact", "--test-threads=1", "--nocapture"]).env(CHILD_ARG, arg);
    // SAFETY: umask(2) is async-signal-safe and changes only the child's own mask.
    unsafe {
        command.pre_exec(move || {
            libc::umask(umask as libc::mode_t);
            Ok(())
        });
    }
    let out = command.output().expect("re-run the test binary");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("1 passed"), "{name} as a child: {text}");
}
