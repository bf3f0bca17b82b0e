//! Listeners and dispatch by port. Unix: the agent answers the hybrid-vsock preamble itself.
//! Vsock: the VMM has already answered it on the host side, so the guest just listens on
//! each port.

use std::{
    io,
    os::fd::{FromRawFd, OwnedFd, RawFd},
    path::Path,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use bulkhead_protocol::{handshake, ports};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{UnixListener, UnixStream},
    sync::mpsc,
};
use tokio_vsock::{VsockAddr, VsockListener, VsockStream, VMADDR_CID_ANY, VMADDR_CID_HOST};

use bulkhead_protocol::frame_guard::FrameGuard;

/// One accepted connection, whatever the transport.
pub enum Conn {
    Unix(UnixStream),
    Vsock(VsockStream),
}

macro_rules! delegate {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.get_mut() {
            Conn::Unix($s) => $e,
            Conn::Vsock($s) => $e,
        }
    };
}

impl AsyncRead for Conn {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => Pin::new(s).poll_read(cx, buf))
    }
}

impl AsyncWrite for Conn {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        delegate!(self, s => Pin::new(s).poll_write(cx, buf))
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => Pin::new(s).poll_flush(cx))
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => Pin::new(s).poll_shutdown(cx))
    }
}

pub type TtrpcConn = FrameGuard<Conn>;

/// Where accepted connections go.
#[derive(Clone)]
pub struct Dispatch {
    pub ttrpc: mpsc::Sender<io::Result<TtrpcConn>>,
    pub streams: mpsc::Sender<Conn>,
    pub frame_stall: Duration,
}

impl Dispatch {
    async fn route(&self, port: u32, conn: Conn) {
        let sent = match port {
            ports::AGENT_TTRPC => self.ttrpc.send(Ok(FrameGuard::new(conn, self.frame_stall))).await.is_ok(),
            ports::AGENT_STREAMS => self.streams.send(conn).await.is_ok(),
            other => {
                tracing::warn!(port = other, "connection for an unserved port dropped");
                true
            }
        };
        if !sent {
            tracing::warn!(port, "dispatcher closed; connection dropped");
        }
    }
}

/// Binds a Unix listener at `path`, replacing a stale socket, mode 0600 whatever the umask:
/// whoever can connect drives the agent. The directory is the shim's own (0700), so the socket
/// is reachable by no one else between the bind and the chmod.
pub fn bind_unix_std(path: &Path) -> io::Result<std::os::unix::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let listener = std::os::unix::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Binds the agent's Unix listener at `path` ([`bind_unix_std`]) for the runtime.
pub fn bind_unix(path: &Path) -> io::Result<UnixListener> {
    let listener = bind_unix_std(path)?;
    listener.set_nonblocking(true)?;
    let listener = UnixListener::from_std(listener)?;
    tracing::info!(path = %path.display(), "listening (unix, hybrid-vsock preamble)");
    Ok(listener)
}

/// The Unix listener the agent bound before it entered its minimal root, passed across exec as
/// descriptor `fd` (crate::guest_init::minimal_root). It is closed on exec from here on: no
/// helper or container may inherit the agent's socket.
pub fn inherited_unix(fd: RawFd) -> io::Result<UnixListener> {
    let refuse = |why: &str| io::Error::other(format!("--listen-fd {fd}: {why}"));
    // SAFETY: F_GETFD only reads a descriptor's flags; asking about any number is harmless.
    if fd < 3 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(refuse("not an open descriptor"));
    }
    // SAFETY: the first run passed its listening socket as `fd` across exec; it is open (checked
    // just above) and nothing else in this process owns it: this takes ownership once.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let stat = nix::sys::stat::fstat(&owned).map_err(io::Error::from)?;
    if stat.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(refuse("not a socket"));
    }
    nix::fcntl::fcntl(&owned, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC))
        .map_err(io::Error::from)?;
    let listener = std::os::unix::net::UnixListener::from(owned);
    listener.set_nonblocking(true)?;
    tracing::info!(fd, "listening (unix, hybrid-vsock preamble) on the socket bound before the minimal root");
    UnixListener::from_std(listener)
}

/// Accepts on a Unix socket, answering the preamble per connection (never blocking the
/// accept loop on a slow or hostile client).
pub async fn serve_unix(listener: UnixListener, dispatch: Dispatch) -> io::Result<()> {
    loop {
        let (mut stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let dispatch = dispatch.clone();
        tokio::spawn(async move {
            match handshake::accept(&mut stream, &ports::ALL, handshake::DEFAULT_TIMEOUT).await {
                Ok(port) => dispatch.route(port, Conn::Unix(stream)).await,
                Err(e) => tracing::warn!(error = %e, "preamble refused"),
            }
        });
    }
}

/// Whether a vsock peer may drive the agent: only the host (the VMM's side of the device). A
/// process in the guest (a container that opens AF_VSOCK to the guest's own CID, or to the
/// loopback CID) must never reach the agent that runs its containers.
fn peer_allowed(peer: &VsockAddr) -> bool {
    peer.cid() == VMADDR_CID_HOST
}

/// Listens on every agent port over vsock; only the host's connections are served.
pub async fn serve_vsock(dispatch: Dispatch) -> io::Result<()> {
    let mut tasks = Vec::new();
    for port in ports::ALL {
        let listener = VsockListener::bind(VsockAddr::new(VMADDR_CID_ANY, port))?;
        tracing::info!(port, "listening (vsock)");
        let dispatch = dispatch.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((s, peer)) if peer_allowed(&peer) => dispatch.route(port, Conn::Vsock(s)).await,
                    Ok((_, peer)) => {
                        tracing::warn!(
                            port,
                            peer_cid = peer.cid(),
                            "vsock connection from a peer other than the host refused"
                        );
                    }
                    Err(e) => {
                        tracing::warn!(port, error = %e, "vsock accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn only_the_host_may_connect_over_vsock() {
        assert!(peer_allowed(&VsockAddr::new(VMADDR_CID_HOST, 49152)));
        // The guest itself (its own CID, loopback, "any") and the hypervisor's CID are refused.
        for cid in [tokio_vsock::VMADDR_CID_LOCAL, 3, 4, 0xffff_ffff, tokio_vsock::VMADDR_CID_HYPERVISOR] {
            assert!(!peer_allowed(&VsockAddr::new(cid, 1024)), "cid {cid}");
        }
    }

    /// Runs `f` on a thread of its own whose credentials are nobody's (raw system calls change
    /// only the calling thread's; glibc's wrappers would change every thread's).
    fn as_nobody<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::spawn(move || {
            // SAFETY: raw setgroups/setresgid/setresuid on this thread only, with plain integers
            // and no list; every result is checked.
            unsafe {
                assert_eq!(libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()), 0);
                assert_eq!(libc::syscall(libc::SYS_setresgid, 65534, 65534, 65534), 0);
                assert_eq!(libc::syscall(libc::SYS_setresuid, 65534, 65534, 65534), 0);
            }
            f()
        })
        .join()
        .unwrap()
    }

    #[test]
    fn the_unix_listener_is_the_owners_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.sock");
        std::fs::write(&path, b"stale").unwrap();
        let _listener = bind_unix_std(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{:o}", mode & 0o777);
        if !nix::unistd::geteuid().is_root() {
            println!("SKIPPED (in part): connecting as nobody needs root");
            return;
        }
        // Even with every directory on the way open, nobody cannot connect.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let connected = as_nobody(move || std::os::unix::net::UnixStream::connect(&path).map(drop));
        let err = connected.expect_err("nobody connected to the agent's socket");
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
    }
}
