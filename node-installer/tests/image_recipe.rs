//! The image recipe cannot be built here (no container engine), so at least check that it puts every artifact the
//! installer needs into the artifact directory under the exact name the installer looks for.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::collections::BTreeSet;
use std::path::Path;

use bulkhead_node_installer::artifacts::{Need, ARTIFACTS};

const ARTIFACT_DIR: &str = "/opt/bulkhead-artifacts/";

/// Names the Containerfile's COPY instructions place in the artifact directory.
fn copied_names(recipe: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in recipe.lines().map(str::trim).filter(|l| l.starts_with("COPY ")) {
        let args: Vec<&str> = line.split_whitespace().skip(1).filter(|a| !a.starts_with("--")).collect();
        let Some((dest, sources)) = args.split_last() else { continue };
        if let Some(name) = dest.strip_prefix(ARTIFACT_DIR) {
            if name.is_empty() {
                names.extend(
                    sources.iter().filter_map(|s| Path::new(s).file_name()).map(|n| n.to_string_lossy().into_owned()),
                );
            } else {
                names.insert(name.to_string());
            }
        }
    }
    names
}

#[test]
fn containerfile_ships_every_required_and_vm_backend_artifact() {
    let recipe = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Containerfile")).unwrap();
    let names = copied_names(&recipe);
    for a in ARTIFACTS.iter().filter(|a| a.need != Need::Optional) {
        assert!(names.contains(a.name), "Containerfile does not put {} in {ARTIFACT_DIR} (has {names:?})", a.name);
    }
    assert!(recipe.contains("ENV BULKHEAD_ARTIFACTS=/opt/bulkhead-artifacts"));
}

#[test]
fn copy_parser_reads_dir_and_file_destinations() {
    let n = copied_names("COPY --from=x /a/shim /b/vmm /opt/bulkhead-artifacts/\nCOPY --from=k /vmlinux /opt/bulkhead-artifacts/vmlinux\n");
    assert_eq!(n, ["shim", "vmm", "vmlinux"].into_iter().map(String::from).collect());
}
