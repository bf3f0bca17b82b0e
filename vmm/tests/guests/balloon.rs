//! Free page reporting, as the driver side: negotiates VIRTIO_BALLOON_F_REPORTING, dirties 8 MiB
//! of its memory, and reports those pages on the reporting queue (index 2: inflate and deflate
//! come first, no stats or hinting queue exists), waiting for each report to come back on the
//! used ring. A hostile report (outside RAM, no whole page, device-readable, wrapping) goes
//! first and must come back with nothing dropped and the device still serving.
//!
//! The host steers it through a mailbox: sector 0 of a virtio-blk disk, which the guest polls.
//! It dirties the pages once (`touched`), waits for `GO`, dirties them again with another
//! pattern (`retouched`; after a restore this is what makes them the VM's private pages), waits
//! for `REPORT`, reports, then says what a sample of the pages reads back as (zeros from a punched
//! memfd, the first pattern from a snapshot's memory file) and stops on `EXIT`.
#![no_std]
#![no_main]

mod common;
use common::*;

const TYPE_BLOCK: u32 = 2;
const TYPE_BALLOON: u32 = 5;
const F_REPORTING: u32 = 1 << 5;
const STATUS_NEEDS_RESET: u32 = 0x40;

const BALLOON_QUEUES: u64 = 0x40_0000;
const BLK_QUEUE: u64 = 0x41_0000;
const HDR: u64 = 0x42_0000;
const DATA: u64 = 0x42_1000;
const STATUS_BYTE: u64 = 0x42_2000;

/// What the guest dirties and reports: 8 MiB at 16 MiB, four 2 MiB blocks as Linux would report
/// them (pageblock order).
const REGION: u64 = 0x100_0000;
const REGION_LEN: u64 = 8 << 20;
const BLOCK: u64 = 2 << 20;
const PAGE: u64 = 4096;

/// Polls of the used ring per request, and of the mailbox per wait (tens of seconds under the
/// PVM instruction emulator).
const SPINS: u32 = 2_000_000;
const MAILBOX_POLLS: u32 = 200_000;

fn first_pattern(page: u64) -> u64 {
    page | 0xa1
}
fn second_pattern(page: u64) -> u64 {
    page | 0xb2
}

fn fail(what: &str) -> ! {
    puts(what);
    puts("\n");
    reset()
}

/// Reads sector 0 of the mailbox disk into DATA.
fn read_mailbox(vq: &mut Vq) {
    w32(HDR, 0); // VIRTIO_BLK_T_IN
    w32(HDR + 4, 0);
    w64(HDR + 8, 0);
    w8(STATUS_BYTE, 0xff);
    vq.set_desc(0, HDR, 16, F_NEXT, 1);
    vq.set_desc(1, DATA, 512, F_NEXT | F_WRITE, 2);
    vq.set_desc(2, STATUS_BYTE, 1, F_WRITE, 0);
    vq.publish(0);
    if vq.wait_used(SPINS).is_none() || r8(STATUS_BYTE) != 0 {
        fail("mailbox read failed");
    }
}

/// Polls the mailbox until it holds `word` (NUL-terminated at the start of sector 0).
fn wait_for(vq: &mut Vq, word: &[u8]) {
    for _ in 0..MAILBOX_POLLS {
        read_mailbox(vq);
        if word.iter().enumerate().all(|(i, b)| r8(DATA + i as u64) == *b) && r8(DATA + word.len() as u64) == 0 {
            return;
        }
    }
    fail("mailbox never said go");
}

fn dirty(pattern: fn(u64) -> u64) {
    let mut page = REGION;
    while page < REGION + REGION_LEN {
        w64(page, pattern(page));
        page += PAGE;
    }
}

/// ACK, DRIVER, accept VERSION_1 and REPORTING, FEATURES_OK.
fn negotiate_reporting(base: u64) {
    w32(base + STATUS, 0);
    w32(base + STATUS, 1);
    w32(base + STATUS, 3);
    w32(base + DEVICE_FEATURES_SEL, 0);
    if r32(base + DEVICE_FEATURES) & F_REPORTING == 0 {
        fail("no free page reporting offered");
    }
    w32(base + DEVICE_FEATURES_SEL, 1);
    if r32(base + DEVICE_FEATURES) & 1 == 0 {
        fail("no VERSION_1");
    }
    w32(base + DRIVER_FEATURES_SEL, 0);
    w32(base + DRIVER_FEATURES, F_REPORTING);
    w32(base + DRIVER_FEATURES_SEL, 1);
    w32(base + DRIVER_FEATURES, 1);
    w32(base + STATUS, 0xb);
    if r32(base + STATUS) & 8 == 0 {
        fail("balloon refused the features");
    }
}

/// Posts one report chain of (addr, len, flags) and waits for it to come back.
fn report(vq: &mut Vq, ranges: &[(u64, u32, u16)]) {
    let n = ranges.len() as u16;
    for (i, (addr, len, flags)) in ranges.iter().enumerate() {
        let i = i as u16;
        if i + 1 < n {
            vq.set_desc(i, *addr, *len, flags | F_NEXT, i + 1);
        } else {
            vq.set_desc(i, *addr, *len, *flags, 0);
        }
    }
    vq.publish(0);
    match vq.wait_used(SPINS) {
        Some((0, _)) => {}
        Some(_) => fail("report came back with another head"),
        None => fail("report never came back"),
    }
}

#[no_mangle]
pub extern "C" fn _start() -> ! {
    let blk = find_device(TYPE_BLOCK);
    if blk == 0 || !negotiate(blk) {
        fail("no mailbox disk");
    }
    let mut mailbox = Vq::new(blk, 0, BLK_QUEUE, 8);
    if !mailbox.setup() || !driver_ok(blk) {
        fail("mailbox setup failed");
    }
    let base = find_device(TYPE_BALLOON);
    if base == 0 {
        fail("no balloon");
    }
    negotiate_reporting(base);
    let inflate = Vq::new(base, 0, BALLOON_QUEUES, 8);
    let deflate = Vq::new(base, 1, BALLOON_QUEUES + 0x1000, 8);
    let mut reporting = Vq::new(base, 2, BALLOON_QUEUES + 0x2000, 32);
    if !inflate.setup() || !deflate.setup() || !reporting.setup() || !driver_ok(base) {
        fail("balloon queue setup failed");
    }
    puts("balloon reporting on queue 2\n");

    dirty(first_pattern);
    puts("touched\n");
    wait_for(&mut mailbox, b"GO");
    dirty(second_pattern);
    puts("retouched\n");
    wait_for(&mut mailbox, b"REPORT");

    report(
        &mut reporting,
        &[
            (0x1_0000_0000_0000, BLOCK as u32, F_WRITE), // outside RAM
            (REGION + 0x10, PAGE as u32, F_WRITE),       // no whole page
            (REGION, BLOCK as u32, 0),                   // device-readable
            (u64::MAX - 0xfff, PAGE as u32, F_WRITE),    // wraps
        ],
    );
    if r32(base + STATUS) & STATUS_NEEDS_RESET != 0 {
        fail("a hostile report broke the device");
    }
    if r64(REGION) != second_pattern(REGION) || r64(REGION + PAGE) != second_pattern(REGION + PAGE) {
        fail("a hostile report dropped pages");
    }
    puts("hostile report returned, nothing dropped\n");

    let mut blocks = [(0u64, 0u32, 0u16); 4];
    for (i, b) in blocks.iter_mut().enumerate() {
        *b = (REGION + i as u64 * BLOCK, BLOCK as u32, F_WRITE);
    }
    report(&mut reporting, &blocks);
    puts("reported\n");

    // What the reported pages read as now: never the pattern written before the report. Only
    // the first and last page of each block: reading a punched-out page allocates it again.
    let (mut zero, mut first, mut second, mut other) = (0u64, 0u64, 0u64, 0u64);
    for i in 0..2 * (REGION_LEN / BLOCK) {
        let page = REGION + (i / 2) * BLOCK + (i % 2) * (BLOCK - PAGE);
        let v = r64(page);
        if v == 0 {
            zero += 1;
        } else if v == first_pattern(page) {
            first += 1;
        } else if v == second_pattern(page) {
            second += 1;
        } else {
            other += 1;
        }
    }
    puts("pages zero ");
    put_hex(zero);
    puts(" first ");
    put_hex(first);
    puts(" second ");
    put_hex(second);
    puts(" other ");
    put_hex(other);
    puts("\n");
    wait_for(&mut mailbox, b"EXIT");
    puts("balloon done\n");
    reset()
}
