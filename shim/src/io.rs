//! stdio plumbing: containerd's stdio targets (FIFOs, or `file://` log paths) on one side,
//! the agent's stream connections on the other. Kept out of the RPC code.
//!
//! - Outputs (stdout/stderr, or the TTY's output) are copied until the agent closes the
//!   stream; [`IoSession::wait_output`] lets the exit path drain them before TaskExit.
//! - stdin (or the TTY's input) is copied until containerd's CloseIO, which half-closes the
//!   agent stream. FIFOs are opened read-write so opening never blocks and containerd's
//!   reopening never yields a spurious EOF.

use std::path::PathBuf;
use std::time::Duration;

use bulkhead_protocol::stream::StreamKind;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, warn, Instrument};

use crate::agent::{AgentClient, AgentError};

#[derive(Debug, thiserror::Error)]
pub enum IoError {
    #[error("stdio target {uri:?}: unsupported scheme (use a FIFO path or file://)")]
    Unsupported { uri: String },
    #[error("stdio target {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Agent(#[from] AgentError),
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
            let sender = tokio::net::unix::pipe::OpenOptions::new()
                .read_write(true)
                .open_sender(path)
                .map_err(|source| IoError::Open { path: path.clone(), source })?;
            Ok(Some(Box::new(sender)))
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
    close_stdin: watch::Sender<bool>,
    stdin: Option<JoinHandle<()>>,
}

impl IoSession {
    /// A session with nothing attached (the sandbox's stand-in process).
    pub fn empty() -> Self {
        let (close_stdin, _) = watch::channel(false);
        Self { outputs: Vec::new(), close_stdin, stdin: None }
    }

    /// Opens containerd's targets and the agent streams, and starts copying.
    pub async fn attach(
        agent: &AgentClient,
        container_id: &str,
        exec_id: Option<&str>,
        stdio: &Stdio,
    ) -> Result<Self, IoError> {
        let (stdin, stdout, stderr) = (&stdio.stdin, &stdio.stdout, &stdio.stderr);
        let (close_tx, close_rx) = watch::channel(false);
        let mut session = Self { outputs: Vec::new(), close_stdin: close_tx, stdin: None };
        let span = tracing::Span::current();
        if stdio.terminal {
            let stream = agent.open_stream(container_id, exec_id, StreamKind::Tty).await?;
            let (read, write) = stream.into_split();
            if let Some(out) = open_writer(stdout).await? {
                session.outputs.push(tokio::spawn(copy_out(read, out, "tty").instrument(span.clone())));
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
                session.outputs.push(tokio::spawn(copy_out(stream, out, name).instrument(span.clone())));
            }
        }
        Ok(session)
    }

    /// containerd's CloseIO: end the process's stdin.
    pub fn close_stdin(&self) {
        self.close_stdin.send_replace(true);
    }

    /// Waits up to `limit` for the outputs to drain (the agent closes them after exit), then
    /// stops every copy. A grandchild holding stdout open must not hold up TaskExit forever.
    pub async fn finish(&mut self, limit: Duration) {
        let outputs = std::mem::take(&mut self.outputs);
        let aborts: Vec<_> = outputs.iter().map(|h| h.abort_handle()).collect();
        if tokio::time::timeout(limit, futures_join_all(outputs)).await.is_err() {
            warn!("stdio still open {limit:?} after exit; closing it");
            aborts.iter().for_each(|a| a.abort());
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

async fn copy_out<R, W>(mut from: R, mut to: W, name: &'static str)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    match tokio::io::copy(&mut from, &mut to).await {
        Ok(n) => debug!(stream = name, bytes = n, "output closed"),
        Err(e) => debug!(stream = name, "output copy ended: {e}"),
    }
    let _ = to.flush().await;
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
        let task = tokio::spawn(copy_out(shim_side, writer, "stdout"));
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
}
