//! KVM integration: virtio-net against a real tap. Each test creates a network namespace of its
//! own with a tap in it (the tap has the guest's peer address and a static neighbour entry for
//! the guest, so no ARP is needed), runs `bulkhead-vmm` inside that namespace and binds a UDP
//! echo listener there. Traffic never leaves the namespace; a Drop guard deletes the tap and the
//! namespace, also when the test fails. A snapshot of a VM with a net device restores in another
//! namespace on the run's own tap.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod common;

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;

const TAP: &str = "bhtap0";
const HOST_MAC: &str = "02:00:00:00:00:01";
const GUEST_MAC: &str = "02:00:00:00:00:02";
const HOST_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const GUEST_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
const ECHO_PORT: u16 = 7777;
const GUEST_PORT: u16 = 5555;

/// A network namespace holding one configured tap; deleted on drop.
struct TestNetns {
    name: String,
    tap: String,
    /// `/run/netns/<name>`, for setns.
    handle: File,
}

fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("cannot run {cmd}: {e}"));
    assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

impl TestNetns {
    fn create() -> Self {
        Self::create_with_tap(TAP)
    }

    fn create_with_tap(tap: &str) -> Self {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let name = format!("bhtest-net-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::SeqCst));
        run("ip", &["netns", "add", &name]);
        let handle = match File::open(format!("/run/netns/{name}")) {
            Ok(f) => f,
            Err(e) => {
                let _ = Command::new("ip").args(["netns", "del", &name]).status();
                panic!("netns {name} has no handle: {e}");
            }
        };
        let ns = Self { name, tap: tap.to_string(), handle };
        ns.ip(&["tuntap", "add", "dev", tap, "mode", "tap"]);
        ns.ip(&["link", "set", "dev", tap, "address", HOST_MAC]);
        // No IPv6 chatter on the link: the guest should see only what the test sends.
        run("ip", &["netns", "exec", &ns.name, "sysctl", "-qw", &format!("net.ipv6.conf.{tap}.disable_ipv6=1")]);
        ns.ip(&["addr", "add", &format!("{HOST_IP}/24"), "dev", tap]);
        ns.ip(&["link", "set", "dev", tap, "up"]);
        ns.ip(&["neigh", "replace", &GUEST_IP.to_string(), "lladdr", GUEST_MAC, "dev", tap, "nud", "permanent"]);
        ns
    }

    fn ip(&self, args: &[&str]) {
        let mut all = vec!["-n", &self.name];
        all.extend_from_slice(args);
        run("ip", &all);
    }

    /// A UDP socket bound inside the namespace (a socket stays in the namespace it was made in).
    fn bind_udp(&self, addr: SocketAddr) -> UdpSocket {
        let fd = self.handle.try_clone().unwrap();
        std::thread::spawn(move || {
            // SAFETY: setns on a namespace fd we hold; it changes only this short-lived thread.
            assert_eq!(unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns");
            UdpSocket::bind(addr).unwrap()
        })
        .join()
        .unwrap()
    }

    /// Starts the VMM inside the namespace.
    fn spawn_vmm(&self, dir: &Path, cfg: &serde_json::Value) -> VmmProcess {
        VmmProcess::spawn_with(dir, cfg, GUEST_TIMEOUT, |cmd| self.enter(cmd))
    }

    /// Starts the VMM with `args` inside the namespace.
    fn spawn_vmm_args(&self, dir: &Path, args: &[&std::ffi::OsStr]) -> VmmProcess {
        VmmProcess::spawn_args_with(dir, args, GUEST_TIMEOUT, |cmd| self.enter(cmd))
    }

    /// Makes `cmd` run inside the namespace.
    fn enter(&self, cmd: &mut Command) {
        let fd = self.handle.as_raw_fd();
        // SAFETY: between fork and exec we only call setns, which is async-signal-safe, on an
        // fd the parent keeps open until spawn returns.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["-n", &self.name, "link", "del", &self.tap]).output();
        match Command::new("ip").args(["netns", "del", &self.name]).output() {
            Ok(o) if o.status.success() => {}
            other => eprintln!("warning: could not delete netns {}: {other:?}", self.name),
        }
    }
}

/// Skips (one SKIPPED line) without KVM, the guest toolchain or root.
fn netns_guest_or_skip(name: &str) -> Option<std::path::PathBuf> {
    let guest = guest_or_skip(name)?;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("SKIPPED: {name}: creating a network namespace and a tap needs root");
        return None;
    }
    Some(guest)
}

fn net_config(dir: &Path, guest: &Path) -> serde_json::Value {
    let mut cfg = raw_config(dir, guest);
    cfg["net"] = serde_json::json!([{ "tap": TAP, "mac": GUEST_MAC, "mtu": 1400 }]);
    cfg
}

/// Receives datagrams until one carries `last` (or the timeout); returns them all.
fn collect_until(sock: &UdpSocket, last: &[u8], timeout: Duration) -> Vec<(Vec<u8>, SocketAddr)> {
    let deadline = Instant::now() + timeout;
    let mut got = Vec::new();
    let mut buf = [0u8; 2048];
    while Instant::now() < deadline {
        sock.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))))
            .unwrap();
        match sock.recv_from(&mut buf) {
            Ok((n, peer)) => {
                got.push((buf[..n].to_vec(), peer));
                if &buf[..n] == last {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    got
}

#[test]
fn guest_udp_datagram_reaches_the_tap_and_the_reply_reaches_the_guest() {
    let Some(guest) = netns_guest_or_skip("net") else { return };
    let dir = tempfile::tempdir().unwrap();
    let ns = TestNetns::create();
    let sock = ns.bind_udp(SocketAddr::V4(SocketAddrV4::new(HOST_IP, ECHO_PORT)));
    let echo = std::thread::spawn(move || {
        let got = collect_until(&sock, b"hello from guest", GUEST_TIMEOUT);
        if let Some((payload, peer)) = got.last() {
            let mut reply = b"echo: ".to_vec();
            reply.extend_from_slice(payload);
            sock.send_to(&reply, peer).unwrap();
        }
        got
    });

    let run = ns.spawn_vmm(dir.path(), &net_config(dir.path(), &guest)).wait();
    let got = echo.join().unwrap();
    let ctx = format!("serial:\n{}\nstderr:\n{}", run.serial, run.stderr);
    assert!(run.status.success(), "{:?}\n{ctx}", run.status);
    assert_eq!(
        got,
        vec![(b"hello from guest".to_vec(), SocketAddr::V4(SocketAddrV4::new(GUEST_IP, GUEST_PORT)))],
        "{ctx}"
    );
    assert!(run.serial.contains(&format!("net mac {GUEST_MAC} mtu=578 link up\n")), "config space\n{ctx}");
    assert!(run.serial.contains("sent\n"), "{ctx}");
    assert!(run.serial.contains("reply: echo: hello from guest\n"), "{ctx}");
}

fn wait_for_serial(dir: &Path, needle: &str) {
    let deadline = Instant::now() + GUEST_TIMEOUT;
    while !read_serial(dir).contains(needle) {
        assert!(Instant::now() < deadline, "serial never showed {needle:?}:\n{}", read_serial(dir));
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn api_call(stream: &mut UnixStream, reader: &mut BufReader<UnixStream>, cmd: &str) -> serde_json::Value {
    stream.write_all(format!("{{\"cmd\":\"{cmd}\"}}\n").as_bytes()).unwrap();
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap()
}

#[test]
fn malformed_net_chains_break_only_the_device_and_the_vmm_keeps_serving() {
    let Some(guest) = netns_guest_or_skip("net_hostile") else { return };
    let dir = tempfile::tempdir().unwrap();
    let ns = TestNetns::create();
    let sock = ns.bind_udp(SocketAddr::V4(SocketAddrV4::new(HOST_IP, ECHO_PORT)));
    let listener = std::thread::spawn(move || collect_until(&sock, b"still alive", GUEST_TIMEOUT));

    let api = dir.path().join("api.sock");
    let mut cfg = net_config(dir.path(), &guest);
    cfg["api_socket"] = serde_json::json!(api);
    let vmm = ns.spawn_vmm(dir.path(), &cfg);
    wait_for_serial(dir.path(), "net hostile done\n");

    // The VMM still answers and stops cleanly.
    let mut s = UnixStream::connect(&api).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let info = api_call(&mut s, &mut r, "info");
    assert_eq!((info["ok"].clone(), info["info"]["state"].clone()), (true.into(), "running".into()), "{info}");
    assert_eq!(api_call(&mut s, &mut r, "shutdown")["ok"], true);
    let run = vmm.wait();
    let got = listener.join().unwrap();
    let ctx = format!("serial:\n{}\nstderr:\n{}", run.serial, run.stderr);
    assert!(run.status.success(), "{:?}\n{ctx}", run.status);
    assert!(!run.stderr.contains("panicked"), "{ctx}");

    // The guest saw DEVICE_NEEDS_RESET (0x40) on top of its live status (0xf) each time...
    for what in ["net out-of-range", "net long chain", "net lying header", "net avail jump"] {
        assert!(run.serial.contains(&format!("{what} status=4f\n")), "{what}\n{ctx}");
    }
    // ...the VMM said why, once per fault...
    for needle in [
        "is outside guest memory",
        "chain has more than 64 descriptors",
        "checksum at 1000+6 lies beyond the",
        "available ring index is corrupt",
    ] {
        assert_eq!(run.stderr.matches(needle).count(), 1, "log {needle:?}\n{ctx}");
    }
    // ...and after a reset the device served again: only the last datagram ever left the guest.
    assert!(run.serial.contains("net recovered\n"), "{ctx}");
    let payloads: Vec<&[u8]> = got.iter().map(|(p, _)| p.as_slice()).collect();
    assert_eq!(payloads, vec![b"still alive".as_slice()], "{ctx}");
}

#[test]
fn a_missing_tap_is_a_clear_startup_error() {
    let Some(guest) = guest_or_skip("net") else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = net_config(dir.path(), &guest);
    // Only looked up, never created: the VMM attaches to taps, it does not make them.
    let tap = format!("bhnope{}", std::process::id() % 100_000);
    cfg["net"][0]["tap"] = serde_json::json!(tap);
    let run = VmmProcess::spawn(dir.path(), &cfg, Duration::from_secs(10)).wait();
    assert_eq!(run.status.code(), Some(1), "{}", run.stderr);
    assert!(run.stderr.contains(&format!("tap {tap} does not exist in this network namespace")), "{}", run.stderr);
}

/// Binds the echo listener in `ns` and answers the guest's datagram; returns what it received.
fn echo_in(ns: &TestNetns) -> std::thread::JoinHandle<Vec<(Vec<u8>, SocketAddr)>> {
    let sock = ns.bind_udp(SocketAddr::V4(SocketAddrV4::new(HOST_IP, ECHO_PORT)));
    std::thread::spawn(move || {
        let got = collect_until(&sock, b"hello from guest", GUEST_TIMEOUT);
        if let Some((payload, peer)) = got.last() {
            let mut reply = b"echo: ".to_vec();
            reply.extend_from_slice(payload);
            sock.send_to(&reply, peer).unwrap();
        }
        got
    })
}

/// The vsock CID that makes a test guest a template (`guests/common.rs`).
const TEMPLATE_CID: u64 = 100;

#[test]
fn a_template_restored_in_another_namespace_talks_through_the_runs_own_tap() {
    let Some(guest) = netns_guest_or_skip("net") else { return };
    let dir = tempfile::tempdir().unwrap();
    let api_timeout = Duration::from_secs(30);
    // The template: net up with its link down (its tap has no network), RX buffers posted,
    // waiting for the transport reset of a restore.
    let template_ns = TestNetns::create();
    let api = dir.path().join("api.sock");
    let mut cfg = net_config(dir.path(), &guest);
    cfg["net"][0]["link"] = serde_json::json!("down");
    cfg["api_socket"] = serde_json::json!(api);
    cfg["vsock"] = serde_json::json!({"uds_path": dir.path().join("v.sock"), "guest_cid": TEMPLATE_CID});
    let vmm = template_ns.spawn_vmm(dir.path(), &cfg);
    wait_for_serial(dir.path(), "waiting for restore\n");
    let snap = dir.path().join("snap");
    let resp = api_request(&api, &serde_json::json!({"cmd": "snapshot", "dir": snap}), api_timeout);
    assert_eq!(resp["ok"], true, "{resp}");
    assert_eq!(api_request(&api, &serde_json::json!({"cmd": "shutdown"}), api_timeout)["ok"], true);
    let run = vmm.wait();
    assert!(run.status.success() && !run.serial.contains("sent"), "{}\n{}", run.serial, run.stderr);
    assert!(run.serial.contains(" link down\n"), "the template's guest saw its link down:\n{}", run.serial);
    drop(template_ns); // the template's tap is gone with its namespace

    // A pod: its own namespace and tap, named in its run config.
    let pod_tap = "bhpod0";
    let pod_ns = TestNetns::create_with_tap(pod_tap);
    let echo = echo_in(&pod_ns);
    let run_dir = dir.path().join("pod");
    std::fs::create_dir(&run_dir).unwrap();
    let pod_api = run_dir.join("api.sock");
    let run_cfg = run_dir.join("restore.json");
    let run = serde_json::json!({
        "api_socket": pod_api,
        "serial_log": run_dir.join("serial.log"),
        "vsock_uds_path": run_dir.join("v.sock"),
        "net_taps": [pod_tap],
    });
    std::fs::write(&run_cfg, run.to_string()).unwrap();
    let args = [std::ffi::OsStr::new("--restore"), snap.as_os_str(), "--restore-config".as_ref(), run_cfg.as_os_str()];
    let vmm = pod_ns.spawn_vmm_args(&run_dir, &args);
    wait_for_socket(&pod_api, Duration::from_secs(10));
    assert_eq!(api_request(&pod_api, &serde_json::json!({"cmd": "resume"}), api_timeout)["ok"], true);
    let run = vmm.wait();
    let got = echo.join().unwrap();
    let ctx = format!("serial:\n{}\nstderr:\n{}", run.serial, run.stderr);
    assert!(run.status.success(), "{:?}\n{ctx}", run.status);
    assert_eq!(
        got,
        vec![(b"hello from guest".to_vec(), SocketAddr::V4(SocketAddrV4::new(GUEST_IP, GUEST_PORT)))],
        "{ctx}"
    );
    // The restore raised the link on the pod's tap, and the guest was told before it sent.
    assert_eq!(run.serial, "restored\nlink up\nsent\nreply: echo: hello from guest\n", "{ctx}");
}
