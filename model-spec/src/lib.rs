//! What every sluice service knows about a DeepSeek-V4 model without computing it.
//! The router, transfer layer and kvstore use this crate; only workers pull in the
//! compute (`kernels`, `engine`).
//!
//! Module map:
//! - [`config`]: the model description, parsed from HF or reference config files.
//! - [`layout`]: byte geometry of KV pages and state-cache slots, entry dtypes.
//! - [`block_hash`]: chained hashes of 128-token prefix blocks, salted per model.
//! - [`prefix`]: SWA caching policies and the choice of how to resume from a cached prefix.
//! - [`text`]: tokenizer.json encode/decode and streaming detokenisation.
//! - [`Fingerprint`]: identity of a model's weights + KV dtype.
#![forbid(unsafe_code)]

pub mod block_hash;
pub mod config;
pub mod layout;
pub mod prefix;
pub mod text;

pub use config::{BLOCK_TOKENS, ConfigError, MlpKind, ModelConfig, StoredDtype};
pub use layout::{AttnKind, Branch, EntryDtype, EntryFormat, KvLayout, LayerKv, LayerSpec, PoolBytes};
pub use prefix::{Restore, RestorePlan, SwaPolicy};

/// YaRN parameters (as in the config's `rope_scaling`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
}

/// Identifies which weights, architecture and KV entry dtype a piece of KV state was
/// computed by (see `engine::fingerprint` for how it is computed). Exported
/// sequences, transferred pages and cached prefix blocks carry it.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// First 12 hex digits, for logs and error messages.
    pub fn short(&self) -> String {
        self.hex()[..12].to_string()
    }

    pub fn from_hex(s: &str) -> Option<Self> {
        if s.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Fingerprint(out))
    }
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fingerprint({})", self.short())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_hex_round_trips() {
        let f = Fingerprint([0xab; 32]);
        assert_eq!(Fingerprint::from_hex(&f.hex()), Some(f.clone()));
        assert_eq!(f.short(), "abababababab");
        assert_eq!(Fingerprint::from_hex("zz"), None);
    }
}
