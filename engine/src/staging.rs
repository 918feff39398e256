//! A sequence's KV bytes copied between the engine's memory and host buffers, for
//! engines whose KV lives where a transport cannot reach it directly (GPU memory when
//! UCX has no CUDA memory support): the sender copies a sequence out into registered
//! host memory and puts from there; the receiver lets peers write into registered host
//! memory and copies it in before decoding.
//!
//! The byte layout is the one [`crate::handoff::SeqBytes`] exposes for host-memory
//! engines (pages in block order, then the state slot's window rings and compressor
//! slots), so both sides agree whatever device each runs on. These functions work on
//! every backend (they go through `Backend::kv_read`/`kv_write`); for CPU engines with
//! adopted memory, `Engine::sequence_bytes` avoids the copy.

use kernels::Backend;

use crate::engine::Engine;
use crate::error::EngineError;
use crate::kv::Sequence;

/// Bytes of one page, one slot's window rings and one slot's compressor state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqByteSizes {
    pub page: usize,
    pub rings: usize,
    pub comp: usize,
}

impl SeqByteSizes {
    /// Bytes of a sequence of `tokens` tokens: its pages, rings and compressor slots.
    pub fn total(&self, tokens: usize, block: usize) -> usize {
        tokens.div_ceil(block) * self.page + self.rings + self.comp
    }
}

fn check_len(what: &str, got: usize, want: usize) -> Result<(), EngineError> {
    if got != want {
        return Err(EngineError::InvalidRequest(format!("{what} buffer holds {got} bytes, {want} needed")));
    }
    Ok(())
}

impl<B: Backend> Engine<B> {
    pub fn seq_byte_sizes(&self) -> SeqByteSizes {
        let l = &self.cache.layout;
        SeqByteSizes { page: l.page_bytes(), rings: l.ring_elems * l.dtype.size(), comp: l.comp_elems * 4 }
    }

    /// Copy the pages holding the first `tokens` tokens of `seq` (back to back, block
    /// order) and its state slot into host buffers sized by [`Self::seq_byte_sizes`].
    pub fn copy_sequence_out(
        &self,
        seq: &Sequence,
        tokens: usize,
        pages: &mut [u8],
        rings: &mut [u8],
        comp: &mut [u8],
    ) -> Result<(), EngineError> {
        let l = &self.cache.layout;
        let sz = self.seq_byte_sizes();
        let used = tokens.div_ceil(l.block);
        if used > seq.pages.len() {
            return Err(EngineError::InvalidRequest(format!(
                "{tokens} tokens need {used} pages; the sequence has {}",
                seq.pages.len()
            )));
        }
        check_len("pages", pages.len(), used * sz.page)?;
        check_len("rings", rings.len(), sz.rings)?;
        check_len("compressor", comp.len(), sz.comp)?;
        let b = &self.model.backend;
        let st = &self.cache.state;
        for (i, &p) in seq.pages[..used].iter().enumerate() {
            let bytes = b.kv_read(&st.pages, p as usize * l.page_elems, l.page_elems);
            pages[i * sz.page..(i + 1) * sz.page].copy_from_slice(&bytes);
        }
        rings.copy_from_slice(&b.kv_read(&st.rings, seq.slot * l.ring_elems, l.ring_elems));
        comp.copy_from_slice(&b.kv_read(&st.comp, seq.slot * l.comp_elems, l.comp_elems));
        Ok(())
    }

    /// Write pages (back to back, block order, as many as `pages` holds) and a state
    /// slot from host buffers into `seq`'s pages and slot, e.g. after a transfer landed
    /// in staging memory; follow with [`Self::mark_filled`].
    pub fn copy_sequence_in(
        &mut self,
        seq: &Sequence,
        pages: &[u8],
        rings: &[u8],
        comp: &[u8],
    ) -> Result<(), EngineError> {
        let l = self.cache.layout.clone();
        let sz = self.seq_byte_sizes();
        if !pages.len().is_multiple_of(sz.page) || pages.len() / sz.page > seq.pages.len() {
            return Err(EngineError::InvalidRequest(format!(
                "{} page bytes are not a whole number of pages ({} B) within the sequence's {} pages",
                pages.len(),
                sz.page,
                seq.pages.len()
            )));
        }
        check_len("rings", rings.len(), sz.rings)?;
        check_len("compressor", comp.len(), sz.comp)?;
        let b = &self.model.backend;
        let st = &mut self.cache.state;
        for (chunk, &p) in pages.chunks_exact(sz.page).zip(&seq.pages) {
            b.kv_write(&mut st.pages, p as usize * l.page_elems, chunk);
        }
        b.kv_write(&mut st.rings, seq.slot * l.ring_elems, rings);
        b.kv_write(&mut st.comp, seq.slot * l.comp_elems, comp);
        Ok(())
    }
}
