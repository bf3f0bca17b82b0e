//! One vsock stream between a guest port and a host Unix socket: its state, credit accounting
//! and the data pump in both directions. No virtio and no epoll here.

use std::io::{ErrorKind, Read, Write};
use std::num::Wrapping;
use std::os::unix::net::UnixStream;
use std::time::Instant;

use crate::devices::virtio::vsock::packet::{
    VsockHeader, OP_CREDIT_UPDATE, OP_RESPONSE, OP_RW, OP_SHUTDOWN, SHUTDOWN_RCV, SHUTDOWN_SEND, TYPE_STREAM,
};
use crate::devices::virtio::vsock::HOST_CID;

/// How many bytes from the guest we are willing to hold for a slow host peer.
pub const CONN_BUF_ALLOC: u32 = 256 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnState {
    /// The guest asked for a host port whose listener's backlog was full; the connect is retried
    /// until `deadline`, then the guest gets RST.
    HostConnecting {
        deadline: Instant,
    },
    /// Host connected and sent CONNECT; we sent REQUEST and wait for the guest's RESPONSE.
    LocalInit {
        deadline: Instant,
    },
    Established,
    /// The host side hung up; we sent SHUTDOWN and wait for the guest's RST.
    LocalClosed {
        deadline: Instant,
    },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConnError {
    #[error("guest overran the credit we granted ({0} bytes buffered)")]
    CreditOverrun(usize),
    #[error("host socket: {0}")]
    Host(String),
}

/// What a readable host socket produced.
#[derive(Debug, PartialEq, Eq)]
pub enum HostRead {
    Data(Vec<u8>),
    Eof,
    Nothing,
}

pub struct VsockConnection {
    pub guest_cid: u64,
    pub local_port: u32,
    pub peer_port: u32,
    pub stream: UnixStream,
    pub state: ConnState,
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    /// Bytes we sent to the guest.
    rx_cnt: Wrapping<u32>,
    /// Bytes from the guest delivered to the host socket.
    fwd_cnt: Wrapping<u32>,
    last_fwd_cnt_sent: Wrapping<u32>,
    /// Guest data the host socket has not taken yet.
    pending_to_host: Vec<u8>,
    /// Edge-triggered readiness: true until a read hits WouldBlock.
    pub host_readable: bool,
}

impl VsockConnection {
    pub fn new(guest_cid: u64, local_port: u32, peer_port: u32, stream: UnixStream, state: ConnState) -> Self {
        Self {
            guest_cid,
            local_port,
            peer_port,
            stream,
            state,
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            rx_cnt: Wrapping(0),
            fwd_cnt: Wrapping(0),
            last_fwd_cnt_sent: Wrapping(0),
            pending_to_host: Vec::new(),
            host_readable: true,
        }
    }

    /// A header for a packet to the guest on this connection.
    pub fn header(&mut self, op: u16, len: u32, flags: u32) -> VsockHeader {
        self.last_fwd_cnt_sent = self.fwd_cnt;
        VsockHeader {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: self.local_port,
            dst_port: self.peer_port,
            len,
            type_: TYPE_STREAM,
            op,
            flags,
            buf_alloc: CONN_BUF_ALLOC,
            fwd_cnt: self.fwd_cnt.0,
        }
    }

    pub fn response(&mut self) -> VsockHeader {
        self.header(OP_RESPONSE, 0, 0)
    }

    pub fn credit_update(&mut self) -> VsockHeader {
        self.header(OP_CREDIT_UPDATE, 0, 0)
    }

    pub fn shutdown(&mut self) -> VsockHeader {
        self.header(OP_SHUTDOWN, 0, SHUTDOWN_RCV | SHUTDOWN_SEND)
    }

    /// Every guest packet carries its view of the credit.
    pub fn update_peer_credit(&mut self, hdr: &VsockHeader) {
        self.peer_buf_alloc = hdr.buf_alloc;
        self.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
    }

    /// How much more the guest can take from us.
    pub fn peer_credit(&self) -> u32 {
        let in_flight = (self.rx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Guest data for the host socket.
    pub fn send_to_host(&mut self, data: &[u8]) -> Result<(), ConnError> {
        self.pending_to_host.extend_from_slice(data);
        if self.pending_to_host.len() > CONN_BUF_ALLOC as usize {
            return Err(ConnError::CreditOverrun(self.pending_to_host.len()));
        }
        self.flush_to_host()
    }

    /// Pushes buffered guest data into the host socket (non-blocking).
    pub fn flush_to_host(&mut self) -> Result<(), ConnError> {
        while !self.pending_to_host.is_empty() {
            match self.stream.write(&self.pending_to_host) {
                Ok(0) => return Err(ConnError::Host("socket closed".into())),
                Ok(n) => {
                    self.pending_to_host.drain(..n);
                    self.fwd_cnt += Wrapping(n as u32);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(ConnError::Host(e.to_string())),
            }
        }
        Ok(())
    }

    /// True when the guest should hear about freed buffer space.
    pub fn needs_credit_update(&self) -> bool {
        (self.fwd_cnt - self.last_fwd_cnt_sent).0 >= CONN_BUF_ALLOC / 2
    }

    /// Reads at most `max` bytes (bounded by the guest's credit) from the host socket.
    pub fn read_from_host(&mut self, max: usize) -> HostRead {
        let room = (self.peer_credit() as usize).min(max);
        if room == 0 || !self.host_readable {
            return HostRead::Nothing;
        }
        let mut buf = vec![0u8; room];
        loop {
            match self.stream.read(&mut buf) {
                Ok(0) => return HostRead::Eof,
                Ok(n) => {
                    buf.truncate(n);
                    self.rx_cnt += Wrapping(n as u32);
                    return HostRead::Data(buf);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    self.host_readable = false;
                    return HostRead::Nothing;
                }
                Err(_) => return HostRead::Eof,
            }
        }
    }

    /// Whether this connection has something to say to the guest right now.
    pub fn wants_rx(&self) -> bool {
        self.state == ConnState::Established && self.host_readable && self.peer_credit() > 0
    }

    pub fn rw_header(&mut self, len: u32) -> VsockHeader {
        self.header(OP_RW, len, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn() -> (VsockConnection, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        (VsockConnection::new(3, 1000, 52, a, ConnState::Established), b)
    }

    #[test]
    fn credit_limits_host_to_guest_data() {
        let (mut c, mut peer) = conn();
        peer.write_all(b"0123456789").unwrap();
        assert_eq!(c.read_from_host(100), HostRead::Nothing, "no credit yet");
        c.update_peer_credit(&VsockHeader { buf_alloc: 4, fwd_cnt: 0, ..Default::default() });
        assert_eq!(c.read_from_host(100), HostRead::Data(b"0123".to_vec()));
        assert_eq!(c.peer_credit(), 0);
        c.update_peer_credit(&VsockHeader { buf_alloc: 4, fwd_cnt: 4, ..Default::default() });
        assert_eq!(c.read_from_host(2), HostRead::Data(b"45".to_vec()));
        // shutdown, not drop: another test thread may fork while `peer` is open, and its child
        // holds the socket (until exec) so a close alone would not reach us as EOF.
        peer.shutdown(std::net::Shutdown::Both).unwrap();
        c.update_peer_credit(&VsockHeader { buf_alloc: 100, fwd_cnt: 6, ..Default::default() });
        assert_eq!(c.read_from_host(100), HostRead::Data(b"6789".to_vec()));
        assert_eq!(c.read_from_host(100), HostRead::Eof);
    }

    #[test]
    fn guest_data_reaches_host_and_counts_forwarded_bytes() {
        let (mut c, mut peer) = conn();
        c.send_to_host(b"ping").unwrap();
        let mut got = [0u8; 4];
        std::io::Read::read_exact(&mut peer, &mut got).unwrap();
        assert_eq!(&got, b"ping");
        let h = c.rw_header(0);
        assert_eq!((h.fwd_cnt, h.buf_alloc, h.src_cid, h.dst_cid), (4, CONN_BUF_ALLOC, 2, 3));
    }

    #[test]
    fn guest_ignoring_credit_is_an_error() {
        let (mut c, _peer) = conn();
        let big = vec![0u8; 64 * 1024];
        let mut result = Ok(());
        // The peer never reads, so the socket buffer fills and then our buffer overflows.
        for _ in 0..64 {
            result = c.send_to_host(&big);
            if result.is_err() {
                break;
            }
        }
        assert!(matches!(result, Err(ConnError::CreditOverrun(_))));
    }
}
