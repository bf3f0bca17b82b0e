//! A template key's own text: the name of its directory, the field of its manifest, the argument
//! of `bulkhead-ctl template`. What the key covers and how it is hashed is [`super::key`]'s.

use serde::{Deserialize, Serialize};

/// Text that is no template key (the first 80 characters of it).
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not a template key (64 lowercase hex digits)")]
pub struct BadKey(pub String);

/// A template key: 64 lowercase hex digits (SHA-256 of the [`super::KeyInputs`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct TemplateKey(pub(super) String);

impl TemplateKey {
    /// Parses a key as written in a directory name, a manifest or on the command line.
    pub fn parse(text: &str) -> Result<Self, BadKey> {
        if text.len() == 64 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            Ok(Self(text.to_string()))
        } else {
            Err(BadKey(text.chars().take(80).collect()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The first 12 digits, for logs and listings.
    pub fn short(&self) -> &str {
        &self.0[..12]
    }
}

impl std::fmt::Display for TemplateKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for TemplateKey {
    type Error = BadKey;
    fn try_from(text: String) -> Result<Self, BadKey> {
        Self::parse(&text)
    }
}

impl From<TemplateKey> for String {
    fn from(key: TemplateKey) -> String {
        key.0
    }
}
