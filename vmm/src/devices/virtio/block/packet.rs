//! virtio-blk request parsing. The chain is already bounds-checked (`chain::collect`); here we
//! check its *shape*: header first, status last, data descriptors in the right direction, sizes
//! in whole sectors and inside the disk.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::devices::virtio::chain::{self, Desc};

pub const SECTOR_SIZE: u64 = 512;
pub const REQ_IN: u32 = 0;
pub const REQ_OUT: u32 = 1;
pub const REQ_FLUSH: u32 = 4;
pub const REQ_GET_ID: u32 = 8;
pub const STATUS_OK: u8 = 0;
pub const STATUS_IOERR: u8 = 1;
pub const STATUS_UNSUPP: u8 = 2;
/// Largest data payload of one request.
pub const MAX_REQUEST_BYTES: u64 = 1 << 20;
const HEADER_LEN: u32 = 16;
pub const ID_BYTES: usize = 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestType {
    In,
    Out,
    Flush,
    GetId,
    Unsupported(u32),
}

/// A request whose shape is valid. `data` descriptors already have the right direction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub kind: RequestType,
    pub sector: u64,
    pub data: Vec<Desc>,
    pub data_len: u64,
    pub status_addr: GuestAddress,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RequestError {
    #[error("chain too short for header and status")]
    TooShort,
    #[error("header descriptor is writable or shorter than 16 bytes")]
    BadHeader,
    #[error("status descriptor is not writable")]
    BadStatus,
    #[error("data descriptor has the wrong direction for this request")]
    BadDirection,
    #[error("reading the header failed")]
    HeaderRead,
}

impl Request {
    pub fn parse(chain: &[Desc], mem: &GuestMemoryMmap) -> Result<Self, RequestError> {
        if chain.len() < 2 {
            return Err(RequestError::TooShort);
        }
        let header = chain[0];
        if header.writable || header.len < HEADER_LEN {
            return Err(RequestError::BadHeader);
        }
        let status = chain[chain.len() - 1];
        if !status.writable || status.len < 1 {
            return Err(RequestError::BadStatus);
        }
        let kind: u32 = mem.read_obj(header.addr).map_err(|_| RequestError::HeaderRead)?;
        // The header is at least 16 bytes long, so +8 is inside it.
        let sector: u64 = mem.read_obj(header.addr_at(8)).map_err(|_| RequestError::HeaderRead)?;
        let kind = match kind {
            REQ_IN => RequestType::In,
            REQ_OUT => RequestType::Out,
            REQ_FLUSH => RequestType::Flush,
            REQ_GET_ID => RequestType::GetId,
            other => RequestType::Unsupported(other),
        };
        let data = chain[1..chain.len() - 1].to_vec();
        let want_writable = match kind {
            RequestType::In | RequestType::GetId => Some(true),
            RequestType::Out => Some(false),
            RequestType::Flush | RequestType::Unsupported(_) => None,
        };
        if let Some(w) = want_writable {
            if data.iter().any(|d| d.writable != w) {
                return Err(RequestError::BadDirection);
            }
        }
        let data_len = chain::total_len(&data);
        Ok(Self { kind, sector, data, data_len, status_addr: status.addr })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::chain::test_utils::{desc as d, mem};

    #[test]
    fn parses_a_read() {
        let m = mem();
        m.write_obj(REQ_IN, GuestAddress(0x1000)).unwrap();
        m.write_obj(7u64, GuestAddress(0x1008)).unwrap();
        let r = Request::parse(&[d(0x1000, 16, false), d(0x2000, 512, true), d(0x3000, 1, true)], &m).unwrap();
        assert_eq!(r.kind, RequestType::In);
        assert_eq!(r.sector, 7);
        assert_eq!(r.data_len, 512);
        assert_eq!(r.status_addr, GuestAddress(0x3000));
    }

    #[test]
    fn rejects_bad_shapes() {
        let m = mem();
        m.write_obj(REQ_OUT, GuestAddress(0x1000)).unwrap();
        assert_eq!(Request::parse(&[d(0x1000, 16, false)], &m), Err(RequestError::TooShort));
        assert_eq!(Request::parse(&[d(0x1000, 8, false), d(0x3000, 1, true)], &m), Err(RequestError::BadHeader));
        assert_eq!(Request::parse(&[d(0x1000, 16, false), d(0x3000, 1, false)], &m), Err(RequestError::BadStatus));
        assert_eq!(
            Request::parse(&[d(0x1000, 16, false), d(0x2000, 512, true), d(0x3000, 1, true)], &m),
            Err(RequestError::BadDirection),
            "a write must not carry device-writable data"
        );
    }

    #[test]
    fn unknown_type_is_unsupported_not_an_error() {
        let m = mem();
        m.write_obj(99u32, GuestAddress(0x1000)).unwrap();
        let r = Request::parse(&[d(0x1000, 16, false), d(0x3000, 1, true)], &m).unwrap();
        assert_eq!(r.kind, RequestType::Unsupported(99));
    }
}
