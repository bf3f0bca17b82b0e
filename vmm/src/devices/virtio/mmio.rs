//! The virtio-mmio (version 2) transport: register file, feature negotiation, queue setup and the
//! driver status state machine. One instance per device, 4 KiB of MMIO each; the register map is
//! `mmio_regs.rs`.

use std::sync::{Arc, Mutex};

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::mmio_regs::{
    self as reg, MMIO_MAGIC, MMIO_VERSION, STATUS_ACKNOWLEDGE, STATUS_DRIVER, STATUS_DRIVER_OK, STATUS_FAILED,
    STATUS_FEATURES_OK, STATUS_NEEDS_RESET,
};
use super::{IrqTrigger, VirtioDevice};
use crate::devices::bus::{lock, BusDevice};
use crate::log_throttle::LogThrottle;
use crate::throttled;

/// What `VENDOR_ID` reads: "BHLK".
pub const VENDOR_ID: u32 = 0x4b4c_4842;

/// Where the driver is in the virtio initialisation sequence (spec 3.1.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriverState {
    Reset,
    Acknowledged,
    DriverLoaded,
    FeaturesOk,
    /// DRIVER_OK: the device owns the queues.
    Live,
    /// The driver gave up (FAILED) or activation failed; only a reset leaves this state.
    Failed,
}

impl DriverState {
    pub(super) fn status_bits(self) -> u32 {
        match self {
            DriverState::Reset => 0,
            DriverState::Acknowledged => STATUS_ACKNOWLEDGE,
            DriverState::DriverLoaded => STATUS_ACKNOWLEDGE | STATUS_DRIVER,
            DriverState::FeaturesOk => STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK,
            DriverState::Live => STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK | STATUS_DRIVER_OK,
            DriverState::Failed => STATUS_FAILED,
        }
    }

    /// The state whose status register reads `bits` (what a snapshot stores).
    pub(super) fn from_status_bits(bits: u32) -> Option<DriverState> {
        use DriverState::*;
        [Reset, Acknowledged, DriverLoaded, FeaturesOk, Live, Failed].into_iter().find(|s| s.status_bits() == bits)
    }

    /// The state the driver asks for by writing `status`, if that is a legal step from `self`.
    /// Resets (0) and FAILED are handled by the caller.
    fn next(self, status: u32) -> Option<DriverState> {
        use DriverState::*;
        match (self, status) {
            (Reset, s) if s == Acknowledged.status_bits() => Some(Acknowledged),
            (Acknowledged, s) if s == DriverLoaded.status_bits() => Some(DriverLoaded),
            (DriverLoaded, s) if s == FeaturesOk.status_bits() => Some(FeaturesOk),
            (FeaturesOk, s) if s == Live.status_bits() => Some(Live),
            // Re-writing the current status is harmless.
            (cur, s) if s == cur.status_bits() => Some(cur),
            _ => None,
        }
    }
}

pub struct MmioTransport {
    pub(super) device: Arc<Mutex<dyn VirtioDevice>>,
    pub(super) mem: GuestMemoryMmap,
    pub(super) irq: IrqTrigger,
    pub(super) queue_evts: Vec<EventFd>,
    pub(super) device_id: u32,
    pub(super) queues: Vec<Queue>,
    pub(super) state: DriverState,
    pub(super) device_features_sel: u32,
    pub(super) driver_features_sel: u32,
    pub(super) driver_features: u64,
    pub(super) queue_sel: u32,
    pub(super) config_generation: u32,
    pub(super) name: String,
    pub(super) logs: TransportLogs,
}

/// The transport's guest-triggered log lines, throttled per kind.
#[derive(Default)]
pub(super) struct TransportLogs {
    /// Odd-sized or unknown register accesses, writes in the wrong state, bad queue sizes and
    /// notifies.
    access: LogThrottle,
    /// Illegal status transitions and failed feature negotiations.
    status: LogThrottle,
    /// Activations the device refused.
    activation: LogThrottle,
}

impl MmioTransport {
    pub fn new(
        name: String,
        mem: GuestMemoryMmap,
        device: Arc<Mutex<dyn VirtioDevice>>,
        irq: IrqTrigger,
    ) -> std::io::Result<Self> {
        let (queue_evts, queues, device_id) = {
            let d = lock(&device);
            let evts = d.queue_events().iter().map(|e| e.try_clone()).collect::<Result<Vec<_>, _>>()?;
            (evts, fresh_queues(d.queue_max_sizes()), d.device_type())
        };
        Ok(Self {
            device,
            mem,
            irq,
            queue_evts,
            device_id,
            queues,
            state: DriverState::Reset,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            queue_sel: 0,
            config_generation: 0,
            name,
            logs: TransportLogs::default(),
        })
    }

    pub fn driver_state(&self) -> DriverState {
        self.state
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_sel as usize)
    }

    /// Queue registers may only change while the driver is configuring.
    fn configuring(&self) -> bool {
        matches!(self.state, DriverState::FeaturesOk | DriverState::DriverLoaded | DriverState::Acknowledged)
    }

    fn reset(&mut self) {
        let pending = lock(&self.device).reset();
        if let Some(pending) = pending {
            pending.wait();
        }
        self.queues = fresh_queues(lock(&self.device).queue_max_sizes());
        self.state = DriverState::Reset;
        self.driver_features = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.queue_sel = 0;
        self.irq.ack(u32::MAX);
    }

    fn set_status(&mut self, status: u32) {
        if status == 0 {
            self.reset();
            return;
        }
        if status & STATUS_FAILED != 0 {
            self.state = DriverState::Failed;
            return;
        }
        let Some(next) = self.state.next(status) else {
            throttled!(self.logs.status, warn, device = %self.name, from = ?self.state, status,
                "illegal virtio status transition ignored");
            return;
        };
        if next == DriverState::FeaturesOk && self.state != DriverState::FeaturesOk {
            let offered = lock(&self.device).avail_features();
            if self.driver_features & !offered != 0 || self.driver_features & super::VIRTIO_F_VERSION_1 == 0 {
                // Leave FEATURES_OK clear: the driver sees negotiation failed.
                throttled!(self.logs.status, warn, device = %self.name, acked = self.driver_features, offered,
                    "feature negotiation failed");
                return;
            }
            lock(&self.device).set_acked_features(self.driver_features);
        }
        if next == DriverState::Live && self.state != DriverState::Live {
            let queues = std::mem::take(&mut self.queues);
            let res = lock(&self.device).activate(self.mem.clone(), queues, self.irq.clone());
            if let Err(e) = res {
                throttled!(self.logs.activation, error, device = %self.name, error = %e, "device activation failed");
                self.state = DriverState::Failed;
                return;
            }
        }
        self.state = next;
    }

    fn status(&self) -> u32 {
        let mut s = self.state.status_bits();
        if lock(&self.device).is_broken() {
            s |= STATUS_NEEDS_RESET;
        }
        s
    }
}

pub(super) fn fresh_queues(max_sizes: &[u16]) -> Vec<Queue> {
    max_sizes.iter().filter_map(|&m| Queue::new(m).ok()).collect()
}

fn set_low(v: u64, lo: u32) -> u64 {
    (v & !0xffff_ffff) | u64::from(lo)
}
fn set_high(v: u64, hi: u32) -> u64 {
    (v & 0xffff_ffff) | (u64::from(hi) << 32)
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= reg::CONFIG {
            lock(&self.device).read_config(offset - reg::CONFIG, data);
            return;
        }
        if data.len() != 4 {
            throttled!(self.logs.access, warn, device = %self.name, offset, len = data.len(),
                "non-32-bit virtio-mmio register read");
            data.fill(0);
            return;
        }
        let v: u32 = match offset {
            reg::MAGIC => MMIO_MAGIC,
            reg::VERSION => MMIO_VERSION,
            reg::DEVICE_ID => self.device_id,
            reg::VENDOR_ID => VENDOR_ID,
            reg::DEVICE_FEATURES => {
                let f = lock(&self.device).avail_features();
                match self.device_features_sel {
                    0 => f as u32,
                    1 => (f >> 32) as u32,
                    _ => 0,
                }
            }
            reg::QUEUE_NUM_MAX => self.queues.get(self.queue_sel as usize).map_or(0, |q| u32::from(q.max_size())),
            reg::QUEUE_READY => self.queues.get(self.queue_sel as usize).map_or(0, |q| u32::from(q.ready())),
            reg::INTERRUPT_STATUS => self.irq.status(),
            reg::STATUS => self.status(),
            reg::CONFIG_GENERATION => self.config_generation,
            _ => {
                throttled!(self.logs.access, warn, device = %self.name, offset, "read of unknown virtio-mmio register");
                0
            }
        };
        data.copy_from_slice(&v.to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= reg::CONFIG {
            if self.state == DriverState::Failed {
                return;
            }
            lock(&self.device).write_config(offset - reg::CONFIG, data);
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            throttled!(self.logs.access, warn, device = %self.name, offset, len = data.len(),
                "non-32-bit virtio-mmio register write ignored");
            return;
        };
        let v = u32::from_le_bytes(bytes);
        let configuring = self.configuring();
        match offset {
            reg::DEVICE_FEATURES_SEL => self.device_features_sel = v,
            reg::DRIVER_FEATURES_SEL => self.driver_features_sel = v,
            reg::DRIVER_FEATURES if self.state == DriverState::DriverLoaded => match self.driver_features_sel {
                0 => self.driver_features = set_low(self.driver_features, v),
                1 => self.driver_features = set_high(self.driver_features, v),
                _ => {}
            },
            reg::QUEUE_SEL => self.queue_sel = v,
            reg::QUEUE_NUM if configuring => {
                let size = u16::try_from(v).ok();
                let refused =
                    self.selected_queue().is_some_and(|q| size.is_none_or(|size| q.try_set_size(size).is_err()));
                if refused {
                    throttled!(self.logs.access, warn, device = %self.name, size = v, "invalid queue size ignored");
                }
            }
            reg::QUEUE_READY if configuring => {
                if let Some(q) = self.selected_queue() {
                    q.set_ready(v == 1);
                }
            }
            reg::QUEUE_DESC_LOW if configuring => {
                if let Some(q) = self.selected_queue() {
                    q.set_desc_table_address(Some(v), None);
                }
            }
            reg::QUEUE_DESC_HIGH if configuring => {
                if let Some(q) = self.selected_queue() {
                    q.set_desc_table_address(None, Some(v));
                }
            }
            reg::QUEUE_DRIVER_LOW if configuring => {
                if let Some(q) = self.selected_queue() {
                    q.set_avail_ring_address(Some(v), None);
                }
            }
            reg::QUEUE_DRIVER_HIGH if configuring => {
                if let Some(q) = self.selected_queue() {
                    q.set_avail_ring_address(None, Some(v));
                }
            }
            reg::QUEUE_DEVICE_LOW if configuring => {
                if let Some(q) = self.selected_queue() {
                    q.set_used_ring_address(Some(v), None);
                }
            }
            reg::QUEUE_DEVICE_HIGH if configuring => {
                if let Some(q) = self.selected_queue() {
                    q.set_used_ring_address(None, Some(v));
                }
            }
            reg::QUEUE_NOTIFY if self.state == DriverState::Live => match self.queue_evts.get(v as usize) {
                Some(evt) => {
                    if let Err(e) = evt.write(1) {
                        throttled!(self.logs.access, warn, device = %self.name, error = %e, "queue notify failed");
                    }
                }
                None => {
                    throttled!(self.logs.access, warn, device = %self.name, queue = v,
                        "notify for a queue that does not exist")
                }
            },
            reg::INTERRUPT_ACK => self.irq.ack(v),
            reg::STATUS => self.set_status(v),
            _ => throttled!(self.logs.access, warn, device = %self.name, offset, value = v, state = ?self.state,
                "virtio-mmio write ignored (unknown register or wrong state)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::persist::{MmioTransportState, QueueState};
    use crate::devices::virtio::DeviceError;
    use crate::persist::Persist;
    use vm_memory::GuestAddress;

    /// A device that records what the transport told it.
    struct Fake {
        acked: u64,
        active_queues: usize,
        evts: Vec<EventFd>,
        broken: bool,
        resets: u32,
    }
    impl VirtioDevice for Fake {
        fn device_type(&self) -> u32 {
            42
        }
        fn avail_features(&self) -> u64 {
            super::super::VIRTIO_F_VERSION_1 | 0b101
        }
        fn set_acked_features(&mut self, f: u64) {
            self.acked = f;
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16, 8]
        }
        fn queue_events(&self) -> &[EventFd] {
            &self.evts
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8 + 1);
        }
        fn write_config(&mut self, _: u64, _: &[u8]) {}
        fn activate(&mut self, mem: GuestMemoryMmap, q: Vec<Queue>, _: IrqTrigger) -> Result<(), DeviceError> {
            super::super::validate_queues(&mem, &q)?;
            self.active_queues = q.len();
            Ok(())
        }
        fn reset(&mut self) -> Option<super::super::PendingReset> {
            self.resets += 1;
            self.broken = false;
            None
        }
        fn is_broken(&self) -> bool {
            self.broken
        }
    }

    fn setup() -> (MmioTransport, Arc<Mutex<Fake>>) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let fake = Arc::new(Mutex::new(Fake {
            acked: 0,
            active_queues: 0,
            evts: vec![EventFd::new(libc::EFD_NONBLOCK).unwrap(), EventFd::new(libc::EFD_NONBLOCK).unwrap()],
            broken: false,
            resets: 0,
        }));
        let t =
            MmioTransport::new("fake".into(), mem, fake.clone(), IrqTrigger::new(EventFd::new(0).unwrap())).unwrap();
        (t, fake)
    }

    fn r(t: &mut MmioTransport, off: u64) -> u32 {
        let mut b = [0u8; 4];
        t.read(off, &mut b);
        u32::from_le_bytes(b)
    }
    fn w(t: &mut MmioTransport, off: u64, v: u32) {
        t.write(off, &v.to_le_bytes());
    }

    fn negotiate(t: &mut MmioTransport) {
        w(t, reg::STATUS, 1);
        w(t, reg::STATUS, 3);
        w(t, reg::DRIVER_FEATURES_SEL, 1);
        w(t, reg::DRIVER_FEATURES, 1);
        w(t, reg::DRIVER_FEATURES_SEL, 0);
        w(t, reg::DRIVER_FEATURES, 0b100);
        w(t, reg::STATUS, 0xb);
    }

    fn setup_queue(t: &mut MmioTransport, sel: u32, base: u32) {
        w(t, reg::QUEUE_SEL, sel);
        w(t, reg::QUEUE_NUM, 8);
        w(t, reg::QUEUE_DESC_LOW, base);
        w(t, reg::QUEUE_DRIVER_LOW, base + 0x100);
        w(t, reg::QUEUE_DEVICE_LOW, base + 0x200);
        w(t, reg::QUEUE_READY, 1);
    }

    #[test]
    fn identification_registers() {
        let (mut t, _) = setup();
        assert_eq!(r(&mut t, reg::MAGIC), MMIO_MAGIC);
        assert_eq!(r(&mut t, reg::VERSION), 2);
        assert_eq!(r(&mut t, reg::DEVICE_ID), 42);
        w(&mut t, reg::DEVICE_FEATURES_SEL, 1);
        assert_eq!(r(&mut t, reg::DEVICE_FEATURES), 1);
        w(&mut t, reg::DEVICE_FEATURES_SEL, 0);
        assert_eq!(r(&mut t, reg::DEVICE_FEATURES), 0b101);
        let mut cfg = [0u8; 1];
        t.read(0x104, &mut cfg);
        assert_eq!(cfg, [5]);
    }

    #[test]
    fn full_init_sequence_activates_device() {
        let (mut t, fake) = setup();
        negotiate(&mut t);
        assert_eq!(r(&mut t, reg::STATUS), 0xb, "FEATURES_OK accepted");
        assert_eq!(fake.lock().unwrap().acked, (1 << 32) | 0b100);
        w(&mut t, reg::QUEUE_SEL, 0);
        assert_eq!(r(&mut t, reg::QUEUE_NUM_MAX), 16);
        setup_queue(&mut t, 0, 0x1000);
        setup_queue(&mut t, 1, 0x2000);
        assert_eq!(r(&mut t, reg::QUEUE_READY), 1);
        w(&mut t, reg::STATUS, 0xf);
        assert_eq!(t.driver_state(), DriverState::Live);
        assert_eq!(fake.lock().unwrap().active_queues, 2);
        w(&mut t, reg::QUEUE_NOTIFY, 1);
        assert_eq!(fake.lock().unwrap().evts[1].read().unwrap(), 1);
    }

    #[test]
    fn unoffered_features_fail_negotiation() {
        let (mut t, _) = setup();
        w(&mut t, reg::STATUS, 1);
        w(&mut t, reg::STATUS, 3);
        w(&mut t, reg::DRIVER_FEATURES, 0b10); // bit 1 was not offered, VERSION_1 missing
        w(&mut t, reg::STATUS, 0xb);
        assert_eq!(r(&mut t, reg::STATUS) & STATUS_FEATURES_OK, 0);
    }

    #[test]
    fn skipping_steps_is_ignored() {
        let (mut t, _) = setup();
        w(&mut t, reg::STATUS, 0xf);
        assert_eq!(t.driver_state(), DriverState::Reset);
        w(&mut t, reg::QUEUE_NUM, 4);
        w(&mut t, reg::QUEUE_NOTIFY, 0);
    }

    #[test]
    fn invalid_queue_sizes_are_ignored() {
        let (mut t, _) = setup();
        negotiate(&mut t);
        w(&mut t, reg::QUEUE_SEL, 0);
        for bad in [0x1_0008, 3, 32, 0] {
            w(&mut t, reg::QUEUE_NUM, bad);
        }
        assert_eq!(t.save().queues[0].size, 16, "max size stays");
        w(&mut t, reg::QUEUE_SEL, 9);
        w(&mut t, reg::QUEUE_NUM, 4);
        assert_eq!(r(&mut t, reg::QUEUE_NUM_MAX), 0, "no such queue");
    }

    #[test]
    fn activation_with_unready_queue_fails_and_reset_recovers() {
        let (mut t, fake) = setup();
        negotiate(&mut t);
        setup_queue(&mut t, 0, 0x1000);
        w(&mut t, reg::STATUS, 0xf);
        assert_eq!(t.driver_state(), DriverState::Failed);
        assert_eq!(r(&mut t, reg::STATUS), STATUS_FAILED);
        w(&mut t, reg::STATUS, 0);
        assert_eq!(t.driver_state(), DriverState::Reset);
        assert_eq!(fake.lock().unwrap().resets, 1);
        assert_eq!(r(&mut t, reg::QUEUE_READY), 0, "queues are fresh after reset");
    }

    fn restore_with(fake: &Arc<Mutex<Fake>>, s: &MmioTransportState) -> Result<MmioTransport, String> {
        use crate::devices::virtio::persist::MmioTransportConstructorArgs;
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let irq = IrqTrigger::new(EventFd::new(0).unwrap());
        let args = MmioTransportConstructorArgs { name: "fake".into(), mem, device: fake.clone(), irq };
        MmioTransport::restore(args, s).map_err(|e| e.to_string())
    }

    #[test]
    fn transport_mid_setup_roundtrips_and_the_driver_carries_on() {
        let (mut t, fake) = setup();
        negotiate(&mut t);
        setup_queue(&mut t, 0, 0x1000);
        w(&mut t, reg::QUEUE_SEL, 1);
        t.irq.trigger(crate::devices::virtio::VIRTIO_MMIO_INT_CONFIG);
        let saved = t.save();
        let bytes = postcard::to_stdvec(&saved).unwrap();
        let back: MmioTransportState = postcard::from_bytes(&bytes).unwrap();
        let mut t2 = restore_with(&fake, &back).unwrap();
        assert_eq!(t2.save(), saved);
        assert_eq!(t2.driver_state(), DriverState::FeaturesOk);
        assert_eq!(r(&mut t2, reg::INTERRUPT_STATUS), crate::devices::virtio::VIRTIO_MMIO_INT_CONFIG);
        w(&mut t2, reg::QUEUE_SEL, 0);
        assert_eq!(r(&mut t2, reg::QUEUE_READY), 1, "queue 0 kept its setup");
        setup_queue(&mut t2, 1, 0x2000);
        w(&mut t2, reg::STATUS, 0xf);
        assert_eq!(t2.driver_state(), DriverState::Live);
        assert_eq!(fake.lock().unwrap().active_queues, 2);
        // Live: the device owns the queues, the transport keeps none.
        let live = t2.save();
        assert!(live.queues.is_empty());
        let mut again = restore_with(&fake, &live).unwrap();
        w(&mut again, reg::QUEUE_NOTIFY, 0);
        assert_eq!(fake.lock().unwrap().evts[0].read().unwrap(), 1, "notifies reach the device");
    }

    #[test]
    fn bogus_transport_state_is_refused() {
        let (t, fake) = setup();
        let good = t.save();
        let cases = [
            (MmioTransportState { device_status: 0x5, ..good.clone() }, "driver status"),
            (MmioTransportState { driver_features: 1 << 60, ..good.clone() }, "acked features"),
            (MmioTransportState { queues: good.queues[..1].to_vec(), ..good.clone() }, "queues saved"),
            (
                MmioTransportState { queues: vec![QueueState { max_size: 99, ..good.queues[0] }; 2], ..good.clone() },
                "max size",
            ),
            (
                MmioTransportState { queues: vec![QueueState { size: 5, ..good.queues[0] }; 2], ..good.clone() },
                "queue 0",
            ),
        ];
        for (s, needle) in cases {
            let e = restore_with(&fake, &s).err().unwrap_or_default();
            assert!(e.contains(needle), "{needle}: {e}");
        }
    }

    #[test]
    fn broken_device_reports_needs_reset() {
        let (mut t, fake) = setup();
        fake.lock().unwrap().broken = true;
        assert_ne!(r(&mut t, reg::STATUS) & STATUS_NEEDS_RESET, 0);
    }

    #[test]
    fn odd_sized_and_unknown_accesses_are_harmless() {
        let (mut t, _) = setup();
        t.write(reg::STATUS, &[1]);
        assert_eq!(t.driver_state(), DriverState::Reset);
        let mut b = [0xffu8; 2];
        t.read(reg::MAGIC, &mut b);
        assert_eq!(b, [0, 0]);
        w(&mut t, 0x0f0, 5);
        assert_eq!(r(&mut t, 0x0f0), 0);
        let snap = t.save();
        assert_eq!(snap.queues.len(), 2);
    }
}
