//! What a balloon device did, as running counters: part of its snapshot state and of its log
//! lines. Plain data; the device bumps them, nothing here acts.

use serde::{Deserialize, Serialize};

/// Running totals since the device was built (a restore carries them on).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct BalloonCounters {
    /// Report chains served on the reporting queue.
    pub reports: u64,
    /// Bytes the guest named in its reports, accepted or not.
    pub reported_bytes: u64,
    /// Bytes handed back to the host (whole pages, reports and inflates together).
    pub freed_bytes: u64,
    /// Ranges skipped: outside guest RAM, across a region's end, wrapping around, wrong
    /// descriptor direction, or holding no whole page.
    pub rejected_ranges: u64,
    /// Ranges accepted only after trimming them inward to page boundaries.
    pub trimmed_ranges: u64,
    /// Ranges the host kernel refused to drop (the pages stay; the guest is not told).
    pub discard_errors: u64,
    /// Pages (4 KiB) the guest put into the balloon on the inflate queue.
    pub inflated_pages: u64,
    /// Buffers the guest sent on the deflate queue (acknowledged; its pages fault back in).
    pub deflate_buffers: u64,
}
