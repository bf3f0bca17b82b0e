//! Multiplexes guest vsock streams onto host Unix sockets.
//!
//! - Host-initiated: a client connects to `uds_path` and sends `CONNECT <port>\n` (bounded to
//!   `MAX_HANDSHAKE_LINE` bytes and `HANDSHAKE_TIMEOUT`); we ask the guest (REQUEST) and answer
//!   `OK <local port>\n` once it accepts.
//! - Guest-initiated: a REQUEST to port P connects to `<uds_path>_<P>`, without blocking: a
//!   listener whose backlog is full is retried on the sweep until `HOST_CONNECT_TIMEOUT`, then
//!   the guest gets RST (`connect.rs`).
//!
//! Every log line a guest (or a host client) can repeat at will is throttled (`MuxerLogs`).

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::connect::{stream_socket, try_connect, Attempt};
use crate::devices::virtio::vsock::csm::connection::HostRead;
use crate::devices::virtio::vsock::csm::{ConnState, VsockConnection};
use crate::devices::virtio::vsock::packet::{
    TxPacket, VsockHeader, OP_CREDIT_REQUEST, OP_CREDIT_UPDATE, OP_REQUEST, OP_RESPONSE, OP_RST, OP_RW, OP_SHUTDOWN,
    SHUTDOWN_RCV, SHUTDOWN_SEND, TYPE_STREAM,
};
use crate::devices::virtio::vsock::HOST_CID;
use crate::log_throttle::LogThrottle;
use crate::throttled;

pub const MAX_HANDSHAKE_LINE: usize = 32;
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the guest has to answer a host-initiated REQUEST, or a SHUTDOWN with RST.
pub const GUEST_REPLY_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_HANDSHAKES: usize = 64;
/// How long a guest-initiated connect may wait for room in a host listener's backlog.
pub const HOST_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Guest-initiated connects waiting for a busy host listener; more are refused at once.
pub const MAX_HOST_CONNECTING: usize = 64;
const MAX_CONNECTIONS: usize = 1024;
/// Header-only packets queued for a guest that is not reading its RX queue.
pub const MAX_CONTROL_BACKLOG: usize = 1024;
const FIRST_LOCAL_PORT: u32 = 1 << 30;

/// epoll changes the device must apply (the muxer has no access to the event loop).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FdOp {
    Add(RawFd),
    Remove(RawFd),
}

struct Handshake {
    stream: UnixStream,
    buf: Vec<u8>,
    deadline: Instant,
}

type ConnKey = (u32, u32);

pub struct VsockMuxer {
    guest_cid: u64,
    uds_path: PathBuf,
    listener: UnixListener,
    handshakes: HashMap<RawFd, Handshake>,
    conns: HashMap<ConnKey, VsockConnection>,
    fd_conn: HashMap<RawFd, ConnKey>,
    /// Header-only packets waiting for an RX buffer.
    control: VecDeque<VsockHeader>,
    next_local_port: u32,
    fd_ops: Vec<FdOp>,
    /// Sockets whose fd must leave epoll before they close.
    graveyard: Vec<UnixStream>,
    /// Connections in `HostConnecting`.
    connecting: usize,
    logs: MuxerLogs,
}

/// The muxer's log lines that a guest or a host client can repeat at will, throttled per kind.
#[derive(Default)]
struct MuxerLogs {
    /// Guest packets that are dropped or reset a connection (wrong CIDs, wrong state).
    guest_packets: LogThrottle,
    /// Guest connects to a port nobody listens on (or that fail outright).
    connects_refused: LogThrottle,
    /// Guest connects refused or reset for want of room: too many connections, a busy host
    /// listener that did not take one in time, too many waiting for busy listeners.
    connects_busy: LogThrottle,
    /// Connections reset because a side failed (host write error, guest credit overrun).
    resets: LogThrottle,
    /// Host clients refused (too many, bad CONNECT line, silent).
    host_clients: LogThrottle,
    /// Connections dropped because the guest did not answer in time.
    timeouts: LogThrottle,
    /// Control packets dropped because the guest does not drain its RX queue.
    backlog: LogThrottle,
}

/// Parses `CONNECT <port>` (the newline already stripped).
pub fn parse_connect(line: &[u8]) -> Option<u32> {
    let s = std::str::from_utf8(line).ok()?.trim_end_matches('\r');
    let port = s.strip_prefix("CONNECT ")?;
    if port.is_empty() || port.len() > 10 || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    port.parse().ok()
}

impl VsockMuxer {
    pub fn new(guest_cid: u64, uds_path: &Path) -> std::io::Result<Self> {
        if uds_path.exists() {
            std::fs::remove_file(uds_path)?;
        }
        let listener = UnixListener::bind(uds_path)?;
        // Whoever connects talks to the guest's agent: the VMM's uid (and root) only.
        std::fs::set_permissions(uds_path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        listener.set_nonblocking(true)?;
        Ok(Self {
            guest_cid,
            uds_path: uds_path.to_owned(),
            listener,
            handshakes: HashMap::new(),
            conns: HashMap::new(),
            fd_conn: HashMap::new(),
            control: VecDeque::new(),
            next_local_port: FIRST_LOCAL_PORT,
            fd_ops: Vec::new(),
            graveyard: Vec::new(),
            connecting: 0,
            logs: MuxerLogs::default(),
        })
    }

    pub fn listener_fd(&self) -> RawFd {
        self.listener.as_raw_fd()
    }

    pub fn take_fd_ops(&mut self) -> Vec<FdOp> {
        std::mem::take(&mut self.fd_ops)
    }

    /// Call after the fd ops were applied.
    pub fn bury(&mut self) {
        self.graveyard.clear();
    }

    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// Drops everything (device reset).
    pub fn reset(&mut self) {
        for (fd, h) in self.handshakes.drain() {
            self.fd_ops.push(FdOp::Remove(fd));
            self.graveyard.push(h.stream);
        }
        for (_, c) in self.conns.drain() {
            let fd = c.stream.as_raw_fd();
            // A connect still waiting for its listener was never watched.
            if self.fd_conn.remove(&fd).is_some() {
                self.fd_ops.push(FdOp::Remove(fd));
            }
            self.graveyard.push(c.stream);
        }
        self.fd_conn.clear();
        self.control.clear();
        self.connecting = 0;
    }

    pub fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if self.handshakes.len() >= MAX_HANDSHAKES || stream.set_nonblocking(true).is_err() {
                        throttled!(
                            self.logs.host_clients,
                            warn,
                            "vsock: too many pending host connections; dropping one"
                        );
                        continue;
                    }
                    let fd = stream.as_raw_fd();
                    self.fd_ops.push(FdOp::Add(fd));
                    self.handshakes.insert(
                        fd,
                        Handshake { stream, buf: Vec::new(), deadline: Instant::now() + HANDSHAKE_TIMEOUT },
                    );
                    // Data may already be waiting; edge-triggered epoll will not tell us again.
                    self.read_handshake(fd);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return,
            }
        }
    }

    /// A host fd became ready.
    pub fn on_fd_event(&mut self, fd: RawFd, readable: bool, writable: bool) {
        if self.handshakes.contains_key(&fd) {
            self.read_handshake(fd);
            return;
        }
        let Some(key) = self.fd_conn.get(&fd).copied() else { return };
        let Some(conn) = self.conns.get_mut(&key) else { return };
        if readable {
            conn.host_readable = true;
        }
        if writable {
            if let Err(e) = conn.flush_to_host() {
                throttled!(self.logs.resets, warn, port = key.0, error = %e, "vsock: host write failed; resetting connection");
                self.kill(key, true);
                return;
            }
            if conn.needs_credit_update() {
                let cu = conn.credit_update();
                self.push_control(cu);
            }
        }
    }

    fn read_handshake(&mut self, fd: RawFd) {
        let Some(h) = self.handshakes.get_mut(&fd) else { return };
        let mut byte = [0u8; MAX_HANDSHAKE_LINE];
        let line = loop {
            // Read only up to the limit: never more than one line's worth.
            let room = MAX_HANDSHAKE_LINE - h.buf.len();
            match h.stream.read(&mut byte[..room.max(1)]) {
                Ok(0) => break Err("closed before CONNECT".to_string()),
                Ok(n) => {
                    h.buf.extend_from_slice(&byte[..n]);
                    if let Some(pos) = h.buf.iter().position(|&b| b == b'\n') {
                        if pos + 1 != h.buf.len() {
                            break Err("data after the CONNECT line before OK".into());
                        }
                        break Ok(h.buf[..pos].to_vec());
                    }
                    if h.buf.len() >= MAX_HANDSHAKE_LINE {
                        break Err("CONNECT line too long".into());
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => break Err(e.to_string()),
            }
        };
        let Some(h) = self.handshakes.remove(&fd) else { return };
        let port = match line.map(|l| parse_connect(&l).ok_or("malformed CONNECT line".to_string())) {
            Ok(Ok(port)) => port,
            Ok(Err(e)) | Err(e) => {
                throttled!(self.logs.host_clients, warn, error = %e, "vsock: rejecting host connection");
                self.fd_ops.push(FdOp::Remove(fd));
                self.graveyard.push(h.stream);
                return;
            }
        };
        if self.conns.len() >= MAX_CONNECTIONS {
            throttled!(self.logs.host_clients, warn, "vsock: connection limit reached; refusing a host connection");
            self.fd_ops.push(FdOp::Remove(fd));
            self.graveyard.push(h.stream);
            return;
        }
        let local_port = self.allocate_local_port();
        let mut conn = VsockConnection::new(
            self.guest_cid,
            local_port,
            port,
            h.stream,
            ConnState::LocalInit { deadline: Instant::now() + GUEST_REPLY_TIMEOUT },
        );
        let req = conn.header(OP_REQUEST, 0, 0);
        self.push_control(req);
        self.fd_conn.insert(fd, (local_port, port));
        self.conns.insert((local_port, port), conn);
        tracing::debug!(local_port, port, "vsock: host connection requested");
    }

    /// Queues a packet for the guest; a guest that never reads cannot grow the backlog forever.
    fn push_control(&mut self, hdr: VsockHeader) {
        if self.control.len() >= MAX_CONTROL_BACKLOG {
            throttled!(self.logs.backlog, warn, "vsock: guest is not draining its RX queue; dropping control packets");
            return;
        }
        self.control.push_back(hdr);
    }

    fn allocate_local_port(&mut self) -> u32 {
        loop {
            let p = self.next_local_port;
            self.next_local_port = self.next_local_port.checked_add(1).unwrap_or(FIRST_LOCAL_PORT);
            if !self.conns.keys().any(|k| k.0 == p) {
                return p;
            }
        }
    }

    /// Removes a connection; optionally tells the guest with RST.
    fn kill(&mut self, key: ConnKey, tell_guest: bool) {
        if let Some(mut c) = self.conns.remove(&key) {
            if matches!(c.state, ConnState::HostConnecting { .. }) {
                self.connecting -= 1;
            }
            if tell_guest {
                let rst = c.header(OP_RST, 0, 0);
                self.push_control(rst);
            }
            let fd = c.stream.as_raw_fd();
            // A connect still waiting for its listener was never watched.
            if self.fd_conn.remove(&fd).is_some() {
                self.fd_ops.push(FdOp::Remove(fd));
            }
            self.graveyard.push(c.stream);
        }
    }

    fn rst_for(&self, hdr: &VsockHeader) -> VsockHeader {
        VsockHeader {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: hdr.dst_port,
            dst_port: hdr.src_port,
            type_: TYPE_STREAM,
            op: OP_RST,
            ..Default::default()
        }
    }

    /// Expires stuck handshakes and connections; retries connects to busy host listeners.
    pub fn sweep(&mut self, now: Instant) {
        let expired: Vec<RawFd> =
            self.handshakes.iter().filter(|(_, h)| h.deadline <= now).map(|(fd, _)| *fd).collect();
        for fd in expired {
            if let Some(h) = self.handshakes.remove(&fd) {
                throttled!(self.logs.host_clients, warn, "vsock: host connection sent no CONNECT line in time");
                self.fd_ops.push(FdOp::Remove(fd));
                self.graveyard.push(h.stream);
            }
        }
        let stale: Vec<(ConnKey, bool)> = self
            .conns
            .iter()
            .filter_map(|(k, c)| match c.state {
                ConnState::LocalInit { deadline } if deadline <= now => Some((*k, true)),
                ConnState::LocalClosed { deadline } if deadline <= now => Some((*k, false)),
                _ => None,
            })
            .collect();
        for (key, tell) in stale {
            throttled!(
                self.logs.timeouts,
                warn,
                port = key.1,
                "vsock: guest did not answer in time; dropping connection"
            );
            self.kill(key, tell);
        }
        let connecting: Vec<ConnKey> = self
            .conns
            .iter()
            .filter(|(_, c)| matches!(c.state, ConnState::HostConnecting { .. }))
            .map(|(k, _)| *k)
            .collect();
        for key in connecting {
            self.retry_connect(key, now);
        }
    }

    /// `<uds_path>_<port>`: where the host listens for guest connections to `port`.
    fn host_port_path(&self, port: u32) -> PathBuf {
        let mut path = self.uds_path.clone().into_os_string();
        path.push(format!("_{port}"));
        path.into()
    }

    /// Tries a waiting guest-initiated connect again; past its deadline the guest gets RST.
    fn retry_connect(&mut self, key: ConnKey, now: Instant) {
        let Some(conn) = self.conns.get(&key) else { return };
        let ConnState::HostConnecting { deadline } = conn.state else { return };
        let path = self.host_port_path(key.0);
        match try_connect(&conn.stream, &path) {
            Ok(Attempt::Connected) => {
                self.connecting -= 1;
                self.establish(key);
            }
            Ok(Attempt::Busy) if now < deadline => {}
            Ok(Attempt::Busy) => {
                throttled!(self.logs.connects_busy, warn, path = %path.display(),
                    "vsock: host listener did not take the guest's connection in time; resetting it");
                self.kill(key, true);
            }
            Err(e) => {
                throttled!(self.logs.connects_refused, info, path = %path.display(), error = %e,
                    "vsock: guest connection refused while waiting for the host listener");
                self.kill(key, true);
            }
        }
    }

    /// A guest-initiated connection reached its host listener: answer the guest, watch the socket.
    fn establish(&mut self, key: ConnKey) {
        let Some(conn) = self.conns.get_mut(&key) else { return };
        conn.state = ConnState::Established;
        let resp = conn.response();
        let fd = conn.stream.as_raw_fd();
        self.push_control(resp);
        self.fd_ops.push(FdOp::Add(fd));
        self.fd_conn.insert(fd, key);
        tracing::debug!(port = key.0, "vsock: guest connected to host listener");
    }

    /// A packet from the guest.
    pub fn send_from_guest(&mut self, pkt: TxPacket) {
        let hdr = pkt.hdr;
        if hdr.src_cid != self.guest_cid || hdr.dst_cid != HOST_CID {
            throttled!(
                self.logs.guest_packets,
                warn,
                src = hdr.src_cid,
                dst = hdr.dst_cid,
                "vsock: dropping packet with wrong CIDs"
            );
            return;
        }
        if hdr.type_ != TYPE_STREAM {
            let rst = self.rst_for(&hdr);
            self.push_control(rst);
            return;
        }
        let key = (hdr.dst_port, hdr.src_port);
        if hdr.op == OP_REQUEST {
            self.guest_connect(&hdr);
            return;
        }
        let Some(conn) = self.conns.get_mut(&key) else {
            if hdr.op != OP_RST {
                let rst = self.rst_for(&hdr);
                self.push_control(rst);
            }
            return;
        };
        conn.update_peer_credit(&hdr);
        match (hdr.op, conn.state) {
            (OP_RESPONSE, ConnState::LocalInit { .. }) => {
                let line = format!("OK {}\n", conn.local_port);
                if conn.stream.write_all(line.as_bytes()).is_err() {
                    self.kill(key, true);
                    return;
                }
                conn.state = ConnState::Established;
                conn.host_readable = true;
            }
            (OP_RW, ConnState::Established) | (OP_RW, ConnState::LocalClosed { .. }) => {
                if let Err(e) = conn.send_to_host(&pkt.data) {
                    throttled!(self.logs.resets, warn, port = key.0, error = %e, "vsock: resetting connection");
                    self.kill(key, true);
                    return;
                }
                if conn.needs_credit_update() {
                    let cu = conn.credit_update();
                    self.push_control(cu);
                }
            }
            (OP_CREDIT_UPDATE, _) => {}
            (OP_CREDIT_REQUEST, _) => {
                let cu = conn.credit_update();
                self.push_control(cu);
            }
            (OP_SHUTDOWN, _) => {
                if hdr.flags & SHUTDOWN_SEND != 0 {
                    let _ = conn.stream.shutdown(std::net::Shutdown::Write);
                }
                if hdr.flags & (SHUTDOWN_SEND | SHUTDOWN_RCV) == (SHUTDOWN_SEND | SHUTDOWN_RCV) {
                    self.kill(key, true);
                }
            }
            (OP_RST, _) => self.kill(key, false),
            (op, state) => {
                throttled!(
                    self.logs.guest_packets,
                    warn,
                    op,
                    ?state,
                    "vsock: unexpected packet for connection state; resetting"
                );
                self.kill(key, true);
            }
        }
    }

    /// A guest REQUEST for a host port: connect to its listener without blocking. A full
    /// backlog leaves the connection waiting (retried on the sweep); anything else that fails
    /// gets the guest an RST.
    fn guest_connect(&mut self, hdr: &VsockHeader) {
        let key = (hdr.dst_port, hdr.src_port);
        if self.conns.contains_key(&key) || self.conns.len() >= MAX_CONNECTIONS {
            throttled!(
                self.logs.connects_busy,
                warn,
                port = hdr.dst_port,
                connections = self.conns.len(),
                "vsock: guest connection refused (already open, or too many connections)"
            );
            let rst = self.rst_for(hdr);
            self.push_control(rst);
            return;
        }
        let path = self.host_port_path(hdr.dst_port);
        let attempt = stream_socket().and_then(|s| try_connect(&s, &path).map(|a| (s, a)));
        let (stream, state) = match attempt {
            Ok((s, Attempt::Connected)) => (s, ConnState::Established),
            Ok((s, Attempt::Busy)) if self.connecting < MAX_HOST_CONNECTING => {
                (s, ConnState::HostConnecting { deadline: Instant::now() + HOST_CONNECT_TIMEOUT })
            }
            Ok((_, Attempt::Busy)) => {
                throttled!(self.logs.connects_busy, warn, path = %path.display(), waiting = self.connecting,
                    "vsock: host listener is busy and too many guest connects wait for one; refusing");
                let rst = self.rst_for(hdr);
                self.push_control(rst);
                return;
            }
            Err(e) => {
                throttled!(self.logs.connects_refused, info, path = %path.display(), error = %e,
                    "vsock: guest connection refused (no host listener)");
                let rst = self.rst_for(hdr);
                self.push_control(rst);
                return;
            }
        };
        let mut conn = VsockConnection::new(self.guest_cid, hdr.dst_port, hdr.src_port, stream, state);
        conn.update_peer_credit(hdr);
        self.conns.insert(key, conn);
        if state == ConnState::Established {
            self.establish(key);
        } else {
            self.connecting += 1;
            tracing::debug!(port = hdr.dst_port, "vsock: host listener busy; the guest's connect waits");
        }
    }

    pub fn has_rx(&self) -> bool {
        !self.control.is_empty() || self.conns.values().any(|c| c.wants_rx())
    }

    /// The next packet for the guest, with at most `max_payload` bytes of data.
    pub fn next_rx(&mut self, max_payload: usize) -> Option<(VsockHeader, Vec<u8>)> {
        if let Some(h) = self.control.pop_front() {
            return Some((h, Vec::new()));
        }
        let keys: Vec<ConnKey> = self.conns.iter().filter(|(_, c)| c.wants_rx()).map(|(k, _)| *k).collect();
        for key in keys {
            let Some(conn) = self.conns.get_mut(&key) else { continue };
            match conn.read_from_host(max_payload) {
                HostRead::Data(d) => {
                    let h = conn.rw_header(d.len() as u32);
                    return Some((h, d));
                }
                HostRead::Eof => {
                    conn.state = ConnState::LocalClosed { deadline: Instant::now() + GUEST_REPLY_TIMEOUT };
                    conn.host_readable = false;
                    return Some((conn.shutdown(), Vec::new()));
                }
                HostRead::Nothing => {}
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;

    const CID: u64 = 3;

    fn muxer() -> (VsockMuxer, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        (VsockMuxer::new(CID, &dir.path().join("v.sock")).unwrap(), dir)
    }

    fn guest(op: u16, src_port: u32, dst_port: u32, data: &[u8]) -> TxPacket {
        TxPacket {
            hdr: VsockHeader {
                src_cid: CID,
                dst_cid: HOST_CID,
                src_port,
                dst_port,
                len: data.len() as u32,
                type_: TYPE_STREAM,
                op,
                buf_alloc: 65536,
                ..Default::default()
            },
            data: data.to_vec(),
        }
    }

    #[test]
    fn parse_connect_lines() {
        assert_eq!(parse_connect(b"CONNECT 1024"), Some(1024));
        assert_eq!(parse_connect(b"CONNECT 1024\r"), Some(1024));
        for bad in [&b"CONNECT"[..], b"CONNECT ", b"CONNECT -1", b"CONNECT 99999999999", b"HELLO 1", b"\xff"] {
            assert_eq!(parse_connect(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn host_initiated_connection_round_trip() {
        let (mut m, dir) = muxer();
        let mut host = UnixStream::connect(dir.path().join("v.sock")).unwrap();
        host.write_all(b"CONNECT 1024\n").unwrap();
        m.accept();
        let (req, _) = m.next_rx(4096).expect("REQUEST for the guest");
        assert_eq!((req.op, req.dst_port, req.dst_cid), (OP_REQUEST, 1024, CID));
        let local = req.src_port;
        m.send_from_guest(guest(OP_RESPONSE, 1024, local, b""));
        let mut line = String::new();
        std::io::BufReader::new(host.try_clone().unwrap()).read_line(&mut line).unwrap();
        assert_eq!(line, format!("OK {local}\n"));

        host.write_all(b"ping").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let (rw, data) = m.next_rx(4096).expect("data for the guest");
        assert_eq!((rw.op, data.as_slice()), (OP_RW, &b"ping"[..]));
        m.send_from_guest(guest(OP_RW, 1024, local, b"pong"));
        let mut got = [0u8; 4];
        host.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"pong");

        // shutdown, not drop: a forking test thread's child may hold the socket open.
        host.shutdown(std::net::Shutdown::Both).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let (sd, _) = m.next_rx(4096).expect("SHUTDOWN");
        assert_eq!(sd.op, OP_SHUTDOWN);
        m.send_from_guest(guest(OP_RST, 1024, local, b""));
        assert_eq!(m.connection_count(), 0);
        assert!(m.take_fd_ops().iter().any(|op| matches!(op, FdOp::Remove(_))));
    }

    #[test]
    fn guest_initiated_connection_reaches_listener() {
        let (mut m, dir) = muxer();
        let listener = UnixListener::bind(dir.path().join("v.sock_5000")).unwrap();
        m.send_from_guest(guest(OP_REQUEST, 77, 5000, b""));
        let (resp, _) = m.next_rx(4096).unwrap();
        assert_eq!((resp.op, resp.src_port, resp.dst_port), (OP_RESPONSE, 5000, 77));
        let (mut s, _) = listener.accept().unwrap();
        m.send_from_guest(guest(OP_RW, 77, 5000, b"hello"));
        let mut got = [0u8; 5];
        s.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello");
    }

    #[test]
    fn refused_and_unknown_get_rst() {
        let (mut m, _dir) = muxer();
        m.send_from_guest(guest(OP_REQUEST, 77, 6000, b""));
        assert_eq!(m.next_rx(4096).unwrap().0.op, OP_RST);
        m.send_from_guest(guest(OP_RW, 77, 6000, b"x"));
        assert_eq!(m.next_rx(4096).unwrap().0.op, OP_RST);
        let mut wrong = guest(OP_REQUEST, 1, 2, b"");
        wrong.hdr.src_cid = 99;
        m.send_from_guest(wrong);
        assert!(m.next_rx(4096).is_none(), "spoofed CID is dropped silently");
    }

    #[test]
    fn bad_handshakes_are_dropped() {
        let (mut m, dir) = muxer();
        let mut long = UnixStream::connect(dir.path().join("v.sock")).unwrap();
        long.write_all(&[b'A'; 64]).unwrap();
        let mut junk = UnixStream::connect(dir.path().join("v.sock")).unwrap();
        junk.write_all(b"HELLO\n").unwrap();
        let _silent = UnixStream::connect(dir.path().join("v.sock")).unwrap();
        m.accept();
        assert!(m.next_rx(4096).is_none());
        assert_eq!(m.handshakes.len(), 1, "only the silent one waits");
        m.sweep(Instant::now() + HANDSHAKE_TIMEOUT + Duration::from_millis(1));
        assert!(m.handshakes.is_empty());
        m.bury();
        long.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(long.read(&mut buf).unwrap_or(0), 0, "closed");
    }

    #[test]
    fn forwarded_bytes_trigger_a_credit_update() {
        let (mut m, dir) = muxer();
        let listener = UnixListener::bind(dir.path().join("v.sock_5001")).unwrap();
        m.send_from_guest(guest(OP_REQUEST, 80, 5001, b""));
        assert_eq!(m.next_rx(4096).unwrap().0.op, OP_RESPONSE);
        let (mut peer, _) = listener.accept().unwrap();
        let reader = std::thread::spawn(move || {
            let mut total = 0usize;
            let mut buf = vec![0u8; 65536];
            peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            while total < 3 * 60000 {
                match peer.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => total += n,
                }
            }
            total
        });
        let chunk = vec![7u8; 60000];
        let mut updates = 0;
        for _ in 0..3 {
            m.send_from_guest(guest(OP_RW, 80, 5001, &chunk));
            // Give the reader a moment so our non-blocking writes drain.
            std::thread::sleep(Duration::from_millis(20));
            if let Some(key) = m.fd_conn.values().next().copied() {
                if let Some(c) = m.conns.get_mut(&key) {
                    c.flush_to_host().unwrap();
                }
            }
            while let Some((h, _)) = m.next_rx(4096) {
                if h.op == OP_CREDIT_UPDATE {
                    updates += 1;
                    assert!(h.fwd_cnt >= 120_000, "fwd_cnt {}", h.fwd_cnt);
                }
            }
        }
        assert_eq!(reader.join().unwrap(), 180_000);
        assert!(updates >= 1, "the guest hears about freed buffer space");
    }

    #[test]
    fn control_backlog_is_bounded() {
        let (mut m, _dir) = muxer();
        for port in 0..(MAX_CONTROL_BACKLOG as u32 + 100) {
            m.send_from_guest(guest(OP_RW, port, 6000, b"x"));
        }
        assert_eq!(m.control.len(), MAX_CONTROL_BACKLOG);
    }

    /// A listener with the smallest backlog (one waiting connection) that never accepts.
    fn stalled_listener(path: &Path) -> std::os::fd::OwnedFd {
        use nix::sys::socket::{bind, listen, socket, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
        let fd = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).unwrap();
        bind(fd.as_raw_fd(), &UnixAddr::new(path).unwrap()).unwrap();
        listen(&fd, Backlog::new(0).unwrap()).unwrap();
        fd
    }

    fn accept_one(listener: &std::os::fd::OwnedFd) -> UnixStream {
        use std::os::fd::{FromRawFd, OwnedFd};
        // SAFETY: accept4 on our listening fd; the result is checked and owned at once.
        let fd = unsafe { libc::accept4(listener.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut(), 0) };
        assert!(fd >= 0);
        // SAFETY: fd is a fresh fd nobody else owns.
        UnixStream::from(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    #[test]
    fn a_listener_that_does_not_accept_never_blocks_a_guest_connect() {
        let (mut m, dir) = muxer();
        let listener = stalled_listener(&dir.path().join("v.sock_7000"));
        let started = Instant::now();
        // The backlog takes one or two; the rest wait without blocking, bounded in number.
        for src in 0..(MAX_HOST_CONNECTING as u32 + 10) {
            m.send_from_guest(guest(OP_REQUEST, 100 + src, 7000, b""));
        }
        assert!(started.elapsed() < Duration::from_secs(2), "a connect blocked");
        let mut ops = Vec::new();
        while let Some((h, _)) = m.next_rx(4096) {
            ops.push(h.op);
        }
        let answered = ops.iter().filter(|op| **op == OP_RESPONSE).count();
        assert!((1..=2).contains(&answered), "{ops:?}");
        assert_eq!(m.connecting, MAX_HOST_CONNECTING);
        assert_eq!(ops.iter().filter(|op| **op == OP_RST).count(), 10 - answered, "beyond the cap: RST at once");
        let watched = m.take_fd_ops().len();
        assert_eq!(watched, answered, "only connected sockets are watched");

        // Room in the backlog: the next sweep connects a waiting one and answers its guest.
        let _first = accept_one(&listener);
        m.sweep(Instant::now());
        assert_eq!(m.next_rx(4096).map(|(h, _)| h.op), Some(OP_RESPONSE));
        assert_eq!(m.connecting, MAX_HOST_CONNECTING - 1);

        // Past the deadline the rest get RST; nothing was watched for them, so nothing is unwatched.
        m.take_fd_ops();
        m.sweep(Instant::now() + HOST_CONNECT_TIMEOUT + Duration::from_millis(1));
        let mut rst = 0;
        while let Some((h, _)) = m.next_rx(4096) {
            assert_eq!(h.op, OP_RST);
            rst += 1;
        }
        assert_eq!(rst, MAX_HOST_CONNECTING - 1);
        assert_eq!(m.connecting, 0);
        assert!(m.take_fd_ops().is_empty());
        assert_eq!(m.connection_count(), answered + 1);
    }

    #[test]
    fn a_guest_rst_or_reset_drops_a_waiting_connect() {
        let (mut m, dir) = muxer();
        let _listener = stalled_listener(&dir.path().join("v.sock_7001"));
        for src in 0..4 {
            m.send_from_guest(guest(OP_REQUEST, 200 + src, 7001, b""));
        }
        while m.next_rx(4096).is_some() {}
        m.take_fd_ops();
        let waiting = m.connecting;
        assert!(waiting >= 2, "{waiting}");
        let key = *m.conns.iter().find(|(_, c)| matches!(c.state, ConnState::HostConnecting { .. })).unwrap().0;
        m.send_from_guest(guest(OP_RST, key.1, key.0, b""));
        assert_eq!(m.connecting, waiting - 1);
        assert!(m.take_fd_ops().is_empty(), "a waiting connect was never watched");
        m.reset();
        assert_eq!((m.connecting, m.connection_count()), (0, 0));
        assert!(m.take_fd_ops().len() <= 2, "only the connected ones leave epoll");
    }

    #[test]
    fn unanswered_request_times_out_with_rst() {
        let (mut m, dir) = muxer();
        let mut host = UnixStream::connect(dir.path().join("v.sock")).unwrap();
        host.write_all(b"CONNECT 9\n").unwrap();
        m.accept();
        assert_eq!(m.next_rx(4096).unwrap().0.op, OP_REQUEST);
        m.sweep(Instant::now() + GUEST_REPLY_TIMEOUT + Duration::from_millis(1));
        assert_eq!(m.next_rx(4096).unwrap().0.op, OP_RST);
        assert_eq!(m.connection_count(), 0);
    }
}
