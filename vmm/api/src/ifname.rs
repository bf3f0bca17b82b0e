//! Linux network interface names: the one rule for every tap name bulkhead handles. The shim
//! creates a pod's taps by name, the VM config and a restore's run settings name them, and the
//! VMM attaches to them by name; all three check the name here.
//!
//! The rule is the kernel's own (`dev_valid_name` in net/core/dev.c), so a name passes exactly
//! when the kernel would take it: 1..=15 bytes (IFNAMSIZ - 1), neither `.` nor `..`, and no `/`,
//! `:`, NUL or whitespace byte.

/// Longest interface name, in bytes (IFNAMSIZ - 1).
pub const MAX_IFNAME_LEN: usize = 15;

/// Why a name is not a Linux interface name.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum IfNameError {
    #[error("is empty")]
    Empty,
    #[error("is {0} bytes long, more than {MAX_IFNAME_LEN}")]
    TooLong(usize),
    #[error("is `.` or `..`")]
    Dots,
    #[error("contains {:?}, which no interface name may", char::from(*.0))]
    Byte(u8),
}

/// Checks `name` against the kernel's rule for interface names.
pub fn check_ifname(name: &str) -> Result<(), IfNameError> {
    let bytes = name.as_bytes();
    if bytes.is_empty() {
        return Err(IfNameError::Empty);
    }
    if bytes.len() > MAX_IFNAME_LEN {
        return Err(IfNameError::TooLong(bytes.len()));
    }
    if name == "." || name == ".." {
        return Err(IfNameError::Dots);
    }
    match bytes.iter().find(|&&b| forbidden(b)) {
        Some(&b) => Err(IfNameError::Byte(b)),
        None => Ok(()),
    }
}

/// `/`, `:`, NUL and what the kernel's `isspace` calls space (its ctype table is Latin-1, so
/// 0xa0 counts; a UTF-8 name holding that byte is refused as the kernel would refuse it).
fn forbidden(b: u8) -> bool {
    matches!(b, b'/' | b':' | 0 | b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | 0xa0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_kernel_takes_pass() {
        for ok in ["bhtap0", "tap-old", "a", "fifteen-chars-x", "eth0.100", "tap_0", "..."] {
            assert_eq!(check_ifname(ok), Ok(()), "{ok:?}");
        }
    }

    #[test]
    fn names_the_kernel_refuses_are_refused_saying_why() {
        let cases = [
            ("", IfNameError::Empty),
            ("sixteen-chars-xx", IfNameError::TooLong(16)),
            (".", IfNameError::Dots),
            ("..", IfNameError::Dots),
            ("a/b", IfNameError::Byte(b'/')),
            ("tap:0", IfNameError::Byte(b':')),
            ("tap 0", IfNameError::Byte(b' ')),
            ("tap\t0", IfNameError::Byte(b'\t')),
            ("tap\0x", IfNameError::Byte(0)),
            ("t\u{e0}", IfNameError::Byte(0xa0)),
        ];
        for (name, want) in cases {
            assert_eq!(check_ifname(name), Err(want.clone()), "{name:?}");
        }
        assert_eq!(IfNameError::Byte(b'/').to_string(), "contains '/', which no interface name may");
    }
}
