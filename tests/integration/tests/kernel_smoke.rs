//! Real guest kernel smoke: `bulkhead-vmm` boots the `guest-kernel/` vmlinux and the test
//! reads the kernel's own serial lines. They must echo the command line (with the
//! `virtio_mmio.device=` entries the VMM added) and the e820 map the VMM wrote.
//!
//! On PVM hosts the kernel runs through KVM's instruction emulator and dies later in
//! boot (DESIGN.md); these early lines are what it reliably reaches, within seconds.

use anyhow::{bail, Context, Result};
use bulkhead_vmm::layout;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Bound for the whole boot-to-e820 wait; it takes ~10 s here, 2-3x more under load.
const BOOT_DEADLINE: Duration = Duration::from_secs(180);
const MEM_MIB: u64 = 64;
const CMDLINE: &str = "console=ttyS0 earlycon=uart8250,io,0x3f8 reboot=k panic=1 pci=off nomodule bulkhead.smoke=1";

fn guest_kernel() -> Result<PathBuf> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../guest-kernel/build-kernel.sh");
    let out =
        Command::new(&script).stderr(Stdio::inherit()).output().with_context(|| format!("{}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed ({})", script.display(), out.status);
    }
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
}

/// The e820 lines Linux prints for the map the VMM builds for `mem` bytes below the MMIO hole.
fn expected_e820(mem: u64) -> Vec<String> {
    let line = |start: u64, end: u64, kind: &str| format!("BIOS-e820: [mem {start:#018x}-{end:#018x}] {kind}");
    vec![
        line(0, layout::EBDA_START - 1, "usable"),
        line(layout::HIMEM_START, mem - 1, "usable"),
        line(layout::MMIO_HOLE_START, layout::MMIO_HOLE_END - 1, "reserved"),
    ]
}

/// Kills the VMM by PID when the test ends, however it ends.
struct Reap(std::process::Child);
impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn guest_kernel_echoes_cmdline_and_e820() -> Result<()> {
    if !Path::new("/dev/kvm").exists() {
        println!("SKIPPED: guest_kernel_echoes_cmdline_and_e820: there is no /dev/kvm on this host");
        return Ok(());
    }
    let kernel = guest_kernel()?;
    let dir = tempfile::tempdir()?;
    let serial = dir.path().join("serial.log");
    let disk = dir.path().join("disk.img");
    std::fs::write(&disk, vec![0u8; 4096])?;
    let config = serde_json::json!({
        "kernel": kernel, "cmdline": CMDLINE, "mem_mib": MEM_MIB, "serial_log": serial,
        "block": [{ "path": disk }],
    });
    let config_path = dir.path().join("vm.json");
    std::fs::write(&config_path, serde_json::to_vec(&config)?)?;

    let vmm = bulkhead_integration::workspace_bin("bulkhead-vmm");
    let child = Command::new(&vmm)
        .arg("--config")
        .arg(&config_path)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("vmm.log"))?)
        .spawn()
        .with_context(|| format!("spawning {}", vmm.display()))?;
    let mut vmm_proc = Reap(child);

    let want_cmdline = format!("Command line: {CMDLINE} virtio_mmio.device=4K@{:#x}:", layout::virtio_mmio_addr(0));
    let want_e820 = expected_e820(MEM_MIB << 20);
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(&serial).unwrap_or_default();
        let has_cmdline = text.lines().any(|l| l.starts_with(&want_cmdline));
        let e820: Vec<&str> = text.lines().filter(|l| l.starts_with("BIOS-e820:")).collect();
        if has_cmdline && e820.len() >= want_e820.len() {
            assert_eq!(e820, want_e820, "the kernel's e820 map differs from the one the VMM wrote");
            assert!(text.contains("Linux version 6.12"), "no kernel banner:\n{text}");
            println!("kernel reached its e820 map after {:.1} s", start.elapsed().as_secs_f64());
            return Ok(());
        }
        if let Some(status) = vmm_proc.0.try_wait()? {
            let log = std::fs::read_to_string(dir.path().join("vmm.log")).unwrap_or_default();
            bail!(
                "bulkhead-vmm exited ({status}) before the kernel printed its map.\nserial:\n{text}\nvmm log:\n{log}"
            );
        }
        if start.elapsed() > BOOT_DEADLINE {
            bail!("no cmdline/e820 lines within {BOOT_DEADLINE:?}; serial so far:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
