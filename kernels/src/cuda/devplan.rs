//! A batch plan in device memory. Every sequence-aware op of one forward step gets the
//! same `&BatchPlan`; uploading it once per step (not once per op and layer) keeps the
//! host-to-device copies off the decode step's critical path. The last plan is kept and
//! reused while ops are called with an equal plan.

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaSlice;

use super::runtime::Gpu;
use crate::plan::BatchPlan;

/// Ints per sequence in `seqs` (must match SEQ_* in common.cuh).
pub(crate) const SEQ_STRIDE: usize = 8;

/// `(ratio, [(seq, entry)] flattened, count)`.
type EntryList = (usize, Arc<CudaSlice<i32>>, usize);

pub(crate) struct DevPlan {
    host: BatchPlan,
    pub positions: CudaSlice<u32>,
    pub row_seq: CudaSlice<i32>,
    pub seqs: CudaSlice<i32>,
    pub pages: CudaSlice<u32>,
    /// Compressor work lists per ratio.
    entries: Mutex<Vec<EntryList>>,
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
            entries: Mutex::new(Vec::new()),
        }
    }

    /// The compressed entries this batch completes for compressors of `ratio`: per
    /// sequence, entries whose window ends inside this step's rows and after
    /// `pages_final_until`, as `(seq, entry)` pairs.
    pub fn entries(&self, gpu: &Gpu, ratio: usize) -> (Arc<CudaSlice<i32>>, usize) {
        let mut cache = self.entries.lock().expect("plan cache poisoned");
        if let Some((_, e, n)) = cache.iter().find(|(r, _, _)| *r == ratio) {
            return (e.clone(), *n);
        }
        let mut list = Vec::new();
        for (si, s) in self.host.seqs.iter().enumerate() {
            let lo = (s.start_pos / ratio).max(s.pages_final_until / ratio);
            let hi = s.end_pos() / ratio;
            for i in lo..hi {
                list.extend_from_slice(&[si as i32, i as i32]);
            }
        }
        let n = list.len() / 2;
        let e = Arc::new(gpu.upload(&list));
        cache.push((ratio, e.clone(), n));
        (e, n)
    }
}

/// The most recent plan's device copy.
#[derive(Default)]
pub(crate) struct PlanCache {
    last: Mutex<Option<Arc<DevPlan>>>,
}

impl PlanCache {
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
