//! A scripted vhost-user backend for unit tests: a socket peer that answers the frontend's
//! requests (features, protocol features, queue count, vring bases), records what it was sent
//! (and the kick eventfds it was handed), and can refuse a message, answer one late, go silent
//! or hang up.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

pub const GET_FEATURES: u32 = 1;
pub const SET_FEATURES: u32 = 2;
pub const SET_OWNER: u32 = 3;
pub const SET_MEM_TABLE: u32 = 5;
pub const SET_VRING_NUM: u32 = 8;
pub const SET_VRING_ADDR: u32 = 9;
pub const SET_VRING_BASE: u32 = 10;
pub const GET_VRING_BASE: u32 = 11;
pub const SET_VRING_KICK: u32 = 12;
pub const SET_VRING_CALL: u32 = 13;
pub const GET_PROTOCOL_FEATURES: u32 = 15;
pub const SET_PROTOCOL_FEATURES: u32 = 16;
pub const GET_QUEUE_NUM: u32 = 17;
pub const SET_VRING_ENABLE: u32 = 18;

const NEED_REPLY: u32 = 0x8;
const REPLY: u32 = 0x4 | 0x1;
const PROTOCOL_MQ: u64 = 0x1;
const PROTOCOL_REPLY_ACK: u64 = 0x8;

#[derive(Clone)]
pub struct Script {
    pub features: u64,
    pub protocol_features: u64,
    pub queue_num: u64,
    /// A request answered with a negative acknowledgement.
    pub refuse: Option<u32>,
    /// A request after which the fake never answers again (the socket stays open).
    pub silent_on: Option<u32>,
    /// A request answered only after this pause.
    pub slow_on: Option<(u32, Duration)>,
}

impl Script {
    /// What virtiofsd offers, as far as the frontend cares.
    pub fn virtiofsd_like() -> Self {
        Self {
            features: super::AVAIL_FEATURES | super::vhost_user::VHOST_USER_F_PROTOCOL_FEATURES,
            protocol_features: PROTOCOL_MQ | PROTOCOL_REPLY_ACK,
            queue_num: 2,
            refuse: None,
            silent_on: None,
            slow_on: None,
        }
    }
}

/// A SET_MEM_TABLE's regions: (guest address, size).
pub type MemTable = Vec<(u64, u64)>;

pub struct FakeBackend {
    pub path: PathBuf,
    requests: Arc<Mutex<Vec<u32>>>,
    kicks: Arc<Mutex<Vec<(u64, File)>>>,
    mem_tables: Arc<Mutex<Vec<MemTable>>>,
    conn: Arc<Mutex<Option<UnixStream>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl FakeBackend {
    /// Listens on a fresh socket and serves one connection by `script`.
    pub fn start(script: Script) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("backend.sock");
        let listener = UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let requests: Arc<Mutex<Vec<u32>>> = Arc::default();
        let kicks: Arc<Mutex<Vec<(u64, File)>>> = Arc::default();
        let mem_tables: Arc<Mutex<Vec<MemTable>>> = Arc::default();
        let conn: Arc<Mutex<Option<UnixStream>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (requests, kicks, tables, conn, stop) = (
                Arc::clone(&requests),
                Arc::clone(&kicks),
                Arc::clone(&mem_tables),
                Arc::clone(&conn),
                Arc::clone(&stop),
            );
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(30);
                let stream = loop {
                    match listener.accept() {
                        Ok((s, _)) => break s,
                        Err(_) if !stop.load(Ordering::SeqCst) && Instant::now() < deadline => {
                            std::thread::sleep(Duration::from_millis(5))
                        }
                        Err(_) => return,
                    }
                };
                stream.set_nonblocking(false).unwrap();
                *conn.lock().unwrap() = Some(stream.try_clone().unwrap());
                serve(stream, &script, &requests, &kicks, &tables);
            })
        };
        Self { path, requests, kicks, mem_tables, conn, stop, thread: Some(thread), _dir: dir }
    }

    /// The request codes received so far, in order.
    pub fn requests(&self) -> Vec<u32> {
        self.requests.lock().unwrap().clone()
    }

    /// The memory tables the backend was handed, in order.
    pub fn mem_tables(&self) -> Vec<MemTable> {
        self.mem_tables.lock().unwrap().clone()
    }

    /// How many kicks the last kick eventfd handed over for `vring` holds (reading resets it).
    pub fn kicks_pending(&self, vring: u64) -> Option<u64> {
        let kicks = self.kicks.lock().unwrap();
        let (_, file) = kicks.iter().rev().find(|(v, _)| *v == vring)?;
        let mut count = [0u8; 8];
        match (&*file).read(&mut count) {
            Ok(8) => Some(u64::from_le_bytes(count)),
            _ => Some(0), // EAGAIN: the counter is zero
        }
    }

    /// Closes the connection, as a dying backend would.
    pub fn hang_up(&self) {
        if let Some(c) = self.conn.lock().unwrap().take() {
            c.shutdown(std::net::Shutdown::Both).unwrap();
        }
    }
}

impl Drop for FakeBackend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.hang_up();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(
    mut s: UnixStream,
    script: &Script,
    requests: &Mutex<Vec<u32>>,
    kicks: &Mutex<Vec<(u64, File)>>,
    tables: &Mutex<Vec<MemTable>>,
) {
    let mut silent = false;
    loop {
        let mut hdr = [0u8; 12];
        // The header, with the file descriptor the message carries (if any).
        let (n, fd) = match s.recv_with_fd(&mut hdr) {
            Ok((0, _)) | Err(_) => return,
            Ok(got) => got,
        };
        if s.read_exact(&mut hdr[n..]).is_err() {
            return;
        }
        let word = |i: usize| u32::from_le_bytes(hdr[i..i + 4].try_into().unwrap());
        let (req, flags, size) = (word(0), word(4), word(8));
        let mut body = vec![0u8; size as usize];
        if s.read_exact(&mut body).is_err() {
            return;
        }
        requests.lock().unwrap().push(req);
        if req == SET_MEM_TABLE && body.len() >= 8 {
            // num_regions, padding, then 32 bytes a region: address, size, user address, offset.
            let u64_at = |i: usize| body.get(i..i + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()));
            let n = u32::from_le_bytes(body[..4].try_into().unwrap()) as usize;
            let table = (0..n).filter_map(|r| Some((u64_at(8 + 32 * r)?, u64_at(16 + 32 * r)?))).collect();
            tables.lock().unwrap().push(table);
        }
        if let (SET_VRING_KICK, Some(fd)) = (req, fd) {
            let vring = u64::from_le_bytes(body[..8].try_into().unwrap()) & 0xff;
            kicks.lock().unwrap().push((vring, fd));
        }
        if let Some((_, pause)) = script.slow_on.filter(|(r, _)| *r == req) {
            std::thread::sleep(pause);
        }
        silent |= script.silent_on == Some(req);
        if silent {
            continue;
        }
        let reply: Option<Vec<u8>> = match req {
            GET_FEATURES => Some(script.features.to_le_bytes().to_vec()),
            GET_PROTOCOL_FEATURES => Some(script.protocol_features.to_le_bytes().to_vec()),
            GET_QUEUE_NUM => Some(script.queue_num.to_le_bytes().to_vec()),
            // The vring index, then where the backend stopped.
            GET_VRING_BASE => Some([&body[..4], &7u32.to_le_bytes()[..]].concat()),
            _ if flags & NEED_REPLY != 0 => Some(u64::from(script.refuse == Some(req)).to_le_bytes().to_vec()),
            _ => None,
        };
        if let Some(payload) = reply {
            let mut msg = Vec::new();
            for w in [req, REPLY, payload.len() as u32] {
                msg.extend_from_slice(&w.to_le_bytes());
            }
            msg.extend_from_slice(&payload);
            if s.write_all(&msg).is_err() {
                return;
            }
        }
    }
}
