//! A host mirror of an engine's KV memory, for engines whose own KV memory transports
//! cannot reach (GPU memory, when UCX has no CUDA memory support): registered host
//! regions with exactly the engine's page and slot geometry. Peers write into the
//! mirror and [`Engine::stage_in`] copies what landed into the engine; the engine's
//! KV goes out by [`Engine::stage_out`] into the mirror and is sent from there. Page
//! ids and slots are the engine's, so a transfer target names mirror memory with the
//! same ids a host-memory engine would hand out.
//!
//! Engines whose KV is host memory (the CPU backend on adopted regions) have no mirror:
//! staging is a no-op and [`Engine::sequence_bytes`] reads their own memory.

use kernels::backend::Backend;
use kernels::cpu::CpuKv;
use kernels::{CpuBackend, KvState};

use crate::engine::Engine;
use crate::error::EngineError;
use crate::kv::Sequence;

/// Host memory in the engine's KV geometry (pages, window rings, compressor slots, and
/// optionally per-slot logits).
pub struct HostMirror {
    pub state: KvState<CpuBackend>,
    pub slot_logits: Option<CpuKv>,
}

impl HostMirror {
    pub fn logits_bytes(&self) -> Option<&[u8]> {
        Some(self.slot_logits.as_ref()?.bytes())
    }

    fn regions(&self) -> (&[u8], &[u8], &[u8]) {
        (self.state.pages.bytes(), self.state.rings.bytes(), self.state.comp.bytes())
    }
}

impl<B: Backend> Engine<B> {
    /// Attach a host mirror (sized by `KvCache::region_elems` for this engine's pools).
    /// A device backend pins its regions for the stage copies; [`Self::mirror_pinned`]
    /// says whether it could.
    pub fn set_mirror(&mut self, mirror: HostMirror) -> Result<(), EngineError> {
        let l = &self.cache.layout;
        let s = self.cache.stats();
        let (pages, rings, comp) = mirror.regions();
        let want = (
            s.pages_total * l.page_bytes(),
            s.slots_total * l.ring_elems * l.dtype.size(),
            s.slots_total * l.comp_elems * 4,
        );
        if (pages.len(), rings.len(), comp.len()) != want {
            return Err(EngineError::InvalidRequest(format!(
                "a host mirror of {:?} bytes for pools of {want:?}",
                (pages.len(), rings.len(), comp.len())
            )));
        }
        // All regions pinned or none counted as pinned.
        let b = &self.model.backend;
        let pins: Option<Vec<_>> =
            [pages, rings, comp].into_iter().filter(|r| !r.is_empty()).map(|r| b.pin_host(r)).collect();
        self.mirror_pins = pins.unwrap_or_default();
        self.mirror = Some(mirror);
        Ok(())
    }

    /// Whether the mirror's regions are pinned for device copies (a device backend
    /// that could pin all of them).
    pub fn mirror_pinned(&self) -> bool {
        self.mirror.is_some() && !self.mirror_pins.is_empty()
    }

    /// How peers reach this engine's KV memory, as the workers' `sluice_kv_memory_path`
    /// metric labels it: `device` (registered device memory, reached in place),
    /// `registered` (no mirror: the engine's KV is the registered host memory), `mirror`
    /// or `mirror_pageable` (staged through the host mirror).
    pub fn kv_memory_path(&self) -> &'static str {
        if self.direct.is_some() {
            return "device";
        }
        match (&self.mirror, self.mirror_pins.is_empty()) {
            (None, _) => "registered",
            (Some(_), false) => "mirror",
            (Some(_), true) => "mirror_pageable",
        }
    }

    /// The host bytes transports see: (pages, rings, comp) of every page and slot.
    pub(crate) fn host_regions(&self) -> Option<(&[u8], &[u8], &[u8])> {
        if let Some(m) = &self.mirror {
            return Some(m.regions());
        }
        let b = &self.model.backend;
        let st = &self.cache.state;
        Some((b.kv_host_bytes(&st.pages)?, b.kv_host_bytes(&st.rings)?, b.kv_host_bytes(&st.comp)?))
    }

    /// Copy the pages holding `tokens` tokens of `seq` and its state slot from the
    /// engine into the mirror (nothing to do without one), straight into the mirror's
    /// memory.
    pub fn stage_out(&mut self, seq: &Sequence, tokens: usize) {
        let Some(m) = self.mirror.as_mut() else { return };
        let (b, l, st) = (&self.model.backend, &self.cache.layout, &self.cache.state);
        let used = tokens.div_ceil(l.block).min(seq.pages.len());
        let pb = l.page_elems * l.dtype.size();
        for &p in &seq.pages[..used] {
            let at = p as usize;
            b.kv_read_into(&st.pages, at * l.page_elems, l.page_elems, &mut m.state.pages.bytes_mut()[at * pb..][..pb]);
        }
        let (rb, cb) = (l.ring_elems * l.dtype.size(), l.comp_elems * 4);
        let ring_out = &mut m.state.rings.bytes_mut()[seq.slot * rb..][..rb];
        b.kv_read_into(&st.rings, seq.slot * l.ring_elems, l.ring_elems, ring_out);
        let comp_out = &mut m.state.comp.bytes_mut()[seq.slot * cb..][..cb];
        b.kv_read_into(&st.comp, seq.slot * l.comp_elems, l.comp_elems, comp_out);
    }

    /// Copy what peers wrote into the mirror for `seq` — its first `pages` pages and,
    /// with `slot`, its state slot — into the engine (nothing to do without a mirror).
    pub fn stage_in(&mut self, seq: &Sequence, pages: usize, slot: bool) {
        let Some(m) = self.mirror.as_ref() else { return };
        let (b, l, st) = (&self.model.backend, &self.cache.layout, &mut self.cache.state);
        let pb = l.page_elems * l.dtype.size();
        for &p in &seq.pages[..pages.min(seq.pages.len())] {
            let at = p as usize;
            b.kv_write(&mut st.pages, at * l.page_elems, &m.state.pages.bytes()[at * pb..][..pb]);
        }
        if slot {
            let (rb, cb) = (l.ring_elems * l.dtype.size(), l.comp_elems * 4);
            b.kv_write(&mut st.rings, seq.slot * l.ring_elems, &m.state.rings.bytes()[seq.slot * rb..][..rb]);
            b.kv_write(&mut st.comp, seq.slot * l.comp_elems, &m.state.comp.bytes()[seq.slot * cb..][..cb]);
        }
        // From pinned memory the copies may still be reading the mirror; peers may
        // write into it again once this returns.
        b.kv_fence();
    }

    /// The snapshot of `seq` as it sits in host memory (what a peer wrote into the
    /// mirror, or the engine's own host memory): rings, then the carried compressor
    /// slots. Compare with [`Self::snapshot`], which reads the engine.
    pub fn host_snapshot(&self, seq: &Sequence) -> Option<Vec<u8>> {
        let l = &self.cache.layout;
        let (_, rings, comp) = self.host_regions()?;
        let rb = l.ring_elems * l.dtype.size();
        let mut out = rings[seq.slot * rb..(seq.slot + 1) * rb].to_vec();
        let cb = l.comp_elems * 4;
        out.extend_from_slice(&comp[seq.slot * cb..seq.slot * cb + l.comp_carry_elems * 4]);
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use kernels::EntryDtype;

    use super::*;
    use crate::kv::KvCache;
    use crate::{EngineOptions, Logits};

    fn engine() -> Engine<CpuBackend> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/tiny-official/model");
        let opts = EngineOptions { kv_dtype: EntryDtype::Bf16, max_pages: 8, max_sequences: 2, max_chunk_tokens: 512 };
        Engine::load(&dir, CpuBackend::new(), opts).unwrap()
    }

    fn mirror_for(e: &Engine<CpuBackend>) -> HostMirror {
        let (pe, re, ce) = KvCache::<CpuBackend>::region_elems(&e.cache.layout, 8, 2);
        let cpu = CpuBackend::new();
        HostMirror {
            state: KvState {
                pages: cpu.kv_alloc(pe, EntryDtype::Bf16),
                rings: cpu.kv_alloc(re, EntryDtype::Bf16),
                comp: cpu.kv_alloc(ce, EntryDtype::F32),
            },
            slot_logits: None,
        }
    }

    #[test]
    fn a_sequence_goes_out_through_one_mirror_and_in_through_another() {
        // The sender's KV (its own memory stands in for device memory the mirror is for).
        let mut sender = engine();
        let mut seq = sender.open_sequence().unwrap();
        let tokens: Vec<u32> = (0..300).map(|i| (i * 7 % 150) as u32).collect();
        sender.prefill(&mut seq, &tokens, Logits::None).unwrap();
        let m = mirror_for(&sender);
        sender.set_mirror(m).unwrap();
        sender.stage_out(&seq, tokens.len());
        let out = sender.sequence_bytes(&seq, tokens.len()).unwrap();
        assert_eq!(out.pages.len(), 3);

        // A receiver: peers write into its mirror; it copies them in.
        let mut receiver = engine();
        receiver.set_mirror(mirror_for(&receiver)).unwrap();
        let mut target = receiver.reserve(tokens.len()).unwrap();
        let cpu = CpuBackend::new();
        let l = receiver.cache.layout.clone();
        {
            let m = receiver.mirror.as_mut().unwrap();
            for (i, &p) in target.pages().iter().enumerate() {
                cpu.kv_write(&mut m.state.pages, p as usize * l.page_elems, out.pages[i]);
            }
            cpu.kv_write(&mut m.state.rings, target.slot() * l.ring_elems, out.rings);
            cpu.kv_write(&mut m.state.comp, target.slot() * l.comp_elems, out.comp);
        }
        receiver.stage_in(&target, 3, true);
        receiver.mark_filled(&mut target, tokens.len()).unwrap();

        // Both continue identically.
        let a = sender.decode(&mut [&mut seq], &[5]).unwrap();
        let b = receiver.decode(&mut [&mut target], &[5]).unwrap();
        assert_eq!(a, b);
        assert_eq!(receiver.host_snapshot(&target).unwrap().len(), receiver.snapshot_len());
        let bad = HostMirror { slot_logits: None, ..mirror_for(&engine()) };
        let mut small = engine();
        small.cache = KvCache::new(&small.model.backend, small.cache.layout.clone(), 4, 2);
        assert!(small.set_mirror(bad).is_err(), "a mirror must match the pools");
    }
}
