//! Sequences whose KV another process writes or reads: a decode worker reserves pages
//! and a state slot that a prefill worker fills over the network, then declares them
//! filled; a prefill worker hands out the bytes of what it computed.

use kernels::Backend;

use crate::engine::Engine;
use crate::error::EngineError;
use crate::kv::Sequence;

/// A sequence's bytes in host memory: its used pages in block order, then its state
/// slot (window rings, compressor slots).
pub struct SeqBytes<'a> {
    pub pages: Vec<&'a [u8]>,
    pub rings: &'a [u8],
    pub comp: &'a [u8],
}

impl<B: Backend> Engine<B> {
    /// An empty sequence with pages for `capacity` tokens, to be filled from outside.
    pub fn reserve(&mut self, capacity: usize) -> Result<Sequence, EngineError> {
        let limit = self.config().max_position;
        if capacity > limit {
            return Err(EngineError::ContextTooLong { tokens: capacity, limit });
        }
        let mut seq = self.cache.open()?;
        if let Err(e) = self.cache.reserve(&mut seq, capacity) {
            self.cache.release(seq);
            return Err(e.into());
        }
        Ok(seq)
    }

    /// Declare that the state of `tokens` tokens has been written into `seq`'s pages
    /// and slot by someone else.
    pub fn mark_filled(&mut self, seq: &mut Sequence, tokens: usize) -> Result<(), EngineError> {
        let capacity = seq.pages.len() * self.cache.layout.block;
        if !seq.is_empty() || tokens == 0 || tokens > capacity {
            return Err(EngineError::InvalidRequest(format!(
                "cannot mark {tokens} tokens filled in a sequence of {} tokens with room for {capacity}",
                seq.len()
            )));
        }
        seq.len = tokens;
        Ok(())
    }

    /// Bytes of the pages holding `tokens` tokens of `seq` and of its state slot, in
    /// host memory: the engine's own, or its host mirror (what peers wrote there, or
    /// what [`Self::stage_out`] copied there). `None` when the backend keeps KV outside
    /// host memory and there is no mirror.
    pub fn sequence_bytes(&self, seq: &Sequence, tokens: usize) -> Option<SeqBytes<'_>> {
        let l = &self.cache.layout;
        let (pb, rb, cb) = (l.page_bytes(), l.ring_elems * l.dtype.size(), l.comp_elems * 4);
        let (pages, rings, comp) = self.host_regions()?;
        let used = tokens.div_ceil(l.block).min(seq.pages.len());
        Some(SeqBytes {
            pages: seq.pages[..used].iter().map(|&p| &pages[p as usize * pb..(p as usize + 1) * pb]).collect(),
            rings: &rings[seq.slot * rb..(seq.slot + 1) * rb],
            comp: &comp[seq.slot * cb..(seq.slot + 1) * cb],
        })
    }

    /// Bytes of the logits slot of `seq` (`None` without a logits region).
    pub fn slot_logits_bytes(&self, seq: &Sequence) -> Option<&[u8]> {
        let direct = self.direct.as_ref().and_then(|d| d.logits.as_ref());
        let bytes = match (&self.mirror, &self.cache.slot_logits) {
            _ if direct.is_some() => direct?.bytes(),
            (Some(m), _) => m.logits_bytes()?,
            (None, Some(own)) => self.model.backend.kv_host_bytes(own)?,
            (None, None) => return None,
        };
        let per = self.config().vocab_size * 4;
        bytes.get(seq.slot * per..(seq.slot + 1) * per)
    }

    /// Logits a remote writer left in `seq`'s slot.
    pub fn slot_logits(&self, seq: &Sequence) -> Option<Vec<f32>> {
        Some(
            self.slot_logits_bytes(seq)?
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )
    }
}
