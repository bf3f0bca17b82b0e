//! `vmm_start`: how fast `bulkhead-vmm` gets a vCPU running, and what an idle VMM costs.
//!
//! For N runs: spawn the release `bulkhead-vmm` with a 3-byte raw guest (`hlt; jmp .-1`) and an
//! API socket; ask `info` for the wall-clock time of the first KVM_RUN; subtract the time just
//! before spawn. Then, with the guest idle, read the VMM's VmRSS. Prints medians (goals: <= 5 ms
//! and <= 10 MiB). Skips with one line when /dev/kvm is unusable.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bulkhead_benches::{unix_ns, vmm_binary};

const RUNS: usize = 20;
const GOAL_START_MS: f64 = 5.0;
const GOAL_RSS_MIB: f64 = 10.0;

struct Sample {
    start_to_run_ms: f64,
    in_process_ms: f64,
    rss_kib: u64,
}

fn wait_for(p: &Path, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    while !p.exists() {
        if Instant::now() > deadline {
            return Err(format!("{} never appeared", p.display()));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(())
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn info(api: &Path) -> Result<serde_json::Value, String> {
    let mut s = UnixStream::connect(api).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    s.write_all(b"{\"cmd\":\"info\"}\n").map_err(|e| e.to_string())?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).map_err(|e| e.to_string())?;
    serde_json::from_str(&line).map_err(|e| e.to_string())
}

fn one_run(vmm: &Path, dir: &Path, i: usize) -> Result<Sample, String> {
    let api = dir.join(format!("api{i}.sock"));
    let cfg = serde_json::json!({
        "raw_guest": { "image": dir.join("idle.bin"), "format": "flat", "load_addr": 0x100000 },
        "vcpus": 1,
        "mem_mib": 128,
        "api_socket": api,
    });
    let cfg_path = dir.join(format!("vm{i}.json"));
    std::fs::write(&cfg_path, cfg.to_string()).map_err(|e| e.to_string())?;
    let t0 = unix_ns();
    let mut child: Child = Command::new(vmm)
        .arg("--config")
        .arg(&cfg_path)
        .env("BULKHEAD_VMM_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("spawn: {e}"))?;
    let result = (|| {
        wait_for(&api, Duration::from_secs(10))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        let v = loop {
            let v = info(&api)?;
            if v["info"]["first_kvm_run_unix_ns"].is_u64() {
                break v;
            }
            if Instant::now() > deadline {
                return Err("no KVM_RUN within 10 s".to_string());
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let first = v["info"]["first_kvm_run_unix_ns"].as_u64().unwrap_or(0);
        let started = v["info"]["start_unix_ns"].as_u64().unwrap_or(0);
        // Let the VMM settle into idle before measuring memory.
        std::thread::sleep(Duration::from_millis(200));
        let rss = rss_kib(child.id()).ok_or("cannot read VmRSS")?;
        Ok(Sample {
            start_to_run_ms: first.saturating_sub(t0) as f64 / 1e6,
            in_process_ms: first.saturating_sub(started) as f64 / 1e6,
            rss_kib: rss,
        })
    })();
    let _ = child.kill();
    let _ = child.wait();
    result
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> std::io::Result<()> {
    // `cargo bench` passes --bench; a filter that is not ours means "not this bench".
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    if !args.is_empty() && !args.iter().any(|a| "vmm_start".contains(a.as_str())) {
        return Ok(());
    }
    if let Err(why) = bulkhead_vmm_api::probe::kvm_device_usable() {
        println!("SKIPPED: vmm_start: {why}");
        return Ok(());
    }
    let vmm = match vmm_binary() {
        Ok(p) => p,
        Err(e) => {
            println!("SKIPPED: vmm_start: {e}");
            return Ok(());
        }
    };
    let dir = tempfile::tempdir()?;
    // hlt; jmp back to the hlt.
    std::fs::write(dir.path().join("idle.bin"), [0xf4, 0xeb, 0xfd])?;

    let mut samples = Vec::new();
    for i in 0..RUNS {
        match one_run(&vmm, dir.path(), i) {
            Ok(s) => samples.push(s),
            Err(e) => return Err(std::io::Error::other(format!("vmm_start: run {i} failed: {e}"))),
        }
    }
    let start = median(samples.iter().map(|s| s.start_to_run_ms).collect());
    let inproc = median(samples.iter().map(|s| s.in_process_ms).collect());
    let rss_mib = median(samples.iter().map(|s| s.rss_kib as f64 / 1024.0).collect());
    let min = samples.iter().map(|s| s.start_to_run_ms).fold(f64::MAX, f64::min);
    let max = samples.iter().map(|s| s.start_to_run_ms).fold(0.0, f64::max);
    println!("vmm_start ({RUNS} runs, 1 vCPU, 128 MiB, release build)");
    println!(
        "  process start -> first KVM_RUN: median {start:.2} ms (min {min:.2}, max {max:.2}); goal <= {GOAL_START_MS} ms: {}",
        if start <= GOAL_START_MS { "met" } else { "MISSED" }
    );
    println!("  of which inside the VMM (main -> first KVM_RUN): median {inproc:.2} ms");
    println!(
        "  idle VMM RSS: median {rss_mib:.2} MiB; goal <= {GOAL_RSS_MIB} MiB: {}",
        if rss_mib <= GOAL_RSS_MIB { "met" } else { "MISSED" }
    );
    Ok(())
}
