//! KVM integration: a hostile guest (unknown MMIO, bad descriptor chains, a lying vsock length)
//! cannot panic or hang the VMM; each fault is logged and the device stops serving until reset.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod common;

use common::*;

#[test]
fn hostile_guest_is_contained() {
    let Some(guest) = guest_or_skip("hostile") else { return };
    let dir = tempfile::tempdir().unwrap();
    let disk = zero_disk(dir.path(), 8192);
    let mut cfg = raw_config(dir.path(), &guest);
    cfg["block"] = serde_json::json!([{ "path": disk }]);
    cfg["vsock"] = serde_json::json!({ "uds_path": dir.path().join("v.sock"), "guest_cid": 3 });
    let run = VmmProcess::spawn(dir.path(), &cfg, GUEST_TIMEOUT).wait();
    let ctx = format!("serial:\n{}\nstderr:\n{}", run.serial, run.stderr);
    assert!(run.status.success(), "{:?}\n{ctx}", run.status);
    assert!(!run.stderr.contains("panicked"), "{ctx}");

    // The guest saw DEVICE_NEEDS_RESET (0x40) on top of its live status (0xf) each time.
    for what in ["blk out-of-range", "blk loop", "blk oversized", "vsock lying length"] {
        assert!(run.serial.contains(&format!("{what} status=4f\n")), "{what}\n{ctx}");
    }
    assert!(run.serial.contains("unknown mmio survived\n"), "{ctx}");
    assert!(run.serial.contains("blk recovered\n"), "{ctx}");
    assert!(run.serial.contains("hostile done\n"), "{ctx}");

    // And the VMM said why, once per fault.
    for needle in [
        "guest accessed unknown MMIO address",
        "virtio-mmio write ignored",
        "is outside guest memory",
        "does not terminate",
        "more than the",
        "claims 60000 payload bytes",
    ] {
        assert!(run.stderr.contains(needle), "missing log {needle:?}\n{ctx}");
    }
}
