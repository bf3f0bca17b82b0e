//! KVM smoke test with a real Linux kernel: the kernel's own early serial lines must echo the
//! cmdline (with our `virtio_mmio.device=` entries), the e820 map and the MP table (2 vCPUs, one
//! IOAPIC) the VMM wrote.
//! Uses $BULKHEAD_KERNEL or the kernel guest-kernel/build-kernel.sh builds (cached by content hash).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

/// The guest kernel: $BULKHEAD_KERNEL, else guest-kernel/build-kernel.sh's cached build (built on
/// first use; `make test` builds it before the tests). A missing kernel fails the test: it must
/// not pass by doing nothing.
fn guest_kernel() -> PathBuf {
    if let Ok(p) = std::env::var("BULKHEAD_KERNEL") {
        return PathBuf::from(p);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../guest-kernel/build-kernel.sh");
    let out = std::process::Command::new(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    assert!(out.status.success(), "{} failed: {}", script.display(), out.status);
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

#[test]
fn linux_kernel_echoes_cmdline_and_e820() {
    if skip_without_kvm() {
        return;
    }
    let kernel = guest_kernel();
    let dir = tempfile::tempdir().unwrap();
    let disk = zero_disk(dir.path(), 4096);
    let cfg = serde_json::json!({
        "kernel": kernel,
        "cmdline": "console=ttyS0 earlyprintk=serial,ttyS0 reboot=k panic=-1",
        "mem_mib": 128,
        "vcpus": 2,
        "serial_log": dir.path().join("serial.log"),
        "block": [{ "path": disk }],
        "vsock": { "uds_path": dir.path().join("v.sock"), "guest_cid": 3 },
    });
    let vmm = VmmProcess::spawn(dir.path(), &cfg, Duration::from_secs(300));
    // Under the PVM instruction emulator the banner takes seconds to a minute.
    let deadline = Instant::now() + Duration::from_secs(180);
    let wanted = [
        "Command line: ",
        "BIOS-e820: [mem 0x0000000000100000-0x0000000007ffffff] usable",
        "MPTABLE: OEM ID: BULKHEAD",
        "Processors: 2",
    ];
    loop {
        let serial = read_serial(dir.path());
        if wanted.iter().all(|w| serial.contains(w)) && serial.contains("] reserved") {
            break;
        }
        if Instant::now() > deadline {
            let run = vmm.kill_and_collect();
            panic!("kernel never printed its memory map\nserial:\n{}\nstderr:\n{}", run.serial, run.stderr);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let run = vmm.kill_and_collect();
    // Lines carry a timestamp (CONFIG_PRINTK_TIME).
    let cmdline = run.serial.lines().find(|l| l.contains("Command line: ")).unwrap_or_default();
    assert!(cmdline.contains("console=ttyS0"), "{cmdline}");
    assert!(cmdline.contains("virtio_mmio.device=4K@0xd0000000:5"), "{cmdline}");
    assert!(cmdline.contains("virtio_mmio.device=4K@0xd0001000:6"), "{cmdline}");
    assert!(run.serial.contains("BIOS-e820: [mem 0x0000000000000000-0x000000000009fbff] usable"), "{}", run.serial);
    assert!(run.serial.contains("BIOS-e820: [mem 0x00000000c0000000-0x00000000ffffffff] reserved"), "{}", run.serial);
    assert!(run.serial.contains("Linux version"), "{}", run.serial);
    assert!(run.serial.contains("IOAPIC[0]: apic_id 3, version 17, address 0xfec00000, GSI 0-23"), "{}", run.serial);
}
