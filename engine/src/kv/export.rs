//! A sequence's KV state as bytes: a versioned header, its pages in block order, then
//! its state-cache slot (window rings in the entry dtype, compressor slots as f32).
//! Import checks the header against the receiving engine's model fingerprint and
//! layout, so KV never lands in a model it was not computed by.
//!
//! Layout (little endian):
//! ```text
//! magic "SLKVSEQ\0" | version u32 | fingerprint [32] | dtype u8 | pad [3]
//! block u32 | window u32 | tokens u64 | pages u32 | page_bytes u64
//! ring_bytes u64 | comp_bytes u64 | pages… | rings | comp
//! ```

use kernels::{Backend, EntryDtype};
use thiserror::Error;

use super::cache::{KvCache, Sequence};
use super::pool::PoolError;
use crate::fingerprint::Fingerprint;

/// 3: fp8 entries (dtype code 2, pages and rings of byte records). Older exports are
/// refused rather than guessed at: version 2 had no fp8, and its readers would take an
/// fp8 export's bytes for something else.
pub const SEQUENCE_FORMAT_VERSION: u32 = 3;
const MAGIC: &[u8; 8] = b"SLKVSEQ\0";
const HEADER_LEN: usize = 8 + 4 + 32 + 4 + 4 + 4 + 8 + 4 + 8 + 8 + 8;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ImportError {
    #[error("not a sluice sequence export (bad magic or too short)")]
    NotAnExport,
    #[error("sequence export has format version {0}, this build reads only version {SEQUENCE_FORMAT_VERSION}")]
    Version(u32),
    #[error("sequence was computed by a different model or KV dtype (fingerprint {theirs}, ours {ours})")]
    Fingerprint { theirs: String, ours: String },
    #[error("sequence geometry differs: {0}")]
    Geometry(String),
    #[error("sequence export is {got} bytes, header describes {want}")]
    Length { got: usize, want: usize },
    #[error(transparent)]
    Pool(#[from] PoolError),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportHeader {
    pub version: u32,
    pub fingerprint: Fingerprint,
    pub dtype: EntryDtype,
    pub block: u32,
    pub window: u32,
    pub tokens: u64,
    pub pages: u32,
    pub page_bytes: u64,
    pub ring_bytes: u64,
    pub comp_bytes: u64,
}

impl ExportHeader {
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.fingerprint.0);
        out.push(match self.dtype {
            EntryDtype::F32 => 0,
            EntryDtype::Bf16 => 1,
            EntryDtype::Fp8 => 2,
        });
        out.extend_from_slice(&[0; 3]);
        out.extend_from_slice(&self.block.to_le_bytes());
        out.extend_from_slice(&self.window.to_le_bytes());
        out.extend_from_slice(&self.tokens.to_le_bytes());
        out.extend_from_slice(&self.pages.to_le_bytes());
        out.extend_from_slice(&self.page_bytes.to_le_bytes());
        out.extend_from_slice(&self.ring_bytes.to_le_bytes());
        out.extend_from_slice(&self.comp_bytes.to_le_bytes());
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, ImportError> {
        if bytes.len() < HEADER_LEN || &bytes[..8] != MAGIC {
            return Err(ImportError::NotAnExport);
        }
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().unwrap());
        let version = u32_at(8);
        if version != SEQUENCE_FORMAT_VERSION {
            return Err(ImportError::Version(version));
        }
        let dtype = match bytes[44] {
            0 => EntryDtype::F32,
            1 => EntryDtype::Bf16,
            2 => EntryDtype::Fp8,
            d => return Err(ImportError::Geometry(format!("unknown entry dtype code {d}"))),
        };
        Ok(ExportHeader {
            version,
            fingerprint: Fingerprint(bytes[12..44].try_into().unwrap()),
            dtype,
            block: u32_at(48),
            window: u32_at(52),
            tokens: u64_at(56),
            pages: u32_at(64),
            page_bytes: u64_at(68),
            ring_bytes: u64_at(76),
            comp_bytes: u64_at(84),
        })
    }

    fn body_len(&self) -> usize {
        self.pages as usize * self.page_bytes as usize + self.ring_bytes as usize + self.comp_bytes as usize
    }
}

impl<B: Backend> KvCache<B> {
    fn header_for(&self, seq: &Sequence, fingerprint: &Fingerprint) -> ExportHeader {
        let l = &self.layout;
        ExportHeader {
            version: SEQUENCE_FORMAT_VERSION,
            fingerprint: fingerprint.clone(),
            dtype: l.dtype,
            block: l.block as u32,
            window: l.window as u32,
            tokens: seq.len as u64,
            pages: seq.len.div_ceil(l.block) as u32,
            page_bytes: l.page_bytes() as u64,
            ring_bytes: (l.ring_elems * l.dtype.size()) as u64,
            comp_bytes: (l.comp_elems * 4) as u64,
        }
    }

    /// Serialise a sequence's pages and state-cache slot.
    pub fn export(&self, b: &B, seq: &Sequence, fingerprint: &Fingerprint) -> Vec<u8> {
        let l = &self.layout;
        let header = self.header_for(seq, fingerprint);
        let mut out = Vec::with_capacity(HEADER_LEN + header.body_len());
        header.encode(&mut out);
        for &page in &seq.pages[..header.pages as usize] {
            out.extend_from_slice(&b.kv_read(&self.state.pages, page as usize * l.page_elems, l.page_elems));
        }
        out.extend_from_slice(&b.kv_read(&self.state.rings, seq.slot * l.ring_elems, l.ring_elems));
        out.extend_from_slice(&b.kv_read(&self.state.comp, seq.slot * l.comp_elems, l.comp_elems));
        out
    }

    /// Recreate a sequence from [`Self::export`] bytes in fresh pages and a fresh slot.
    pub fn import(&mut self, b: &B, bytes: &[u8], fingerprint: &Fingerprint) -> Result<Sequence, ImportError> {
        let h = ExportHeader::decode(bytes)?;
        // Checked before `header_for`, whose u32 page count would wrap for such a token
        // count and let a sequence of 2^57 tokens pass as one of no pages.
        if h.tokens.div_ceil(self.layout.block as u64) != h.pages as u64 {
            return Err(ImportError::Geometry(format!("{} tokens do not fill {} pages", h.tokens, h.pages)));
        }
        if &h.fingerprint != fingerprint {
            return Err(ImportError::Fingerprint { theirs: h.fingerprint.short(), ours: fingerprint.short() });
        }
        let ours = self.header_for(&Sequence { slot: 0, pages: Vec::new(), len: h.tokens as usize }, fingerprint);
        if h != ours {
            return Err(ImportError::Geometry(format!("export {h:?} vs this engine {ours:?}")));
        }
        let want = HEADER_LEN + h.body_len();
        if bytes.len() != want {
            return Err(ImportError::Length { got: bytes.len(), want });
        }
        let (pages, slots) = self.pool_mut();
        let rank = super::pool::pick_rank(pages, slots)?;
        let slot = slots.alloc_on(rank)?;
        let page_ids = match pages.alloc_on(rank, h.pages as usize) {
            Ok(p) => p,
            Err(e) => {
                slots.release(slot);
                return Err(e.into());
            }
        };
        let l = &self.layout;
        let mut at = HEADER_LEN;
        for &page in &page_ids {
            b.kv_write(&mut self.state.pages, page as usize * l.page_elems, &bytes[at..at + l.page_bytes()]);
            at += l.page_bytes();
        }
        b.kv_write(&mut self.state.rings, slot * l.ring_elems, &bytes[at..at + h.ring_bytes as usize]);
        at += h.ring_bytes as usize;
        b.kv_write(&mut self.state.comp, slot * l.comp_elems, &bytes[at..]);
        Ok(Sequence { slot, pages: page_ids, len: h.tokens as usize })
    }
}
