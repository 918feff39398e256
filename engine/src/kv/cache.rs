//! The KV memory of one engine and the sequences that hold parts of it.

use kernels::{Backend, EntryDtype, KvLayout, KvState};

use super::pool::{PagePool, PoolError, SlotPool, pick_rank};

/// One sequence's share of the KV memory. Dropping it without [`KvCache::release`]
/// leaks its slot and pages, so it is not `Clone` and the engine owns releasing it.
#[derive(Debug, PartialEq, Eq)]
pub struct Sequence {
    pub(crate) slot: usize,
    pub(crate) pages: Vec<u32>,
    pub(crate) len: usize,
}

impl Sequence {
    /// Tokens already folded into the state.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Page ids in block order.
    pub fn pages(&self) -> &[u32] {
        &self.pages
    }

    pub fn slot(&self) -> usize {
        self.slot
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolStats {
    pub pages_total: usize,
    pub pages_used: usize,
    pub slots_total: usize,
    pub slots_used: usize,
}

pub struct KvCache<B: Backend> {
    pub layout: KvLayout,
    pub state: KvState<B>,
    /// Last-token logits per state slot (f32 × vocab), where a prefill worker leaves
    /// them for the decode worker that continues the sequence; absent otherwise.
    pub slot_logits: Option<B::Kv>,
    pages: PagePool,
    slots: SlotPool,
}

impl<B: Backend> KvCache<B> {
    /// Pools on `backend`'s memory, split between its devices (see
    /// [`kernels::Backend::ranks`]; both counts must be multiples of it).
    pub fn new(backend: &B, layout: KvLayout, max_pages: usize, max_sequences: usize) -> Self {
        let ranks = backend.ranks();
        let state = KvState {
            pages: backend.kv_alloc(max_pages * layout.page_elems, layout.dtype),
            rings: backend.kv_alloc(max_sequences * layout.ring_elems, layout.dtype),
            comp: backend.kv_alloc(max_sequences * layout.comp_elems, EntryDtype::F32),
        };
        KvCache {
            layout,
            state,
            slot_logits: None,
            pages: PagePool::split(max_pages, ranks),
            slots: SlotPool::split(max_sequences, ranks),
        }
    }

    /// Element counts of the three regions a state for these pools needs:
    /// `(pages, rings, comp)`; comp is always f32.
    pub fn region_elems(layout: &KvLayout, max_pages: usize, max_sequences: usize) -> (usize, usize, usize) {
        (max_pages * layout.page_elems, max_sequences * layout.ring_elems, max_sequences * layout.comp_elems)
    }

    /// Use memory the caller provided (e.g. regions a transport registered for remote
    /// writes), sized by [`Self::region_elems`].
    pub fn with_state(
        layout: KvLayout,
        state: KvState<B>,
        slot_logits: Option<B::Kv>,
        max_pages: usize,
        max_sequences: usize,
    ) -> Self {
        KvCache { layout, state, slot_logits, pages: PagePool::new(max_pages), slots: SlotPool::new(max_sequences) }
    }

    /// A new empty sequence (takes a state slot, on the device with the most free pages
    /// when the pools span several).
    pub fn open(&mut self) -> Result<Sequence, PoolError> {
        let rank = pick_rank(&self.pages, &self.slots)?;
        Ok(Sequence { slot: self.slots.alloc_on(rank)?, pages: Vec::new(), len: 0 })
    }

    /// Device holding a sequence's slot and pages (0 on one device).
    pub fn rank_of(&self, seq: &Sequence) -> usize {
        self.slots.rank_of(seq.slot)
    }

    /// Give a sequence enough pages to hold `len` tokens; nothing changes on failure.
    pub fn reserve(&mut self, seq: &mut Sequence, len: usize) -> Result<(), PoolError> {
        let need = len.div_ceil(self.layout.block).saturating_sub(seq.pages.len());
        if need > 0 {
            let rank = self.slots.rank_of(seq.slot);
            seq.pages.extend(self.pages.alloc_on(rank, need)?);
        }
        Ok(())
    }

    /// Return pages reserved beyond what `len` tokens need (undo of a failed step).
    pub fn trim(&mut self, seq: &mut Sequence, len: usize) {
        let keep = len.div_ceil(self.layout.block);
        if seq.pages.len() > keep {
            let extra = seq.pages.split_off(keep);
            self.pages.release(&extra);
        }
    }

    pub fn release(&mut self, seq: Sequence) {
        self.pages.release(&seq.pages);
        self.slots.release(seq.slot);
    }

    pub fn stats(&self) -> PoolStats {
        PoolStats {
            pages_total: self.pages.total(),
            pages_used: self.pages.used(),
            slots_total: self.slots.total(),
            slots_used: self.slots.used(),
        }
    }

    pub(crate) fn pool_mut(&mut self) -> (&mut PagePool, &mut SlotPool) {
        (&mut self.pages, &mut self.slots)
    }
}
