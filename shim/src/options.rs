//! The runtime options containerd hands a non-runc shim (`runtimeoptions.v1.Options`, Kata's
//! convention): where the shim finds its config. Decoded by hand (two string fields), bounded
//! by the message itself, malformed input is an error.

use containerd_shim::protos::protobuf::well_known_types::any::Any;

use crate::error::TaskError;

/// The runtime options containerd passes for non-runc runtimes (`runtimeoptions.v1.Options`,
/// Kata's convention): `type_url` = 1, `config_path` = 2.
pub fn config_path_from_options(any: Option<&Any>) -> Result<Option<String>, TaskError> {
    let Some(any) = any else { return Ok(None) };
    if !any.type_url.ends_with("runtimeoptions.v1.Options") {
        return Ok(None);
    }
    let mut buf = any.value.as_slice();
    let mut config_path = None;
    while !buf.is_empty() {
        let (key, rest) = read_varint(buf)?;
        buf = rest;
        let (field, wire) = (key >> 3, key & 7);
        match wire {
            2 => {
                let (len, rest) = read_varint(buf)?;
                let len = usize::try_from(len)
                    .ok()
                    .filter(|l| *l <= rest.len())
                    .ok_or_else(|| TaskError::InvalidArgument("runtime options: truncated".into()))?;
                if field == 2 {
                    let s = std::str::from_utf8(&rest[..len])
                        .map_err(|_| TaskError::InvalidArgument("runtime options: ConfigPath is not UTF-8".into()))?;
                    config_path = Some(s.to_string()).filter(|s| !s.is_empty());
                }
                buf = &rest[len..];
            }
            0 => buf = read_varint(buf)?.1,
            _ => return Err(TaskError::InvalidArgument(format!("runtime options: unexpected wire type {wire}"))),
        }
    }
    Ok(config_path)
}

fn read_varint(buf: &[u8]) -> Result<(u64, &[u8]), TaskError> {
    let mut value = 0u64;
    for (i, byte) in buf.iter().enumerate().take(10) {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Ok((value, &buf[i + 1..]));
        }
    }
    Err(TaskError::InvalidArgument("runtime options: bad varint".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn any(type_url: &str, value: Vec<u8>) -> Any {
        Any { type_url: type_url.into(), value, ..Default::default() }
    }

    fn encode_options(type_url: &str, config_path: &str) -> Vec<u8> {
        let mut out = Vec::new();
        for (field, s) in [(1u8, type_url), (2u8, config_path)] {
            out.push(field << 3 | 2);
            out.push(s.len() as u8);
            out.extend_from_slice(s.as_bytes());
        }
        out
    }

    #[test]
    fn config_path_comes_from_runtime_options() {
        let a = any("runtimeoptions.v1.Options", encode_options("", "/etc/bulkhead/test.toml"));
        assert_eq!(config_path_from_options(Some(&a)).unwrap().as_deref(), Some("/etc/bulkhead/test.toml"));
        assert_eq!(config_path_from_options(None).unwrap(), None);
        let runc = any("containerd.runc.v1.Options", vec![1, 2, 3]);
        assert_eq!(config_path_from_options(Some(&runc)).unwrap(), None);
    }

    #[test]
    fn malformed_runtime_options_are_an_error() {
        let truncated = any("runtimeoptions.v1.Options", vec![0x12, 50, b'a']);
        assert!(config_path_from_options(Some(&truncated)).is_err());
        let bad_varint = any("runtimeoptions.v1.Options", vec![0xff; 12]);
        assert!(config_path_from_options(Some(&bad_varint)).is_err());
    }
}
