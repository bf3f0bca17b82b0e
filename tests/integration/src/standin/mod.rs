//! The QEMU stand-in for `bulkhead-vmm` (tests only, never shipped): on hosts whose /dev/kvm runs
//! no ordinary guest (PVM), the real guest kernel, initramfs and agent still run, on QEMU's
//! `microvm` machine under TCG. The binary `bulkhead-qemu-vmm` takes exactly what the shim gives
//! `bulkhead-vmm` (`--config vm.json --jail jail.json`), so the shim runs unchanged with only its
//! `vmm_path` pointing here.
//!
//! What it keeps of the real VMM's contract: the VM config (kernel, initramfs, command line,
//! vCPUs, memory), the serial console into the pod's console log, virtio-fs to the pod's own
//! virtiofsd (vhost-user), vsock as the same hybrid Unix socket with the `CONNECT <port>`
//! protocol (served by rust-vmm's `vhost-device-vsock`), virtio-net on the pod's taps, the
//! pod's cgroup and network namespace, the API socket's pause/resume/shutdown/info, and dying
//! with its waiter (its children get `PR_SET_PDEATHSIG`). What it skips: the chroot and the uid
//! drop (`vmm/tests/kvm_jail.rs` proves those on the real VMM), snapshots, block devices.
//!
//! [`plan`] resolves the two documents into host paths, [`qemu`] turns a plan into QEMU's
//! arguments, [`qmp`] is a bounded QMP client, [`api`] serves the VMM's API socket over it and
//! [`cgroup`] joins the pod's cgroup; [`shutdown_watch`] ends a QEMU that outlives its guest;
//! [`vsock_gate`] keeps the hybrid-vsock socket hidden until
//! the guest's driver is ready (a `vhost-device-vsock` flaw).

pub mod api;
pub mod cgroup;
pub mod plan;
pub mod qemu;
pub mod qmp;
pub mod shutdown_watch;
pub mod vsock_gate;

pub use plan::Plan;
