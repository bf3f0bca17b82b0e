//! stdio plumbing: containerd's stdio targets (FIFOs, or `file://` log paths) on one side,
//! the agent's stream connections on the other. Kept out of the RPC code.
//!
//! - Outputs (stdout/stderr, or the TTY's output) are relayed until the agent closes the
//!   stream, through a bounded buffer of [`OUTPUT_BUFFER`] bytes per stream. While containerd's
//!   side keeps taking bytes, a full buffer holds the process back as runc's pipe would, so a
//!   flood runs at the pace of containerd's log writer and loses nothing. A reader that takes
//!   nothing for [`READER_STALL`] (a stalled log reader, a containerd restart) no longer holds
//!   it back: the agent's side is read on, and the oldest bytes go, counted in
//!   [`OutputDrops`], never the stream. [`IoSession::finish`] lets the exit path drain them
//!   before TaskExit.
//! - An output FIFO is opened for writing once containerd's reader is there ([`fifo`]).
//! - stdin (or the TTY's input) is copied until containerd's CloseIO, which half-closes the
//!   agent stream. Its FIFO is opened read-write so opening never blocks and containerd's
//!   reopening never yields a spurious EOF.

mod fifo;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bulkhead_protocol::stream::StreamKind;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn, Instrument};

/// Output held per stream while containerd's side does not keep up (1 MiB, as the agent's own
/// backlog): past it the oldest bytes go.
pub const OUTPUT_BUFFER: usize = 1 << 20;
/// Largest write handed to containerd's side at once, and largest read from the agent's.
const WRITE_CHUNK: usize = 64 * 1024;
/// containerd's side that takes nothing for this long stops holding the process back.
pub const READER_STALL: Duration = Duration::from_millis(500);
/// Longest the exit path drains a reader that keeps making progress.
const FINISH_CAP: Duration = Duration::from_secs(10);

/// Bytes of the pod's output the shim dropped (added to the agent's in the pod's metrics).
pub type OutputDrops = Arc<AtomicU64>;

use crate::agent::{AgentClient, AgentClientError};

#[derive(Debug, thiserror::Error)]
pub enum IoError {
    #[error("stdio target {uri:?}: unsupported scheme (use a FIFO path or file://)")]
    Unsupported { uri: String },
    #[error("stdio target {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Agent(#[from] AgentClientError),
}

/// What containerd asked for, verbatim from Create/Exec.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StdioPaths {
    pub stdin: String,
    pub stdout: String,
    pub stderr: String,
    pub terminal: bool,
}

/// One stdio target named by containerd.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Target {
    #[default]
    None,
    Fifo(PathBuf),
    /// `file://` (ctr --log-uri): append to a file.
    File(PathBuf),
}

impl Target {
    pub fn parse(uri: &str) -> Result<Self, IoError> {
        if uri.is_empty() {
            return Ok(Target::None);
        }
        if let Some(path) = uri.strip_prefix("file://") {
            return Ok(Target::File(path.into()));
        }
        if let Some(path) = uri.strip_prefix("fifo://") {
            return Ok(Target::Fifo(path.into()));
        }
        if uri.contains("://") {
            return Err(IoError::Unsupported { uri: uri.into() });
        }
        Ok(Target::Fifo(uri.into()))
    }

    fn is_none(&self) -> bool {
        matches!(self, Target::None)
    }
}

/// containerd's stdio request for one process, parsed once at Create or Exec.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stdio {
    /// What containerd sent, verbatim (State reports it back).
    pub paths: StdioPaths,
    pub stdin: Target,
    pub stdout: Target,
    pub stderr: Target,
    pub terminal: bool,
}

impl Stdio {
    /// Parses containerd's targets; an unsupported scheme or a file as stdin is refused here,
    /// before anything is created.
    pub fn parse(paths: StdioPaths) -> Result<Self, IoError> {
        let stdin = Target::parse(&paths.stdin)?;
        if let Target::File(path) = &stdin {
            return Err(IoError::Unsupported { uri: format!("file://{} as stdin", path.display()) });
        }
        let stdout = Target::parse(&paths.stdout)?;
        let stderr = Target::parse(&paths.stderr)?;
        let terminal = paths.terminal;
        Ok(Self { paths, stdin, stdout, stderr, terminal })
    }

    /// The agent-side streams the process needs.
    pub fn stream_kinds(&self) -> Vec<StreamKind> {
        if self.terminal {
            return vec![StreamKind::Tty];
        }
        [(&self.stdin, StreamKind::Stdin), (&self.stdout, StreamKind::Stdout), (&self.stderr, StreamKind::Stderr)]
            .into_iter()
            .filter(|(target, _)| !target.is_none())
            .map(|(_, kind)| kind)
            .collect()
    }
}

async fn open_writer(target: &Target) -> Result<Option<Box<dyn AsyncWrite + Send + Unpin>>, IoError> {
    match target {
        Target::None => Ok(None),
        Target::Fifo(path) => {
            let writer = fifo::FifoWriter::open(path, fifo::READER_WAIT)
                .await
                .map_err(|source| IoError::Open { path: path.clone(), source })?;
            Ok(Some(Box::new(writer)))
        }
        Target::File(path) => {
            let file = tokio::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .await
                .map_err(|source| IoError::Open { path: path.clone(), source })?;
            Ok(Some(Box::new(file)))
        }
    }
}

fn open_reader(target: &Target) -> Result<Option<Box<dyn AsyncRead + Send + Unpin>>, IoError> {
    match target {
        Target::None => Ok(None),
        Target::Fifo(path) => {
            let receiver = tokio::net::unix::pipe::OpenOptions::new()
                .read_write(true)
                .open_receiver(path)
                .map_err(|source| IoError::Open { path: path.clone(), source })?;
            Ok(Some(Box::new(receiver)))
        }
        // Refused by Stdio::parse already.
        Target::File(path) => Err(IoError::Unsupported { uri: format!("file://{} as stdin", path.display()) }),
    }
}

/// Live copies of one process's stdio.
pub struct IoSession {
    outputs: Vec<JoinHandle<()>>,
    /// The outputs' buffers, for counting what an abandoned drain leaves behind.
    buffers: Vec<Arc<Buffer>>,
    close_stdin: watch::Sender<bool>,
    stdin: Option<JoinHandle<()>>,
    drops: OutputDrops,
}

impl IoSession {
    /// A session with nothing attached (the sandbox's stand-in process).
    pub fn empty() -> Self {
        let (close_stdin, _) = watch::channel(false);
        Self { outputs: Vec::new(), buffers: Vec::new(), close_stdin, stdin: None, drops: OutputDrops::default() }
    }

    /// Opens containerd's targets and the agent streams, and starts copying; output the shim
    /// has to drop is counted in `drops`.
    pub async fn attach(
        agent: &AgentClient,
        container_id: &str,
        exec_id: Option<&str>,
        stdio: &Stdio,
        drops: OutputDrops,
    ) -> Result<Self, IoError> {
        let (stdin, stdout, stderr) = (&stdio.stdin, &stdio.stdout, &stdio.stderr);
        let (close_tx, close_rx) = watch::channel(false);
        let mut session = Self { outputs: Vec::new(), buffers: Vec::new(), close_stdin: close_tx, stdin: None, drops };
        let span = tracing::Span::current();
        if stdio.terminal {
            let stream = agent.open_stream(container_id, exec_id, StreamKind::Tty).await?;
            let (read, write) = stream.into_split();
            if let Some(out) = open_writer(stdout).await? {
                session.relay(read, out, "tty", &span);
            }
            if let Some(input) = open_reader(stdin)? {
                session.stdin = Some(tokio::spawn(copy_in(input, write, close_rx).instrument(span.clone())));
            }
            return Ok(session);
        }
        if let Some(input) = open_reader(stdin)? {
            let stream = agent.open_stream(container_id, exec_id, StreamKind::Stdin).await?;
            session.stdin = Some(tokio::spawn(copy_in(input, stream, close_rx).instrument(span.clone())));
        }
        for (target, kind, name) in [(stdout, StreamKind::Stdout, "stdout"), (stderr, StreamKind::Stderr, "stderr")] {
            if let Some(out) = open_writer(target).await? {
                let stream = agent.open_stream(container_id, exec_id, kind).await?;
                session.relay(stream, out, name, &span);
            }
        }
        Ok(session)
    }

    fn relay<R, W>(&mut self, from: R, to: W, name: &'static str, span: &tracing::Span)
    where
        R: AsyncRead + Send + Unpin + 'static,
        W: AsyncWrite + Send + Unpin + 'static,
    {
        let buffer = Arc::new(Buffer::new(OUTPUT_BUFFER, READER_STALL, self.drops.clone()));
        self.buffers.push(buffer.clone());
        self.outputs.push(tokio::spawn(relay_out(from, to, name, buffer).instrument(span.clone())));
    }

    /// containerd's CloseIO: end the process's stdin.
    pub fn close_stdin(&self) {
        self.close_stdin.send_replace(true);
    }

    /// Lets the outputs drain (the agent closes them after exit) while containerd's side makes
    /// progress, giving up after `stall` without any (or [`FINISH_CAP`] in all), then stops every
    /// copy. A grandchild holding stdout open must not hold up TaskExit for long.
    pub async fn finish(&mut self, stall: Duration) {
        let outputs = std::mem::take(&mut self.outputs);
        let aborts: Vec<_> = outputs.iter().map(|h| h.abort_handle()).collect();
        let deadline = Instant::now() + FINISH_CAP;
        let drained = futures_join_all(outputs);
        tokio::pin!(drained);
        loop {
            if tokio::time::timeout(stall, &mut drained).await.is_ok() {
                break;
            }
            if Instant::now() < deadline && self.buffers.iter().any(|b| b.progressed_within(stall)) {
                continue;
            }
            let left: usize = self.buffers.iter().map(|b| b.abandon()).sum();
            warn!(undelivered_bytes = left, "stdio still open and not drained {stall:?} after exit; closing it");
            aborts.iter().for_each(|a| a.abort());
            break;
        }
        self.close_stdin();
        if let Some(stdin) = self.stdin.take() {
            stdin.abort();
        }
    }
}

impl Drop for IoSession {
    fn drop(&mut self) {
        self.outputs.iter().for_each(|h| h.abort());
        if let Some(stdin) = &self.stdin {
            stdin.abort();
        }
    }
}

async fn futures_join_all(handles: Vec<JoinHandle<()>>) {
    for handle in handles {
        let _ = handle.await;
    }
}

/// One output stream's bytes between the agent's side and containerd's: bounded; when full,
/// the agent's side waits while containerd's makes progress, else the oldest bytes are dropped
/// (and counted).
struct Buffer {
    state: Mutex<BufferState>,
    /// Bytes to write arrived (or the agent's side closed).
    ready: Notify,
    /// containerd's side took a chunk: there is room.
    room: Notify,
    capacity: usize,
    /// How long containerd's side may take nothing before the agent's side stops waiting for it.
    stall: Duration,
    drops: OutputDrops,
}

struct BufferState {
    bytes: VecDeque<u8>,
    /// The agent's side ended: what is left is the last of it.
    closed: bool,
    /// Bytes dropped since the buffer last ran empty (one warning per episode).
    dropped_now: u64,
    /// When containerd's side last started or finished a write.
    last_progress: Instant,
}

impl Buffer {
    fn new(capacity: usize, stall: Duration, drops: OutputDrops) -> Self {
        let state =
            BufferState { bytes: VecDeque::new(), closed: false, dropped_now: 0, last_progress: Instant::now() };
        Self { state: Mutex::new(state), ready: Notify::new(), room: Notify::new(), capacity, stall, drops }
    }

    /// Returns once the buffer has room, or once containerd's side has taken nothing for `stall`
    /// (the next [`Buffer::push`] then drops the oldest bytes).
    async fn wait_for_room(&self) {
        loop {
            let wait = {
                let state = self.lock();
                let since = state.last_progress.elapsed();
                if state.bytes.len() < self.capacity || since >= self.stall {
                    return;
                }
                self.stall - since
            };
            let _ = tokio::time::timeout(wait, self.room.notified()).await;
        }
    }

    /// containerd's side finished a write.
    fn progressed(&self) {
        self.lock().last_progress = Instant::now();
        self.room.notify_one();
    }

    fn progressed_within(&self, window: Duration) -> bool {
        self.lock().last_progress.elapsed() < window
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BufferState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds `chunk`, dropping the oldest bytes past capacity.
    fn push(&self, chunk: &[u8], name: &str) {
        let mut state = self.lock();
        if state.bytes.is_empty() {
            // containerd's side is given its full allowance from when bytes start to wait.
            state.last_progress = Instant::now();
        }
        let over = (state.bytes.len() + chunk.len()).saturating_sub(self.capacity);
        if over > 0 {
            let from_old = over.min(state.bytes.len());
            state.bytes.drain(..from_old);
            if state.dropped_now == 0 {
                warn!(stream = name, "containerd's side is not reading: dropping the oldest output");
            }
            state.dropped_now += over as u64;
            self.drops.fetch_add(over as u64, Ordering::Relaxed);
        }
        let keep = &chunk[chunk.len().saturating_sub(self.capacity)..];
        state.bytes.extend(keep);
        drop(state);
        self.ready.notify_one();
    }

    fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_one();
    }

    /// The next bytes to write; empty once closed and drained.
    async fn next(&self, name: &str) -> Vec<u8> {
        loop {
            {
                let mut state = self.lock();
                if !state.bytes.is_empty() {
                    let n = state.bytes.len().min(WRITE_CHUNK);
                    state.last_progress = Instant::now();
                    let chunk = state.bytes.drain(..n).collect();
                    drop(state);
                    self.room.notify_one();
                    return chunk;
                }
                if state.dropped_now > 0 {
                    info!(stream = name, dropped_bytes = state.dropped_now, "output flows again");
                    state.dropped_now = 0;
                }
                if state.closed {
                    return Vec::new();
                }
            }
            self.ready.notified().await;
        }
    }

    /// Gives up on what is still held (the drain ran out of time): counted as dropped.
    fn abandon(&self) -> usize {
        let mut state = self.lock();
        let left = state.bytes.len();
        state.bytes.clear();
        self.drops.fetch_add(left as u64, Ordering::Relaxed);
        left
    }
}

/// Relays one output stream: the agent's side is read into `buffer` while it has room or
/// containerd's side is stalled, and containerd's side is written at its own pace.
async fn relay_out<R, W>(mut from: R, mut to: W, name: &'static str, buffer: Arc<Buffer>)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let read = async {
        let mut chunk = vec![0u8; WRITE_CHUNK];
        let mut total = 0u64;
        loop {
            buffer.wait_for_room().await;
            match from.read(&mut chunk).await {
                Ok(0) => break,
                Ok(n) => {
                    total += n as u64;
                    buffer.push(&chunk[..n], name);
                }
                Err(e) => {
                    debug!(stream = name, "output read ended: {e}");
                    break;
                }
            }
        }
        buffer.close();
        debug!(stream = name, bytes = total, "output closed");
    };
    let write = async {
        loop {
            let bytes = buffer.next(name).await;
            if bytes.is_empty() {
                break;
            }
            if let Err(e) = to.write_all(&bytes).await {
                // The target is gone for good (a file that fails): the rest has nowhere to go.
                warn!(stream = name, "output write failed: {e}; dropping the rest");
                buffer.drops.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                while !buffer.next(name).await.is_empty() {}
                break;
            }
            buffer.progressed();
        }
        let _ = to.flush().await;
    };
    tokio::join!(read, write);
}

async fn copy_in<R, W>(mut from: R, mut to: W, mut close: watch::Receiver<bool>)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    tokio::select! {
        res = tokio::io::copy(&mut from, &mut to) => {
            if let Err(e) = res {
                debug!("stdin copy ended: {e}");
            }
        }
        _ = close.wait_for(|closed| *closed) => debug!("stdin closed by containerd"),
    }
    // Half-close: the agent sees EOF on the process's stdin.
    let _ = to.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse() {
        assert_eq!(Target::parse("").unwrap(), Target::None);
        assert_eq!(Target::parse("/run/x/stdout").unwrap(), Target::Fifo("/run/x/stdout".into()));
        assert_eq!(Target::parse("file:///var/log/c.log").unwrap(), Target::File("/var/log/c.log".into()));
        assert!(Target::parse("binary:///usr/bin/logger").is_err());
    }

    #[test]
    fn stream_kinds_follow_the_request() {
        let paths =
            StdioPaths { stdin: String::new(), stdout: "/f/out".into(), stderr: "/f/err".into(), terminal: false };
        assert_eq!(Stdio::parse(paths).unwrap().stream_kinds(), vec![StreamKind::Stdout, StreamKind::Stderr]);
        let tty = StdioPaths { stdin: "/f/in".into(), stdout: "/f/out".into(), stderr: String::new(), terminal: true };
        assert_eq!(Stdio::parse(tty).unwrap().stream_kinds(), vec![StreamKind::Tty]);
    }

    #[test]
    fn bad_targets_are_refused_at_parse() {
        let file_stdin = StdioPaths { stdin: "file:///x".into(), ..Default::default() };
        assert!(Stdio::parse(file_stdin).is_err());
        let scheme = StdioPaths { stdout: "binary:///logger".into(), ..Default::default() };
        assert!(Stdio::parse(scheme).is_err());
    }

    #[tokio::test]
    async fn output_copy_reaches_the_fifo_and_stdin_closes_on_request() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("out");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let mut reader = tokio::net::unix::pipe::OpenOptions::new().open_receiver(&fifo).unwrap();
        let writer = open_writer(&Target::Fifo(fifo.clone())).await.unwrap().unwrap();
        let (mut agent_side, shim_side) = tokio::io::duplex(64);
        let buffer = Arc::new(Buffer::new(OUTPUT_BUFFER, READER_STALL, OutputDrops::default()));
        let task = tokio::spawn(relay_out(shim_side, writer, "stdout", buffer));
        agent_side.write_all(b"hello").await.unwrap();
        drop(agent_side);
        task.await.unwrap();
        let mut buf = [0u8; 5];
        tokio::io::AsyncReadExt::read_exact(&mut reader, &mut buf).await.unwrap();
        assert_eq!(&buf, b"hello");

        let (close_tx, close_rx) = watch::channel(false);
        let (input, _keep) = tokio::io::duplex(64);
        let (to_agent, mut agent_end) = tokio::io::duplex(64);
        let stdin = tokio::spawn(copy_in(input, to_agent, close_rx));
        close_tx.send_replace(true);
        stdin.await.unwrap();
        let mut rest = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut agent_end, &mut rest).await.unwrap();
        assert!(rest.is_empty());
    }

    #[tokio::test]
    async fn a_stalled_reader_costs_the_oldest_bytes_counted_never_the_stream() {
        // containerd's side accepts nothing (a 4 KiB pipe nobody reads); the agent's side writes
        // 64 KiB through a 16 KiB buffer and is held up only for the stall allowance.
        let (agent_side, shim_side) = tokio::io::duplex(1024);
        let (stalled, mut later) = tokio::io::duplex(4096);
        let drops = OutputDrops::default();
        let buffer = Arc::new(Buffer::new(16 * 1024, Duration::from_millis(50), drops.clone()));
        let relay = tokio::spawn(relay_out(shim_side, stalled, "stdout", buffer.clone()));
        let mut agent_side = agent_side;
        let data: Vec<u8> = (0..64 * 1024u32).map(|i| (i % 251) as u8).collect();
        tokio::time::timeout(Duration::from_secs(10), agent_side.write_all(&data))
            .await
            .expect("the agent's side never waits for the reader")
            .unwrap();
        drop(agent_side);
        // Only now the reader comes back: it gets what the pipe held, then the newest bytes.
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), later.read_to_end(&mut got)).await.unwrap().unwrap();
        relay.await.unwrap();
        let dropped = drops.load(Ordering::Relaxed) as usize;
        assert!(dropped > 0, "something was dropped");
        assert_eq!(got.len() + dropped, data.len(), "every byte delivered or counted");
        assert!(data.ends_with(&got[got.len() - 16 * 1024..]), "the newest bytes arrive");
    }

    #[tokio::test]
    async fn a_slow_reader_that_keeps_reading_loses_nothing() {
        // containerd's side reads 1 KiB at a time with pauses shorter than the stall allowance:
        // the agent's side is held back instead, and every byte arrives in order.
        let (mut agent_side, shim_side) = tokio::io::duplex(1024);
        let (to_containerd, mut containerd) = tokio::io::duplex(1024);
        let drops = OutputDrops::default();
        let buffer = Arc::new(Buffer::new(4 * 1024, Duration::from_secs(5), drops.clone()));
        let relay = tokio::spawn(relay_out(shim_side, to_containerd, "stdout", buffer));
        let data: Vec<u8> = (0..64 * 1024u32).map(|i| (i % 251) as u8).collect();
        let writer = {
            let data = data.clone();
            tokio::spawn(async move {
                agent_side.write_all(&data).await.unwrap();
            })
        };
        let mut got = Vec::new();
        let mut chunk = [0u8; 1024];
        loop {
            let n = tokio::time::timeout(Duration::from_secs(10), containerd.read(&mut chunk)).await.unwrap().unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&chunk[..n]);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        writer.await.unwrap();
        relay.await.unwrap();
        assert_eq!(drops.load(Ordering::Relaxed), 0, "nothing dropped");
        assert!(got == data, "every byte, in order");
    }

    #[test]
    fn a_chunk_larger_than_the_buffer_keeps_its_end() {
        let drops = OutputDrops::default();
        let buffer = Buffer::new(4, READER_STALL, drops.clone());
        buffer.push(b"ab", "stdout");
        buffer.push(b"cdefgh", "stdout");
        assert_eq!(buffer.lock().bytes.iter().copied().collect::<Vec<_>>(), b"efgh");
        assert_eq!(drops.load(Ordering::Relaxed), 4);
        assert_eq!(buffer.abandon(), 4);
        assert_eq!(drops.load(Ordering::Relaxed), 8);
    }
}
