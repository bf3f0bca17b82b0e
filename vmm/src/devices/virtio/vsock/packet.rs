//! The virtio-vsock packet header and bounded parsing/writing of packets in descriptor chains.

use vm_memory::{Bytes, GuestMemoryMmap};

use super::MAX_PKT_PAYLOAD;
use crate::devices::virtio::chain::{self, Desc};

pub use super::wire::*;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VsockHeader {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

impl VsockHeader {
    pub fn from_bytes(b: &[u8; HDR_LEN]) -> Self {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default());
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or_default());
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap_or_default());
        Self {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    pub fn to_bytes(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PacketError {
    #[error("TX chain has a device-writable descriptor")]
    WritableTx,
    #[error("RX chain has a device-readable descriptor")]
    ReadableRx,
    #[error("chain of {0} bytes cannot hold a 44-byte header")]
    ShortHeader(u64),
    #[error("header claims {claimed} payload bytes but the chain carries {carried}")]
    LyingLength { claimed: u32, carried: u64 },
    #[error("payload of {0} bytes exceeds the {MAX_PKT_PAYLOAD}-byte limit")]
    TooBig(u32),
    #[error("guest memory: {0}")]
    Memory(String),
}

/// A packet the guest sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxPacket {
    pub hdr: VsockHeader,
    pub data: Vec<u8>,
}

/// Copies `len` bytes starting `skip` bytes into the chain.
fn read_chain(descs: &[Desc], mem: &GuestMemoryMmap, mut skip: usize, len: usize) -> Result<Vec<u8>, PacketError> {
    let mut out = Vec::with_capacity(len);
    for d in descs {
        if out.len() == len {
            break;
        }
        let dlen = d.len as usize;
        if skip >= dlen {
            skip -= dlen;
            continue;
        }
        let n = (dlen - skip).min(len - out.len());
        let start = out.len();
        out.resize(start + n, 0);
        // `skip` < the descriptor's length here.
        let addr = d.addr_at(skip as u64);
        mem.read_slice(&mut out[start..], addr).map_err(|e| PacketError::Memory(e.to_string()))?;
        skip = 0;
    }
    Ok(out)
}

/// Total length of a chain whose descriptors all have the direction `writable`, checked to hold
/// at least a header.
fn header_chain_len(descs: &[Desc], writable: bool) -> Result<u64, PacketError> {
    if descs.iter().any(|d| d.writable != writable) {
        return Err(if writable { PacketError::ReadableRx } else { PacketError::WritableTx });
    }
    let total = chain::total_len(descs);
    if total < HDR_LEN as u64 {
        return Err(PacketError::ShortHeader(total));
    }
    Ok(total)
}

impl TxPacket {
    /// Parses a guest TX chain. The header's `len` must match what the chain really carries.
    pub fn parse(descs: &[Desc], mem: &GuestMemoryMmap) -> Result<Self, PacketError> {
        let total = header_chain_len(descs, false)?;
        let raw = read_chain(descs, mem, 0, HDR_LEN)?;
        let mut hb = [0u8; HDR_LEN];
        hb.copy_from_slice(&raw);
        let hdr = VsockHeader::from_bytes(&hb);
        if hdr.len as usize > MAX_PKT_PAYLOAD {
            return Err(PacketError::TooBig(hdr.len));
        }
        let carried = total - HDR_LEN as u64;
        if u64::from(hdr.len) > carried {
            return Err(PacketError::LyingLength { claimed: hdr.len, carried });
        }
        let data = read_chain(descs, mem, HDR_LEN, hdr.len as usize)?;
        Ok(Self { hdr, data })
    }
}

/// Payload room of an RX chain (after the header), validating its shape.
pub fn rx_capacity(descs: &[Desc]) -> Result<usize, PacketError> {
    let total = header_chain_len(descs, true)?;
    Ok(((total - HDR_LEN as u64) as usize).min(MAX_PKT_PAYLOAD))
}

/// Writes header + payload into an RX chain; returns the bytes written.
pub fn write_rx(descs: &[Desc], mem: &GuestMemoryMmap, hdr: &VsockHeader, data: &[u8]) -> Result<u32, PacketError> {
    let mut bytes = Vec::with_capacity(HDR_LEN + data.len());
    bytes.extend_from_slice(&hdr.to_bytes());
    bytes.extend_from_slice(data);
    let written = chain::scatter(&bytes, descs, mem).map_err(|e| PacketError::Memory(e.to_string()))?;
    Ok(written as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::chain::test_utils::{desc as d, mem};
    use vm_memory::GuestAddress;

    fn hdr(len: u32) -> VsockHeader {
        VsockHeader { src_cid: 3, dst_cid: 2, src_port: 5, dst_port: 6, len, type_: 1, op: OP_RW, ..Default::default() }
    }

    #[test]
    fn header_roundtrips() {
        let h = VsockHeader { flags: 3, buf_alloc: 9, fwd_cnt: 11, ..hdr(7) };
        assert_eq!(VsockHeader::from_bytes(&h.to_bytes()), h);
    }

    #[test]
    fn parses_header_and_payload_split_across_descriptors() {
        let m = mem();
        let mut bytes = hdr(5).to_bytes().to_vec();
        bytes.extend_from_slice(b"hello");
        m.write_slice(&bytes[..30], GuestAddress(0x1000)).unwrap();
        m.write_slice(&bytes[30..], GuestAddress(0x2000)).unwrap();
        let p = TxPacket::parse(&[d(0x1000, 30, false), d(0x2000, 19, false)], &m).unwrap();
        assert_eq!(p.hdr, hdr(5));
        assert_eq!(p.data, b"hello");
    }

    #[test]
    fn lying_length_is_rejected() {
        let m = mem();
        m.write_slice(&hdr(60000).to_bytes(), GuestAddress(0x1000)).unwrap();
        assert_eq!(
            TxPacket::parse(&[d(0x1000, 52, false)], &m),
            Err(PacketError::LyingLength { claimed: 60000, carried: 8 })
        );
        m.write_slice(&hdr(u32::MAX).to_bytes(), GuestAddress(0x1000)).unwrap();
        assert_eq!(TxPacket::parse(&[d(0x1000, 52, false)], &m), Err(PacketError::TooBig(u32::MAX)));
    }

    #[test]
    fn malformed_shapes_are_rejected() {
        let m = mem();
        assert_eq!(TxPacket::parse(&[d(0x1000, 10, false)], &m), Err(PacketError::ShortHeader(10)));
        assert_eq!(TxPacket::parse(&[d(0x1000, 60, true)], &m), Err(PacketError::WritableTx));
        assert_eq!(rx_capacity(&[d(0x1000, 60, false)]), Err(PacketError::ReadableRx));
        assert_eq!(rx_capacity(&[d(0x1000, 40, true)]), Err(PacketError::ShortHeader(40)));
        assert_eq!(rx_capacity(&[d(0x1000, 4096, true)]), Ok(4096 - 44));
    }

    #[test]
    fn rx_write_spans_descriptors() {
        let m = mem();
        let descs = [d(0x1000, 40, true), d(0x2000, 100, true)];
        let n = write_rx(&descs, &m, &hdr(3), b"abc").unwrap();
        assert_eq!(n, 47);
        let mut raw = [0u8; 44];
        m.read_slice(&mut raw[..40], GuestAddress(0x1000)).unwrap();
        m.read_slice(&mut raw[40..], GuestAddress(0x2000)).unwrap();
        assert_eq!(VsockHeader::from_bytes(&raw), hdr(3));
        let mut data = [0u8; 3];
        m.read_slice(&mut data, GuestAddress(0x2004)).unwrap();
        assert_eq!(&data, b"abc");
    }
}
