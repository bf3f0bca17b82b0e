//! Public-API regression tests for problems found while writing the fuzz targets in code this
//! crate does not own. Both were fixed by the VMM owner (18307a1 and the mmio QUEUE_NUM check);
//! these keep them fixed from the outside.

use std::sync::{Arc, Mutex};

use bulkhead_vmm::config::BlockConfig;
use bulkhead_vmm::devices::bus::BusDevice;
use bulkhead_vmm::devices::virtio::block::Block;
use bulkhead_vmm::devices::virtio::mmio::MmioTransport;
use bulkhead_vmm::devices::virtio::vsock::packet::{TxPacket, VsockHeader, OP_RW};
use bulkhead_vmm::devices::virtio::vsock::unix::VsockMuxer;
use bulkhead_vmm::devices::virtio::{IrqTrigger, VirtioDevice};
use bulkhead_vmm::persist::Persist;
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

/// A guest that sends packets the muxer answers with RST (here: RW for a connection that does
/// not exist) and never posts an RX buffer must not grow host memory at its TX rate.
#[test]
fn guest_cannot_grow_the_rst_queue_without_bound() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut mx = VsockMuxer::new(3, &dir.path().join("v.sock")).expect("muxer");
    for i in 0..100_000u32 {
        let hdr =
            VsockHeader { src_cid: 3, dst_cid: 2, src_port: i, dst_port: 9, type_: 1, op: OP_RW, ..Default::default() };
        mx.send_from_guest(TxPacket { hdr, data: Vec::new() });
    }
    let mut queued = 0;
    while mx.next_rx(0).is_some() {
        queued += 1;
    }
    assert!(queued > 0, "an RST is still owed to the guest");
    assert!(queued <= 4096, "{queued} RST packets queued for a guest that posted no RX buffer");
}

/// QUEUE_NUM is a 32-bit register but a queue size is 16 bits: 0x1_0008 must be refused, not
/// truncated to 8.
#[test]
fn out_of_range_queue_num_leaves_the_queue_size_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("disk.img");
    std::fs::write(&path, vec![0u8; 4096]).expect("disk image");
    let dev: Arc<Mutex<dyn VirtioDevice>> =
        Arc::new(Mutex::new(Block::new(&BlockConfig { path, read_only: false }, 0).expect("block")));
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 16)]).expect("memory");
    let irq = IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"));
    let mut t = MmioTransport::new("blk".into(), mem, dev, irq).expect("transport");
    let w = |t: &mut MmioTransport, off: u64, v: u32| t.write(off, &v.to_le_bytes());
    w(&mut t, 0x070, 1);
    w(&mut t, 0x070, 3);
    w(&mut t, 0x030, 0);
    let before = t.save().queues[0].size;
    w(&mut t, 0x038, 0x1_0008);
    assert_eq!(t.save().queues[0].size, before, "out-of-range QUEUE_NUM changed the size");
    w(&mut t, 0x038, 8);
    assert_eq!(t.save().queues[0].size, 8);
}
