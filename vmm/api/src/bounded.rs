//! Reading a document from a file with its size bounded by the read itself, not by what the file
//! says beforehand: a file that grows between a size check and the read, a FIFO or a device node
//! never makes the reader hold more than `limit + 1` bytes. Every document this crate reads from
//! a file (the VM config, a restore's run settings, the jail config) comes through here.

use std::io::Read;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum BoundedReadError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("larger than {limit} bytes")]
    TooLarge { limit: u64 },
}

/// The text of the file at `path`, refused once it passes `limit` bytes (or is not UTF-8, as an
/// `InvalidData` I/O error).
pub fn read_bounded(path: &Path, limit: u64) -> Result<String, BoundedReadError> {
    let mut text = String::new();
    std::fs::File::open(path)?.take(limit.saturating_add(1)).read_to_string(&mut text)?;
    if text.len() as u64 > limit {
        return Err(BoundedReadError::TooLarge { limit });
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_up_to_the_limit_and_refuses_beyond_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("doc.json");
        std::fs::write(&path, "x".repeat(16)).unwrap();
        assert_eq!(read_bounded(&path, 16).unwrap().len(), 16);
        assert!(matches!(read_bounded(&path, 15), Err(BoundedReadError::TooLarge { limit: 15 })));
        let missing = read_bounded(&dir.path().join("missing"), 16).unwrap_err();
        assert!(matches!(missing, BoundedReadError::Io(ref e) if e.kind() == std::io::ErrorKind::NotFound));
        std::fs::write(&path, [0xff, 0xfe]).unwrap();
        assert!(matches!(read_bounded(&path, 16), Err(BoundedReadError::Io(_))), "not UTF-8");
    }

    #[test]
    fn a_device_that_never_ends_is_cut_at_the_limit() {
        // /dev/zero reports size 0 and never ends: only a bounded read stops.
        assert!(matches!(read_bounded(Path::new("/dev/zero"), 1024), Err(BoundedReadError::TooLarge { .. })));
    }
}
