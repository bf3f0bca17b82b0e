//! The stdio of a new container process: [`ProcessIoSetup::prepare`] makes the child's ends
//! for libcontainer (pipes, or a console socket for a terminal) and keeps ours pending;
//! [`ProcessIoSetup::finish`], once the process exists, turns ours into a [`ProcessIo`] with
//! its output pumps. Dropping a [`PendingIo`] (a failed create or exec) closes everything.

use std::{
    os::fd::OwnedFd,
    path::PathBuf,
    sync::atomic::{AtomicU64, Ordering},
};

use crate::{
    console::ConsoleSocket,
    error::{AgentError, Result},
    runtime::ChildIo,
    stdio::{OutputStream, ProcessIo, PtyMaster, PumpOpts, StdinSink},
};

pub struct StdioRequest {
    pub terminal: bool,
    pub stdin: bool,
}

/// Our ends, until the process exists.
pub enum PendingIo {
    Pipes { stdin: Option<OwnedFd>, stdout: OwnedFd, stderr: OwnedFd },
    Tty(ConsoleSocket),
}

pub struct ProcessIoSetup {
    sock_dir: PathBuf,
    sock_seq: AtomicU64,
    pump: PumpOpts,
}

impl ProcessIoSetup {
    /// Console sockets go in `sock_dir` (made here).
    pub fn new(sock_dir: PathBuf, pump: PumpOpts) -> std::io::Result<Self> {
        std::fs::create_dir_all(&sock_dir)?;
        Ok(Self { sock_dir, sock_seq: AtomicU64::new(0), pump })
    }

    pub fn prepare(&self, req: &StdioRequest) -> Result<(ChildIo, PendingIo)> {
        if req.terminal {
            let n = self.sock_seq.fetch_add(1, Ordering::Relaxed);
            let console = ConsoleSocket::bind(self.sock_dir.join(format!("c{n}.sock")))?;
            return Ok((ChildIo::Console(console.path().to_path_buf()), PendingIo::Tty(console)));
        }
        let pipe = || nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| AgentError::internal("pipe2", e));
        let (stdin_child, stdin_ours) = if req.stdin {
            let (r, w) = pipe()?;
            (r, Some(w))
        } else {
            let null = std::fs::File::open("/dev/null").map_err(|e| AgentError::internal("open /dev/null", e))?;
            (OwnedFd::from(null), None)
        };
        let (out_r, out_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        Ok((
            ChildIo::Pipes([stdin_child, out_w, err_w]),
            PendingIo::Pipes { stdin: stdin_ours, stdout: out_r, stderr: err_r },
        ))
    }

    /// `label` names the process in the pumps' logs (`<container>/<exec>`).
    pub async fn finish(&self, pending: PendingIo, label: &str) -> Result<ProcessIo> {
        match pending {
            PendingIo::Pipes { stdin, stdout, stderr } => {
                let rx = |fd: OwnedFd| {
                    tokio::net::unix::pipe::Receiver::from_owned_fd(fd).map_err(|e| AgentError::internal("pipe", e))
                };
                let stdin = match stdin {
                    Some(w) => Some(StdinSink::new(Box::new(
                        tokio::net::unix::pipe::Sender::from_owned_fd(w)
                            .map_err(|e| AgentError::internal("pipe", e))?,
                    ))),
                    None => None,
                };
                Ok(ProcessIo::Pipes {
                    stdin,
                    stdout: OutputStream::spawn(rx(stdout)?, self.pump, format!("{label}/stdout")),
                    stderr: OutputStream::spawn(rx(stderr)?, self.pump, format!("{label}/stderr")),
                })
            }
            PendingIo::Tty(console) => {
                let master = console.master().await?;
                let dup = |fd: &OwnedFd| fd.try_clone().map_err(|e| AgentError::internal("dup pty master", e));
                let reader = PtyMaster::new(dup(&master)?).map_err(|e| AgentError::internal("pty", e))?;
                let writer = PtyMaster::new(dup(&master)?).map_err(|e| AgentError::internal("pty", e))?;
                Ok(ProcessIo::Tty {
                    control: master,
                    output: OutputStream::spawn(reader, self.pump, format!("{label}/tty")),
                    input: StdinSink::new(Box::new(writer)),
                })
            }
        }
    }
}
