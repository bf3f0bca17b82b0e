//! The pod annotation that sizes emptyDirs ([`EMPTYDIR_SIZE_LIMITS`]): its parser, bounded,
//! and the volume-name rule it checks.

use std::collections::BTreeMap;

#[cfg(doc)]
use crate::annotations::EMPTYDIR_SIZE_LIMITS;

/// Upper bounds of that annotation: its length and its number of volumes.
const MAX_SIZE_LIMITS_BYTES: usize = 8 << 10;
const MAX_SIZE_LIMITS_VOLUMES: usize = 128;

/// Whether `name` is a Kubernetes volume name: a DNS-1123 label (1 to 63 of `a-z`, `0-9` and
/// `-`, starting and ending alphanumeric). So it is also a safe file name.
pub fn is_volume_name(name: &str) -> bool {
    let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let bytes = name.as_bytes();
    (1..=63).contains(&bytes.len())
        && bytes.iter().all(|b| alnum(b) || *b == b'-')
        && bytes.first().is_some_and(alnum)
        && bytes.last().is_some_and(alnum)
}

/// Parses [`EMPTYDIR_SIZE_LIMITS`]'s value: `name=quantity` pairs separated by commas, spaces
/// allowed around a pair, each name a volume name at most once, each size a Kubernetes
/// quantity between [`MIN_EMPTYDIR_BYTES`] and `max` (at most [`MAX_EMPTYDIR_BYTES`]).
///
/// [`MIN_EMPTYDIR_BYTES`]: crate::config::MIN_EMPTYDIR_BYTES
/// [`MAX_EMPTYDIR_BYTES`]: crate::config::MAX_EMPTYDIR_BYTES
pub fn parse_size_limits(value: &str, max: u64) -> Result<BTreeMap<String, u64>, String> {
    use crate::config::{MAX_EMPTYDIR_BYTES, MIN_EMPTYDIR_BYTES};
    use crate::quantity::{format_bytes, parse_bytes};
    if value.len() > MAX_SIZE_LIMITS_BYTES {
        return Err(format!("longer than {MAX_SIZE_LIMITS_BYTES} bytes"));
    }
    let max = max.min(MAX_EMPTYDIR_BYTES);
    let mut limits = BTreeMap::new();
    for (n, pair) in value.split(',').enumerate() {
        let pair = pair.trim_matches(' ');
        let Some((name, size)) = pair.split_once('=') else {
            return Err(format!("entry {} {pair:?} is not name=size (e.g. \"scratch=1Gi, cache=500Mi\")", n + 1));
        };
        if !is_volume_name(name) {
            return Err(format!(
                "{name:?} is not a volume name (1-63 of a-z, 0-9 and '-', starting and ending alphanumeric)"
            ));
        }
        let bytes = parse_bytes(size).map_err(|e| format!("volume {name}: {e}"))?;
        if !(MIN_EMPTYDIR_BYTES..=max).contains(&bytes) {
            return Err(format!(
                "volume {name}: {size} is outside {}..={} (the node's emptydir.max_size_limit or bulkhead's bounds)",
                format_bytes(MIN_EMPTYDIR_BYTES),
                format_bytes(max)
            ));
        }
        if limits.insert(name.to_string(), bytes).is_some() {
            return Err(format!("volume {name} is named twice"));
        }
        if limits.len() > MAX_SIZE_LIMITS_VOLUMES {
            return Err(format!("more than {MAX_SIZE_LIMITS_VOLUMES} volumes"));
        }
    }
    Ok(limits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_names_are_dns_labels() {
        assert!(is_volume_name(&"a".repeat(63)) && !is_volume_name(&"a".repeat(64)));
        for bad in ["", "-a", "a-", "A", "a_b", "a.b", "a/b"] {
            assert!(!is_volume_name(bad), "{bad:?}");
        }
        assert!(is_volume_name("scratch-1"));
    }

    #[test]
    fn a_pair_list_becomes_limits() {
        let limits = parse_size_limits("scratch=32Mi, cache=1G", 1 << 40).unwrap();
        assert_eq!(limits.get("scratch"), Some(&(32 << 20)));
        assert_eq!(limits.get("cache"), Some(&1_000_000_000));
    }
}
