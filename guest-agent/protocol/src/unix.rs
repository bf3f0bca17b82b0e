//! Dialing a Unix socket whose path a less privileged process can write: the jailed VMM owns the
//! directory of its API and hybrid-vsock sockets. `connect(2)` follows a symlink in the last
//! component, so a VMM that put `api.sock -> /run/containerd/containerd.sock` (or another pod's
//! agent socket) there would have root dial whatever it named. [`connect_no_follow`] takes the
//! last component only as a socket itself, never through a link, and connects to that inode.

use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use tokio::net::UnixStream;

/// Connects to the socket at `path`, refusing a symlink or anything but a socket there.
pub async fn connect_no_follow(path: &Path) -> std::io::Result<UnixStream> {
    // O_PATH opens the inode without opening the socket; with O_NOFOLLOW, a link is the link.
    let handle = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    let kind = handle.metadata()?.file_type();
    if !kind.is_socket() {
        let what = if kind.is_symlink() { "a symlink" } else { "not a socket" };
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} is {what}: refused", path.display()),
        ));
    }
    // The magic link names exactly the inode checked above, whatever is at `path` by now.
    let by_fd = format!("/proc/self/fd/{}", handle.as_raw_fd());
    let stream = UnixStream::connect(&by_fd).await;
    drop(handle);
    stream
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_socket_is_dialed_and_a_link_or_a_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("real.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let _dialed = connect_no_follow(&socket).await.expect("the socket itself");
        listener.accept().await.expect("the dial reached the listener");

        let link = dir.path().join("api.sock");
        std::os::unix::fs::symlink(&socket, &link).unwrap();
        let err = connect_no_follow(&link).await.unwrap_err();
        assert!(err.to_string().contains("a symlink"), "{err}");
        assert!(UnixStream::connect(&link).await.is_ok(), "a plain connect would have followed it");

        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        assert!(connect_no_follow(&file).await.unwrap_err().to_string().contains("not a socket"));
        assert!(connect_no_follow(&dir.path().join("missing")).await.is_err());
    }
}
