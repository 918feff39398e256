//! Sequences resumed from a prefix cache, and what a prefix cache stores of them.
//!
//! A restore is three steps: [`Engine::reserve_prefix`] gives an empty sequence pages
//! for the cached blocks (someone — a kvstore over UCX, or a test — fills them, and the
//! snapshot if there is one, with [`Engine::write_snapshot`] or remote writes into the
//! slot), then [`Engine::finish_restore`] declares the prefix present, rebuilding the
//! window first when there was no snapshot. Prefill then continues from the prefix like
//! any chunked prefill.
//!
//! A *snapshot* is what a sequence carries across a block boundary: its window rings
//! and its CSA compressor slots (the leading `comp_carry_elems` of its compressor
//! region); see `model_spec::prefix` for the policies that decide which to keep.

use kernels::{Backend, EntryDtype};

use crate::engine::Engine;
use crate::error::EngineError;
use crate::kv::Sequence;

/// How the state of a restored prefix comes about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefixState {
    /// Its snapshot was written into the sequence's slot.
    Snapshot,
    /// No snapshot: rebuild the window from the cached pages.
    Rebuild,
}

impl<B: Backend> Engine<B> {
    /// Give an empty sequence the pages of `blocks` cached blocks; returns their ids in
    /// block order (where the cached pages must be written).
    pub fn reserve_prefix(&mut self, seq: &mut Sequence, blocks: usize) -> Result<Vec<u32>, EngineError> {
        if !seq.is_empty() || !seq.pages().is_empty() {
            return Err(EngineError::InvalidRequest("a prefix can only be restored into an empty sequence".into()));
        }
        let tokens = blocks * self.cache.layout.block;
        self.validate_length(tokens)?;
        self.cache.reserve(seq, tokens)?;
        Ok(seq.pages().to_vec())
    }

    /// Bytes of one snapshot for this model.
    pub fn snapshot_len(&self) -> usize {
        self.cache.layout.snapshot_bytes()
    }

    /// The state `seq` carries across its current length, which must be a block
    /// boundary: its window rings then its CSA compressor slots.
    pub fn snapshot(&self, seq: &Sequence) -> Vec<u8> {
        let l = &self.cache.layout;
        assert!(seq.len().is_multiple_of(l.block), "snapshots are taken at block boundaries");
        let b = &self.model.backend;
        let mut out = b.kv_read(&self.cache.state.rings, seq.slot() * l.ring_elems, l.ring_elems);
        out.extend(b.kv_read(&self.cache.state.comp, seq.slot() * l.comp_elems, l.comp_carry_elems));
        out
    }

    /// Write a snapshot (from [`Self::snapshot`] of the same model) into `seq`'s slot.
    pub fn write_snapshot(&mut self, seq: &Sequence, bytes: &[u8]) -> Result<(), EngineError> {
        let l = &self.cache.layout;
        if bytes.len() != l.snapshot_bytes() {
            return Err(EngineError::InvalidRequest(format!(
                "a snapshot of {} bytes; this model's are {}",
                bytes.len(),
                l.snapshot_bytes()
            )));
        }
        let (rings, comp) = bytes.split_at(l.window_bytes());
        let (ring_at, comp_at) = (seq.slot() * l.ring_elems, seq.slot() * l.comp_elems);
        let b = &self.model.backend;
        b.kv_write(&mut self.cache.state.rings, ring_at, rings);
        b.kv_write(&mut self.cache.state.comp, comp_at, comp);
        Ok(())
    }

    /// Write cached page bytes into `seq`'s pages, in block order from its first page.
    pub fn write_pages(&mut self, seq: &Sequence, pages: &[&[u8]]) -> Result<(), EngineError> {
        let l = &self.cache.layout;
        if pages.len() > seq.pages().len() {
            return Err(EngineError::InvalidRequest(format!(
                "{} pages for a sequence holding {}",
                pages.len(),
                seq.pages().len()
            )));
        }
        if let Some(p) = pages.iter().find(|p| p.len() != l.page_bytes()) {
            return Err(EngineError::InvalidRequest(format!(
                "a page of {} bytes; this model's are {}",
                p.len(),
                l.page_bytes()
            )));
        }
        let b = &self.model.backend;
        for (&id, bytes) in seq.pages().iter().zip(pages) {
            b.kv_write(&mut self.cache.state.pages, id as usize * l.page_elems, bytes);
        }
        Ok(())
    }

    /// Declare the first `prefix.len()` tokens (whole blocks, pages already written)
    /// present in `seq`. With [`PrefixState::Rebuild`] the window and compressor slots
    /// are recomputed from the pages first. Returns the token-layers recomputed.
    pub fn finish_restore(
        &mut self,
        seq: &mut Sequence,
        prefix: &[u32],
        state: PrefixState,
    ) -> Result<usize, EngineError> {
        let block = self.cache.layout.block;
        let blocks = prefix.len() / block;
        if !seq.is_empty() || !prefix.len().is_multiple_of(block) || seq.pages().len() < blocks || blocks == 0 {
            return Err(EngineError::InvalidRequest(format!(
                "cannot restore {} tokens into a sequence of {} tokens and {} pages (whole blocks only)",
                prefix.len(),
                seq.len(),
                seq.pages().len()
            )));
        }
        self.validate(0, prefix)?;
        let work = match state {
            PrefixState::Snapshot => 0,
            PrefixState::Rebuild => {
                self.clear_slot(seq);
                let (model, kv) = (&self.model, &mut self.cache.state);
                let pages = &seq.pages()[..blocks];
                model.backend.enter(|| model.rebuild_window(kv, seq.slot(), pages, prefix))
            }
        };
        self.cache.trim(seq, prefix.len());
        seq.len = prefix.len();
        Ok(work)
    }

    /// Zero a slot's rings and compressor slots, so that what a rebuild reads before
    /// writing is finite whatever the slot held before.
    fn clear_slot(&mut self, seq: &Sequence) {
        let l = &self.cache.layout;
        let b = &self.model.backend;
        let ring_zero = vec![0u8; l.ring_elems * l.dtype.size()];
        b.kv_write(&mut self.cache.state.rings, seq.slot() * l.ring_elems, &ring_zero);
        let comp_zero = vec![0u8; l.comp_elems * EntryDtype::F32.size()];
        b.kv_write(&mut self.cache.state.comp, seq.slot() * l.comp_elems, &comp_zero);
    }

    fn validate_length(&self, tokens: usize) -> Result<(), EngineError> {
        let limit = self.config().max_position;
        if tokens > limit {
            return Err(EngineError::ContextTooLong { tokens, limit });
        }
        Ok(())
    }
}
