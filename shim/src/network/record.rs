//! What the shim added to a pod's network namespace, recorded in the pod's state dir before it
//! is added, so that teardown (also `delete` after a shim crash) removes exactly that: the clsact
//! qdiscs (their filters go with them) and the taps. Written atomically; read with a size limit.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::error::NetworkError;
use super::netns::NetnsId;

/// A record is a few hundred bytes; anything near this is not one.
const MAX_RECORD_BYTES: u64 = 64 << 10;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetRecord {
    /// The pod's network namespace, and which one it was.
    pub netns: PathBuf,
    pub netns_id: NetnsId,
    /// Links that got a clsact qdisc from us (not the taps: a tap goes whole).
    pub clsact: Vec<RecordedLink>,
    /// Taps we created, by name.
    pub taps: Vec<String>,
}

/// A link by index and the name it had, so a reused index is not mistaken for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordedLink {
    pub index: u32,
    pub name: String,
}

impl NetRecord {
    pub fn write(&self, path: &Path) -> Result<(), NetworkError> {
        let err = |e: std::io::Error| NetworkError::Record { path: path.to_path_buf(), message: e.to_string() };
        let json = serde_json::to_vec(self).map_err(|e| err(std::io::Error::other(e)))?;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, json).and_then(|()| std::fs::rename(&tmp, path)).map_err(err)
    }

    /// The record at `path`; `None` when there is none (nothing was added, or it was removed).
    pub fn read(path: &Path) -> Result<Option<Self>, NetworkError> {
        use std::io::Read;
        let err = |message: String| NetworkError::Record { path: path.to_path_buf(), message };
        let file = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(err(e.to_string())),
        };
        let mut bytes = Vec::new();
        file.take(MAX_RECORD_BYTES + 1).read_to_end(&mut bytes).map_err(|e| err(e.to_string()))?;
        if bytes.len() as u64 > MAX_RECORD_BYTES {
            return Err(err(format!("larger than {MAX_RECORD_BYTES} bytes")));
        }
        serde_json::from_slice(&bytes).map(Some).map_err(|e| err(e.to_string()))
    }

    pub fn remove(path: &Path) -> Result<(), NetworkError> {
        match std::fs::remove_file(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(NetworkError::Record { path: path.to_path_buf(), message: e.to_string() }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> NetRecord {
        NetRecord {
            netns: "/var/run/netns/cni-1".into(),
            netns_id: NetnsId { dev: 4, ino: 4026532000 },
            clsact: vec![RecordedLink { index: 3, name: "eth0".into() }],
            taps: vec!["bhtap0".into()],
        }
    }

    #[test]
    fn round_trips_and_missing_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("network.json");
        assert_eq!(NetRecord::read(&path).unwrap(), None);
        record().write(&path).unwrap();
        assert_eq!(NetRecord::read(&path).unwrap(), Some(record()));
        NetRecord::remove(&path).unwrap();
        NetRecord::remove(&path).unwrap();
        assert_eq!(NetRecord::read(&path).unwrap(), None);
    }

    #[test]
    fn malformed_or_huge_records_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("network.json");
        std::fs::write(&path, b"{\"netns\": 1").unwrap();
        assert!(NetRecord::read(&path).is_err());
        std::fs::write(&path, vec![b' '; (MAX_RECORD_BYTES + 1) as usize]).unwrap();
        let err = NetRecord::read(&path).unwrap_err();
        assert!(err.to_string().contains("larger than"), "{err}");
    }
}
