//! One installer at a time per node: an exclusive `flock` on the host's `/run/bulkhead/installer.lock`,
//! waited for with a bound. During a DaemonSet rollout the old pod's uninstall-on-SIGTERM and the
//! new pod's install can overlap, and a person may run the binary by hand; interleaved, their
//! steps could restart containerd twice or unwire a node the other just wired. The kernel drops
//! the lock when its holder dies, so a killed installer never blocks the next one.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{io, Error, Result};

/// How long an installer waits for another to finish before it gives up (and retries later).
pub const LOCK_WAIT: Duration = Duration::from_secs(120);
const POLL: Duration = Duration::from_millis(100);

/// Held while an install or uninstall runs; dropping it releases the lock.
#[derive(Debug)]
pub struct InstallLock {
    _file: File,
    pub path: PathBuf,
}

impl InstallLock {
    /// Takes the lock in `dir` (created if missing), waiting up to `wait`.
    pub async fn acquire(dir: &Path, wait: Duration) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(io("create dir", dir))?;
        let path = dir.join("installer.lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io("open", &path))?;
        let deadline = Instant::now() + wait;
        let mut logged = false;
        loop {
            // SAFETY: flock on a file descriptor this function owns; no memory is involved.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Ok(Self { _file: file, path });
            }
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(Error::Io { op: "lock", path, source: e });
            }
            if Instant::now() >= deadline {
                return Err(Error::Locked { path, waited: wait });
            }
            if !logged {
                tracing::info!(lock = %path.display(), "another installer is running on this node; waiting for it");
                logged = true;
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_second_installer_waits_and_then_gets_the_lock() {
        let dir = tempfile::tempdir().unwrap();
        let first = InstallLock::acquire(dir.path(), LOCK_WAIT).await.unwrap();
        let err = InstallLock::acquire(dir.path(), Duration::from_millis(300)).await.unwrap_err();
        assert!(matches!(err, Error::Locked { .. }), "{err}");
        assert!(err.to_string().contains("installer.lock"), "{err}");
        let waiter = tokio::spawn({
            let dir = dir.path().to_owned();
            async move { InstallLock::acquire(&dir, Duration::from_secs(10)).await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(first);
        waiter.await.unwrap().unwrap();
    }
}
