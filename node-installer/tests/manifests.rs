//! Every manifest in runtimeclass/ and node-installer/ (and the rendered kustomization) validates offline against a
//! recent Kubernetes schema. The work is in runtimeclass/validate.sh; this runs it under `cargo test`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::path::Path;
use std::process::Command;

#[test]
fn manifests_validate_against_kubernetes_schema() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../runtimeclass/validate.sh");
    let out = Command::new("bash").arg(&script).output().expect("run validate.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if let Some(line) = stdout.lines().find(|l| l.starts_with("SKIPPED:")) {
        let reason = line.trim_start_matches("SKIPPED:").trim();
        bulkhead_integration::skip::missing_prerequisite("manifests_validate_against_kubernetes_schema", reason);
        return;
    }
    assert!(out.status.success(), "validate.sh failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("OK:"), "{stdout}");
    println!("{}", stdout.trim_end());
}
