//! Netlink work inside a pod's network namespace. A dedicated thread joins the namespace
//! (`setns` changes only the calling thread, so no runtime worker is ever moved), opens its
//! netlink socket there (a socket stays in the namespace it was made in), runs the work on a
//! runtime of its own and ends with it. /dev/net/tun and /proc/sys/net opened on that thread
//! act on the pod's namespace too.

use std::fs::File;
use std::future::Future;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sched::{setns, CloneFlags};
use rtnetlink::Handle;
use serde::{Deserialize, Serialize};

use super::error::NetworkError;

/// Which namespace a path named when it was opened (device and inode of the nsfs file), so
/// teardown after a crash never acts on a different namespace mounted at the same path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetnsId {
    pub dev: u64,
    pub ino: u64,
}

/// An open network namespace.
#[derive(Debug)]
pub struct Netns {
    path: PathBuf,
    file: File,
    pub id: NetnsId,
}

impl Netns {
    /// Opens the namespace at `path` (e.g. `/var/run/netns/cni-...`); `NotFound` when it is gone.
    pub fn open(path: &Path) -> Result<Self, NetworkError> {
        let err = |source| NetworkError::Netns { path: path.to_path_buf(), source };
        let file = File::open(path).map_err(err)?;
        let meta = file.metadata().map_err(err)?;
        Ok(Self { path: path.to_path_buf(), file, id: NetnsId { dev: meta.dev(), ino: meta.ino() } })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `work` with a netlink handle inside this namespace, on a thread of its own,
    /// bounded by `limit`.
    pub async fn run<T, F, Fut>(&self, what: &'static str, limit: Duration, work: F) -> Result<T, NetworkError>
    where
        T: Send + 'static,
        F: FnOnce(Handle) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, NetworkError>>,
    {
        let file = self.file.try_clone().map_err(|source| NetworkError::Netns { path: self.path.clone(), source })?;
        let path = self.path.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("bulkhead-netns".into())
            .spawn(move || {
                let _ = tx.send(run_on_this_thread(&file, &path, what, limit, work));
            })
            .map_err(|e| NetworkError::Thread(format!("{what}: spawn: {e}")))?;
        // The thread bounds its own work; this bound only guards against a wedged thread.
        match tokio::time::timeout(limit + Duration::from_secs(1), rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(NetworkError::Thread(format!("{what}: the netns thread ended without an answer"))),
            Err(_) => Err(NetworkError::Timeout { what, limit }),
        }
    }
}

fn run_on_this_thread<T, F, Fut>(
    file: &File,
    path: &Path,
    what: &'static str,
    limit: Duration,
    work: F,
) -> Result<T, NetworkError>
where
    F: FnOnce(Handle) -> Fut,
    Fut: Future<Output = Result<T, NetworkError>>,
{
    setns(file.as_fd(), CloneFlags::CLONE_NEWNET)
        .map_err(|e| NetworkError::Netns { path: path.to_path_buf(), source: e.into() })?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| NetworkError::Thread(format!("{what}: runtime: {e}")))?;
    runtime.block_on(async {
        let (connection, handle, _) =
            rtnetlink::new_connection().map_err(|e| NetworkError::Thread(format!("{what}: netlink socket: {e}")))?;
        let connection = tokio::spawn(connection);
        let result = match tokio::time::timeout(limit, work(handle)).await {
            Ok(result) => result,
            Err(_) => Err(NetworkError::Timeout { what, limit }),
        };
        connection.abort();
        result
    })
}
