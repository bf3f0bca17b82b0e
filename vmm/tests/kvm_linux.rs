//! KVM smoke test with a real Linux kernel: the kernel's own early serial lines must echo the
//! cmdline (with our `virtio_mmio.device=` entries), the e820 map and the MP table (2 vCPUs, one
//! IOAPIC) the VMM wrote.
//! Uses $BULKHEAD_KERNEL, guest-kernel/build/vmlinux or the kernel cache; SKIPPED without one.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

fn find_kernel() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("BULKHEAD_KERNEL") {
        return Some(PathBuf::from(p));
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../guest-kernel/build/vmlinux");
    if repo.is_file() {
        return Some(repo);
    }
    let cache = std::fs::read_dir("/var/cache/bulkhead").ok()?;
    cache.filter_map(|e| e.ok()).map(|e| e.path().join("vmlinux")).find(|p| p.is_file())
}

#[test]
fn linux_kernel_echoes_cmdline_and_e820() {
    if skip_without_kvm() {
        return;
    }
    let Some(kernel) = find_kernel() else {
        println!("SKIPPED: no guest kernel (set BULKHEAD_KERNEL or build guest-kernel/)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk.img");
    std::fs::write(&disk, vec![0u8; 4096]).unwrap();
    let cfg = serde_json::json!({
        "kernel": kernel,
        "cmdline": "console=ttyS0 earlyprintk=serial,ttyS0 reboot=k panic=-1 nomodule",
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
    let cmdline = run.serial.lines().find(|l| l.starts_with("Command line: ")).unwrap_or_default();
    assert!(cmdline.contains("console=ttyS0"), "{cmdline}");
    assert!(cmdline.contains("virtio_mmio.device=4K@0xd0000000:5"), "{cmdline}");
    assert!(cmdline.contains("virtio_mmio.device=4K@0xd0001000:6"), "{cmdline}");
    assert!(run.serial.contains("BIOS-e820: [mem 0x0000000000000000-0x000000000009fbff] usable"), "{}", run.serial);
    assert!(run.serial.contains("BIOS-e820: [mem 0x00000000c0000000-0x00000000ffffffff] reserved"), "{}", run.serial);
    assert!(run.serial.contains("Linux version"), "{}", run.serial);
    assert!(run.serial.contains("IOAPIC[0]: apic_id 3, version 17, address 0xfec00000, GSI 0-23"), "{}", run.serial);
}
