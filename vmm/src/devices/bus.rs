//! A bus maps guest port-I/O or MMIO addresses to devices. vCPU threads dispatch exits through it.

use std::sync::{Arc, Mutex};

/// A device reachable from a bus; offsets are relative to the device's base address.
pub trait BusDevice: Send {
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    #[error("range {base:#x}+{len:#x} overlaps an existing device")]
    Overlap { base: u64, len: u64 },
    #[error("zero-length range at {0:#x}")]
    Empty(u64),
}

struct Entry {
    base: u64,
    len: u64,
    device: Arc<Mutex<dyn BusDevice>>,
}

#[derive(Default)]
pub struct Bus {
    entries: Vec<Entry>,
}

impl Bus {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&mut self, device: Arc<Mutex<dyn BusDevice>>, base: u64, len: u64) -> Result<(), BusError> {
        if len == 0 {
            return Err(BusError::Empty(base));
        }
        let end = base.checked_add(len).ok_or(BusError::Overlap { base, len })?;
        if self.entries.iter().any(|e| base < e.base + e.len && e.base < end) {
            return Err(BusError::Overlap { base, len });
        }
        let pos = self.entries.partition_point(|e| e.base < base);
        self.entries.insert(pos, Entry { base, len, device });
        Ok(())
    }

    fn find(&self, addr: u64, size: usize) -> Option<(&Entry, u64)> {
        let idx = self.entries.partition_point(|e| e.base <= addr).checked_sub(1)?;
        let e = &self.entries[idx];
        let offset = addr - e.base;
        (offset.checked_add(size as u64)? <= e.len).then_some((e, offset))
    }

    /// Returns false if no device claims the address (the caller decides how loudly to complain).
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((e, offset)) => {
                lock(&e.device).read(offset, data);
                true
            }
            None => false,
        }
    }

    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((e, offset)) => {
                lock(&e.device).write(offset, data);
                true
            }
            None => false,
        }
    }
}

/// Locks a device, recovering from a poisoned mutex: a panicked device thread must not take the
/// whole VMM down with a second panic.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo(Vec<(u64, Vec<u8>)>);
    impl BusDevice for Echo {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.0.push((offset, data.to_vec()));
        }
    }

    #[test]
    fn dispatches_by_range_and_rejects_overlaps() {
        let mut bus = Bus::new();
        let a = Arc::new(Mutex::new(Echo(vec![])));
        bus.insert(a.clone(), 0x100, 0x10).unwrap();
        assert_eq!(bus.insert(a.clone(), 0x108, 0x10), Err(BusError::Overlap { base: 0x108, len: 0x10 }));
        bus.insert(a.clone(), 0x110, 0x10).unwrap();
        let mut buf = [0u8; 2];
        assert!(bus.read(0x104, &mut buf));
        assert_eq!(buf, [4, 4]);
        assert!(bus.write(0x112, &[7]));
        assert_eq!(a.lock().unwrap().0, vec![(2, vec![7])]);
        assert!(!bus.read(0xff, &mut buf));
        assert!(!bus.read(0x11f, &mut buf), "access straddling the end is unclaimed");
        assert!(!bus.write(0x200, &[1]));
    }
}
