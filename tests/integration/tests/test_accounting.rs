//! scripts/test-summary.py, the suite's accounting (issue 14): skips must be listed in the
//! ledger for the host kind, a skip that then failed counts as failed, and the summary line
//! says what ran. Driven with synthetic `cargo test -- --show-output` logs. Also the emulated
//! node's own accounting when its kernel dies (tests/node/node.py).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::path::{Path, PathBuf};
use std::process::Command;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/test-summary.py")
}

/// A cargo log with one binary `vm_e2e`: `skipping` passes after a SKIPPED line, `plain` passes,
/// and, if `fail_after_skip`, `broken` prints SKIPPED and then fails.
fn log(fail_after_skip: bool) -> String {
    let mut text = String::from(
        "     Running tests/vm_e2e.rs (target/debug/deps/vm_e2e-0123456789abcdef)\n\n\
         running 3 tests\ntest plain ... ok\ntest skipping ... ok\n",
    );
    if fail_after_skip {
        text.push_str(
            "test broken ... FAILED\n\nsuccesses:\n\n---- skipping stdout ----\nSKIPPED: skipping: no vmx\n\n\n",
        );
        text.push_str(
            "successes:\n    plain\n    skipping\n\nfailures:\n\n---- broken stdout ----\nSKIPPED: broken: x\n",
        );
        text.push_str("thread 'broken' panicked\n\nfailures:\n    broken\n\n");
        text.push_str("test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\n");
    } else {
        text.push_str("\nsuccesses:\n\n---- skipping stdout ----\nSKIPPED: skipping: no vmx\n\n\n");
        text.push_str("successes:\n    plain\n    skipping\n\n");
        text.push_str("test result: ok. 2 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out\n");
    }
    text
}

struct Run {
    code: i32,
    out: String,
}

fn summarize(log_text: &str, ledger: &str, kind: &str, status: i32) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("log");
    let ledger_path = dir.path().join("ledger");
    std::fs::write(&log_path, log_text).unwrap();
    std::fs::write(&ledger_path, ledger).unwrap();
    let out = Command::new("python3")
        .arg(script())
        .arg("--log")
        .arg(&log_path)
        .arg("--ledger")
        .arg(&ledger_path)
        .args(["--host-kind", kind, "--status", &status.to_string()])
        .output()
        .expect("python3 runs the summary script (make setup installs python3)");
    Run { code: out.status.code().unwrap_or(-1), out: String::from_utf8_lossy(&out.stdout).into_owned() }
}

#[test]
fn a_listed_skip_counts_as_skipped() {
    let run = summarize(&log(false), "pvm vm_e2e::skipping no ordinary guests on PVM\n", "pvm", 0);
    assert_eq!(run.code, 0, "{}", run.out);
    assert!(run.out.ends_with("tests: 1 passed, 0 failed, 1 skipped\n"), "{}", run.out);
}

#[test]
fn an_unlisted_skip_fails_the_run() {
    // Listed, but for another host kind.
    let run = summarize(&log(false), "pvm vm_e2e::skipping no ordinary guests on PVM\n", "vmx", 0);
    assert_eq!(run.code, 1, "{}", run.out);
    assert!(
        run.out.contains("unlisted skip on a vmx host: vm_e2e::skipping: SKIPPED: skipping: no vmx"),
        "{}",
        run.out
    );
    let run = summarize(&log(false), "# nothing allowed\n", "pvm", 0);
    assert_eq!(run.code, 1, "{}", run.out);
}

#[test]
fn a_skip_that_then_failed_counts_as_failed() {
    let ledger = "pvm vm_e2e::skipping r\npvm vm_e2e::broken r\n";
    let run = summarize(&log(true), ledger, "pvm", 101);
    assert_eq!(run.code, 1, "{}", run.out);
    assert!(run.out.ends_with("tests: 1 passed, 1 failed, 1 skipped\n"), "{}", run.out);
}

#[test]
fn a_failure_is_repeated_with_its_error_and_without_its_backtrace() {
    let mut text = String::from(
        "     Running tests/vm_e2e.rs (target/debug/deps/vm_e2e-0123456789abcdef)\n\n\
         running 1 test\ntest boots ... FAILED\n\nfailures:\n\n---- boots stdout ----\n\
         Error: pod state left behind\n\nStack backtrace:\n",
    );
    // More frames than the repeated tail holds, as a real anyhow backtrace has.
    for n in 0..40 {
        text.push_str(&format!("  {n:2}: frame_{n}\n             at ./src/x.rs:{n}:1\n"));
    }
    text.push_str("  note: Some details are omitted\n\nfailures:\n    boots\n\n");
    text.push_str("test result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\n");
    let run = summarize(&text, "", "pvm", 101);
    assert_eq!(run.code, 1, "{}", run.out);
    assert!(run.out.contains("failed: vm_e2e::boots"), "{}", run.out);
    assert!(run.out.contains("Error: pod state left behind"), "the error was pushed out: {}", run.out);
    assert!(!run.out.contains("frame_"), "{}", run.out);
    assert!(run.out.ends_with("tests: 0 passed, 1 failed, 0 skipped\n"), "{}", run.out);
}

/// The shim's warning far up a failing test's output (containerd's log, printed by the test's
/// environment) is repeated after the tail, which is too short to reach it.
#[test]
fn a_failures_warnings_from_further_up_are_repeated() {
    let mut text = String::from(
        "     Running tests/vm_e2e.rs (target/debug/deps/vm_e2e-0123456789abcdef)\n\n\
         running 1 test\ntest execs ... FAILED\n\nfailures:\n\n---- execs stdout ----\n\
         2026-12-04T01:02:03.000000Z  WARN sandbox{id=ab}: bulkhead_shim::sandbox::vm: the VM ended on its own\n",
    );
    for n in 0..40 {
        text.push_str(&format!("time=\"t{n}\" level=info msg=\"filler {n}\"\n"));
    }
    text.push_str("Error: CRI ExecSync: timeout 30s exceeded\n\nfailures:\n    execs\n\n");
    text.push_str("test result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\n");
    let run = summarize(&text, "", "pvm", 101);
    assert!(run.out.contains("Error: CRI ExecSync: timeout 30s exceeded"), "{}", run.out);
    assert!(run.out.contains("the VM ended on its own"), "the warning was not repeated: {}", run.out);
    assert!(!run.out.contains("filler 0\""), "{}", run.out);
}

#[test]
fn a_build_failure_is_a_failure() {
    let run = summarize("error[E0425]: cannot find value\n", "", "pvm", 101);
    assert_eq!(run.code, 1, "{}", run.out);
    assert!(run.out.ends_with("tests: 0 passed, 1 failed, 0 skipped\n"), "{}", run.out);
}

#[test]
fn the_checked_in_ledger_parses() {
    let ledger = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/skips.ledger");
    let text = std::fs::read_to_string(&ledger).unwrap();
    let run = summarize("", &text, "pvm", 0);
    assert_eq!(run.code, 0, "{}", run.out);
}

/// A node whose kernel died in its first test binary has no progress file: node.py keeps its
/// console and reports no binary ended, so a new node runs them all (CI at 37ad684 crashed here
/// instead, and lost the stage).
#[test]
fn a_node_that_died_in_its_first_binary_is_set_aside_for_a_new_one() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("console.log"), "Kernel panic - not syncing\n").unwrap();
    let node = Path::new(env!("CARGO_MANIFEST_DIR")).join("../node");
    let code = "import sys, os; sys.path.insert(0, sys.argv[1]); import node; \
                out = sys.argv[2]; s, c = node.set_aside_panicked_node(out, os.path.join(out, 'progress')); \
                print(s, os.path.basename(c))";
    let set_aside = || {
        let out = Command::new("python3").args(["-B", "-c", code]).arg(&node).arg(dir.path()).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(set_aside(), "[] console-node-panicked.log\n");
    assert!(dir.path().join("console-node-panicked.log").is_file());

    // One binary had ended (status 0) before the node died: its status is kept, and so is the file.
    std::fs::write(dir.path().join("console.log"), "Kernel panic - not syncing\n").unwrap();
    std::fs::write(dir.path().join("progress"), "0 0\n").unwrap();
    assert_eq!(set_aside(), "[0] console-node-panicked.log\n");
    assert!(dir.path().join("progress-node-panicked").is_file());
}
