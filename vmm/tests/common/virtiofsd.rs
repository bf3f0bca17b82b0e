//! The real virtiofsd for the virtio-fs tests. `make setup` (scripts/setup.sh) builds it into
//! `$BULKHEAD_CACHE/bin/virtiofsd` (default cache /var/cache/bulkhead); this is the one place
//! tests look for it. Missing, the tests fail: it is a prerequisite setup installs.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Where `make setup` puts virtiofsd.
pub fn path() -> PathBuf {
    bulkhead_integration::virtiofsd_path()
}

/// A virtiofsd serving `shared` on `socket`, stopped (by PID) on drop.
pub struct Virtiofsd {
    child: Option<Child>,
    pub socket: PathBuf,
    pub log: PathBuf,
}

impl Virtiofsd {
    /// Starts virtiofsd and waits for its socket. Its log goes to `log`.
    pub fn start(shared: &Path, socket: &Path, log: &Path) -> Self {
        let mut cmd = command(shared, log);
        cmd.arg("--socket-path").arg(socket);
        let child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start {}: {e}", path().display()));
        let mut me = Self { child: Some(child), socket: socket.to_owned(), log: log.to_owned() };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !socket.exists() {
            if let Some(status) = me.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("virtiofsd exited with {status} before listening:\n{}", me.log_text());
            }
            assert!(std::time::Instant::now() < deadline, "virtiofsd did not listen:\n{}", me.log_text());
            std::thread::sleep(Duration::from_millis(10));
        }
        me
    }

    /// Starts virtiofsd serving a listening socket the caller made and owns (`--fd`), as the
    /// shim does for a jailed VMM: the caller chose the socket's place, owner and mode.
    pub fn start_on_listener(shared: &Path, listener: UnixListener, log: &Path) -> Self {
        let socket = listener.local_addr().unwrap().as_pathname().expect("a path socket").to_owned();
        let fd = listener.as_raw_fd();
        let mut cmd = command(shared, log);
        cmd.arg(format!("--fd={fd}"));
        // SAFETY: between fork and exec; fcntl is async-signal-safe and touches only this fd,
        // which stays open in the parent until the child has it.
        unsafe {
            cmd.pre_exec(move || match libc::fcntl(fd, libc::F_SETFD, 0) {
                -1 => Err(std::io::Error::last_os_error()),
                _ => Ok(()),
            });
        }
        let child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start {}: {e}", path().display()));
        drop(listener); // virtiofsd has its own copy now
        Self { child: Some(child), socket, log: log.to_owned() }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL by PID, then reap. Its sandboxed worker dies with it (parent-death signal).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// virtiofsd sharing `shared` (no cache, so every read reaches the host file), logging to `log`.
fn command(shared: &Path, log: &Path) -> Command {
    let bin = path();
    assert!(bin.exists(), "virtiofsd not found at {}: `make setup` installs it", bin.display());
    let mut cmd = Command::new(&bin);
    cmd.arg("--shared-dir")
        .arg(shared)
        .args(["--cache", "never"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("virtiofsd log"));
    cmd
}

impl Drop for Virtiofsd {
    fn drop(&mut self) {
        self.kill();
    }
}
