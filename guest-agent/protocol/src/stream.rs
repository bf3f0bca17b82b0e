//! The header that opens every stdio stream connection (port [`crate::ports::AGENT_STREAMS`]).
//!
//! Wire format, version 1 (all integers big-endian):
//!
//! ```text
//! offset size  field
//! 0      4     magic "BHST"
//! 4      1     version (1)
//! 5      1     kind: 1 stdin, 2 stdout, 3 stderr, 4 tty (bidirectional)
//! 6      2     container id length (1..=MAX_ID_LEN)
//! 8      2     exec id length (0..=MAX_ID_LEN; 0 = the container's init process)
//! 10     n     container id (see [`validate_id`])
//! 10+n   m     exec id
//! ```
//!
//! The agent answers with a [`StreamAck`]: `status u8` (0 attached, 1 rejected),
//! `len u16`, then `len` bytes of UTF-8 reason. After an accepted ack the connection
//! carries raw bytes in the stream's direction (both directions for `tty`); end of
//! stream is the connection's EOF.

use std::{fmt, time::Duration};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub const MAGIC: [u8; 4] = *b"BHST";
pub const VERSION: u8 = 1;
/// Longest container or exec id, in bytes.
pub const MAX_ID_LEN: usize = 256;
/// Fixed part of the header.
pub const FIXED_LEN: usize = 10;
/// Longest possible header.
pub const MAX_HEADER_LEN: usize = FIXED_LEN + 2 * MAX_ID_LEN;
/// Longest ack reason.
pub const MAX_ACK_REASON: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamKind {
    Stdin,
    Stdout,
    Stderr,
    /// A terminal: input and output on one connection.
    Tty,
}

impl StreamKind {
    pub fn to_wire(self) -> u8 {
        match self {
            StreamKind::Stdin => 1,
            StreamKind::Stdout => 2,
            StreamKind::Stderr => 3,
            StreamKind::Tty => 4,
        }
    }

    pub fn from_wire(b: u8) -> Option<Self> {
        match b {
            1 => Some(StreamKind::Stdin),
            2 => Some(StreamKind::Stdout),
            3 => Some(StreamKind::Stderr),
            4 => Some(StreamKind::Tty),
            _ => None,
        }
    }
}

impl fmt::Display for StreamKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StreamKind::Stdin => "stdin",
            StreamKind::Stdout => "stdout",
            StreamKind::Stderr => "stderr",
            StreamKind::Tty => "tty",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StreamHeader {
    pub container_id: String,
    /// `None` for the container's init process.
    pub exec_id: Option<String>,
    pub kind: StreamKind,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HeaderError {
    #[error("stream header: bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    #[error("stream header: unsupported version {0} (this side speaks {VERSION})")]
    UnsupportedVersion(u8),
    #[error("stream header: unknown stream kind {0}")]
    UnknownKind(u8),
    #[error("stream header: {0}")]
    BadId(#[from] IdError),
    #[error("stream header: truncated, need {needed} bytes, have {have}")]
    Truncated { needed: usize, have: usize },
    #[error("stream header: i/o: {0}")]
    Io(String),
    #[error("stream header: timed out after {0:?}")]
    Timeout(Duration),
    #[error("stream ack: malformed ({0})")]
    BadAck(&'static str),
    #[error("stream rejected by the agent: {0}")]
    Rejected(String),
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdError {
    #[error("id is empty")]
    Empty,
    #[error("id is {0} bytes, longer than {MAX_ID_LEN}")]
    TooLong(usize),
    #[error("id {0:?} has a character outside [A-Za-z0-9_.-] or does not start alphanumeric")]
    BadChars(String),
}

/// Container and exec ids name directories and cgroups in the agent, so both sides hold them
/// to containerd's own rule: 1..=256 bytes of `[A-Za-z0-9_.-]`, starting alphanumeric.
pub fn validate_id(id: &str) -> Result<(), IdError> {
    if id.is_empty() {
        return Err(IdError::Empty);
    }
    if id.len() > MAX_ID_LEN {
        return Err(IdError::TooLong(id.len()));
    }
    let mut bytes = id.bytes();
    let first_ok = bytes.next().is_some_and(|b| b.is_ascii_alphanumeric());
    let rest_ok = bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if !(first_ok && rest_ok) {
        return Err(IdError::BadChars(id.chars().take(64).collect()));
    }
    Ok(())
}

impl StreamHeader {
    pub fn new(container_id: &str, exec_id: Option<&str>, kind: StreamKind) -> Self {
        Self { container_id: container_id.to_owned(), exec_id: exec_id.map(str::to_owned), kind }
    }

    /// Encodes the header; fails only if an id is invalid.
    pub fn encode(&self) -> Result<Vec<u8>, HeaderError> {
        validate_id(&self.container_id)?;
        let exec = self.exec_id.as_deref().unwrap_or("");
        if !exec.is_empty() {
            validate_id(exec)?;
        }
        let mut out = Vec::with_capacity(FIXED_LEN + self.container_id.len() + exec.len());
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(self.kind.to_wire());
        // Lengths fit: validate_id bounds them by MAX_ID_LEN.
        out.extend_from_slice(&(self.container_id.len() as u16).to_be_bytes());
        out.extend_from_slice(&(exec.len() as u16).to_be_bytes());
        out.extend_from_slice(self.container_id.as_bytes());
        out.extend_from_slice(exec.as_bytes());
        Ok(out)
    }

    /// Decodes a header from the start of `buf`, returning it and the bytes consumed.
    /// [`HeaderError::Truncated`] means "read more"; every other error is final.
    pub fn decode(buf: &[u8]) -> Result<(Self, usize), HeaderError> {
        let fixed = Self::decode_fixed(buf)?;
        let total = FIXED_LEN + fixed.cid_len + fixed.exec_len;
        if buf.len() < total {
            return Err(HeaderError::Truncated { needed: total, have: buf.len() });
        }
        let header = fixed.finish(&buf[FIXED_LEN..total])?;
        Ok((header, total))
    }

    fn decode_fixed(buf: &[u8]) -> Result<Fixed, HeaderError> {
        // Check what we can as early as we can, so garbage fails on its first bytes.
        let have = buf.len();
        let magic_have = have.min(4);
        if buf[..magic_have] != MAGIC[..magic_have] {
            let mut m = [0u8; 4];
            m[..magic_have].copy_from_slice(&buf[..magic_have]);
            return Err(HeaderError::BadMagic(m));
        }
        if have > 4 && buf[4] != VERSION {
            return Err(HeaderError::UnsupportedVersion(buf[4]));
        }
        if have > 5 && StreamKind::from_wire(buf[5]).is_none() {
            return Err(HeaderError::UnknownKind(buf[5]));
        }
        if have < FIXED_LEN {
            return Err(HeaderError::Truncated { needed: FIXED_LEN, have });
        }
        let kind = StreamKind::from_wire(buf[5]).ok_or(HeaderError::UnknownKind(buf[5]))?;
        let cid_len = u16::from_be_bytes([buf[6], buf[7]]) as usize;
        let exec_len = u16::from_be_bytes([buf[8], buf[9]]) as usize;
        if cid_len == 0 {
            return Err(IdError::Empty.into());
        }
        for len in [cid_len, exec_len] {
            if len > MAX_ID_LEN {
                return Err(IdError::TooLong(len).into());
            }
        }
        Ok(Fixed { kind, cid_len, exec_len })
    }

    /// Reads exactly one header from `reader` (never past it), bounded by `timeout`.
    pub async fn read_from<R: AsyncRead + Unpin>(reader: &mut R, timeout: Duration) -> Result<Self, HeaderError> {
        let fut = async {
            let mut fixed_buf = [0u8; FIXED_LEN];
            read_exact(reader, &mut fixed_buf).await?;
            let fixed = Self::decode_fixed(&fixed_buf)?;
            let mut ids = vec![0u8; fixed.cid_len + fixed.exec_len];
            read_exact(reader, &mut ids).await?;
            fixed.finish(&ids)
        };
        tokio::time::timeout(timeout, fut).await.map_err(|_| HeaderError::Timeout(timeout))?
    }

    /// Writes the header.
    pub async fn write_to<W: AsyncWrite + Unpin>(&self, writer: &mut W) -> Result<(), HeaderError> {
        let bytes = self.encode()?;
        writer.write_all(&bytes).await.map_err(io_err)?;
        writer.flush().await.map_err(io_err)
    }

    /// Dialer side: writes the header, then reads the agent's [`StreamAck`] within `timeout`.
    /// Returns `Ok(())` only if the agent attached the stream.
    pub async fn open<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        stream: &mut S,
        timeout: Duration,
    ) -> Result<(), HeaderError> {
        let fut = async {
            self.write_to(stream).await?;
            StreamAck::read_from(stream).await
        };
        match tokio::time::timeout(timeout, fut).await {
            Err(_) => Err(HeaderError::Timeout(timeout)),
            Ok(Err(e)) => Err(e),
            Ok(Ok(StreamAck::Attached)) => Ok(()),
            Ok(Ok(StreamAck::Rejected(reason))) => Err(HeaderError::Rejected(reason)),
        }
    }
}

struct Fixed {
    kind: StreamKind,
    cid_len: usize,
    exec_len: usize,
}

impl Fixed {
    fn finish(&self, ids: &[u8]) -> Result<StreamHeader, HeaderError> {
        let (cid, exec) = ids.split_at(self.cid_len);
        let cid = id_from_bytes(cid)?;
        let exec_id = if exec.is_empty() { None } else { Some(id_from_bytes(exec)?) };
        Ok(StreamHeader { container_id: cid, exec_id, kind: self.kind })
    }
}

fn id_from_bytes(b: &[u8]) -> Result<String, HeaderError> {
    let s =
        std::str::from_utf8(b).map_err(|_| IdError::BadChars(String::from_utf8_lossy(b).chars().take(64).collect()))?;
    validate_id(s)?;
    Ok(s.to_owned())
}

fn io_err(e: std::io::Error) -> HeaderError {
    HeaderError::Io(e.to_string())
}

async fn read_exact<R: AsyncRead + Unpin>(r: &mut R, buf: &mut [u8]) -> Result<(), HeaderError> {
    let mut have = 0;
    while have < buf.len() {
        match r.read(&mut buf[have..]).await.map_err(io_err)? {
            0 => return Err(HeaderError::Truncated { needed: buf.len(), have }),
            n => have += n,
        }
    }
    Ok(())
}

/// The agent's answer to a [`StreamHeader`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamAck {
    Attached,
    Rejected(String),
}

impl StreamAck {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            StreamAck::Attached => vec![0, 0, 0],
            StreamAck::Rejected(reason) => {
                // Truncate on a char boundary so the reason stays valid UTF-8.
                let mut end = reason.len().min(MAX_ACK_REASON);
                while !reason.is_char_boundary(end) {
                    end -= 1;
                }
                let r = &reason.as_bytes()[..end];
                let mut out = vec![1];
                out.extend_from_slice(&(r.len() as u16).to_be_bytes());
                out.extend_from_slice(r);
                out
            }
        }
    }

    pub async fn read_from<R: AsyncRead + Unpin>(reader: &mut R) -> Result<Self, HeaderError> {
        let mut fixed = [0u8; 3];
        read_exact(reader, &mut fixed).await?;
        let len = u16::from_be_bytes([fixed[1], fixed[2]]) as usize;
        match fixed[0] {
            0 if len == 0 => Ok(StreamAck::Attached),
            0 => Err(HeaderError::BadAck("attached ack with a reason")),
            1 if len > MAX_ACK_REASON => Err(HeaderError::BadAck("reason too long")),
            1 => {
                let mut reason = vec![0u8; len];
                read_exact(reader, &mut reason).await?;
                Ok(StreamAck::Rejected(String::from_utf8_lossy(&reason).into_owned()))
            }
            _ => Err(HeaderError::BadAck("unknown status")),
        }
    }

    pub async fn write_to<W: AsyncWrite + Unpin>(&self, w: &mut W) -> Result<(), HeaderError> {
        w.write_all(&self.encode()).await.map_err(io_err)?;
        w.flush().await.map_err(io_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr(cid: &str, exec: Option<&str>, kind: StreamKind) -> StreamHeader {
        StreamHeader::new(cid, exec, kind)
    }

    #[test]
    fn round_trips_every_kind() {
        for kind in [StreamKind::Stdin, StreamKind::Stdout, StreamKind::Stderr, StreamKind::Tty] {
            for exec in [None, Some("exec-1")] {
                let h = hdr("c0ffee.pod_1", exec, kind);
                let mut bytes = h.encode().unwrap();
                let len = bytes.len();
                bytes.extend_from_slice(b"payload");
                let (back, used) = StreamHeader::decode(&bytes).unwrap();
                assert_eq!(back, h);
                assert_eq!(used, len);
            }
        }
    }

    #[test]
    fn every_prefix_is_truncated_not_wrong() {
        let bytes = hdr("abc", Some("e1"), StreamKind::Stdout).encode().unwrap();
        for n in 0..bytes.len() {
            assert!(matches!(StreamHeader::decode(&bytes[..n]), Err(HeaderError::Truncated { .. })), "prefix of {n}");
        }
    }

    #[test]
    fn rejects_malformed_headers() {
        let good = hdr("abc", None, StreamKind::Stdin).encode().unwrap();
        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(matches!(StreamHeader::decode(&bad), Err(HeaderError::BadMagic(_))));
        // Garbage fails on its first byte, without waiting for more.
        assert!(matches!(StreamHeader::decode(b"G"), Err(HeaderError::BadMagic(_))));
        let mut bad = good.clone();
        bad[4] = 2;
        assert_eq!(StreamHeader::decode(&bad), Err(HeaderError::UnsupportedVersion(2)));
        let mut bad = good.clone();
        bad[5] = 9;
        assert_eq!(StreamHeader::decode(&bad), Err(HeaderError::UnknownKind(9)));
        let mut bad = good.clone();
        bad[6..8].copy_from_slice(&0u16.to_be_bytes());
        assert_eq!(StreamHeader::decode(&bad), Err(HeaderError::BadId(IdError::Empty)));
        let mut bad = good.clone();
        bad[6..8].copy_from_slice(&u16::MAX.to_be_bytes());
        assert_eq!(StreamHeader::decode(&bad), Err(HeaderError::BadId(IdError::TooLong(65535))));
        let mut bad = good.clone();
        bad[10] = b'/';
        assert!(matches!(StreamHeader::decode(&bad), Err(HeaderError::BadId(IdError::BadChars(_)))));
        let mut bad = good;
        bad[11] = 0xff;
        assert!(matches!(StreamHeader::decode(&bad), Err(HeaderError::BadId(IdError::BadChars(_)))));
    }

    #[test]
    fn validates_ids() {
        assert!(validate_id("a").is_ok());
        assert!(validate_id(&"a".repeat(MAX_ID_LEN)).is_ok());
        assert_eq!(validate_id(&"a".repeat(MAX_ID_LEN + 1)), Err(IdError::TooLong(MAX_ID_LEN + 1)));
        for bad in ["", "../x", ".hidden", "-x", "a b", "a/b", "é"] {
            assert!(validate_id(bad).is_err(), "{bad:?}");
        }
        assert!(hdr("../etc", None, StreamKind::Stdin).encode().is_err());
        assert!(hdr("ok", Some("bad/exec"), StreamKind::Stdin).encode().is_err());
    }

    #[tokio::test]
    async fn async_read_stops_at_header_end() {
        let h = hdr("ctr", Some("ex"), StreamKind::Tty);
        let (mut a, mut b) = tokio::io::duplex(1024);
        h.write_to(&mut a).await.unwrap();
        a.write_all(b"raw").await.unwrap();
        let back = StreamHeader::read_from(&mut b, Duration::from_secs(5)).await.unwrap();
        assert_eq!(back, h);
        let mut rest = [0u8; 3];
        b.read_exact(&mut rest).await.unwrap();
        assert_eq!(&rest, b"raw");
    }

    #[tokio::test(start_paused = true)]
    async fn async_read_is_bounded_in_time_and_size() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&MAGIC).await.unwrap();
        assert!(matches!(
            StreamHeader::read_from(&mut b, Duration::from_millis(50)).await,
            Err(HeaderError::Timeout(_))
        ));
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(b"BHST\x01\x02\xff\xff\x00\x00").await.unwrap();
        assert!(matches!(
            StreamHeader::read_from(&mut b, Duration::from_secs(1)).await,
            Err(HeaderError::BadId(IdError::TooLong(_)))
        ));
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(b"BHST\x01").await.unwrap();
        drop(a);
        assert!(matches!(
            StreamHeader::read_from(&mut b, Duration::from_secs(1)).await,
            Err(HeaderError::Truncated { .. })
        ));
    }

    #[tokio::test]
    async fn open_reports_ack() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let agent = tokio::spawn(async move {
            let h = StreamHeader::read_from(&mut b, Duration::from_secs(5)).await.unwrap();
            StreamAck::Rejected(format!("no such container {}", h.container_id)).write_to(&mut b).await.unwrap();
        });
        let err = hdr("nope", None, StreamKind::Stdout).open(&mut a, Duration::from_secs(5)).await.unwrap_err();
        assert_eq!(err, HeaderError::Rejected("no such container nope".to_owned()));
        agent.await.unwrap();

        let (mut a, mut b) = tokio::io::duplex(4096);
        StreamAck::Attached.write_to(&mut b).await.unwrap();
        hdr("yes", None, StreamKind::Stdout).open(&mut a, Duration::from_secs(5)).await.unwrap();
    }

    #[tokio::test]
    async fn malformed_acks_are_errors() {
        for bytes in [&b"\x00\x00\x01x"[..], b"\x07\x00\x00", b"\x01\xff\xff"] {
            let (mut a, mut b) = tokio::io::duplex(64);
            a.write_all(bytes).await.unwrap();
            assert!(matches!(StreamAck::read_from(&mut b).await, Err(HeaderError::BadAck(_))));
        }
        let long = StreamAck::Rejected("é".repeat(MAX_ACK_REASON)).encode();
        assert!(long.len() <= 3 + MAX_ACK_REASON);
        assert!(std::str::from_utf8(&long[3..]).is_ok());
    }
}
