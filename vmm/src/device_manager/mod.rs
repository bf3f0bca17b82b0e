//! Device assembly, in one place (Firecracker's `device_manager/`, cloud-hypervisor's
//! `DeviceManager`): every device of a VM, built fresh from the config on a boot or restored from
//! the snapshot's device state, put on its bus with its interrupt, and kept as the set a snapshot
//! saves. The builder makes the KVM VM, guest memory and vCPUs and hands this a
//! [`DeviceContext`]; the devices themselves live in `devices/`, one folder each.
//!
//! - `context.rs`: what the builder hands over ([`DeviceContext`]); `error.rs`: how it fails;
//! - `legacy.rs`: the serial port and the i8042 on port I/O;
//! - `mmio.rs`: the virtio-mmio slots (address, GSI, transport, the saved state of each slot);
//! - `persist.rs`: the device set's state and the live handles a snapshot walks.
//!
//! Adding a virtio device: its folder under `devices/virtio/` (declared in
//! `devices/virtio/mod.rs`), its kind in `persist.rs` (a `VirtioDeviceState` and a `VirtioHandle`
//! variant, a `VirtioKind` impl), and its `add` in [`DeviceManager::build`], whose order is the
//! slot order.
//!
//! Runs on the main thread before any seccomp filter: the run's files, sockets and taps are opened
//! here, and the virtio-fs backend threads are started (each confined by its own filter), as no
//! thread can start later.

pub mod context;
pub mod error;
pub mod legacy;
pub mod mmio;
pub mod persist;

use std::sync::{Arc, Mutex};

pub use context::{CmdlineDevice, DeviceContext, Subscriber};
pub use error::DeviceManagerError;

use crate::config::ValidConfig;
use crate::devices::bus::Bus;
use crate::devices::virtio::balloon::persist::BalloonConstructorArgs;
use crate::devices::virtio::balloon::Balloon;
use crate::devices::virtio::block::persist::BlockConstructorArgs;
use crate::devices::virtio::block::Block;
use crate::devices::virtio::fs::persist::FsConstructorArgs;
use crate::devices::virtio::fs::{BackendThreads, Fs};
use crate::devices::virtio::net::persist::NetConstructorArgs;
use crate::devices::virtio::net::tap::Tap;
use crate::devices::virtio::net::Net;
use crate::devices::virtio::vsock::persist::VsockConstructorArgs;
use crate::devices::virtio::vsock::Vsock;
use crate::seccomp::{self, ThreadKind};
use crate::thread::Confine;
use mmio::{Attached, MmioSlots};
use persist::{DevicesState, SaveableDevices};

/// Everything the guest can reach: the port I/O and MMIO buses the vCPUs dispatch to, the
/// devices' event-loop halves, and the devices as a snapshot saves them.
pub struct DeviceManager {
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    pub subscribers: Vec<Subscriber>,
    /// (base, size, gsi) of each virtio-mmio device, for the kernel cmdline.
    pub cmdline_devices: Vec<CmdlineDevice>,
    pub saveable: SaveableDevices,
    /// The balloon, whose target the API sets.
    pub balloon: Option<Arc<Mutex<Balloon>>>,
}

impl DeviceManager {
    /// Builds every device the config names; from `saved` state when restoring, which must hold
    /// the same devices in the same slots.
    pub fn build(
        cfg: &ValidConfig,
        ctx: &DeviceContext,
        saved: Option<&DevicesState>,
    ) -> Result<Self, DeviceManagerError> {
        let device_err = |what: String| move |source| DeviceManagerError::Device { what, source };
        let mut pio = Bus::new();
        let mut mmio = Bus::new();
        let mut subscribers: Vec<Subscriber> = Vec::new();

        let legacy = legacy::attach(cfg, ctx, saved, &mut pio)?;
        #[cfg(debug_assertions)]
        if let Some((port, watcher)) = crate::crash::probe::devices().map_err(device_err("panic probe".into()))? {
            pio.insert(port, crate::crash::probe::PROBE_PORT, 1)?;
            subscribers.push(watcher);
        }

        // Virtio devices, one MMIO slot each, in this order: block devices, vsock, fs, net, balloon.
        let mut virtio = MmioSlots::new(saved.map(|s| s.virtio.as_slice()));
        let mem = ctx.mem;
        for (i, b) in cfg.block.iter().enumerate() {
            let blk = virtio.add(
                format!("blk{i}"),
                || Block::new(b, i).map_err(device_err(format!("block {}", b.path.display()))),
                |irq| Ok(BlockConstructorArgs { cfg: b.clone(), index: i, mem: mem.clone(), irq }),
            )?;
            subscribers.push(blk);
        }
        if let Some(v) = &cfg.vsock {
            let vsock = virtio.add(
                "vsock".into(),
                || Vsock::new(v.guest_cid, &v.uds_path).map_err(device_err(format!("vsock {}", v.uds_path.display()))),
                |irq| Ok(VsockConstructorArgs { uds_path: v.uds_path.clone(), mem: mem.clone(), irq }),
            )?;
            subscribers.push(vsock);
        }
        for (i, f) in cfg.fs.iter().enumerate() {
            let threads = || BackendThreads {
                worker: confine(ThreadKind::FsBackend, ctx.filters.fs_backend()),
                watchdog: confine(ThreadKind::FsWatchdog, ctx.filters.fs_watchdog()),
                unconfirmed: ctx.threads.clone(),
            };
            let fs = virtio.add(
                format!("fs{i}"),
                || Fs::new(f, i, threads()).map_err(device_err(format!("fs {}", f.tag))),
                |irq| Ok(FsConstructorArgs { cfg: f.clone(), index: i, threads: threads(), mem: mem.clone(), irq }),
            )?;
            subscribers.push(fs);
        }
        for (i, n) in cfg.net.iter().enumerate() {
            let net_err = |source| DeviceManagerError::Net { tap: n.tap.clone(), source };
            let net = virtio.add(
                format!("net{i}"),
                || Net::new(n, i).map_err(net_err),
                |irq| {
                    let tap = Tap::open(&n.tap).map_err(|e| net_err(e.into()))?;
                    Ok(NetConstructorArgs {
                        index: i,
                        tap: n.tap.clone(),
                        backend: Box::new(tap),
                        rate_limiter: n.rate_limiter.clone(),
                        link: n.link,
                        mem: mem.clone(),
                        irq,
                    })
                },
            )?;
            subscribers.push(net);
        }
        let mut balloon = None;
        if let Some(b) = &cfg.balloon {
            let device = virtio.add(
                "balloon".into(),
                || Balloon::new(b).map_err(device_err("balloon".into())),
                |irq| Ok(BalloonConstructorArgs { cfg: *b, mem: mem.clone(), irq }),
            )?;
            subscribers.push(device.clone());
            balloon = Some(device);
        }
        let Attached { saveable: virtio, cmdline_devices } = virtio.attach(ctx, &mut mmio)?;

        let saveable = SaveableDevices { serial: legacy.serial, i8042: legacy.i8042, virtio };
        Ok(Self { pio: Arc::new(pio), mmio: Arc::new(mmio), subscribers, cmdline_devices, saveable, balloon })
    }
}

/// What a new thread of `kind` runs first: installing its filter.
fn confine(kind: ThreadKind, program: &seccompiler::BpfProgram) -> Confine {
    let program = program.clone();
    Box::new(move || seccomp::install(kind, &program).map_err(|e| e.to_string()))
}
