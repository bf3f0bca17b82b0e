//! The virtio-net wire format: a 12-byte `virtio_net_hdr_v1` followed by one Ethernet frame.
//! Bounded parsing of guest TX chains (header checked against the negotiated offloads, every
//! offset checked against the frame) and bounded writing of host frames into guest RX chains.

use vm_memory::{Bytes, GuestMemoryMmap};

use crate::devices::virtio::chain::{self, Desc};

/// `virtio_net_hdr_v1`: with VERSION_1 the header always carries `num_buffers`.
pub const VNET_HDR_LEN: usize = 12;
pub const ETH_HLEN: usize = 14;
/// Largest Ethernet frame either way: a 64 KiB GSO super-frame plus its Ethernet header.
pub const MAX_FRAME_LEN: usize = 65536 + ETH_HLEN;
/// Largest header + frame, and so the largest chain the device reads or fills.
pub const MAX_BUFFER_LEN: usize = VNET_HDR_LEN + MAX_FRAME_LEN;

pub const HDR_F_NEEDS_CSUM: u8 = 1;
pub const GSO_NONE: u8 = 0;
pub const GSO_TCPV4: u8 = 1;
pub const GSO_TCPV6: u8 = 4;
pub const GSO_ECN: u8 = 0x80;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VnetHeader {
    pub flags: u8,
    pub gso_type: u8,
    pub hdr_len: u16,
    pub gso_size: u16,
    pub csum_start: u16,
    pub csum_offset: u16,
    pub num_buffers: u16,
}

impl VnetHeader {
    pub fn from_bytes(b: &[u8; VNET_HDR_LEN]) -> Self {
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        Self {
            flags: b[0],
            gso_type: b[1],
            hdr_len: u16_at(2),
            gso_size: u16_at(4),
            csum_start: u16_at(6),
            csum_offset: u16_at(8),
            num_buffers: u16_at(10),
        }
    }

    pub fn to_bytes(&self) -> [u8; VNET_HDR_LEN] {
        let mut b = [0u8; VNET_HDR_LEN];
        b[0] = self.flags;
        b[1] = self.gso_type;
        for (o, v) in
            [(2, self.hdr_len), (4, self.gso_size), (6, self.csum_start), (8, self.csum_offset), (10, self.num_buffers)]
        {
            b[o..o + 2].copy_from_slice(&v.to_le_bytes());
        }
        b
    }
}

/// Offloads the driver negotiated for frames it sends; TX headers may ask for nothing else.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TxOffloads {
    /// VIRTIO_NET_F_CSUM: partial checksums.
    pub csum: bool,
    /// VIRTIO_NET_F_HOST_TSO4 (with CSUM).
    pub tso4: bool,
    /// VIRTIO_NET_F_HOST_TSO6 (with CSUM).
    pub tso6: bool,
}

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum PacketError {
    #[error("TX chain has a device-writable descriptor")]
    WritableTx,
    #[error("RX chain has a device-readable descriptor")]
    ReadableRx,
    #[error("chain of {0} bytes cannot hold the {VNET_HDR_LEN}-byte vnet header")]
    ShortHeader(u64),
    #[error("frame of {0} bytes is shorter than an Ethernet header")]
    ShortFrame(u64),
    #[error("frame of {0} bytes exceeds the {MAX_FRAME_LEN}-byte limit")]
    TooBig(u64),
    #[error("vnet header flags {0:#x} are not valid from a driver")]
    BadFlags(u8),
    #[error("vnet header asks for checksum offload, which was not negotiated")]
    CsumNotNegotiated,
    #[error("vnet header checksum at {start}+{offset} lies beyond the {frame_len}-byte frame")]
    CsumOutOfFrame { start: u16, offset: u16, frame_len: u64 },
    #[error("vnet header GSO type {0:#x} was not negotiated")]
    GsoNotNegotiated(u8),
    #[error("vnet header asks for GSO without checksum offload or with a zero segment size")]
    GsoIncomplete,
    #[error("vnet header claims {hdr_len} header bytes in a {frame_len}-byte frame")]
    HdrLenOutOfFrame { hdr_len: u16, frame_len: u64 },
    #[error("guest memory: {0}")]
    Memory(String),
}

/// Checks a driver's TX header against what was negotiated and against the frame it precedes.
pub fn check_tx_header(h: &VnetHeader, frame_len: u64, offloads: TxOffloads) -> Result<(), PacketError> {
    if h.flags & !HDR_F_NEEDS_CSUM != 0 {
        return Err(PacketError::BadFlags(h.flags));
    }
    let needs_csum = h.flags & HDR_F_NEEDS_CSUM != 0;
    if needs_csum {
        if !offloads.csum {
            return Err(PacketError::CsumNotNegotiated);
        }
        let end = u64::from(h.csum_start) + u64::from(h.csum_offset) + 2;
        if end > frame_len {
            return Err(PacketError::CsumOutOfFrame { start: h.csum_start, offset: h.csum_offset, frame_len });
        }
    }
    let allowed = match h.gso_type {
        GSO_NONE => return Ok(()),
        GSO_TCPV4 => offloads.tso4,
        GSO_TCPV6 => offloads.tso6,
        _ => false, // UDP, USO and ECN were never offered
    };
    if !allowed {
        return Err(PacketError::GsoNotNegotiated(h.gso_type));
    }
    if !needs_csum || h.gso_size == 0 {
        return Err(PacketError::GsoIncomplete);
    }
    if u64::from(h.hdr_len) > frame_len {
        return Err(PacketError::HdrLenOutOfFrame { hdr_len: h.hdr_len, frame_len });
    }
    Ok(())
}

/// Copies a guest TX chain (vnet header + frame) into `buf`, replacing its contents, and checks
/// the header. `buf` then holds exactly what goes to the tap.
pub fn read_tx(
    descs: &[Desc],
    mem: &GuestMemoryMmap,
    offloads: TxOffloads,
    buf: &mut Vec<u8>,
) -> Result<VnetHeader, PacketError> {
    if descs.iter().any(|d| d.writable) {
        return Err(PacketError::WritableTx);
    }
    let total = chain::total_len(descs);
    if total < VNET_HDR_LEN as u64 {
        return Err(PacketError::ShortHeader(total));
    }
    let frame_len = total - VNET_HDR_LEN as u64;
    if frame_len > MAX_FRAME_LEN as u64 {
        return Err(PacketError::TooBig(frame_len));
    }
    if frame_len < ETH_HLEN as u64 {
        return Err(PacketError::ShortFrame(frame_len));
    }
    buf.clear();
    buf.resize(total as usize, 0);
    let mut off = 0;
    for d in descs {
        let end = off + d.len as usize;
        mem.read_slice(&mut buf[off..end], d.addr).map_err(|e| PacketError::Memory(e.to_string()))?;
        off = end;
    }
    let mut hb = [0u8; VNET_HDR_LEN];
    hb.copy_from_slice(&buf[..VNET_HDR_LEN]);
    let hdr = VnetHeader::from_bytes(&hb);
    check_tx_header(&hdr, frame_len, offloads)?;
    Ok(hdr)
}

/// Room of a guest RX chain (header included, capped at [`MAX_BUFFER_LEN`]), checking its shape.
pub fn rx_capacity(descs: &[Desc]) -> Result<usize, PacketError> {
    if descs.iter().any(|d| !d.writable) {
        return Err(PacketError::ReadableRx);
    }
    let total = chain::total_len(descs);
    if total < VNET_HDR_LEN as u64 {
        return Err(PacketError::ShortHeader(total));
    }
    Ok(total.min(MAX_BUFFER_LEN as u64) as usize)
}

/// Writes a host frame (vnet header + frame, as the tap delivered it) into an RX chain whose
/// [`rx_capacity`] is at least `frame.len()`; returns the bytes written.
pub fn write_rx(descs: &[Desc], mem: &GuestMemoryMmap, frame: &[u8]) -> Result<u32, PacketError> {
    let n = chain::scatter(frame, descs, mem).map_err(|e| PacketError::Memory(e.to_string()))?;
    Ok(n as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::chain::test_utils::{desc as d, mem};
    use vm_memory::GuestAddress;

    const ALL: TxOffloads = TxOffloads { csum: true, tso4: true, tso6: true };
    const NONE: TxOffloads = TxOffloads { csum: false, tso4: false, tso6: false };

    fn frame(hdr: VnetHeader, payload_len: usize) -> Vec<u8> {
        let mut v = hdr.to_bytes().to_vec();
        v.extend((0..ETH_HLEN + payload_len).map(|i| i as u8));
        v
    }

    #[test]
    fn header_roundtrips() {
        let h = VnetHeader {
            flags: 1,
            gso_type: 4,
            hdr_len: 66,
            gso_size: 1448,
            csum_start: 54,
            csum_offset: 16,
            num_buffers: 1,
        };
        assert_eq!(VnetHeader::from_bytes(&h.to_bytes()), h);
        assert_eq!(h.to_bytes()[4..6], 1448u16.to_le_bytes());
    }

    #[test]
    fn reads_a_frame_split_across_descriptors() {
        let m = mem();
        let bytes = frame(VnetHeader::default(), 50);
        m.write_slice(&bytes[..5], GuestAddress(0x1000)).unwrap();
        m.write_slice(&bytes[5..], GuestAddress(0x2000)).unwrap();
        let mut buf = Vec::new();
        let descs = [d(0x1000, 5, false), d(0x2000, bytes.len() as u32 - 5, false)];
        assert_eq!(read_tx(&descs, &m, NONE, &mut buf), Ok(VnetHeader::default()));
        assert_eq!(buf, bytes);
    }

    #[test]
    fn malformed_tx_shapes_are_rejected() {
        let m = mem();
        let mut buf = Vec::new();
        let cases = [
            (vec![d(0x1000, 100, true)], PacketError::WritableTx),
            (vec![d(0x1000, 11, false)], PacketError::ShortHeader(11)),
            (vec![d(0x1000, 12 + 13, false)], PacketError::ShortFrame(13)),
            (vec![d(0x1000, 0x8000, false), d(0x1000, 0x8000, false), d(0, 27, false)], PacketError::TooBig(65551)),
        ];
        for (descs, want) in cases {
            assert_eq!(read_tx(&descs, &m, ALL, &mut buf), Err(want));
        }
    }

    #[test]
    fn tx_headers_must_match_negotiation_and_the_frame() {
        let csum = |start, offset| VnetHeader {
            flags: HDR_F_NEEDS_CSUM,
            csum_start: start,
            csum_offset: offset,
            ..Default::default()
        };
        let tso = |gso_type, hdr_len, gso_size| VnetHeader { gso_type, hdr_len, gso_size, ..csum(34, 16) };
        let cases: [(VnetHeader, TxOffloads, Result<(), PacketError>); 11] = [
            (VnetHeader::default(), NONE, Ok(())),
            (csum(34, 6), ALL, Ok(())),
            (csum(34, 6), NONE, Err(PacketError::CsumNotNegotiated)),
            // The lying header: a checksum field far beyond a 100-byte frame.
            (csum(1000, 6), ALL, Err(PacketError::CsumOutOfFrame { start: 1000, offset: 6, frame_len: 100 })),
            (csum(98, 1), ALL, Err(PacketError::CsumOutOfFrame { start: 98, offset: 1, frame_len: 100 })),
            (VnetHeader { flags: 2, ..Default::default() }, ALL, Err(PacketError::BadFlags(2))),
            (tso(GSO_TCPV4, 66, 1448), ALL, Ok(())),
            (tso(GSO_TCPV6, 66, 1448), TxOffloads { tso6: false, ..ALL }, Err(PacketError::GsoNotNegotiated(4))),
            (tso(GSO_TCPV4 | GSO_ECN, 66, 1448), ALL, Err(PacketError::GsoNotNegotiated(0x81))),
            (tso(GSO_TCPV4, 66, 0), ALL, Err(PacketError::GsoIncomplete)),
            (tso(GSO_TCPV4, 101, 1448), ALL, Err(PacketError::HdrLenOutOfFrame { hdr_len: 101, frame_len: 100 })),
        ];
        for (h, offloads, want) in cases {
            assert_eq!(check_tx_header(&h, 100, offloads), want, "{h:?}");
        }
        let no_csum_gso = VnetHeader { gso_type: GSO_TCPV4, gso_size: 1448, ..Default::default() };
        assert_eq!(check_tx_header(&no_csum_gso, 100, ALL), Err(PacketError::GsoIncomplete));
    }

    #[test]
    fn rx_chain_shape_and_write() {
        let m = mem();
        assert_eq!(rx_capacity(&[d(0x1000, 100, false)]), Err(PacketError::ReadableRx));
        assert_eq!(rx_capacity(&[d(0x1000, 11, true)]), Err(PacketError::ShortHeader(11)));
        assert_eq!(rx_capacity(&[d(0x1000, 0x1_0000, true), d(0x20000, 0x1_0000, true)]), Ok(MAX_BUFFER_LEN));
        let descs = [d(0x1000, 8, true), d(0x2000, 100, true)];
        assert_eq!(rx_capacity(&descs), Ok(108));
        let bytes = frame(VnetHeader { num_buffers: 1, ..Default::default() }, 10);
        assert_eq!(write_rx(&descs, &m, &bytes), Ok(bytes.len() as u32));
        let mut got = vec![0u8; bytes.len()];
        m.read_slice(&mut got[..8], GuestAddress(0x1000)).unwrap();
        m.read_slice(&mut got[8..], GuestAddress(0x2000)).unwrap();
        assert_eq!(got, bytes);
    }
}
