//! Test harness for KVM integration tests: builds the no_std test guests with rustc for
//! x86_64-unknown-none, writes VM configs, and runs the real `bulkhead-vmm` binary with a timeout.
#![allow(dead_code)]

pub mod virtiofsd;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The `bulkhead-vmm` the tests run: the one cargo built with them, or `$BULKHEAD_VMM` (e.g. a
/// release build, to check the release filters; the debug-only seccomp probe is absent there).
pub fn vmm_binary() -> PathBuf {
    std::env::var_os("BULKHEAD_VMM").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_bulkhead-vmm")), PathBuf::from)
}

/// Why a KVM test cannot run here, if it cannot (the shared host probe).
pub fn kvm_unavailable() -> Option<String> {
    bulkhead_vmm_api::probe::kvm_device_usable().err()
}

/// The calling test's name (libtest names each test's thread after it).
pub fn test_name() -> String {
    std::thread::current().name().unwrap_or("kvm test").to_string()
}

/// Prints the SKIPPED line and returns true if KVM tests cannot run (a missing prerequisite:
/// a failure under BULKHEAD_REQUIRE_E2E).
pub fn skip_without_kvm() -> bool {
    match kvm_unavailable() {
        Some(reason) => bulkhead_integration::skip::missing_prerequisite(&test_name(), &reason),
        None => false,
    }
}

/// Compiles `tests/guests/<name>.rs` into a static ELF. Err(reason) means "cannot build here".
pub fn build_guest(name: &str) -> Result<PathBuf, String> {
    bulkhead_integration::guests::build(name, &Path::new(env!("CARGO_TARGET_TMPDIR")).join("bulkhead-test-guests"))
}

/// Skips (prints SKIPPED) when KVM or the guest toolchain is missing; otherwise the guest path.
pub fn guest_or_skip(name: &str) -> Option<PathBuf> {
    if skip_without_kvm() {
        return None;
    }
    match build_guest(name) {
        Ok(p) => Some(p),
        Err(reason) => {
            bulkhead_integration::skip::missing_prerequisite(&test_name(), &reason);
            None
        }
    }
}

pub struct Run {
    pub status: ExitStatus,
    pub stderr: String,
    pub serial: String,
}

/// A VMM child process with a hard deadline.
pub struct VmmProcess {
    pub child: Child,
    pub dir: PathBuf,
    /// Where the serial log lands on the host (`dir/serial.log` unless jailed).
    pub serial: PathBuf,
    deadline: Instant,
}

impl VmmProcess {
    pub fn spawn(dir: &Path, config: &serde_json::Value, timeout: Duration) -> Self {
        Self::spawn_with(dir, config, timeout, |_| {})
    }

    /// Like `spawn`, letting the caller adjust the command first (extra arguments after
    /// `--config dir/vm.json`, environment, entering a network namespace).
    pub fn spawn_with(
        dir: &Path,
        config: &serde_json::Value,
        timeout: Duration,
        adjust: impl FnOnce(&mut Command),
    ) -> Self {
        let cfg_path = dir.join("vm.json");
        std::fs::write(&cfg_path, serde_json::to_vec_pretty(config).unwrap()).unwrap();
        Self::spawn_args_with(dir, &["--config".as_ref(), cfg_path.as_os_str()], timeout, adjust)
    }

    /// Runs the VMM with `args`; `dir` holds its serial log.
    pub fn spawn_args(dir: &Path, args: &[&std::ffi::OsStr], timeout: Duration) -> Self {
        Self::spawn_args_with(dir, args, timeout, |_| {})
    }

    /// Like `spawn_args`, letting the caller adjust the command first.
    pub fn spawn_args_with(
        dir: &Path,
        args: &[&std::ffi::OsStr],
        timeout: Duration,
        adjust: impl FnOnce(&mut Command),
    ) -> Self {
        let mut cmd = Command::new(vmm_binary());
        cmd.args(args)
            .env("BULKHEAD_VMM_LOG", std::env::var("BULKHEAD_VMM_LOG").unwrap_or_else(|_| "info".into()))
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        adjust(&mut cmd);
        let child = cmd.spawn().expect("spawn bulkhead-vmm");
        Self { child, dir: dir.to_owned(), serial: dir.join("serial.log"), deadline: Instant::now() + timeout }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Kills the child (by PID) and returns what it logged, for failure messages.
    pub fn kill_and_collect(mut self) -> Run {
        let _ = self.child.kill();
        let status = self.child.wait().expect("wait");
        let mut stderr = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut stderr);
        }
        Run { status, stderr, serial: std::fs::read_to_string(&self.serial).unwrap_or_default() }
    }

    /// Waits for exit; kills the child (by PID) and panics if the deadline passes.
    pub fn wait(mut self) -> Run {
        let status = loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                break s;
            }
            if Instant::now() > self.deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                let mut err = String::new();
                if let Some(mut e) = self.child.stderr.take() {
                    let _ = e.read_to_string(&mut err);
                }
                panic!(
                    "bulkhead-vmm did not exit in time; killed.\nstderr:\n{err}\nserial:\n{}",
                    std::fs::read_to_string(&self.serial).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut stderr = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut stderr);
        }
        Run { status, stderr, serial: std::fs::read_to_string(&self.serial).unwrap_or_default() }
    }
}

impl Drop for VmmProcess {
    fn drop(&mut self) {
        // Never leave a VMM behind if a test fails midway.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One API request on a fresh connection; the answer as JSON. Bounded by `timeout`.
pub fn api_request(socket: &Path, request: &serde_json::Value, timeout: Duration) -> serde_json::Value {
    use std::io::{BufRead, BufReader, Write};
    let mut s = std::os::unix::net::UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(timeout)).unwrap();
    s.write_all(format!("{request}\n").as_bytes()).unwrap();
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad API answer {line:?}: {e}"))
}

/// Polls `dir/serial.log` until `done` holds for its text; panics after `timeout`.
pub fn wait_for_serial_text(dir: &Path, timeout: Duration, what: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let text = read_serial(dir);
        if done(&text) {
            return text;
        }
        assert!(Instant::now() < deadline, "serial never showed {what}; it holds: {text:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn read_serial(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("serial.log")).unwrap_or_default()
}

/// A zero-filled disk image `dir/disk.img` of `len` bytes.
pub fn zero_disk(dir: &Path, len: usize) -> PathBuf {
    let disk = dir.join("disk.img");
    std::fs::write(&disk, vec![0u8; len]).unwrap();
    disk
}

/// Polls until the Unix socket `p` accepts a connection; panics after `timeout`.
pub fn wait_for_socket(p: &Path, timeout: Duration) {
    // A socket file exists from bind(2) on, but accepts only after listen(2): under load a
    // client in between is refused. Ready means a connection is accepted.
    let deadline = Instant::now() + timeout;
    while let Err(e) = UnixStream::connect(p) {
        assert!(Instant::now() < deadline, "{} does not accept connections: {e}", p.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Polls the serial log until it shows `needle`; panics after `timeout`.
pub fn wait_for_serial(dir: &Path, needle: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while !read_serial(dir).contains(needle) {
        assert!(Instant::now() < deadline, "serial never showed {needle:?}; serial:\n{}", read_serial(dir));
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// One request on the VMM's API socket: `{"cmd":"<cmd>"}` out, one JSON line back.
pub fn api_call(stream: &mut UnixStream, reader: &mut BufReader<UnixStream>, cmd: &str) -> serde_json::Value {
    stream.write_all(format!("{{\"cmd\":\"{cmd}\"}}\n").as_bytes()).unwrap();
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap()
}

/// Base config for a raw test guest; the serial log lands in `dir/serial.log`.
pub fn raw_config(dir: &Path, guest: &Path) -> serde_json::Value {
    serde_json::json!({
        "raw_guest": { "image": guest },
        "vcpus": 1,
        "mem_mib": 32,
        "serial_log": dir.join("serial.log"),
    })
}

/// Generous: guest code runs through the PVM instruction emulator here.
pub const GUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// A minimal bzImage: a real setup header (boot protocol 2.12, loaded high) whose 64-bit entry
/// (payload + 0x200) prints the kernel cmdline it finds through boot_params (rsi) and resets.
pub fn fake_bzimage() -> Vec<u8> {
    let mut img = vec![0u8; 1024]; // boot sector + 1 setup sector
    img[0x1f1] = 1; // setup_sects
    img[0x1fe] = 0x55;
    img[0x1ff] = 0xaa;
    img[0x202..0x206].copy_from_slice(b"HdrS");
    img[0x206..0x208].copy_from_slice(&0x020cu16.to_le_bytes());
    img[0x211] = 0x01; // LOADED_HIGH
    img[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes());
    let mut payload = vec![0u8; 0x200];
    payload.extend_from_slice(&[
        0x8b, 0xbe, 0x28, 0x02, 0x00, 0x00, // mov edi, [rsi+0x228]  (hdr.cmd_line_ptr)
        0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
        0x8a, 0x07, // loop: mov al, [rdi]
        0x84, 0xc0, // test al, al
        0x74, 0x06, // jz done
        0xee, // out dx, al
        0x48, 0xff, 0xc7, // inc rdi
        0xeb, 0xf4, // jmp loop
        0xb0, 0x0a, 0xee, // done: newline
        0xb0, 0xfe, 0xe6, 0x64, // i8042 reset
        0xf4, // hlt
    ]);
    img.extend_from_slice(&payload);
    img
}
