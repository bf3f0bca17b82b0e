//! Fuzz bodies for `bulkhead-protocol`: the hybrid-vsock handshake lines and the stdio stream
//! header and its ack.

use arbitrary::{Result, Unstructured};
use bulkhead_protocol::{handshake, stream};
use bulkhead_vmm::devices::virtio::vsock::unix::muxer::{self};

use crate::*;

// ---------------------------------------------------------------------------------------------
// Protocol crate: handshake lines and stdio stream header / ack.

/// `CONNECT <port>\n` / `OK <port>\n` lines: the agent's and the VMM muxer's parsers, and the
/// bounded line reader.
pub fn handshake(data: &[u8]) {
    for (parsed, encode) in [
        (handshake::parse_connect(data), handshake::encode_connect as fn(u32) -> String),
        (handshake::parse_ok(data), handshake::encode_ok),
    ] {
        if let Ok(port) = parsed {
            assert!(data.len() <= handshake::MAX_LINE, "accepted an over-long line");
            let canon = encode(port);
            // Leading zeros are accepted, so compare through a second parse.
            let again = if canon.starts_with('C') {
                handshake::parse_connect(canon.as_bytes())
            } else {
                handshake::parse_ok(canon.as_bytes())
            };
            assert_eq!(again.ok(), Some(port));
        }
    }

    // The VMM's host-side parser gets the line without its newline; it must accept at least
    // what the protocol crate accepts, with the same port.
    let vmm_port = muxer::parse_connect(data.strip_suffix(b"\n").unwrap_or(data));
    if let Ok(p) = handshake::parse_connect(data) {
        assert_eq!(vmm_port, Some(p), "VMM and agent disagree on {data:?}");
    }

    let mut reader = data;
    match block_on(handshake::read_line(&mut reader, handshake::MAX_LINE)) {
        Ok(line) => {
            assert!(line.len() <= handshake::MAX_LINE);
            assert_eq!(line.last(), Some(&b'\n'));
            assert_eq!(&data[..line.len()], &line[..], "read_line returned bytes it was not given");
            assert_eq!(reader.len(), data.len() - line.len(), "read past the newline");
        }
        Err(handshake::HandshakeError::TooLong) => {
            assert!(!data[..handshake::MAX_LINE].contains(&b'\n'));
        }
        Err(handshake::HandshakeError::Closed) => {
            assert!(data.len() < handshake::MAX_LINE && !data.contains(&b'\n'));
        }
        Err(e) => panic!("unexpected read_line error {e}"),
    }
}

/// The stdio stream header (agent side: decodes what the shim sends) and the stream ack (host
/// side: decodes what the agent in the guest sends).
pub fn stream_header(data: &[u8]) {
    match stream::StreamHeader::decode(data) {
        Ok((h, used)) => {
            assert!(used <= data.len() && used <= stream::MAX_HEADER_LEN);
            assert_eq!(h.encode().as_deref(), Ok(&data[..used]), "decode/encode not inverse");
            let mut reader = data;
            let via_reader =
                RT.with(|rt| rt.block_on(stream::StreamHeader::read_from(&mut reader, handshake::DEFAULT_TIMEOUT)));
            assert_eq!(via_reader, Ok(h), "read_from disagrees with decode");
            assert_eq!(reader.len(), data.len() - used, "read_from read past the header");
        }
        Err(stream::HeaderError::Truncated { needed, have }) => {
            assert_eq!(have, data.len());
            assert!(needed > have && needed <= stream::MAX_HEADER_LEN);
        }
        Err(_) => {}
    }

    let mut reader = data;
    match block_on(stream::StreamAck::read_from(&mut reader)) {
        Ok(stream::StreamAck::Attached) => assert_eq!(&data[..3], &[0, 0, 0]),
        // Lossy UTF-8 turns each bad byte into a 3-byte U+FFFD at most.
        Ok(stream::StreamAck::Rejected(r)) => assert!(r.len() <= 3 * stream::MAX_ACK_REASON),
        Err(_) => {}
    }
    let consumed = data.len() - reader.len();
    assert!(consumed <= 3 + stream::MAX_ACK_REASON, "ack reader consumed {consumed} bytes");

    // Structured side: anything encode() accepts must decode to itself.
    let mut u = Unstructured::new(data);
    if let Ok((cid, exec, kind)) =
        (|| -> Result<(String, Option<String>, u8)> { Ok((u.arbitrary()?, u.arbitrary()?, u.int_in_range(1..=4)?)) })()
    {
        let kind = stream::StreamKind::from_wire(kind).expect("1..=4 are kinds");
        let h = stream::StreamHeader::new(&cid, exec.as_deref().filter(|e| !e.is_empty()), kind);
        if let Ok(bytes) = h.encode() {
            assert_eq!(stream::StreamHeader::decode(&bytes), Ok((h, bytes.len())));
        }
    }
}
