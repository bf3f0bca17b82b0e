//! QEMU's command line for a [`Plan`]: the `microvm` machine under TCG, with the settings measured
//! to boot bulkhead's guest here (`shared/DESIGN.md`):
//! - `acpi=off`, so QEMU announces its virtio-mmio devices as `virtio_mmio.device=` words on the
//!   kernel command line (the guest kernel has no ACPI);
//! - guest memory in a shared memfd, which vhost-user backends (virtiofsd, vhost-device-vsock)
//!   must map;
//! - an ELF vmlinux booted through its PVH note (`CONFIG_PVH`);
//! - `-no-reboot`: a guest reset or panic ends QEMU, as it ends `bulkhead-vmm`;
//! - a second QMP monitor that only carries events, so the stand-in sees the guest's `SHUTDOWN`
//!   while the first serves the API and the vsock gate (a QMP socket takes one client at a time);
//! - `reboot=t` after the shim's words: `microvm` has no i8042, so the shim's `reboot=k` (right
//!   for `bulkhead-vmm`, which has one) would spin through the kernel's keyboard-controller reset
//!   loop (10 tries of up to 65536 reads of a port nothing answers) before it falls back to a
//!   triple fault; under TCG on a loaded host that took longer than the shim's 45 s connect
//!   timeout once. A triple fault resets at once.
//! - `init_on_free=1` after the shim's words: the guest kernel zeroes every page it frees. TCG
//!   drops the code it translated from a page only when a vCPU or QEMU itself writes that page;
//!   virtiofsd writes file data straight into the shared memfd, so a page cache page refilled
//!   over virtio-fs could still run the code translated from what the page held before. Two
//!   static binaries share text addresses (busybox and the conformance binary, both at 0x400000),
//!   and measured without it, one of them segfaulted within 45 alternate runs (3 of 3 tries,
//!   `vm_e2e::binaries_read_over_virtio_fs_run_as_they_are`); with it, none in 1500. The zeroing
//!   is a vCPU's write, so the stale code goes before virtiofsd can reuse the page. KVM has no
//!   such cache: `bulkhead-vmm`'s guests do not need it.

use std::path::Path;

use super::Plan;

/// The QEMU binary (Debian's `qemu-system-x86`, installed by `make setup`).
pub const QEMU: &str = "qemu-system-x86_64";
/// Kernel words the stand-in adds (module docs): how the guest resets (and so ends QEMU) on a
/// machine without an i8042, and freed pages zeroed so TCG forgets the code translated from them.
const STAND_IN_WORDS: &str = "init_on_free=1 reboot=t";

/// QEMU's arguments (after the binary) for `plan`, with its QMP sockets at `qmp` (commands) and
/// `events` (events only) and, when the plan has vsock, `vhost-device-vsock` serving vhost-user
/// at `vhost_vsock`.
pub fn args(plan: &Plan, qmp: &Path, events: &Path, vhost_vsock: Option<&Path>) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    let mut push = |items: &[&str]| a.extend(items.iter().map(|s| s.to_string()));
    let mem = format!("{}M", plan.mem_mib.get());
    push(&["-name", &format!("bulkhead-{}", plan.id)]);
    push(&["-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"]);
    push(&["-M", "microvm,acpi=off,rtc=off,memory-backend=mem"]);
    push(&["-accel", "tcg"]);
    push(&["-cpu", "max"]);
    push(&["-smp", &plan.vcpus.to_string(), "-m", &mem]);
    push(&["-object", &format!("memory-backend-memfd,id=mem,size={mem},share=on")]);
    push(&["-kernel", &plan.kernel.display().to_string()]);
    if let Some(initramfs) = &plan.initramfs {
        push(&["-initrd", &initramfs.display().to_string()]);
    }
    // The last `reboot=` wins.
    push(&["-append", &format!("{} {STAND_IN_WORDS}", plan.cmdline)]);
    match &plan.console {
        Some(console) => {
            push(&["-chardev", &format!("file,id=console,path={}", qemu_path(console)), "-serial", "chardev:console"])
        }
        None => push(&["-serial", "null"]),
    }
    for socket in [qmp, events] {
        push(&["-qmp", &format!("unix:{},server=on,wait=off", qemu_path(socket))]);
    }
    for (i, fs) in plan.fs.iter().enumerate() {
        push(&[
            "-chardev",
            &format!("socket,id=fs{i},path={}", qemu_path(&fs.socket)),
            "-device",
            &format!("vhost-user-fs-device,chardev=fs{i},tag={},queue-size={}", fs.tag, fs.queue_size),
        ]);
    }
    if let Some(socket) = vhost_vsock.filter(|_| plan.vsock.is_some()) {
        push(&[
            "-chardev",
            &format!("socket,id=vsock,path={}", qemu_path(socket)),
            "-device",
            &format!("vhost-user-vsock-device,id={},chardev=vsock", super::vsock_gate::DEVICE_ID),
        ]);
    }
    for (i, nic) in plan.net.iter().enumerate() {
        let mut device = format!("virtio-net-device,netdev=net{i},mac={}", nic.mac);
        if let Some(mtu) = nic.mtu {
            device.push_str(&format!(",host_mtu={mtu}"));
        }
        push(&["-netdev", &format!("tap,id=net{i},ifname={},script=no,downscript=no", nic.tap), "-device", &device]);
    }
    // Entropy from the host; free page reporting hands memory the guest frees back to the host.
    push(&["-device", "virtio-rng-device"]);
    if plan.free_page_reporting {
        push(&["-device", "virtio-balloon-device,free-page-reporting=on"]);
    }
    a
}

/// A path inside a QEMU option value, where `,` separates options and is escaped as `,,`.
fn qemu_path(path: &Path) -> String {
    path.display().to_string().replace(',', ",,")
}

#[cfg(test)]
mod tests {
    use super::super::plan::{FsDevice, Vsock};
    use super::*;
    use bulkhead_vmm_api::config::{LinkState, NetConfig};
    use bulkhead_vmm_api::memory::Mib;

    fn plan() -> Plan {
        Plan {
            id: "pod1".into(),
            kernel: "/cache/vmlinux".into(),
            initramfs: Some("/cache/initramfs.cpio.gz".into()),
            cmdline: "console=ttyS0 bulkhead.shared_fs=bulkhead".into(),
            vcpus: 2,
            mem_mib: Mib(512),
            console: Some("/s/run/console.log".into()),
            vsock: Some(Vsock { uds_path: "/s/run/v.sock".into(), guest_cid: 3 }),
            fs: vec![FsDevice { tag: "bulkhead".into(), socket: "/s/run/fs0.sock".into(), queue_size: 1024 }],
            net: vec![NetConfig {
                tap: "bhtap0".into(),
                mac: "02:00:00:00:00:01".into(),
                mtu: Some(1450),
                rate_limiter: None,
                link: LinkState::Up,
            }],
            api_socket: Some("/s/run/api.sock".into()),
            free_page_reporting: true,
            run_dir: "/s/run".into(),
            writable_dirs: vec!["/s/run".into()],
            cgroup: None,
            netns: None,
        }
    }

    fn value_after<'a>(args: &'a [String], flag: &str, containing: &str) -> Option<&'a str> {
        args.windows(2).find(|w| w[0] == flag && w[1].contains(containing)).map(|w| w[1].as_str())
    }

    #[test]
    fn the_machine_is_what_the_guest_needs() {
        let a =
            args(&plan(), Path::new("/s/run/q.sock"), Path::new("/s/run/qe.sock"), Some(Path::new("/s/run/vv.sock")));
        let m = value_after(&a, "-M", "microvm").unwrap();
        assert!(m.contains("acpi=off") && m.contains("memory-backend=mem"), "{m}");
        assert_eq!(value_after(&a, "-object", "memfd"), Some("memory-backend-memfd,id=mem,size=512M,share=on"));
        assert_eq!(value_after(&a, "-smp", ""), Some("2"));
        assert_eq!(
            value_after(&a, "-append", ""),
            Some("console=ttyS0 bulkhead.shared_fs=bulkhead init_on_free=1 reboot=t")
        );
        assert_eq!(value_after(&a, "-kernel", ""), Some("/cache/vmlinux"));
        assert!(a.contains(&"-no-reboot".to_string()));
        assert_eq!(value_after(&a, "-device", "balloon"), Some("virtio-balloon-device,free-page-reporting=on"));
        let mut p = plan();
        p.free_page_reporting = false;
        assert_eq!(value_after(&args(&p, Path::new("/q"), Path::new("/e"), None), "-device", "balloon"), None);
    }

    #[test]
    fn every_device_of_the_plan_is_there() {
        let a =
            args(&plan(), Path::new("/s/run/q.sock"), Path::new("/s/run/qe.sock"), Some(Path::new("/s/run/vv.sock")));
        assert_eq!(
            value_after(&a, "-device", "vhost-user-fs"),
            Some("vhost-user-fs-device,chardev=fs0,tag=bulkhead,queue-size=1024")
        );
        assert_eq!(value_after(&a, "-chardev", "id=fs0"), Some("socket,id=fs0,path=/s/run/fs0.sock"));
        assert_eq!(value_after(&a, "-chardev", "id=vsock"), Some("socket,id=vsock,path=/s/run/vv.sock"));
        assert_eq!(value_after(&a, "-netdev", "tap"), Some("tap,id=net0,ifname=bhtap0,script=no,downscript=no"));
        assert_eq!(
            value_after(&a, "-device", "virtio-net"),
            Some("virtio-net-device,netdev=net0,mac=02:00:00:00:00:01,host_mtu=1450")
        );
        assert_eq!(value_after(&a, "-chardev", "console"), Some("file,id=console,path=/s/run/console.log"));
        assert_eq!(value_after(&a, "-qmp", "q.sock"), Some("unix:/s/run/q.sock,server=on,wait=off"));
        assert_eq!(value_after(&a, "-qmp", "qe.sock"), Some("unix:/s/run/qe.sock,server=on,wait=off"));
    }

    #[test]
    fn commas_in_paths_are_escaped() {
        let mut p = plan();
        p.console = Some("/s/a,b/console.log".into());
        let a = args(&p, Path::new("/q"), Path::new("/e"), None);
        assert_eq!(value_after(&a, "-chardev", "console"), Some("file,id=console,path=/s/a,,b/console.log"));
        assert!(value_after(&a, "-device", "vhost-user-vsock").is_none(), "no vhost-user socket, no vsock device");
    }
}
