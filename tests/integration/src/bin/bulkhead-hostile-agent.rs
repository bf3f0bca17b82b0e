//! A hostile stand-in for `bulkhead-agent` (namespace mode), for `tests/hostile_agent.rs`: it
//! runs the real agent behind it and sits on the agent's socket, passing connections through
//! until the shim calls the trigger method; then it misbehaves on that reply:
//!
//! - `stall`: sends half of the reply frame, then nothing more;
//! - `huge-length`: sends a frame header declaring 2 GiB;
//! - `wrong-type`: sends the reply with an unknown message type;
//! - `big-error`: answers with a 1 MiB error text;
//! - `close`: closes the connection instead of answering;
//! - `oom-flood`: once a container exists, answers every OOM long-poll at once with an event
//!   for it (the trigger is then `GetOomEvent`);
//! - `stdout-flood`: writes lines to its stdout as fast as the pipe takes them (no trigger).
//!
//! Usage (as the shim config's `agent_path`, through a wrapper script):
//! `bulkhead-hostile-agent --fault KIND --on METHOD --real AGENT -- <agent args>`.
//! Test code: it stops only with its pod (it is the pod's PID 1).

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bulkhead_protocol::agent as pb;
use bulkhead_protocol::{handshake, ports};
use protobuf::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::{UnixListener, UnixStream};

const HEADER: usize = 10;
const TYPE_REQUEST: u8 = 1;
const TYPE_RESPONSE: u8 = 2;
/// Largest frame this proxy forwards (ttrpc's own limit).
const MAX_FRAME: usize = 4 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Stall,
    HugeLength,
    WrongType,
    BigError,
    Close,
    OomFlood,
    StdoutFlood,
}

impl Fault {
    fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "stall" => Self::Stall,
            "huge-length" => Self::HugeLength,
            "wrong-type" => Self::WrongType,
            "big-error" => Self::BigError,
            "close" => Self::Close,
            "oom-flood" => Self::OomFlood,
            "stdout-flood" => Self::StdoutFlood,
            other => bail!("unknown fault {other:?}"),
        })
    }
}

struct Args {
    fault: Fault,
    on: String,
    real: PathBuf,
    agent_args: Vec<String>,
}

fn parse_args() -> Result<Args> {
    let mut args = std::env::args().skip(1);
    let (mut fault, mut on, mut real) = (None, String::new(), None);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--fault" => fault = Some(Fault::parse(&args.next().context("--fault needs a value")?)?),
            "--on" => on = args.next().context("--on needs a value")?,
            "--real" => real = Some(PathBuf::from(args.next().context("--real needs a value")?)),
            "--" => break,
            other => bail!("unknown argument {other:?}"),
        }
    }
    Ok(Args {
        fault: fault.context("--fault is required")?,
        on,
        real: real.context("--real is required")?,
        agent_args: args.collect(),
    })
}

/// What the proxy has seen on the ttrpc connections of this pod.
#[derive(Default)]
struct Seen {
    /// Method of each outstanding request, by stream id.
    methods: HashMap<u32, String>,
    /// The first container created in the pod (the OOM flood names it).
    container: Option<String>,
    /// The OOM poll forwarded to the real agent before any container existed: (stream, after).
    forwarded_poll: Option<(u32, u64)>,
    /// Streams the proxy answered itself; the real agent's replies to them are dropped.
    answered: HashSet<u32>,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = parse_args()?;
    let listen_at = args.agent_args.iter().position(|a| a == "--listen").context("agent args lack --listen")?;
    let outer = args
        .agent_args
        .get(listen_at + 1)
        .and_then(|a| a.strip_prefix("unix:"))
        .map(PathBuf::from)
        .context("--listen is not unix:<path>")?;
    let inner = outer.with_file_name("real-agent.sock");
    let mut real_args = args.agent_args.clone();
    real_args[listen_at + 1] = format!("unix:{}", inner.display());
    let mut real = tokio::process::Command::new(&args.real).args(&real_args).kill_on_drop(true).spawn()?;

    if args.fault == Fault::StdoutFlood {
        std::thread::spawn(|| {
            let mut out = std::io::stdout().lock();
            for n in 0u64.. {
                if writeln!(out, "hostile agent flood line {n}").is_err() {
                    return;
                }
            }
        });
    }

    let deadline = Instant::now() + Duration::from_secs(10);
    while !inner.exists() {
        if Instant::now() > deadline {
            bail!("the real agent never listened at {}", inner.display());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let listener = UnixListener::bind(&outer)?;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let fault = (args.fault, Arc::new(args.on));
    loop {
        tokio::select! {
            status = real.wait() => bail!("the real agent exited: {status:?}"),
            accepted = listener.accept() => {
                let (conn, _) = accepted?;
                let (inner, seen, fault) = (inner.clone(), seen.clone(), (fault.0, fault.1.clone()));
                tokio::spawn(async move {
                    if let Err(e) = proxy(conn, &inner, seen, fault.0, &fault.1).await {
                        eprintln!("hostile agent: connection: {e:#}");
                    }
                });
            }
        }
    }
}

/// Reads one preamble line byte by byte (nothing after the newline).
async fn read_line(s: &mut UnixStream) -> Result<Vec<u8>> {
    let mut line = Vec::new();
    while line.len() < handshake::MAX_LINE {
        let b = s.read_u8().await?;
        line.push(b);
        if b == b'\n' {
            return Ok(line);
        }
    }
    bail!("preamble too long")
}

async fn proxy(mut client: UnixStream, inner: &Path, seen: Arc<Mutex<Seen>>, fault: Fault, on: &str) -> Result<()> {
    let connect = read_line(&mut client).await?;
    let port = handshake::parse_connect(&connect)?;
    let mut agent = UnixStream::connect(inner).await?;
    agent.write_all(&connect).await?;
    let ok = read_line(&mut agent).await?;
    client.write_all(&ok).await?;
    if port != ports::AGENT_TTRPC {
        tokio::io::copy_bidirectional(&mut client, &mut agent).await?;
        return Ok(());
    }
    let (mut client_rx, client_tx) = client.into_split();
    let (mut agent_rx, mut agent_tx) = agent.into_split();
    let client_tx = Arc::new(tokio::sync::Mutex::new(client_tx));

    // Shim -> agent: note each request's method; the OOM flood answers polls itself.
    let requests = {
        let (seen, client_tx) = (seen.clone(), client_tx.clone());
        async move {
            loop {
                let (header, body) = read_frame(&mut client_rx).await?;
                let stream = u32::from_be_bytes([header[4], header[5], header[6], header[7]]);
                let mut answers = Vec::new();
                let mut forward = true;
                if header[8] == TYPE_REQUEST {
                    let req = ttrpc::Request::parse_from_bytes(&body)?;
                    let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
                    seen.methods.insert(stream, req.method.clone());
                    if req.method == "CreateContainer" && seen.container.is_none() {
                        let id = pb::CreateContainerRequest::parse_from_bytes(&req.payload)?.container_id;
                        if fault == Fault::OomFlood {
                            if let Some((poll, after)) = seen.forwarded_poll.take() {
                                seen.answered.insert(poll);
                                answers.push(oom_reply(poll, after, &id)?);
                            }
                        }
                        seen.container = Some(id);
                    }
                    if fault == Fault::OomFlood && req.method == "GetOomEvent" {
                        let after = pb::GetOomEventRequest::parse_from_bytes(&req.payload)?.after_seq;
                        match seen.container.clone() {
                            Some(id) => {
                                seen.methods.remove(&stream);
                                answers.push(oom_reply(stream, after, &id)?);
                                forward = false;
                            }
                            None => seen.forwarded_poll = Some((stream, after)),
                        }
                    }
                }
                if forward {
                    agent_tx.write_all(&header).await?;
                    agent_tx.write_all(&body).await?;
                }
                let mut tx = client_tx.lock().await;
                for answer in answers {
                    tx.write_all(&answer).await?;
                }
            }
            #[allow(unreachable_code)]
            Ok::<(), anyhow::Error>(())
        }
    };

    // Agent -> shim: pass replies through until the trigger method's.
    let replies = async move {
        loop {
            let (mut header, body) = read_frame(&mut agent_rx).await?;
            let stream = u32::from_be_bytes([header[4], header[5], header[6], header[7]]);
            let method = {
                let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
                if seen.answered.remove(&stream) {
                    continue; // the proxy already answered this one
                }
                if header[8] == TYPE_RESPONSE {
                    seen.methods.remove(&stream)
                } else {
                    None
                }
            };
            let mut tx = client_tx.lock().await;
            if method.as_deref() != Some(on) {
                tx.write_all(&header).await?;
                tx.write_all(&body).await?;
                continue;
            }
            misbehave(fault, &mut tx, &mut header, &body, stream).await?;
            if fault == Fault::Close {
                return Ok(());
            }
        }
    };
    tokio::select! {
        r = requests => r,
        r = replies => r,
    }
}

/// An immediate OOM event for `container`, as the reply to poll `stream`.
fn oom_reply(stream: u32, after: u64, container: &str) -> Result<Vec<u8>> {
    let event = pb::OomEvent { seq: after + 1, container_id: container.into(), at_unix_nanos: 1, ..Default::default() };
    let reply = pb::GetOomEventResponse { event: Some(event).into(), ..Default::default() };
    let response = ttrpc::Response { payload: reply.write_to_bytes()?, ..Default::default() };
    Ok(frame(stream, TYPE_RESPONSE, &response.write_to_bytes()?))
}

async fn misbehave(
    fault: Fault,
    tx: &mut OwnedWriteHalf,
    header: &mut [u8; HEADER],
    body: &[u8],
    stream: u32,
) -> Result<()> {
    match fault {
        Fault::Stall => {
            tx.write_all(header).await?;
            tx.write_all(&body[..body.len() / 2]).await?;
            std::future::pending::<()>().await;
        }
        Fault::HugeLength => {
            header[..4].copy_from_slice(&(2u32 << 30).to_be_bytes());
            tx.write_all(header).await?;
            std::future::pending::<()>().await;
        }
        Fault::WrongType => {
            header[8] = 0x7;
            tx.write_all(header).await?;
            tx.write_all(body).await?;
        }
        Fault::BigError => {
            let status = ttrpc::get_status(ttrpc::Code::NOT_FOUND, "hostile ".repeat(128 * 1024));
            let response = ttrpc::Response { status: Some(status).into(), ..Default::default() };
            tx.write_all(&frame(stream, TYPE_RESPONSE, &response.write_to_bytes()?)).await?;
        }
        Fault::Close => tx.shutdown().await?,
        Fault::OomFlood | Fault::StdoutFlood => {
            tx.write_all(header).await?;
            tx.write_all(body).await?;
        }
    }
    Ok(())
}

fn frame(stream: u32, kind: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(&[kind, 0]);
    out.extend_from_slice(body);
    out
}

async fn read_frame(rx: &mut (impl tokio::io::AsyncRead + Unpin)) -> Result<([u8; HEADER], Vec<u8>)> {
    let mut header = [0u8; HEADER];
    rx.read_exact(&mut header).await?;
    let len = u32::from_be_bytes([header[0], header[1], header[2], header[3]]) as usize;
    if len > MAX_FRAME {
        bail!("frame of {len} bytes");
    }
    let mut body = vec![0u8; len];
    rx.read_exact(&mut body).await?;
    Ok((header, body))
}
