//! Guest memory sizes, in the one unit every document and setting names them in: MiB, from the
//! pod's shape in the shim to the VM config the VMM reads (which turns them into bytes once,
//! where it maps memory).

use serde::{Deserialize, Serialize};

/// A size in MiB. Serialized as the bare number, so the documents' fields stay as they were.
/// There is no `Display`: a message says the unit itself (`{} MiB`, with [`Mib::get`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Mib(pub u64);

impl Mib {
    /// The MiB that hold `bytes`, rounded up.
    pub const fn holding(bytes: u64) -> Self {
        Self(bytes.div_ceil(1 << 20))
    }

    pub const fn get(self) -> u64 {
        self.0
    }

    /// In bytes; `None` past `u64`.
    pub const fn bytes(self) -> Option<u64> {
        self.0.checked_mul(1 << 20)
    }

    pub const fn saturating_add(self, other: Mib) -> Mib {
        Mib(self.0.saturating_add(other.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_up_and_stay_bare_numbers_in_documents() {
        assert_eq!(Mib::holding(0), Mib(0));
        assert_eq!(Mib::holding(1), Mib(1));
        assert_eq!(Mib::holding(512 << 20), Mib(512));
        assert_eq!(Mib::holding((512 << 20) + 1), Mib(513));
        assert_eq!(Mib(256).bytes(), Some(256 << 20));
        assert_eq!(Mib(u64::MAX).bytes(), None);
        assert_eq!(serde_json::to_string(&Mib(256)).unwrap(), "256");
        assert_eq!(serde_json::from_str::<Mib>("64").unwrap(), Mib(64));
    }
}
