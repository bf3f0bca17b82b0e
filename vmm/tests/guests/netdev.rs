//! A minimal polling virtio-net driver for the test guests: bring-up with chosen features, one
//! Ethernet + IPv4 + UDP datagram out, frames in. The addresses are fixed and match the test's
//! network namespace: the tap there has HOST_MAC/HOST_IP and a static neighbour entry for the
//! guest, so nobody needs ARP. Used by `net.rs` and `net_hostile.rs` (after `mod common;`).
#![allow(dead_code)]

use crate::common::*;

pub const TYPE_NET: u32 = 1;
pub const F_CSUM: u32 = 1 << 0;
pub const F_MTU: u32 = 1 << 3;
pub const F_MAC: u32 = 1 << 5;
pub const F_STATUS: u32 = 1 << 16;
/// virtio-net config space: the link status (u16) after the MAC.
pub const LINK_STATUS: u64 = CONFIG + 6;
/// Polls of the interrupt status for a link change (as long as a restore may take to arrive).
pub const LINK_SPINS: u32 = 2_000_000;
/// INTERRUPT_STATUS's "the config changed" bit.
pub const INT_CONFIG: u32 = 2;
pub const VNET_HDR: u64 = 12;
pub const HOST_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];
pub const HOST_IP: [u8; 4] = [10, 0, 0, 1];
pub const GUEST_IP: [u8; 4] = [10, 0, 0, 2];
pub const ECHO_PORT: u16 = 7777;
pub const GUEST_PORT: u16 = 5555;

pub const RX_RING: u64 = 0x40_0000;
pub const TX_RING: u64 = 0x40_1000;
pub const RX_BUF: u64 = 0x41_0000;
pub const RX_BUF_LEN: u32 = 2048;
pub const TX_BUF: u64 = 0x42_0000;
pub const NRX: u16 = 4;

pub fn be16(addr: u64) -> u16 {
    (r8(addr) as u16) << 8 | r8(addr + 1) as u16
}

pub fn wbe16(addr: u64, v: u16) {
    w8(addr, (v >> 8) as u8);
    w8(addr + 1, v as u8);
}

fn put_bytes(addr: u64, bytes: &[u8]) {
    for (i, b) in bytes.iter().enumerate() {
        w8(addr + i as u64, *b);
    }
}

/// `aa:bb:cc:dd:ee:ff`
pub fn put_mac(mac: &[u8; 6]) {
    let digits = b"0123456789abcdef";
    for (i, b) in mac.iter().enumerate() {
        if i > 0 {
            outb(0x3f8, b':');
        }
        outb(0x3f8, digits[(b >> 4) as usize]);
        outb(0x3f8, digits[(b & 0xf) as usize]);
    }
}

/// ACK, DRIVER, VERSION_1 plus those low feature bits of `want` the device offers, FEATURES_OK.
/// Returns the low bits acked.
pub fn negotiate_net(base: u64, want: u32) -> Option<u32> {
    w32(base + STATUS, 0);
    w32(base + STATUS, 1);
    w32(base + STATUS, 3);
    w32(base + DEVICE_FEATURES_SEL, 1);
    if r32(base + DEVICE_FEATURES) & 1 == 0 {
        return None;
    }
    w32(base + DEVICE_FEATURES_SEL, 0);
    let low = r32(base + DEVICE_FEATURES) & want;
    w32(base + DRIVER_FEATURES_SEL, 1);
    w32(base + DRIVER_FEATURES, 1);
    w32(base + DRIVER_FEATURES_SEL, 0);
    w32(base + DRIVER_FEATURES, low);
    w32(base + STATUS, 0xb);
    if r32(base + STATUS) & 8 == 0 {
        return None;
    }
    Some(low)
}

pub struct Net {
    pub base: u64,
    pub rx: Vq,
    pub tx: Vq,
    pub mac: [u8; 6],
    pub features: u32,
}

impl Net {
    /// Resets and brings the device up with `tx_size` TX entries, then posts NRX RX buffers.
    pub fn up(base: u64, want: u32, tx_size: u16) -> Option<Net> {
        let features = negotiate_net(base, want)?;
        let rx = Vq::new(base, 0, RX_RING, 8);
        let tx = Vq::new(base, 1, TX_RING, tx_size);
        if !rx.setup() || !tx.setup() || !driver_ok(base) {
            return None;
        }
        let mut mac = [0u8; 6];
        for (i, m) in mac.iter_mut().enumerate() {
            *m = r8(base + CONFIG + i as u64);
        }
        let mut net = Net { base, rx, tx, mac, features };
        for i in 0..NRX {
            net.rx.set_desc(i, RX_BUF + i as u64 * 0x1000, RX_BUF_LEN, F_WRITE, 0);
            net.rx.publish(i);
        }
        Some(net)
    }

    /// Writes a zero vnet header + Ethernet + IPv4 (with header checksum) + UDP (checksum 0)
    /// carrying `payload` to HOST_IP:ECHO_PORT at TX_BUF; returns the total length.
    pub fn build_udp(&self, payload: &[u8]) -> u32 {
        for i in 0..VNET_HDR {
            w8(TX_BUF + i, 0);
        }
        let eth = TX_BUF + VNET_HDR;
        put_bytes(eth, &HOST_MAC);
        put_bytes(eth + 6, &self.mac);
        wbe16(eth + 12, 0x0800);
        let ip = eth + 14;
        let ip_len = 20 + 8 + payload.len() as u16;
        put_bytes(ip, &[0x45, 0]);
        wbe16(ip + 2, ip_len);
        put_bytes(ip + 4, &[0, 0, 0x40, 0, 64, 17, 0, 0]);
        put_bytes(ip + 12, &GUEST_IP);
        put_bytes(ip + 16, &HOST_IP);
        let mut sum: u32 = 0;
        for i in 0..10 {
            sum += be16(ip + 2 * i) as u32;
        }
        while sum >> 16 != 0 {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        wbe16(ip + 10, !(sum as u16));
        let udp = ip + 20;
        wbe16(udp, GUEST_PORT);
        wbe16(udp + 2, ECHO_PORT);
        wbe16(udp + 4, 8 + payload.len() as u16);
        wbe16(udp + 6, 0);
        put_bytes(udp + 8, payload);
        (VNET_HDR + 14) as u32 + ip_len as u32
    }

    /// Sends the `len` bytes at TX_BUF as one descriptor; true once the device used it.
    pub fn send(&mut self, len: u32) -> bool {
        self.tx.set_desc(0, TX_BUF, len, 0, 0);
        self.tx.publish(0);
        self.tx.wait_used(2_000_000).is_some()
    }

    /// Waits for a UDP datagram from ECHO_PORT; returns (payload address, payload length).
    /// Other frames (IPv6 chatter of the host, say) go back to the device.
    pub fn recv_udp(&mut self) -> Option<(u64, u64)> {
        for _ in 0..32 {
            let (id, _len) = self.rx.wait_used(5_000_000)?;
            let eth = RX_BUF + id as u64 * 0x1000 + VNET_HDR;
            let ip = eth + 14;
            if be16(eth + 12) == 0x0800 && r8(ip + 9) == 17 && be16(ip + 20) == ECHO_PORT {
                return Some((ip + 28, be16(ip + 24).saturating_sub(8) as u64));
            }
            self.rx.publish(id as u16);
        }
        None
    }
}
