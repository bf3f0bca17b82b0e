//! A minimal RFC 6455 client: enough to speak the Kubernetes `v4.channel.k8s.io` protocol to containerd's
//! streaming server, as `crictl exec -it` does (over websocket instead of SPDY); and a TTY exec through it.

use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use k8s_cri::v1 as cri;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub struct Client {
    stream: TcpStream,
}

/// Longest frame accepted from the server.
const MAX_FRAME: u64 = 1 << 20;

impl Client {
    pub async fn connect(url: &str, protocol: &str) -> Result<Self> {
        let rest = url.strip_prefix("http://").context("streaming URL is not http://")?;
        let (host, path) = rest.split_once('/').context("streaming URL has no path")?;
        let mut stream = TcpStream::connect(host).await.with_context(|| format!("connect {host}"))?;
        let request = format!(
            "GET /{path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
             Sec-WebSocket-Protocol: {protocol}\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await?;
        // Read the response head byte by byte so no frame byte is consumed.
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            if head.len() > 8192 {
                bail!("websocket response head too long");
            }
            let mut b = [0u8; 1];
            if stream.read(&mut b).await? == 0 {
                bail!("server closed during handshake: {}", String::from_utf8_lossy(&head));
            }
            head.push(b[0]);
        }
        let head = String::from_utf8_lossy(&head).to_string();
        if !head.starts_with("HTTP/1.1 101") {
            bail!("websocket upgrade refused: {head}");
        }
        Ok(Self { stream })
    }

    /// Sends one binary message: channel byte + data (client frames are masked).
    pub async fn send(&mut self, channel: u8, data: &[u8]) -> Result<()> {
        let mut payload = vec![channel];
        payload.extend_from_slice(data);
        let mask = [0x12u8, 0x34, 0x56, 0x78];
        let mut frame = vec![0x82u8];
        let len = payload.len();
        if len < 126 {
            frame.push(0x80 | len as u8);
        } else {
            frame.push(0x80 | 126);
            frame.extend_from_slice(&(len as u16).to_be_bytes());
        }
        frame.extend_from_slice(&mask);
        frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        self.stream.write_all(&frame).await?;
        Ok(())
    }

    /// Next data message as (channel, bytes); `None` when the server closes.
    pub async fn recv(&mut self) -> Result<Option<(u8, Vec<u8>)>> {
        loop {
            let mut h = [0u8; 2];
            if self.stream.read_exact(&mut h).await.is_err() {
                return Ok(None);
            }
            let opcode = h[0] & 0x0f;
            let mut len = u64::from(h[1] & 0x7f);
            if len == 126 {
                let mut b = [0u8; 2];
                self.stream.read_exact(&mut b).await?;
                len = u64::from(u16::from_be_bytes(b));
            } else if len == 127 {
                let mut b = [0u8; 8];
                self.stream.read_exact(&mut b).await?;
                len = u64::from_be_bytes(b);
            }
            if len > MAX_FRAME {
                bail!("websocket frame of {len} bytes");
            }
            let mut payload = vec![0u8; len as usize];
            self.stream.read_exact(&mut payload).await?;
            match opcode {
                0x8 => return Ok(None),
                0x9 | 0xA => continue,
                _ if payload.is_empty() => continue,
                _ => return Ok(Some((payload[0], payload[1..].to_vec()))),
            }
        }
    }
}

/// What a TTY exec wrote to its terminal, and the status message the streaming server sent at its end.
pub struct TtyExec {
    pub stdout: String,
    pub status: String,
}

/// `sh` in container `ctr` on a terminal (80x24), as `kubectl exec -it` runs it: `input` is typed in (end it with
/// `exit`), and everything the terminal shows comes back. Bounded: 20 s for the whole session.
pub async fn tty_exec(cri: &crate::Cri, ctr: &str, input: &str) -> Result<TtyExec> {
    let url = cri
        .exec(cri::ExecRequest {
            container_id: ctr.into(),
            cmd: vec!["sh".into()],
            tty: true,
            stdin: true,
            stdout: true,
            stderr: false,
        })
        .await?;
    let mut client = Client::connect(&url, "v4.channel.k8s.io").await?;
    client.send(4, br#"{"Width":80,"Height":24}"#).await?;
    client.send(0, input.as_bytes()).await?;
    let (mut stdout, mut status) = (Vec::new(), Vec::new());
    let session = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some((channel, data)) = client.recv().await? {
            match channel {
                1 => stdout.extend_from_slice(&data),
                3 => status.extend_from_slice(&data),
                _ => {}
            }
        }
        anyhow::Ok(())
    })
    .await;
    let stdout = String::from_utf8_lossy(&stdout).into_owned();
    session.map_err(|_| anyhow!("the TTY exec did not finish in 20 s; its terminal so far: {stdout:?}"))??;
    Ok(TtyExec { stdout, status: String::from_utf8_lossy(&status).into_owned() })
}
