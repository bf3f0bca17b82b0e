//! KVM integration: boot, serial, i8042 reset, errors, signals and the API, with the real binary.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use common::*;

#[test]
fn serial_line_lands_in_log_and_i8042_reset_exits_zero() {
    let Some(guest) = guest_or_skip("hello") else { return };
    let dir = tempfile::tempdir().unwrap();
    let run = VmmProcess::spawn(dir.path(), &raw_config(dir.path(), &guest), GUEST_TIMEOUT).wait();
    assert!(run.status.success(), "exit {:?}\nstderr:\n{}", run.status, run.stderr);
    assert!(run.serial.contains("hello from the bulkhead test guest\n"), "serial: {:?}", run.serial);
    assert!(run.stderr.contains("guest reset through i8042"), "{}", run.stderr);
}
