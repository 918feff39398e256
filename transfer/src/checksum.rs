//! Checksums of the bytes a sender wrote, so the receiver can prove what landed is what
//! was computed before it decodes from it. The function is the
//! [KV checksum](kernels::kv_checksum) (wire version 4; xxh3 before), which GPU workers
//! compute in device memory where the bytes are.

pub use kernels::kv_checksum::kv_checksum;

use crate::sender::SendParts;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checksums {
    pub pages: Vec<u64>,
    pub rings: u64,
    pub comp: u64,
    pub logits: u64,
}

impl Checksums {
    pub fn of(parts: &SendParts<'_>) -> Self {
        Checksums {
            pages: parts.pages.iter().map(|p| kv_checksum(p)).collect(),
            rings: kv_checksum(parts.rings),
            comp: kv_checksum(parts.comp),
            logits: kv_checksum(parts.logits),
        }
    }

    /// The first part whose checksum differs, or `None` when all match.
    pub fn first_mismatch(&self, landed: &Checksums) -> Option<String> {
        if self.pages.len() != landed.pages.len() {
            return Some(format!("{} pages sent, {} expected", self.pages.len(), landed.pages.len()));
        }
        if let Some(i) = self.pages.iter().zip(&landed.pages).position(|(a, b)| a != b) {
            return Some(format!("page {i}"));
        }
        [
            ("window rings", self.rings, landed.rings),
            ("compressor slots", self.comp, landed.comp),
            ("logits", self.logits, landed.logits),
        ]
        .into_iter()
        .find(|(_, a, b)| a != b)
        .map(|(what, _, _)| what.to_string())
    }
}
