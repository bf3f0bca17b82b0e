//! `overhead.podFixed` in runtimeclass/runtimeclass.yaml covers the formula of runtimeclass/README.md
//! ("`overhead.podFixed`: how it is derived") with the figures measured there. When the benches
//! report new figures, change them here and in the README together: this test reads both.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::path::Path;

/// The measured figures, MiB (README.md, "The figures", with where each comes from).
struct Figures {
    /// RSS of the runtime's processes in the pod's cgroup: jail waiter, jailed VMM, virtiofsd and
    /// its worker (`vm_pod`). RSS, not PSS: the cgroup may be charged every page they map (the
    /// first pod on a node faults in the binaries).
    in_pod_cgroup_rss: f64,
    /// What one more shim adds to the node (`vm_pod`, marginal PSS; the shim is outside the pod's
    /// cgroup, so only scheduling sees it).
    shim_marginal_pss: f64,
    /// Page tables and kernel stacks of the pod's processes (`vm_pod`).
    kernel: f64,
    /// Guest memory the guest uses idle: MemTotal - MemAvailable in a pod with two containers
    /// (`vm_e2e`, the real guest on the QEMU stand-in).
    guest_used: f64,
    /// The guest kernel's image in guest memory, which MemTotal leaves out (the PT_LOAD segments
    /// of the built vmlinux).
    guest_kernel_image: f64,
}

const FIGURES: Figures = Figures {
    in_pod_cgroup_rss: 14.7,
    shim_marginal_pss: 1.0,
    kernel: 0.5,
    guest_used: 39.0,
    guest_kernel_image: 10.8,
};

/// Headroom over the measured sum.
const HEADROOM: f64 = 1.25;
/// The CPU floor: a vCPU thread that mostly halts, the event loop, virtiofsd and the shim.
const CPU_FLOOR_MILLI: u64 = 100;

fn sum(f: &Figures) -> f64 {
    f.in_pod_cgroup_rss + f.shim_marginal_pss + f.kernel + f.guest_used + f.guest_kernel_image
}

/// `ceil_16Mi(HEADROOM x sum)`, MiB.
fn formula_mib(f: &Figures) -> u64 {
    let mib = (HEADROOM * sum(f)).ceil() as u64;
    mib.div_ceil(16) * 16
}

/// The formula as the README writes it.
fn formula_line(f: &Figures) -> String {
    format!(
        "ceil_16Mi( {HEADROOM} x ( {} + {} + {} + {} + {} ) MiB ) = ceil_16Mi( {:.1} MiB ) = {}Mi",
        f.in_pod_cgroup_rss,
        f.shim_marginal_pss,
        f.kernel,
        f.guest_used,
        f.guest_kernel_image,
        HEADROOM * sum(f),
        formula_mib(f)
    )
}

fn runtimeclass_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../runtimeclass"))
}

/// `overhead.podFixed.<key>` of the RuntimeClass manifest, unquoted.
fn pod_fixed(key: &str) -> String {
    let yaml = std::fs::read_to_string(runtimeclass_dir().join("runtimeclass.yaml")).unwrap();
    let block = yaml.split_once("podFixed:").expect("overhead.podFixed").1;
    let line = block.lines().find_map(|l| l.trim().strip_prefix(&format!("{key}:"))).expect(key);
    line.split('#').next().unwrap().trim().trim_matches('"').to_string()
}

/// A memory quantity in MiB (Mi and Gi only: what the manifest writes).
fn mib_of(quantity: &str) -> u64 {
    if let Some(v) = quantity.strip_suffix("Mi") {
        return v.parse().unwrap();
    }
    if let Some(v) = quantity.strip_suffix("Gi") {
        return v.parse::<u64>().unwrap() * 1024;
    }
    panic!("memory quantity {quantity:?} is not in Mi or Gi");
}

#[test]
fn pod_fixed_memory_covers_the_formula() {
    let shipped = mib_of(&pod_fixed("memory"));
    let needed = formula_mib(&FIGURES);
    println!("podFixed memory {shipped}Mi; the formula gives {}", formula_line(&FIGURES));
    assert!(shipped >= needed, "podFixed memory {shipped}Mi is below the formula's {needed}Mi");
}

#[test]
fn pod_fixed_cpu_is_at_least_the_floor() {
    let cpu = pod_fixed("cpu");
    let milli: u64 = match cpu.strip_suffix('m') {
        Some(m) => m.parse().unwrap(),
        None => cpu.parse::<u64>().unwrap() * 1000,
    };
    assert!(milli >= CPU_FLOOR_MILLI, "podFixed cpu {cpu} is below {CPU_FLOOR_MILLI}m");
}

#[test]
fn the_readme_states_the_formula_with_these_figures() {
    let readme = std::fs::read_to_string(runtimeclass_dir().join("README.md")).unwrap();
    let line = formula_line(&FIGURES);
    assert!(readme.contains(&line), "runtimeclass/README.md does not state\n    {line}");
}

#[test]
fn the_formula_rounds_up_to_16_mi() {
    let f = Figures {
        in_pod_cgroup_rss: 1.0,
        shim_marginal_pss: 0.0,
        kernel: 0.0,
        guest_used: 11.75,
        guest_kernel_image: 0.0,
    };
    assert_eq!(formula_mib(&f), 16);
    let f = Figures { guest_used: 11.875, ..f };
    assert_eq!(formula_mib(&f), 32, "1.25 x 12.875 = 16.09 -> 17 -> 32");
    assert_eq!(mib_of("1Gi"), 1024);
}
