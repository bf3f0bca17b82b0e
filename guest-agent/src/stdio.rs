//! Process stdio on the agent side: pipes or a pty toward the process, stream connections
//! toward the shim.
//!
//! Policy for output (stdout, stderr, tty), per stream, in its own task so no stream can
//! block another:
//! - No reader attached: output goes to a backlog of at most `backlog` bytes; beyond that
//!   the OLDEST bytes are dropped (and counted). The process never blocks.
//! - Reader attached: output is written through (backpressure: a slow reader slows the
//!   process, as a pipe would). A reader that accepts nothing for `stall` is disconnected
//!   and the stream falls back to the backlog, so the process is never stuck for longer.
//! - At the process's EOF the reader gets everything and then EOF. A reader attaching after
//!   EOF gets the backlog and EOF.
//!
//! Input (stdin, tty input) is copied as the process consumes it; backpressure goes to the
//! shim's connection, which costs the agent nothing.

use std::{
    collections::VecDeque,
    io,
    os::fd::{AsRawFd, OwnedFd},
    pin::Pin,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    task::{Context, Poll},
    time::Duration,
};

use bulkhead_protocol::stream::StreamKind;
use tokio::{
    io::{unix::AsyncFd, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf},
    sync::{mpsc, watch, Notify},
};

use crate::transport::Conn;

pub type BoxWrite = Box<dyn AsyncWrite + Send + Unpin>;
pub type BoxRead = Box<dyn AsyncRead + Send + Unpin>;

#[derive(Debug, Clone, Copy)]
pub struct PumpOpts {
    pub backlog: usize,
    pub stall: Duration,
}

/// Handle to an output pump; dropping it ends the pump (the process was removed).
pub struct OutputStream {
    attach: mpsc::Sender<BoxWrite>,
    /// Set once the process's end of the output is reached and handed on: written and shut
    /// down to the attached reader, or left in the backlog when none is attached.
    handed_on: watch::Receiver<bool>,
}

impl OutputStream {
    pub fn spawn(source: impl AsyncRead + Send + Unpin + 'static, opts: PumpOpts, label: String) -> Self {
        let (tx, rx) = mpsc::channel(4);
        let (done_tx, done_rx) = watch::channel(false);
        tokio::spawn(pump(source, rx, opts, label, done_tx));
        Self { attach: tx, handed_on: done_rx }
    }

    pub fn attach(&self, w: BoxWrite) -> Result<(), String> {
        self.attach.try_send(w).map_err(|_| "output stream is busy or finished".to_owned())
    }

    /// Waits until the output is handed on (see the field), or the pump is gone.
    pub async fn handed_on(&self) {
        let mut rx = self.handed_on.clone();
        let _ = rx.wait_for(|done| *done).await;
    }
}

/// Output bytes every pump of this agent dropped (one agent per pod): reported in Version.
static DROPPED_OUTPUT_BYTES: AtomicU64 = AtomicU64::new(0);

pub fn dropped_output_bytes() -> u64 {
    DROPPED_OUTPUT_BYTES.load(Ordering::Relaxed)
}

struct Backlog {
    buf: VecDeque<u8>,
    cap: usize,
    dropped: u64,
}

impl Backlog {
    fn push(&mut self, data: &[u8]) {
        self.buf.extend(data);
        if self.buf.len() > self.cap {
            let excess = self.buf.len() - self.cap;
            self.buf.drain(..excess);
            self.dropped += excess as u64;
            DROPPED_OUTPUT_BYTES.fetch_add(excess as u64, Ordering::Relaxed);
        }
    }
}

async fn write_timed(w: &mut BoxWrite, data: &[u8], stall: Duration) -> bool {
    matches!(
        tokio::time::timeout(stall, async {
            w.write_all(data).await?;
            w.flush().await
        })
        .await,
        Ok(Ok(()))
    )
}

async fn pump(
    mut source: impl AsyncRead + Send + Unpin,
    mut attach: mpsc::Receiver<BoxWrite>,
    opts: PumpOpts,
    label: String,
    handed_on: watch::Sender<bool>,
) {
    let mut backlog = Backlog { buf: VecDeque::new(), cap: opts.backlog, dropped: 0 };
    let mut reader: Option<BoxWrite> = None;
    let mut eof = false;
    let mut buf = vec![0u8; 32 << 10];
    loop {
        tokio::select! {
            att = attach.recv() => {
                let Some(mut w) = att else { break };
                let pending: Vec<u8> = backlog.buf.drain(..).collect();
                if !pending.is_empty() && !write_timed(&mut w, &pending, opts.stall).await {
                    tracing::warn!(stream = %label, "reader stalled on backlog; disconnected");
                    backlog.push(&pending);
                    continue;
                }
                if eof {
                    let _ = tokio::time::timeout(opts.stall, w.shutdown()).await;
                } else {
                    // A new reader replaces an old one (a reconnecting shim).
                    reader = Some(w);
                }
            }
            r = source.read(&mut buf), if !eof => {
                // EIO from a pty master after the last slave closes is its EOF.
                let n = r.unwrap_or(0);
                if n == 0 {
                    eof = true;
                    if let Some(mut w) = reader.take() {
                        let _ = tokio::time::timeout(opts.stall, w.shutdown()).await;
                    }
                    handed_on.send_replace(true);
                    continue;
                }
                let chunk = &buf[..n];
                match reader.as_mut() {
                    Some(w) => {
                        if !write_timed(w, chunk, opts.stall).await {
                            tracing::warn!(stream = %label, stall = ?opts.stall,
                                "reader accepted nothing; disconnected, buffering");
                            reader = None;
                            backlog.push(chunk);
                        }
                    }
                    None => backlog.push(chunk),
                }
            }
        }
    }
    if backlog.dropped > 0 {
        tracing::warn!(stream = %label, dropped = backlog.dropped, "output dropped (no reader)");
    }
}

/// The writable side of a process's input.
pub struct StdinSink {
    writer: Mutex<Option<BoxWrite>>,
    close: Arc<Notify>,
}

impl Drop for StdinSink {
    fn drop(&mut self) {
        // Ends an attached copy task: the process is gone.
        self.close.notify_one();
    }
}

impl StdinSink {
    pub fn new(w: BoxWrite) -> Self {
        Self { writer: Mutex::new(Some(w)), close: Arc::new(Notify::new()) }
    }

    fn take(&self) -> Option<BoxWrite> {
        self.writer.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Copies `conn` into the process input until either ends, CloseStdin, or the process is
    /// removed. For a pipe, dropping the writer is the process's EOF; for a pty the writer is a
    /// duplicate of the master, so dropping it changes nothing (CloseStdin sends EOT instead).
    pub fn attach(&self, mut conn: BoxRead) -> Result<(), String> {
        let Some(mut w) = self.take() else {
            return Err("stdin is closed or already attached".to_owned());
        };
        let close = self.close.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 16 << 10];
            loop {
                tokio::select! {
                    _ = close.notified() => break,
                    r = conn.read(&mut buf) => match r {
                        Ok(0) | Err(_) => break,
                        Ok(n) => if w.write_all(&buf[..n]).await.is_err() { break },
                    },
                }
            }
            let _ = w.shutdown().await;
        });
        Ok(())
    }

    /// CloseStdin for pipes: the process sees EOF.
    pub fn close(&self) {
        match self.take() {
            Some(w) => drop(w),
            None => self.close.notify_one(),
        }
    }
}

/// A pty master as an async byte stream (tokio's pipe types refuse non-FIFOs).
pub struct PtyMaster {
    fd: AsyncFd<OwnedFd>,
}

impl PtyMaster {
    pub fn new(fd: OwnedFd) -> io::Result<Self> {
        nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK))
            .map_err(io::Error::from)?;
        // SAFETY: we own `fd` (OwnedFd) and it stays open for the AsyncFd's lifetime.
        let fd = unsafe { AsyncFd::register(fd) }.map_err(|e| io::Error::other(e.to_string()))?;
        Ok(Self { fd })
    }
}

impl AsyncRead for PtyMaster {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        loop {
            let mut guard = match self.fd.poll_read_ready(cx) {
                Poll::Ready(r) => r?,
                Poll::Pending => return Poll::Pending,
            };
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|fd| nix::unistd::read(fd.get_ref(), unfilled).map_err(io::Error::from)) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for PtyMaster {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = match self.fd.poll_write_ready(cx) {
                Poll::Ready(r) => r?,
                Poll::Pending => return Poll::Pending,
            };
            match guard.try_io(|fd| nix::unistd::write(fd.get_ref(), data).map_err(io::Error::from)) {
                Ok(r) => return Poll::Ready(r),
                Err(_would_block) => continue,
            }
        }
    }
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// The agent's side of one process's stdio.
pub enum ProcessIo {
    Pipes {
        stdin: Option<StdinSink>,
        stdout: OutputStream,
        stderr: OutputStream,
    },
    Tty {
        /// Kept for TIOCSWINSZ and the EOT of CloseStdin.
        control: OwnedFd,
        output: OutputStream,
        input: StdinSink,
    },
}

impl ProcessIo {
    /// Whether a stream of `kind` can attach, checked before the ack is sent.
    pub fn check(&self, kind: StreamKind) -> Result<(), String> {
        match (self, kind) {
            (ProcessIo::Pipes { stdin: None, .. }, StreamKind::Stdin) => {
                Err("process was created without stdin".to_owned())
            }
            (ProcessIo::Pipes { .. }, StreamKind::Tty) => {
                Err("process has no terminal; open stdin/stdout/stderr".to_owned())
            }
            (ProcessIo::Tty { .. }, StreamKind::Tty) | (ProcessIo::Pipes { .. }, _) => Ok(()),
            (ProcessIo::Tty { .. }, _) => Err("process has a terminal; open one tty stream".to_owned()),
        }
    }

    pub fn attach(&self, kind: StreamKind, conn: Conn) -> Result<(), String> {
        match (self, kind) {
            (ProcessIo::Pipes { stdin, .. }, StreamKind::Stdin) => match stdin {
                Some(s) => s.attach(Box::new(conn)),
                None => Err("process was created without stdin".to_owned()),
            },
            (ProcessIo::Pipes { stdout, .. }, StreamKind::Stdout) => stdout.attach(Box::new(conn)),
            (ProcessIo::Pipes { stderr, .. }, StreamKind::Stderr) => stderr.attach(Box::new(conn)),
            (ProcessIo::Pipes { .. }, StreamKind::Tty) => {
                Err("process has no terminal; open stdin/stdout/stderr".to_owned())
            }
            (ProcessIo::Tty { output, input, .. }, StreamKind::Tty) => {
                let (r, w) = tokio::io::split(conn);
                output.attach(Box::new(w))?;
                // Input may already be attached from an earlier connection; output still works.
                if let Err(e) = input.attach(Box::new(r)) {
                    tracing::debug!("tty input not re-attached: {e}");
                }
                Ok(())
            }
            (ProcessIo::Tty { .. }, _) => Err("process has a terminal; open one tty stream".to_owned()),
        }
    }

    /// Waits, at most `bound`, until every output of the process is handed on (written to its
    /// reader and shut down), so that a process's exit is reported after its output: the shim
    /// gives the output only a short while past the exit, and the output travels on streams of
    /// its own. `bound` covers a process whose output a child of its own still holds open.
    /// Returns whether it was.
    pub async fn output_handed_on(&self, bound: Duration) -> bool {
        let all = async {
            match self {
                ProcessIo::Pipes { stdout, stderr, .. } => {
                    tokio::join!(stdout.handed_on(), stderr.handed_on());
                }
                ProcessIo::Tty { output, .. } => output.handed_on().await,
            }
        };
        tokio::time::timeout(bound, all).await.is_ok()
    }

    pub fn resize(&self, rows: u16, cols: u16) -> Result<(), String> {
        let ProcessIo::Tty { control, .. } = self else {
            return Err("process has no terminal".to_owned());
        };
        let ws = libc::winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
        // SAFETY: TIOCSWINSZ reads a winsize that outlives the call.
        let rc = unsafe { libc::ioctl(control.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
        if rc == 0 {
            Ok(())
        } else {
            Err(format!("TIOCSWINSZ: {}", io::Error::last_os_error()))
        }
    }

    pub fn close_stdin(&self) {
        match self {
            ProcessIo::Pipes { stdin: Some(s), .. } => s.close(),
            ProcessIo::Pipes { stdin: None, .. } => {}
            ProcessIo::Tty { control, .. } => {
                // A terminal's "end of input" is EOT in canonical mode.
                let _ = nix::unistd::write(control, &[4u8]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPTS: PumpOpts = PumpOpts { backlog: 8, stall: Duration::from_secs(5) };

    #[tokio::test]
    async fn backlog_keeps_the_newest_bytes_until_a_reader_attaches() {
        let dropped_before = dropped_output_bytes();
        let (mut proc_w, proc_r) = tokio::io::duplex(64);
        let out = OutputStream::spawn(proc_r, OPTS, "t".into());
        proc_w.write_all(b"0123456789abcdef").await.unwrap();
        drop(proc_w); // process exits
        tokio::task::yield_now().await;
        let (reader_side, mut shim) = tokio::io::duplex(64);
        // Let the pump see everything before the reader attaches.
        tokio::time::sleep(Duration::from_millis(50)).await;
        out.attach(Box::new(reader_side)).unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), shim.read_to_end(&mut got)).await.unwrap().unwrap();
        assert_eq!(got, b"89abcdef");
        // Other tests' pumps count into the same agent-wide total.
        assert!(dropped_output_bytes() >= dropped_before + 8);
    }

    #[tokio::test]
    async fn a_reader_that_never_reads_does_not_block_the_process() {
        let opts = PumpOpts { backlog: 1024, stall: Duration::from_millis(100) };
        let (mut proc_w, proc_r) = tokio::io::duplex(1024);
        let out = OutputStream::spawn(proc_r, opts, "t".into());
        let (reader_side, _shim_never_reads) = tokio::io::duplex(16);
        out.attach(Box::new(reader_side)).unwrap();
        // 1 MiB through a 1 KiB pipe with a reader that never reads: the process-side
        // writes complete because the stalled reader is cut off and output is dropped.
        let data = vec![b'x'; 1 << 20];
        tokio::time::timeout(Duration::from_secs(30), proc_w.write_all(&data))
            .await
            .expect("process blocked on its output")
            .unwrap();
    }

    #[tokio::test]
    async fn stdin_close_gives_the_process_eof() {
        let (proc_stdin_w, mut proc_stdin_r) = tokio::io::duplex(64);
        let sink = StdinSink::new(Box::new(proc_stdin_w));
        let (mut shim, conn) = tokio::io::duplex(64);
        sink.attach(Box::new(conn)).unwrap();
        shim.write_all(b"hi").await.unwrap();
        let mut got = [0u8; 2];
        proc_stdin_r.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hi");
        sink.close();
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), proc_stdin_r.read_to_end(&mut rest)).await.unwrap().unwrap();
        assert!(rest.is_empty());
        assert!(sink.attach(Box::new(tokio::io::empty())).is_err());
    }

    #[tokio::test]
    async fn the_output_is_handed_on_before_the_exit_is_told_unless_a_child_holds_it() {
        let pipes = |stdout| ProcessIo::Pipes {
            stdin: None,
            stdout: OutputStream::spawn(stdout, OPTS, "out".into()),
            stderr: OutputStream::spawn(tokio::io::empty(), OPTS, "err".into()),
        };
        let (mut proc_w, proc_r) = tokio::io::duplex(64);
        let io = pipes(proc_r);
        let (reader_side, mut shim) = tokio::io::duplex(64);
        let ProcessIo::Pipes { stdout, .. } = &io else { unreachable!("made as pipes") };
        stdout.attach(Box::new(reader_side)).unwrap();
        proc_w.write_all(b"9\n").await.unwrap();
        drop(proc_w); // the process exits
        assert!(io.output_handed_on(Duration::from_secs(5)).await);
        // Handed on means already in the stream: the bytes and EOF are there at once.
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_millis(100), shim.read_to_end(&mut got)).await.unwrap().unwrap();
        assert_eq!(got, b"9\n");

        // Output a child still holds open: the exit is told after the bound.
        let (_held, proc_r) = tokio::io::duplex(64);
        assert!(!pipes(proc_r).output_handed_on(Duration::from_millis(50)).await);
    }
}
