//! A small client of the VMM's API socket: one JSON request line out, one bounded response line
//! back, the whole exchange under one deadline (the contract is `bulkhead_vmm_api::api`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use bulkhead_vmm_api::api::{encode_line, parse_response, MessageError, Request, Response, VmInfo, MAX_RESPONSE_LINE};
use bulkhead_vmm_api::memory::Mib;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{request:?} at {socket}: {source}")]
    Io { request: Request, socket: PathBuf, source: std::io::Error },
    #[error("{request:?} at {socket}: no answer within {timeout:?}")]
    Timeout { request: Request, socket: PathBuf, timeout: Duration },
    #[error("{request:?} at {socket}: the VMM closed the connection without answering")]
    Closed { request: Request, socket: PathBuf },
    #[error("{request:?} at {socket}: {source}")]
    BadReply { request: Request, socket: PathBuf, source: MessageError },
    #[error("{request:?}: the VMM refused: {message}")]
    Refused { request: Request, message: String },
}

/// The API socket of one VM.
#[derive(Debug, Clone)]
pub struct VmmApi {
    socket: PathBuf,
    timeout: Duration,
}

impl VmmApi {
    pub fn new(socket: &Path, timeout: Duration) -> Self {
        Self { socket: socket.to_owned(), timeout }
    }

    /// Sends `request` and returns the VMM's answer, refusals included.
    pub async fn call(&self, request: Request) -> Result<Response, ApiError> {
        let timeout = self.timeout;
        match tokio::time::timeout(timeout, self.exchange(&request)).await {
            Ok(result) => result,
            Err(_) => Err(ApiError::Timeout { request, socket: self.socket.clone(), timeout }),
        }
    }

    async fn exchange(&self, request: &Request) -> Result<Response, ApiError> {
        let io = |source| ApiError::Io { request: request.clone(), socket: self.socket.clone(), source };
        // The VMM's run/ is the jail's: never dial through a link it put there.
        let mut stream = bulkhead_protocol::unix::connect_no_follow(&self.socket).await.map_err(io)?;
        stream.write_all(&encode_line(request)).await.map_err(io)?;
        // One byte over the limit is enough to know the line is too long.
        let mut reader = BufReader::new(stream).take(MAX_RESPONSE_LINE as u64 + 1);
        let mut line = Vec::new();
        reader.read_until(b'\n', &mut line).await.map_err(io)?;
        match line.pop() {
            Some(b'\n') => {}
            None => return Err(ApiError::Closed { request: request.clone(), socket: self.socket.clone() }),
            Some(last) => {
                line.push(last);
                if line.len() <= MAX_RESPONSE_LINE {
                    return Err(ApiError::Closed { request: request.clone(), socket: self.socket.clone() });
                }
            }
        }
        parse_response(&line).map_err(|source| ApiError::BadReply {
            request: request.clone(),
            socket: self.socket.clone(),
            source,
        })
    }

    /// Sends `request`; a refusal is an error.
    async fn command(&self, request: Request) -> Result<Response, ApiError> {
        let response = self.call(request.clone()).await?;
        if !response.ok {
            return Err(ApiError::Refused { request, message: response.error.unwrap_or_default() });
        }
        Ok(response)
    }

    pub async fn pause(&self) -> Result<(), ApiError> {
        self.command(Request::Pause).await.map(drop)
    }

    pub async fn resume(&self) -> Result<(), ApiError> {
        self.command(Request::Resume).await.map(drop)
    }

    /// Pauses the VM and writes its snapshot into `dir` (a path inside the VMM's jail); the VM
    /// stays paused.
    pub async fn snapshot(&self, dir: &Path) -> Result<(), ApiError> {
        self.command(Request::Snapshot { dir: dir.to_owned() }).await.map(drop)
    }

    /// Asks the guest to hold `mib` in its balloon (0: give it all back).
    pub async fn balloon(&self, mib: Mib) -> Result<(), ApiError> {
        self.command(Request::Balloon { mib }).await.map(drop)
    }

    pub async fn info(&self) -> Result<VmInfo, ApiError> {
        let response = self.command(Request::Info).await?;
        response.info.ok_or_else(|| ApiError::BadReply {
            request: Request::Info,
            socket: self.socket.clone(),
            source: MessageError::Parse("an info answer without info".into()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_vmm_api::api::{parse_request, RunState};
    use tokio::net::UnixListener;

    /// How the fake VMM answers a request (raw bytes).
    type Reply = fn(Request) -> Vec<u8>;

    /// A fake VMM API: reads one request line and answers `reply(request)`.
    fn serve(dir: &Path, reply: Reply) -> PathBuf {
        let socket = dir.join("api.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut reader = BufReader::new(stream);
                    let mut line = Vec::new();
                    if reader.read_until(b'\n', &mut line).await.is_err() {
                        return;
                    }
                    let request = parse_request(line.strip_suffix(b"\n").unwrap_or(&line)).unwrap();
                    let _ = reader.get_mut().write_all(&reply(request)).await;
                    // Hold the connection a while: a missing newline must not look like EOF.
                    tokio::time::sleep(Duration::from_secs(2)).await;
                });
            }
        });
        socket
    }

    fn api(socket: &Path) -> VmmApi {
        VmmApi::new(socket, Duration::from_millis(500))
    }

    #[tokio::test]
    async fn pause_resume_and_info() {
        let dir = tempfile::tempdir().unwrap();
        let socket = serve(dir.path(), |request| match request {
            Request::Info => encode_line(&Response {
                ok: true,
                error: None,
                info: Some(VmInfo {
                    state: RunState::Running,
                    pid: 1,
                    vcpus: 1,
                    mem_mib: bulkhead_vmm_api::memory::Mib(256),
                    irqchip: true,
                    start_unix_ns: 10,
                    first_kvm_run_unix_ns: Some(20),
                    restore: None,
                    boot: None,
                    balloon: None,
                }),
                snapshot: None,
                restore: None,
            }),
            Request::Resume => encode_line(&Response::error("not paused")),
            _ => encode_line(&Response::ok()),
        });
        let api = api(&socket);
        api.pause().await.unwrap();
        assert_eq!(api.info().await.unwrap().first_kvm_run_unix_ns, Some(20));
        let err = api.resume().await.unwrap_err();
        assert!(matches!(&err, ApiError::Refused { message, .. } if message == "not paused"), "{err}");
    }

    #[tokio::test]
    async fn hostile_or_silent_answers_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let cases: [(&str, Reply); 4] = [
            ("junk", |_| b"{\"ok\": maybe}\n".to_vec()),
            ("endless", |_| vec![b'x'; MAX_RESPONSE_LINE * 2]),
            ("silent", |_| Vec::new()),
            ("no info", |_| encode_line(&Response::ok())),
        ];
        for (name, reply) in cases {
            let sub = dir.path().join(name.replace(' ', "_"));
            std::fs::create_dir(&sub).unwrap();
            let api = api(&serve(&sub, reply));
            let started = std::time::Instant::now();
            let err = api.info().await.unwrap_err();
            assert!(started.elapsed() < Duration::from_secs(2), "{name}: {:?}", started.elapsed());
            match name {
                "junk" => assert!(matches!(err, ApiError::BadReply { source: MessageError::Parse(_), .. }), "{err}"),
                "endless" => {
                    assert!(matches!(err, ApiError::BadReply { source: MessageError::TooLong(_), .. }), "{err}")
                }
                "silent" => assert!(matches!(err, ApiError::Timeout { .. }), "{err}"),
                _ => assert!(matches!(err, ApiError::BadReply { .. }), "{err}"),
            }
        }
        let gone = api(&dir.path().join("missing.sock"));
        assert!(matches!(gone.pause().await.unwrap_err(), ApiError::Io { .. }));
    }
}
