//! The guest kernel's build checks itself: an option of `guest-kernel/bulkhead.config` that
//! `olddefconfig` drops (its dependencies are missing) fails the build and is named.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::path::{Path, PathBuf};
use std::process::Command;

fn guest_kernel_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../guest-kernel")
}

#[test]
fn the_config_check_names_each_lost_option() {
    let dir = tempfile::tempdir().unwrap();
    let fragment = dir.path().join("fragment");
    let config = dir.path().join(".config");
    std::fs::write(&fragment, "# a comment\nCONFIG_A=y\nCONFIG_B=y\nCONFIG_C=n\nCONFIG_D=32\nCONFIG_E=n\n").unwrap();
    std::fs::write(&config, "CONFIG_A=y\n# CONFIG_B is not set\n# CONFIG_C is not set\nCONFIG_D=16\nCONFIG_E=y\n")
        .unwrap();
    let out = Command::new(guest_kernel_dir().join("check-config.py")).arg(&fragment).arg(&config).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    for lost in ["CONFIG_B=y", "CONFIG_D=32", "CONFIG_E=n"] {
        assert!(err.contains(lost), "{lost} not named in:\n{err}");
    }
    assert!(!err.contains("CONFIG_A") && !err.contains("CONFIG_C="), "kept options are not named:\n{err}");

    std::fs::write(&config, "CONFIG_A=y\nCONFIG_B=y\nCONFIG_D=32\n").unwrap();
    std::fs::write(&fragment, "CONFIG_A=y\nCONFIG_B=y\nCONFIG_C=n\nCONFIG_D=32\n").unwrap();
    let out = Command::new(guest_kernel_dir().join("check-config.py")).arg(&fragment).arg(&config).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_kernel_option_with_a_missing_dependency_fails_the_build() {
    let test = "a_kernel_option_with_a_missing_dependency_fails_the_build";
    if !Path::new("/usr/src")
        .read_dir()
        .is_ok_and(|mut d| d.any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().starts_with("linux-source-6.12"))))
    {
        bulkhead_integration::skip::missing_prerequisite(test, "linux-source-6.12 is not installed (run `make setup`)");
        return;
    }
    // The real fragment plus VMGENID, which needs ACPI, which the guest kernel leaves out.
    let dir = tempfile::tempdir().unwrap();
    let fragment = dir.path().join("bulkhead.config");
    let mut text = std::fs::read_to_string(guest_kernel_dir().join("bulkhead.config")).unwrap();
    text.push_str("CONFIG_VMGENID=y\n");
    std::fs::write(&fragment, text).unwrap();
    let out = Command::new(guest_kernel_dir().join("build-kernel.sh"))
        .arg("--check-only")
        .arg(&fragment)
        .env("TMPDIR", dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the build went on without CONFIG_VMGENID:\n{err}");
    assert!(err.contains("CONFIG_VMGENID=y") && err.contains("did not survive olddefconfig"), "{err}");
    assert!(!err.contains("CONFIG_IPC_NS"), "only the lost option is named:\n{err}");
}
