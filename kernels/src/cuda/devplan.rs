//! A batch plan in device memory. Every sequence-aware op of one forward step gets the
//! same `&BatchPlan`; uploading it once per step (not once per op and layer) keeps the
//! host-to-device copies off the decode step's critical path. The last plan is kept and
//! reused while ops are called with an equal plan.

use std::sync::{Arc, Mutex};

use super::arena::DevBuf;

use super::runtime::Gpu;
use crate::plan::BatchPlan;

/// Ints per sequence in `seqs` (must match SEQ_* in common.cuh).
pub(crate) const SEQ_STRIDE: usize = 8;

/// Ints per entry in a compressor work list (must match ENTRY_META in compress.cu).
pub(crate) const ENTRY_META: usize = 8;

/// Rows of a ring one fused store item writes (CS_STORE_ROWS in compress.cu).
const STORE_ROWS: usize = 8;

/// What one compressor call does for a batch: the entries it completes and, where no
/// entry reads a ring, the ring writes the same kernel can do.
#[derive(Clone)]
pub(crate) struct CompressorWork {
    /// ENTRY_META ints per entry.
    pub entries: Arc<DevBuf<i32>>,
    pub n_entries: usize,
    /// `(sequence, first ring row)` per store item of CS_STORE_ROWS rows; `None` when
    /// some entry reads its sequence's ring, so the ring is written by a later launch.
    pub stores: Option<(Arc<DevBuf<i32>>, usize)>,
}

/// Compressor geometry a work list depends on: ratio, entries per page, whether windows
/// overlap (CSA), ring slots.
pub(crate) type CompressorKey = (usize, usize, bool, usize);

pub(crate) struct DevPlan {
    host: BatchPlan,
    pub positions: DevBuf<u32>,
    pub row_seq: DevBuf<i32>,
    pub seqs: DevBuf<i32>,
    pub pages: DevBuf<u32>,
    /// Compressor work per geometry.
    work: Mutex<Vec<(CompressorKey, CompressorWork)>>,
}

impl DevPlan {
    fn upload(gpu: &Gpu, plan: &BatchPlan) -> Self {
        let mut seqs = Vec::with_capacity(plan.seqs.len() * SEQ_STRIDE);
        let mut pages = Vec::new();
        for s in &plan.seqs {
            seqs.extend_from_slice(&[
                s.first_row as i32,
                s.rows as i32,
                s.start_pos as i32,
                s.slot as i32,
                pages.len() as i32,
                s.pages.len() as i32,
                s.pages_final_until as i32,
                0,
            ]);
            pages.extend_from_slice(&s.pages);
        }
        let row_seq: Vec<i32> = plan.row_owner().into_iter().map(|s| s as i32).collect();
        DevPlan {
            host: plan.clone(),
            positions: gpu.upload(&plan.positions),
            row_seq: gpu.upload(&row_seq),
            seqs: gpu.upload(&seqs),
            pages: gpu.upload(&pages),
            work: Mutex::new(Vec::new()),
        }
    }

    /// The compressor work of this batch for a layer of geometry `key`: per sequence,
    /// the entries whose window ends inside this step's rows and after
    /// `pages_final_until`, each as ENTRY_META ints (entry index i, row of the sequence's
    /// token 0 in this batch, first position of this batch, ring slot, page, three
    /// unused) so a kernel finds everything about an entry in one load; and the ring
    /// writes as store items when no entry reads a ring (its first source before the
    /// batch), so one launch does both.
    pub fn compressor_work(&self, gpu: &Gpu, key: CompressorKey) -> CompressorWork {
        let mut cache = self.work.lock().expect("plan cache poisoned");
        if let Some((_, w)) = cache.iter().find(|(k, _)| *k == key) {
            return w.clone();
        }
        let (ratio, per_page, overlap, slots) = key;
        let mut list = Vec::new();
        let mut reads_ring = false;
        for s in &self.host.seqs {
            let lo = (s.start_pos / ratio).max(s.pages_final_until / ratio);
            let hi = s.end_pos() / ratio;
            let row0 = i32::try_from(s.first_row as i64 - s.start_pos as i64).expect("batch rows fit i32");
            for i in lo..hi {
                let first_source = if overlap && i > 0 { ratio * (i - 1) } else { ratio * i };
                reads_ring |= first_source < s.start_pos;
                let page = s.pages[i / per_page] as i32;
                list.extend_from_slice(&[i as i32, row0, s.start_pos as i32, s.slot as i32, page, 0, 0, 0]);
            }
        }
        let stores = (!reads_ring).then(|| {
            let mut items = Vec::new();
            for (si, s) in self.host.seqs.iter().enumerate() {
                let kept = s.rows.min(slots);
                for k0 in (slots - kept..slots).step_by(STORE_ROWS) {
                    items.extend_from_slice(&[si as i32, k0 as i32]);
                }
            }
            let n = items.len() / 2;
            (Arc::new(gpu.upload(&items)), n)
        });
        let work = CompressorWork { n_entries: list.len() / ENTRY_META, entries: Arc::new(gpu.upload(&list)), stores };
        cache.push((key, work.clone()));
        work
    }
}

/// The most recent plan's device copy.
#[derive(Default)]
pub(crate) struct PlanCache {
    last: Mutex<Option<Arc<DevPlan>>>,
}

impl PlanCache {
    /// Forget the cached plan (its buffers may be a finished step's arena pieces).
    pub fn clear(&self) {
        *self.last.lock().expect("plan cache poisoned") = None;
    }

    pub fn get(&self, gpu: &Gpu, plan: &BatchPlan) -> Arc<DevPlan> {
        let mut last = self.last.lock().expect("plan cache poisoned");
        if let Some(p) = last.as_ref()
            && p.host == *plan
        {
            return p.clone();
        }
        let p = Arc::new(DevPlan::upload(gpu, plan));
        *last = Some(p.clone());
        p
    }

    /// Device positions equal to `positions` if the cached plan has them (RoPE is called
    /// with the plan's positions), else `None`.
    pub fn positions_of(&self, positions: &[u32]) -> Option<Arc<DevPlan>> {
        let last = self.last.lock().expect("plan cache poisoned");
        last.as_ref().filter(|p| p.host.positions == positions).cloned()
    }
}
