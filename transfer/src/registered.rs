//! Memory peers write into: an engine's KV pools allocated as UCX regions (so a
//! prefill worker can put pages into a decode worker's pool, and a kvstore can put
//! cached pages into a prefill worker's), and landing areas whose bytes are read back
//! after a peer's writes complete (a kvstore's put staging).
//!
//! The regions are handed to the CPU backend as adopted KV storage, which is how the
//! owner reads what landed; the protocol (a message sent after the writer's flush)
//! orders those reads after the writes.

use kernels::backend::Backend;
use kernels::cpu::CpuKv;
use kernels::{CpuBackend, EntryDtype, KvLayout, KvState};

use crate::TransferError;
use crate::receiver::{Receiver, RegisteredRegion};
use crate::target::RegionSpec;

/// An engine's KV memory in UCX regions, and how peers find each region.
pub struct RegisteredKv {
    pub state: KvState<CpuBackend>,
    /// f32 × vocab per state slot, when asked for (decode workers receive the prompt's
    /// last logits there).
    pub slot_logits: Option<CpuKv>,
    pub pages: RegionSpec,
    pub rings: RegionSpec,
    pub comp: RegionSpec,
    pub logits: Option<RegionSpec>,
}

impl RegisteredKv {
    /// Regions for `max_pages` pages and `max_sequences` state slots of `layout`, plus
    /// `logits_per_slot` f32 values per slot when given.
    pub fn allocate(
        receiver: &Receiver,
        layout: &KvLayout,
        max_pages: usize,
        max_sequences: usize,
        logits_per_slot: Option<usize>,
    ) -> Result<Self, TransferError> {
        let (pe, re, ce) =
            (max_pages * layout.page_elems, max_sequences * layout.ring_elems, max_sequences * layout.comp_elems);
        let size = layout.dtype.size();
        let b = CpuBackend::new();
        let adopt =
            |r: RegisteredRegion, elems: usize, dtype: EntryDtype| -> Result<(CpuKv, RegionSpec), TransferError> {
                let spec = r.spec.clone();
                let kv = b.kv_adopt(Box::new(r.region), elems, dtype).map_err(TransferError::Memory)?;
                Ok((kv, spec))
            };
        let (pages, pages_spec) = adopt(receiver.allocate(pe * size)?, pe, layout.dtype)?;
        let (rings, rings_spec) = adopt(receiver.allocate(re * size)?, re, layout.dtype)?;
        let (comp, comp_spec) = adopt(receiver.allocate(ce * 4)?, ce, EntryDtype::F32)?;
        let (slot_logits, logits) = match logits_per_slot {
            Some(vocab) => {
                let le = max_sequences * vocab;
                let (kv, spec) = adopt(receiver.allocate(le * 4)?, le, EntryDtype::F32)?;
                (Some(kv), Some(spec))
            }
            None => (None, None),
        };
        Ok(RegisteredKv {
            state: KvState { pages, rings, comp },
            slot_logits,
            pages: pages_spec,
            rings: rings_spec,
            comp: comp_spec,
            logits,
        })
    }
}

/// A region of `logits_per_slot` f32 values per state slot for `max_sequences` slots,
/// as adopted host storage: where prefill workers put a prompt's last logits when the
/// KV itself is reached in device memory (logits are sampled on the host).
pub fn allocate_logits(
    receiver: &Receiver,
    max_sequences: usize,
    logits_per_slot: usize,
) -> Result<(CpuKv, RegionSpec), TransferError> {
    let elems = max_sequences * logits_per_slot;
    let r = receiver.allocate(elems * 4)?;
    let spec = r.spec.clone();
    let kv = CpuBackend::new().kv_adopt(Box::new(r.region), elems, EntryDtype::F32).map_err(TransferError::Memory)?;
    Ok((kv, spec))
}

/// A region peers put bytes into, read back by its owner once they say the bytes are
/// there.
pub struct Landing {
    kv: CpuKv,
    pub spec: RegionSpec,
}

impl Landing {
    /// A landing area of at least `bytes` (rounded up to whole f32 elements).
    pub fn allocate(receiver: &Receiver, bytes: usize) -> Result<Self, TransferError> {
        let elems = bytes.div_ceil(4).max(1);
        let r = receiver.allocate(elems * 4)?;
        let spec = r.spec.clone();
        let kv =
            CpuBackend::new().kv_adopt(Box::new(r.region), elems, EntryDtype::F32).map_err(TransferError::Memory)?;
        Ok(Landing { kv, spec })
    }

    pub fn len(&self) -> usize {
        self.kv.bytes().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What landed in `offset..offset + len`. Call only after the writer said its
    /// writes are flushed; bytes still in flight are unspecified (check them).
    pub fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        &self.kv.bytes()[offset..offset + len]
    }
}
