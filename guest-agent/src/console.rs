//! libcontainer's console socket: for a terminal process the agent binds a Unix socket,
//! libcontainer connects to it and passes the pty master (SCM_RIGHTS). Dropping the
//! [`ConsoleSocket`] before the master arrives (a failed create or exec) aborts the wait and
//! removes the socket.

use std::{
    os::fd::OwnedFd,
    path::{Path, PathBuf},
    time::Duration,
};

use crate::error::{AgentError, Result};

/// How long libcontainer may take to connect and send the master, and to send it once connected.
const CONSOLE_TIMEOUT: Duration = Duration::from_secs(30);

pub struct ConsoleSocket {
    task: tokio::task::JoinHandle<Result<OwnedFd>>,
    path: PathBuf,
}

impl ConsoleSocket {
    /// Binds `path` (replacing a stale socket) and starts waiting for the master.
    pub fn bind(path: PathBuf) -> Result<Self> {
        let _ = std::fs::remove_file(&path);
        let listener = tokio::net::UnixListener::bind(&path).map_err(|e| AgentError::internal("console socket", e))?;
        let task = tokio::spawn(accept_master(listener, path.clone()));
        Ok(Self { task, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The pty master, once libcontainer has sent it.
    pub async fn master(mut self) -> Result<OwnedFd> {
        tokio::time::timeout(CONSOLE_TIMEOUT, &mut self.task)
            .await
            .map_err(|_| AgentError::Timeout("pty master from libcontainer".into()))?
            .map_err(|e| AgentError::internal("console task", e))?
    }
}

impl Drop for ConsoleSocket {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.path);
    }
}

async fn accept_master(listener: tokio::net::UnixListener, path: PathBuf) -> Result<OwnedFd> {
    let (stream, _) = listener.accept().await.map_err(|e| AgentError::internal("accept console socket", e))?;
    let _ = std::fs::remove_file(&path);
    let std_stream = stream.into_std().map_err(|e| AgentError::internal("console socket", e))?;
    tokio::task::spawn_blocking(move || {
        std_stream
            .set_nonblocking(false)
            .and_then(|_| std_stream.set_read_timeout(Some(CONSOLE_TIMEOUT)))
            .map_err(|e| AgentError::internal("console socket", e))?;
        recv_fd(&std_stream)
    })
    .await
    .map_err(|e| AgentError::internal("console task", e))?
}

fn recv_fd(sock: &std::os::unix::net::UnixStream) -> Result<OwnedFd> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    use std::os::fd::{AsRawFd, FromRawFd};
    let mut buf = [0u8; 4096];
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let msg = recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(|e| AgentError::internal("recvmsg pty master", e))?;
    for c in msg.cmsgs().map_err(|e| AgentError::internal("cmsgs", e))? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            if let Some(fd) = fds.first() {
                // SAFETY: SCM_RIGHTS just installed this descriptor in our table.
                return Ok(unsafe { OwnedFd::from_raw_fd(*fd) });
            }
        }
    }
    Err(AgentError::Internal("console socket sent no descriptor".into()))
}

#[cfg(test)]
mod tests {
    use std::{
        io::{Read, Seek, Write},
        os::{fd::AsRawFd, unix::net::UnixStream},
    };

    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};

    use super::*;

    /// What libcontainer does: connect and send one descriptor.
    fn send_fd(path: &Path, fd: &impl AsRawFd) {
        let s = UnixStream::connect(path).unwrap();
        let fds = [fd.as_raw_fd()];
        sendmsg::<()>(
            s.as_raw_fd(),
            &[std::io::IoSlice::new(b"x")],
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
    }

    #[tokio::test]
    async fn receives_the_descriptor_libcontainer_sends() {
        let dir = tempfile::tempdir().unwrap();
        let console = ConsoleSocket::bind(dir.path().join("c0.sock")).unwrap();
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(b"the master").unwrap();
        let path = console.path().to_path_buf();
        tokio::task::spawn_blocking(move || send_fd(&path, &file)).await.unwrap();
        let mut got = std::fs::File::from(console.master().await.unwrap());
        got.rewind().unwrap();
        let mut text = String::new();
        got.read_to_string(&mut text).unwrap();
        assert_eq!(text, "the master");
        assert!(!dir.path().join("c0.sock").exists(), "the socket is removed once used");
    }

    #[tokio::test]
    async fn a_connection_without_a_descriptor_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let console = ConsoleSocket::bind(dir.path().join("c1.sock")).unwrap();
        let path = console.path().to_path_buf();
        tokio::task::spawn_blocking(move || UnixStream::connect(path).unwrap().write_all(b"no fd").unwrap())
            .await
            .unwrap();
        assert!(matches!(console.master().await, Err(AgentError::Internal(_))));
    }

    #[tokio::test]
    async fn dropping_before_the_master_arrives_removes_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let console = ConsoleSocket::bind(dir.path().join("c2.sock")).unwrap();
        assert!(console.path().exists());
        drop(console);
        assert!(!dir.path().join("c2.sock").exists());
    }
}
