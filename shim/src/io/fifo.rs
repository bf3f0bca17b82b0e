//! The write end of one of containerd's output FIFOs, opened so that containerd never waits on it
//! forever.
//!
//! containerd opens its read end in the background (its fifo package runs a blocking `open(2)`
//! in a goroutine, started when it made the FIFO). Linux wakes a reader waiting in `open` only
//! for a writer that opens after it started waiting: a write end this shim opened, wrote and
//! closed before containerd's `open` ran would leave containerd's reader waiting for a writer
//! forever (its ExecSync never returns: measured, a 0.2 ms exec under load) and the bytes gone
//! with the pipe. runc's shim blocks in a write-only `open` instead; this waits, bounded, for
//! containerd's reader to be there.

use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::AsyncWrite;
use tokio::net::unix::pipe;
use tracing::warn;

/// How long the write end waits for containerd's reader before it opens without one.
pub const READER_WAIT: Duration = Duration::from_secs(10);
/// The longest pause between two tries.
const RETRY_CAP: Duration = Duration::from_millis(20);

/// An output FIFO's write end, with a read end of our own held beside it: while containerd is
/// away (a restart) writes still go into the pipe, and the stall rule drops them once it is full,
/// instead of the relay failing with EPIPE.
pub struct FifoWriter {
    sender: pipe::Sender,
    _own_reader: Option<std::fs::File>,
}

impl FifoWriter {
    /// Opens `path` for writing once a reader is there, trying for at most `wait`; past it,
    /// read-write (the output then waits in the pipe for a reader, as long as this end is open).
    pub async fn open(path: &Path, wait: Duration) -> std::io::Result<Self> {
        let deadline = Instant::now() + wait;
        let mut pause = Duration::from_millis(1);
        let sender = loop {
            // Write-only and non-blocking: ENXIO while nobody has the read end open, or is
            // waiting in `open` for it.
            match pipe::OpenOptions::new().open_sender(path) {
                Ok(sender) => break sender,
                Err(e) if e.raw_os_error() == Some(libc::ENXIO) && Instant::now() < deadline => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(RETRY_CAP);
                }
                Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {
                    warn!(fifo = %path.display(), "no reader on containerd's FIFO after {wait:?}; writing without one");
                    return Ok(Self {
                        sender: pipe::OpenOptions::new().read_write(true).open_sender(path)?,
                        _own_reader: None,
                    });
                }
                Err(e) => return Err(e),
            }
        };
        // Never read: it only keeps the pipe writable while containerd's end is closed.
        let own_reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| warn!(fifo = %path.display(), "FIFO's second read end: {e}"))
            .ok();
        Ok(Self { sender, _own_reader: own_reader })
    }
}

impl AsyncWrite for FifoWriter {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.sender).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.sender).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.sender).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{ErrorKind, Read};
    use std::sync::mpsc;
    use tokio::io::AsyncWriteExt;

    fn fifo() -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        (dir, path)
    }

    /// containerd's reader, late: its blocking open runs only after the shim has written and
    /// closed. Before the fix the open never returned (the pipe was gone) and the bytes with it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_late_reader_still_gets_the_output_and_its_end() {
        let (_dir, path) = fifo();
        let (tx, rx) = mpsc::channel();
        let reader_path = path.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            let mut got = Vec::new();
            let read = std::fs::File::open(&reader_path).and_then(|mut f| f.read_to_end(&mut got));
            let _ = tx.send(read.map(|_| got));
        });
        let mut writer = FifoWriter::open(&path, Duration::from_secs(10)).await.unwrap();
        writer.write_all(b"NoNewPrivs:\t1\n").await.unwrap();
        drop(writer);
        let got = tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(10))).await.unwrap();
        if got.is_err() {
            // Free the reader thread's open before failing.
            let _ = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(&path);
        }
        assert_eq!(got.expect("the reader's open returned").unwrap(), b"NoNewPrivs:\t1\n");
    }

    #[tokio::test]
    async fn with_no_reader_it_opens_after_the_wait_and_writes_into_the_pipe() {
        let (_dir, path) = fifo();
        let mut writer = FifoWriter::open(&path, Duration::from_millis(100)).await.unwrap();
        writer.write_all(b"kept").await.unwrap();
        let mut reader = pipe::OpenOptions::new().open_receiver(&path).unwrap();
        let mut got = [0u8; 4];
        tokio::io::AsyncReadExt::read_exact(&mut reader, &mut got).await.unwrap();
        assert_eq!(&got, b"kept");
    }

    #[tokio::test]
    async fn a_missing_fifo_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let e = FifoWriter::open(&dir.path().join("gone"), Duration::from_millis(50)).await.err().unwrap();
        assert_eq!(e.kind(), ErrorKind::NotFound);
    }
}
