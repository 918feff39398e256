//! KV memory that transports reach where it is: a GPU engine's pages and state slots in
//! device memory, which a worker registers with a CUDA-enabled UCX so that peers put
//! into it (decode workers) and puts read from it (prefill workers), with no host mirror
//! and no staging copy. A sequence's bytes and its checksums are found on the device
//! that holds it ([`Engine::sequence_device_ranges`], [`Engine::own_checksums`]);
//! checksums are summed by that device (`kernels::kv_checksum`), so verifying a transfer
//! reads nothing back to the host.
//!
//! Several devices: each holds a contiguous block of the pages and slots
//! (`kv::pool`); a transport registers each device's part as its own region and names,
//! for a sequence, the region of its device with page ids and slot relative to it.

use kernels::Backend;
use kernels::backend::{DeviceMemory, SumRange};
use kernels::cpu::CpuKv;
use kernels::kv_checksum::finish;

use crate::engine::Engine;
use crate::error::EngineError;
use crate::kv::Sequence;

/// Set on an engine whose device memory transports reach in place
/// ([`Engine::set_direct`]).
pub struct DirectKv {
    /// Host memory peers write a prompt's last logits into (a decode worker's landing;
    /// logits are sampled on the host).
    pub logits: Option<CpuKv>,
}

/// One device's part of an engine's KV memory.
pub struct DeviceKvPart {
    /// Position of the device in the engine's device list.
    pub rank: usize,
    pub pages: Box<dyn DeviceMemory>,
    pub rings: Box<dyn DeviceMemory>,
    pub comp: Box<dyn DeviceMemory>,
    /// Global id of this device's first page and first state slot.
    pub first_page: usize,
    pub first_slot: usize,
}

/// Where one sequence's bytes lie in its device's parts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqDeviceRanges {
    pub rank: usize,
    /// `(byte offset in the device's pages memory, bytes)` per used page, block order.
    pub pages: Vec<(usize, usize)>,
    /// `(byte offset, bytes)` of its window rings and compressor slot.
    pub rings: (usize, usize),
    pub comp: (usize, usize),
    /// Page ids and slot relative to the device's first page and slot.
    pub local_pages: Vec<u32>,
    pub local_slot: usize,
}

/// KV checksums of one sequence's pages (block order), window rings and compressor slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqSums {
    pub pages: Vec<u64>,
    pub rings: u64,
    pub comp: u64,
}

impl<B: Backend> Engine<B> {
    /// Declare that transports reach this engine's KV in device memory (the caller has
    /// registered [`Self::device_kv`]); `logits` is the host landing for prompt logits.
    pub fn set_direct(&mut self, logits: Option<CpuKv>) -> Result<(), EngineError> {
        if self.device_kv().is_none() {
            return Err(EngineError::InvalidRequest(format!(
                "the {} backend keeps no KV in device memory to reach in place",
                self.model.backend.describe()
            )));
        }
        self.direct = Some(DirectKv { logits });
        Ok(())
    }

    /// Whether transports reach this engine's KV in device memory.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// The engine's KV device memory, one part per device, or `None` when its KV is in
    /// host memory.
    pub fn device_kv(&self) -> Option<Vec<DeviceKvPart>> {
        let (b, st) = (&self.model.backend, &self.cache.state);
        let pages = b.kv_device_memory(&st.pages);
        if pages.is_empty() {
            return None;
        }
        let (rings, comp) = (b.kv_device_memory(&st.rings), b.kv_device_memory(&st.comp));
        let ranks = pages.len();
        assert!(rings.len() == ranks && comp.len() == ranks, "every KV region spans the same devices");
        let s = self.cache.stats();
        let (pages_per, slots_per) = (s.pages_total / ranks, s.slots_total / ranks);
        Some(
            pages
                .into_iter()
                .zip(rings)
                .zip(comp)
                .enumerate()
                .map(|(rank, ((pages, rings), comp))| DeviceKvPart {
                    rank,
                    pages,
                    rings,
                    comp,
                    first_page: rank * pages_per,
                    first_slot: rank * slots_per,
                })
                .collect(),
        )
    }

    /// Where the pages holding `tokens` tokens of `seq` and its state slot lie in its
    /// device's memory (`None` when the engine's KV is in host memory).
    pub fn sequence_device_ranges(&self, seq: &Sequence, tokens: usize) -> Option<SeqDeviceRanges> {
        let b = &self.model.backend;
        if b.kv_device_memory(&self.cache.state.pages).is_empty() {
            return None;
        }
        let l = &self.cache.layout;
        let s = self.cache.stats();
        let ranks = b.ranks().max(1);
        let rank = self.cache.rank_of(seq);
        let (first_page, first_slot) = (rank * (s.pages_total / ranks), rank * (s.slots_total / ranks));
        let used = tokens.div_ceil(l.block).min(seq.pages.len());
        let local_pages: Vec<u32> = seq.pages[..used].iter().map(|&p| p - first_page as u32).collect();
        let local_slot = seq.slot - first_slot;
        let (pb, rb, cb) = (l.page_bytes(), l.ring_elems * l.dtype.size(), l.comp_elems * 4);
        Some(SeqDeviceRanges {
            rank,
            pages: local_pages.iter().map(|&p| (p as usize * pb, pb)).collect(),
            rings: (local_slot * rb, rb),
            comp: (local_slot * cb, cb),
            local_pages,
            local_slot,
        })
    }

    /// KV checksums of `seq`'s pages holding `tokens` tokens and of its state slot, in
    /// the engine's own memory (a GPU sums them on the device).
    pub fn own_checksums(&self, seq: &Sequence, tokens: usize) -> SeqSums {
        let (b, l, st) = (&self.model.backend, &self.cache.layout, &self.cache.state);
        let used = tokens.div_ceil(l.block).min(seq.pages.len());
        let page_ranges: Vec<SumRange> =
            seq.pages[..used].iter().map(|&p| SumRange::whole(p as usize * l.page_elems, l.page_elems)).collect();
        let pages = b.kv_sums(&st.pages, &page_ranges).into_iter().map(|s| finish(s, l.page_bytes())).collect();
        let rings = b.kv_sums(&st.rings, &[SumRange::whole(seq.slot * l.ring_elems, l.ring_elems)])[0];
        let comp = b.kv_sums(&st.comp, &[SumRange::whole(seq.slot * l.comp_elems, l.comp_elems)])[0];
        SeqSums { pages, rings: finish(rings, l.ring_elems * l.dtype.size()), comp: finish(comp, l.comp_elems * 4) }
    }

    /// KV checksums of what transports see of `seq`: its host bytes (the mirror, or the
    /// engine's own host memory) when there are any, else its device memory.
    pub fn transport_checksums(&self, seq: &Sequence, tokens: usize) -> SeqSums {
        use kernels::kv_checksum::kv_checksum;
        match self.sequence_bytes(seq, tokens) {
            Some(b) => SeqSums {
                pages: b.pages.iter().map(|p| kv_checksum(p)).collect(),
                rings: kv_checksum(b.rings),
                comp: kv_checksum(b.comp),
            },
            None => self.own_checksums(seq, tokens),
        }
    }

    /// The KV checksum of `seq`'s window snapshot (its rings, then the carried
    /// compressor slots: the bytes a kvstore snapshot record holds) in the engine's own
    /// memory.
    pub fn own_snapshot_checksum(&self, seq: &Sequence) -> u64 {
        let (b, l, st) = (&self.model.backend, &self.cache.layout, &self.cache.state);
        let ring_bytes = l.ring_elems * l.dtype.size();
        let carry_bytes = l.comp_carry_elems * 4;
        if !ring_bytes.is_multiple_of(8) {
            // The second piece would not start on a word: sum the joined bytes.
            let mut all = b.kv_read(&st.rings, seq.slot * l.ring_elems, l.ring_elems);
            all.extend(b.kv_read(&st.comp, seq.slot * l.comp_elems, l.comp_carry_elems));
            return kernels::kv_checksum::kv_checksum(&all);
        }
        let rings = b.kv_sums(&st.rings, &[SumRange::whole(seq.slot * l.ring_elems, l.ring_elems)])[0];
        let carry = b.kv_sums(
            &st.comp,
            &[SumRange {
                offset: seq.slot * l.comp_elems,
                elems: l.comp_carry_elems,
                first_word: ring_bytes as u64 / 8,
            }],
        )[0];
        finish(rings.wrapping_add(carry), ring_bytes + carry_bytes)
    }

    /// A copy of `seq`'s bytes read from the engine's own memory (test hooks and dumps
    /// of device engines, whose KV is not host memory).
    pub fn read_sequence(&self, seq: &Sequence, tokens: usize) -> OwnedSeqBytes {
        let (b, l, st) = (&self.model.backend, &self.cache.layout, &self.cache.state);
        let used = tokens.div_ceil(l.block).min(seq.pages.len());
        OwnedSeqBytes {
            pages: seq.pages[..used]
                .iter()
                .map(|&p| b.kv_read(&st.pages, p as usize * l.page_elems, l.page_elems))
                .collect(),
            rings: b.kv_read(&st.rings, seq.slot * l.ring_elems, l.ring_elems),
            comp: b.kv_read(&st.comp, seq.slot * l.comp_elems, l.comp_elems),
        }
    }
}

/// A sequence's bytes copied out of an engine.
pub struct OwnedSeqBytes {
    pub pages: Vec<Vec<u8>>,
    pub rings: Vec<u8>,
    pub comp: Vec<u8>,
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use kernels::{CpuBackend, EntryDtype};

    use crate::{EngineOptions, Logits};

    #[test]
    fn checksums_of_own_memory_match_those_of_the_bytes_and_snapshots_join_two_pieces() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/tiny-official/model");
        let opts = EngineOptions { kv_dtype: EntryDtype::Bf16, max_pages: 8, max_sequences: 2, max_chunk_tokens: 512 };
        let mut e = crate::Engine::load(&dir, CpuBackend::new(), opts).unwrap();
        let mut seq = e.open_sequence().unwrap();
        let tokens: Vec<u32> = (0..300).map(|i| (i * 7 % 150) as u32).collect();
        e.prefill(&mut seq, &tokens, Logits::None).unwrap();
        let sums = e.own_checksums(&seq, tokens.len());
        let bytes = e.read_sequence(&seq, tokens.len());
        use kernels::kv_checksum::kv_checksum;
        assert_eq!(sums.pages, bytes.pages.iter().map(|p| kv_checksum(p)).collect::<Vec<_>>());
        assert_eq!((sums.rings, sums.comp), (kv_checksum(&bytes.rings), kv_checksum(&bytes.comp)));
        assert_eq!(e.transport_checksums(&seq, tokens.len()), sums, "host memory: the same bytes");
        let l = &e.cache.layout;
        let mut snapshot = bytes.rings.clone();
        snapshot.extend_from_slice(&bytes.comp[..l.comp_carry_elems * 4]);
        assert_eq!(e.own_snapshot_checksum(&seq), kv_checksum(&snapshot));
        assert!(e.device_kv().is_none() && e.sequence_device_ranges(&seq, 300).is_none(), "host memory");
        assert!(e.set_direct(None).is_err(), "a CPU engine has nothing to reach in place");
    }
}
