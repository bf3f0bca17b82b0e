//! KVM integration: virtio-mmio discovery, virtio-blk I/O and hybrid vsock in both directions,
//! driven by test guests inside the real `bulkhead-vmm`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;

fn disk(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("disk.img");
    let mut data = vec![0u8; 64 * 1024];
    data[..16].copy_from_slice(b"BULKHEAD-SECTOR0");
    for (i, b) in data[16..512].iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    std::fs::write(&path, data).unwrap();
    path
}

#[test]
fn guest_discovers_devices_negotiates_and_sets_up_queues() {
    let Some(guest) = guest_or_skip("discover") else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = raw_config(dir.path(), &guest);
    cfg["block"] = serde_json::json!([{ "path": disk(dir.path()) }]);
    cfg["vsock"] = serde_json::json!({ "uds_path": dir.path().join("v.sock"), "guest_cid": 3 });
    let run = VmmProcess::spawn(dir.path(), &cfg, GUEST_TIMEOUT).wait();
    assert!(run.status.success(), "{:?}\n{}", run.status, run.stderr);
    let expected = "found id 2 at d0000000 version 2\nfeatures ok\nqueues ok\ndriver ok\n\
                    found id 13 at d0001000 version 2\nfeatures ok\nqueues ok\ndriver ok\n";
    assert_eq!(run.serial, expected, "stderr:\n{}", run.stderr);
}

#[test]
fn guest_reads_a_sector_and_host_sees_the_write() {
    let Some(guest) = guest_or_skip("blk") else { return };
    let dir = tempfile::tempdir().unwrap();
    let path = disk(dir.path());
    let mut cfg = raw_config(dir.path(), &guest);
    cfg["block"] = serde_json::json!([{ "path": path }]);
    let run = VmmProcess::spawn(dir.path(), &cfg, GUEST_TIMEOUT).wait();
    assert!(run.status.success(), "{:?}\n{}", run.status, run.stderr);
    assert!(run.serial.contains("read ok: BULKHEAD-SECTOR0\n"), "serial: {:?}\n{}", run.serial, run.stderr);
    assert!(run.serial.contains("write ok\n"), "serial: {:?}", run.serial);
    let f = std::fs::File::open(&path).unwrap();
    let (mut s0, mut s1) = ([0u8; 512], [0u8; 512]);
    f.read_exact_at(&mut s0, 0).unwrap();
    f.read_exact_at(&mut s1, 512).unwrap();
    assert_eq!(&s1[..5], b"GUEST");
    assert_eq!(s1[5..], s0[5..], "rest of sector 1 is the sector 0 the guest read");
}

#[test]
fn vsock_host_to_guest_echo_and_guest_to_host_connection() {
    let Some(guest) = guest_or_skip("vsock") else { return };
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("v.sock");
    let listener = UnixListener::bind(dir.path().join("v.sock_5000")).unwrap();
    listener.set_nonblocking(true).unwrap();
    let mut cfg = raw_config(dir.path(), &guest);
    cfg["vsock"] = serde_json::json!({ "uds_path": uds, "guest_cid": 3 });
    let vmm = VmmProcess::spawn(dir.path(), &cfg, GUEST_TIMEOUT);
    wait_for_socket(&uds, Duration::from_secs(10));

    // Host -> guest: CONNECT, OK, echo.
    let mut s = UnixStream::connect(&uds).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(b"CONNECT 1024\n").unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut ok = String::new();
    r.read_line(&mut ok).unwrap();
    if !(ok.starts_with("OK ") && ok.ends_with('\n')) {
        let run = vmm.kill_and_collect();
        panic!("handshake answer {ok:?}\nserial: {}\nstderr:\n{}", run.serial, run.stderr);
    }
    ok.trim_end()[3..].parse::<u32>().expect("OK carries a port number");
    s.write_all(b"ping-from-host").unwrap();
    let mut echo = [0u8; 14];
    r.read_exact(&mut echo).unwrap();
    assert_eq!(&echo, b"ping-from-host");
    drop(r);
    drop(s);

    // Guest -> host: the guest connects to port 5000 once we hang up.
    let deadline = Instant::now() + GUEST_TIMEOUT;
    let mut conn = loop {
        match listener.accept() {
            Ok((c, _)) => break c,
            Err(_) => {
                assert!(Instant::now() < deadline, "guest never connected; serial: {}", read_serial(dir.path()));
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    };
    conn.set_nonblocking(false).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut got = String::new();
    conn.read_to_string(&mut got).unwrap();
    assert_eq!(got, "hello from guest\n");

    let run = vmm.wait();
    assert!(run.status.success(), "{:?}\n{}", run.status, run.stderr);
    assert!(run.serial.contains("accepted\necho done\nvsock done\n"), "serial: {:?}", run.serial);
}
