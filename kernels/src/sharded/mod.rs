//! One backend over several devices of one process: the layout DeepSeek and SGLang run
//! V4 with. Attention is data-parallel (a sequence, its pages and its state slot live
//! on one device, which computes its rows), routed experts are partitioned across the
//! devices (expert parallelism), and everything else (dense projections, norms, mHC,
//! routers, the shared expert, embeddings, the head) is replicated.
//!
//! Each op runs on every device that holds rows of its input, in device order, from
//! the calling thread (device backends only enqueue work, so the devices run
//! concurrently). The MoE block is where devices meet: every device gathers the whole
//! batch's normed rows, runs the experts it holds on all of them (routing is
//! replicated, so every device picks the same experts), adds the shared expert on its
//! own rows, and a reduce-scatter sums each row's contributions back onto the device
//! that owns it ([`collective`]).
//!
//! Module map:
//! - `split`: pools divided between devices, a step's plan per device, row splits.
//! - `buf`: the buffer, weight, KV and selection types (one part per device).
//! - [`collective`]: the gather / reduce-scatter the MoE block needs, and a host
//!   implementation every backend can use; device backends bring faster ones.
//! - `ops`: the row-wise ops; `seq_ops`: the ops that read and write KV; `moe`: the
//!   expert-parallel MoE block; `params`: splitting parameter bundles between devices.

mod buf;
pub mod collective;
mod moe;
mod ops;
mod params;
mod seq_ops;
pub mod split;

use std::sync::{Arc, Mutex, OnceLock};

use crate::EntryDtype;
use crate::backend::{
    AttentionIo, Backend, CompressorParams, HcHeadWeights, HcWeights, HeadNormJob, HeadNormShared, HostPin, KvView,
    KvViewMut, MoeWeights, OutputProjection, Selection,
};
use crate::kv_layout::{Branch, EntryFormat, KvLayout};
use crate::plan::BatchPlan;
use crate::rope::RopeTable;
use crate::stored::WeightView;

pub use buf::{ShardBuf, ShardIdx, ShardKv, ShardWeight};
pub use collective::{Collective, HostCollective};
pub use split::{Pools, RowSplit, StepSplit};

/// Several devices as one [`Backend`] (see the module docs).
pub struct Sharded<B: Backend> {
    ranks: Vec<B>,
    comm: Box<dyn Collective<B>>,
    pools: OnceLock<Pools>,
    /// The last plan split (ops of a step share one plan).
    last: Mutex<Option<(BatchPlan, Arc<StepSplit>)>>,
}

impl<B: Backend> std::fmt::Debug for Sharded<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sharded({})", self.describe())
    }
}

impl<B: Backend> Sharded<B> {
    /// Devices `ranks` (at least one), exchanging rows through `comm`.
    pub fn new(ranks: Vec<B>, comm: Box<dyn Collective<B>>) -> Self {
        assert!(!ranks.is_empty(), "a sharded backend needs at least one device");
        Sharded { ranks, comm, pools: OnceLock::new(), last: Mutex::new(None) }
    }

    /// The devices, in rank order.
    pub fn devices(&self) -> &[B] {
        &self.ranks
    }

    /// What carries rows between devices.
    pub fn collective(&self) -> &'static str {
        self.comm.name()
    }

    /// The declared KV pools.
    pub fn pools(&self) -> Pools {
        *self.pools.get().expect("the engine declares its KV pools (set_kv_pools) before the first step")
    }

    /// Device of routed expert `e` of `n`: contiguous, balanced blocks in id order.
    pub fn expert_owner(&self, e: usize, n: usize) -> usize {
        e * self.ranks.len() / n
    }

    /// The per-device plans of `plan` (cached: a step's ops share its plan).
    fn split(&self, plan: &BatchPlan) -> Arc<StepSplit> {
        let mut last = self.last.lock().expect("plan split cache poisoned");
        if let Some((p, s)) = last.as_ref()
            && p == plan
        {
            return s.clone();
        }
        let s = Arc::new(split::split_plan(plan, &self.pools()).unwrap_or_else(|e| panic!("{e}")));
        *last = Some((plan.clone(), s.clone()));
        s
    }
}

impl<B: Backend> Backend for Sharded<B> {
    type Buf = ShardBuf<B>;
    type Weight = ShardWeight<B>;
    type Kv = ShardKv<B>;
    type Idx = ShardIdx<B>;
    type Hc = Vec<B::Hc>;
    type HcHead = Vec<B::HcHead>;
    type Moe = Vec<B::Moe>;

    fn describe(&self) -> String {
        let each: Vec<String> = self.ranks.iter().map(|b| b.describe()).collect();
        format!("{} devices [{}], rows exchanged by {}", self.ranks.len(), each.join("; "), self.comm.name())
    }

    /// Graphs are on when every rank replays them; refusals add up.
    fn graph_health(&self) -> Option<crate::GraphHealth> {
        let ranks: Vec<_> = self.ranks.iter().filter_map(|b| b.graph_health()).collect();
        (!ranks.is_empty()).then(|| crate::GraphHealth {
            on: ranks.iter().all(|h| h.on),
            refused: ranks.iter().map(|h| h.refused).sum(),
        })
    }

    fn enter<R: Send, F: FnOnce() -> R + Send>(&self, f: F) -> R {
        self.ranks[0].enter(f)
    }

    fn zeros(&self, len: usize) -> ShardBuf<B> {
        ShardBuf::Pending { len }
    }

    fn upload(&self, data: &[f32]) -> ShardBuf<B> {
        ShardBuf::Replicated { len: data.len(), parts: self.ranks.iter().map(|b| b.upload(data)).collect() }
    }

    fn download(&self, buf: &ShardBuf<B>) -> Vec<f32> {
        ops::download(self, buf)
    }

    fn download_parts(&self, buf: &ShardBuf<B>, lens: &[usize]) -> Vec<Vec<f32>> {
        ops::download_parts(self, buf, lens)
    }

    fn gather_rows(&self, src: &ShardBuf<B>, width: usize, rows: &[usize]) -> ShardBuf<B> {
        ops::gather_rows(self, src, width, rows)
    }

    fn greedy_rows(&self, logits: &ShardBuf<B>, rows: usize, vocab: usize) -> Vec<(u32, f32)> {
        ops::greedy_rows(self, logits, rows, vocab)
    }

    fn weight(&self, w: WeightView<'_>) -> ShardWeight<B> {
        ShardWeight::Replicated(self.ranks.iter().map(|b| b.weight(w.clone())).collect())
    }

    fn expert_weight(&self, w: WeightView<'_>, expert: usize, n_experts: usize) -> ShardWeight<B> {
        let rank = self.expert_owner(expert, n_experts);
        ShardWeight::Held { rank, weight: self.ranks[rank].expert_weight(w, expert, n_experts) }
    }

    fn hc_weights(&self, w: HcWeights<Self>) -> Vec<B::Hc> {
        params::hc(self, w)
    }

    fn hc_head_weights(&self, w: HcHeadWeights<Self>) -> Vec<B::HcHead> {
        params::hc_head(self, w)
    }

    fn moe_weights(&self, w: MoeWeights<Self>) -> Vec<B::Moe> {
        params::moe(self, w)
    }

    fn ranks(&self) -> usize {
        self.ranks.len()
    }

    fn set_kv_pools(&self, pages: usize, slots: usize) -> Result<(), String> {
        let pools = Pools::new(self.ranks.len(), pages, slots)?;
        match self.pools.get() {
            Some(p) if *p != pools => Err(format!("KV pools already declared as {p:?}")),
            _ => {
                let _ = self.pools.set(pools);
                Ok(())
            }
        }
    }

    fn finish_load(&self) {
        self.ranks.iter().for_each(|b| b.finish_load());
    }

    /// Every device records the step (a CUDA rank replays its segments as graphs; the
    /// exchanges between ranks end a segment on each: `cuda::collective`).
    fn begin_step(&self, plan: &BatchPlan) {
        self.ranks.iter().for_each(|b| b.begin_step(plan));
    }

    fn end_step(&self) {
        self.ranks.iter().for_each(|b| b.end_step());
    }

    fn weight_shape(&self, w: &ShardWeight<B>) -> (usize, usize) {
        self.ranks[0].weight_shape(w.any())
    }

    fn kv_alloc(&self, elems: usize, dtype: EntryDtype) -> ShardKv<B> {
        let n = self.ranks.len();
        assert!(elems.is_multiple_of(n), "KV storage of {elems} elements does not divide over {n} devices");
        let part_elems = elems / n;
        ShardKv { part_elems, dtype, parts: self.ranks.iter().map(|b| b.kv_alloc(part_elems, dtype)).collect() }
    }

    fn kv_read(&self, kv: &ShardKv<B>, offset: usize, elems: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(elems * kv.dtype.size());
        for (r, at, n) in kv.pieces(offset, elems) {
            out.extend(self.ranks[r].kv_read(&kv.parts[r], at, n));
        }
        out
    }

    fn kv_read_into(&self, kv: &ShardKv<B>, offset: usize, elems: usize, out: &mut [u8]) {
        let sz = kv.dtype.size();
        assert_eq!(out.len(), elems * sz, "kv_read_into buffer is not {elems} elements");
        let mut done = 0;
        for (r, at, n) in kv.pieces(offset, elems) {
            self.ranks[r].kv_read_into(&kv.parts[r], at, n, &mut out[done..done + n * sz]);
            done += n * sz;
        }
    }

    fn kv_write(&self, kv: &mut ShardKv<B>, offset: usize, bytes: &[u8]) {
        let sz = kv.dtype.size();
        assert_eq!(bytes.len() % sz, 0, "kv_write of a partial element");
        let mut done = 0;
        for (r, at, n) in kv.pieces(offset, bytes.len() / sz) {
            self.ranks[r].kv_write(&mut kv.parts[r], at, &bytes[done..done + n * sz]);
            done += n * sz;
        }
    }

    fn kv_fence(&self) {
        self.ranks.iter().for_each(|b| b.kv_fence());
    }

    fn kv_device_memory(&self, kv: &ShardKv<B>) -> Vec<Box<dyn crate::backend::DeviceMemory>> {
        self.ranks.iter().zip(&kv.parts).flat_map(|(b, part)| b.kv_device_memory(part)).collect()
    }

    fn kv_sums(&self, kv: &ShardKv<B>, ranges: &[crate::backend::SumRange]) -> Vec<u64> {
        // A sequence's pages and slot live on one device, so a range is one piece there:
        // that device sums it. A range across devices (none the engine asks for) is read.
        let mut out = vec![0u64; ranges.len()];
        let mut per_rank: Vec<(Vec<usize>, Vec<crate::backend::SumRange>)> =
            vec![(Vec::new(), Vec::new()); self.ranks.len()];
        for (i, r) in ranges.iter().enumerate() {
            match kv.pieces(r.offset, r.elems).as_slice() {
                [(rank, at, n)] => {
                    per_rank[*rank].0.push(i);
                    per_rank[*rank].1.push(crate::backend::SumRange {
                        offset: *at,
                        elems: *n,
                        first_word: r.first_word,
                    });
                }
                _ => {
                    out[i] = crate::kv_checksum::partial_sum(&self.kv_read(kv, r.offset, r.elems), r.first_word);
                }
            }
        }
        for (rank, (which, local)) in per_rank.into_iter().enumerate() {
            if which.is_empty() {
                continue;
            }
            for (i, sum) in which.into_iter().zip(self.ranks[rank].kv_sums(&kv.parts[rank], &local)) {
                out[i] = sum;
            }
        }
        out
    }

    fn synchronize(&self) {
        self.ranks.iter().for_each(|b| b.synchronize());
    }

    fn pin_host(&self, region: &[u8]) -> Option<Box<dyn HostPin>> {
        // Device backends pin host memory for every device of the process at once.
        self.ranks[0].pin_host(region)
    }

    fn buf_read(&self, buf: &ShardBuf<B>, offset: usize, len: usize) -> Vec<f32> {
        self.download(buf)[offset..offset + len].to_vec()
    }

    fn buf_write(&self, buf: &mut ShardBuf<B>, offset: usize, data: &[f32]) {
        ops::buf_write(self, buf, offset, data)
    }

    fn idx_download(&self, idx: &ShardIdx<B>) -> Vec<i32> {
        ops::idx_download(self, idx)
    }

    fn embed(&self, table: &ShardWeight<B>, plan: &BatchPlan, out: &mut ShardBuf<B>) {
        ops::embed(self, table, plan, out)
    }

    fn matmul(&self, x: &ShardBuf<B>, rows: usize, w: &ShardWeight<B>, out: &mut ShardBuf<B>) {
        ops::each_rows(self, x, rows, out, |r, b, xr, n, o| b.matmul(xr, n, w.on(r), o))
    }

    fn fork(&self) {
        self.ranks.iter().for_each(B::fork)
    }

    fn to_main(&self) {
        self.ranks.iter().for_each(B::to_main)
    }

    fn join(&self) {
        self.ranks.iter().for_each(B::join)
    }

    fn matmul_many(&self, x: &ShardBuf<B>, rows: usize, ws: &[&ShardWeight<B>], outs: &mut [&mut ShardBuf<B>]) {
        ops::each_rows_many(self, x, rows, outs, |r, b, xr, n, os| {
            b.matmul_many(xr, n, &ws.iter().map(|w| w.on(r)).collect::<Vec<_>>(), os)
        })
    }

    fn grouped_matmul(&self, x: &ShardBuf<B>, rows: usize, groups: usize, w: &ShardWeight<B>, out: &mut ShardBuf<B>) {
        ops::each_rows(self, x, rows, out, |r, b, xr, n, o| b.grouped_matmul(xr, n, groups, w.on(r), o))
    }

    fn rms_norm(&self, x: &mut ShardBuf<B>, dim: usize, weight: Option<&ShardBuf<B>>, eps: f32) {
        ops::each_in_place(self, x, |r, b, part| b.rms_norm(part, dim, weight.map(|w| w.on(r)), eps))
    }

    fn rope(
        &self,
        x: &mut ShardBuf<B>,
        heads: usize,
        head_dim: usize,
        positions: &[u32],
        rope: &RopeTable,
        inverse: bool,
    ) {
        let held = x.rows_at(positions.len()).0.held.clone();
        ops::each_in_place(self, x, |r, b, part| {
            let pos: Vec<u32> = held[r].iter().map(|&g| positions[g]).collect();
            b.rope(part, heads, head_dim, &pos, rope, inverse)
        })
    }

    fn scale(&self, x: &mut ShardBuf<B>, factor: f32) {
        ops::each_in_place(self, x, |_, b, part| b.scale(part, factor))
    }

    fn add_into(&self, acc: &mut ShardBuf<B>, x: &ShardBuf<B>) {
        let (split, parts) = x.rows();
        assert_eq!(split.held, acc.rows().0.held, "add_into of buffers split differently");
        ops::each_in_place(self, acc, |r, b, part| b.add_into(part, &parts[r]))
    }

    fn round_to(&self, x: &mut ShardBuf<B>, fmt: &EntryFormat) {
        ops::each_in_place(self, x, |_, b, part| b.round_to(part, fmt))
    }

    fn head_norm_rope(
        &self,
        x: &mut ShardBuf<B>,
        heads: usize,
        head_dim: usize,
        weight: Option<&ShardBuf<B>>,
        eps: f32,
        positions: &[u32],
        rope: &RopeTable,
        round: Option<&EntryFormat>,
    ) {
        let held = x.rows_at(positions.len()).0.held.clone();
        ops::each_in_place(self, x, |r, b, part| {
            let pos: Vec<u32> = held[r].iter().map(|&g| positions[g]).collect();
            b.head_norm_rope(part, heads, head_dim, weight.map(|w| w.on(r)), eps, &pos, rope, round)
        })
    }

    fn head_norm_rope2(
        &self,
        first: &mut HeadNormJob<'_, Self>,
        second: &mut HeadNormJob<'_, Self>,
        shared: &HeadNormShared<'_>,
    ) {
        ops::head_norm_rope2(self, first, second, shared)
    }

    fn hc_pre(
        &self,
        streams: &ShardBuf<B>,
        rows: usize,
        w: &Vec<B::Hc>,
        norm: Option<(&ShardBuf<B>, f32)>,
        collapsed: &mut ShardBuf<B>,
        post: &mut ShardBuf<B>,
        comb: &mut ShardBuf<B>,
    ) {
        ops::hc_pre(self, streams, rows, w, norm, collapsed, post, comb)
    }

    fn hc_post(
        &self,
        streams: &mut ShardBuf<B>,
        rows: usize,
        hc: usize,
        out: &ShardBuf<B>,
        post: &ShardBuf<B>,
        comb: &ShardBuf<B>,
    ) {
        let (split, o) = out.rows_at(rows);
        let (p, c) = (post.rows().1, comb.rows().1);
        ops::each_in_place(self, streams, |r, b, s| b.hc_post(s, split.count(r), hc, &o[r], &p[r], &c[r]))
    }

    fn hc_post_pre(
        &self,
        streams: &mut ShardBuf<B>,
        rows: usize,
        hc: usize,
        out: &ShardBuf<B>,
        w: &Vec<B::Hc>,
        norm: Option<(&ShardBuf<B>, f32)>,
        collapsed: &mut ShardBuf<B>,
        post: &mut ShardBuf<B>,
        comb: &mut ShardBuf<B>,
    ) {
        ops::hc_post_pre(self, streams, rows, hc, out, w, norm, collapsed, post, comb)
    }

    fn hc_head(&self, streams: &ShardBuf<B>, rows: usize, w: &Vec<B::HcHead>, out: &mut ShardBuf<B>) {
        ops::each_rows(self, streams, rows, out, |r, b, s, n, o| b.hc_head(s, n, &w[r], o))
    }

    fn moe(
        &self,
        x: &ShardBuf<B>,
        rows: usize,
        tokens: &[u32],
        w: &Vec<B::Moe>,
        shared_rows: std::ops::Range<usize>,
        out: &mut ShardBuf<B>,
    ) {
        assert_eq!(shared_rows, 0..rows, "a sharded MoE block takes the shared expert on every row");
        moe::moe(self, x, rows, tokens, w, out)
    }

    fn compress(
        &self,
        kv: &mut KvViewMut<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        branch: Branch,
        plan: &BatchPlan,
        proj_kv: &ShardBuf<B>,
        proj_score: &ShardBuf<B>,
        p: &CompressorParams<'_, Self>,
    ) {
        seq_ops::compress(self, kv, layout, layer, branch, plan, proj_kv, proj_score, p)
    }

    fn index_topk(
        &self,
        kv: &KvView<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        q: &ShardBuf<B>,
        weights: &ShardBuf<B>,
        heads: usize,
        top_k: usize,
    ) -> Selection<Self> {
        seq_ops::index_topk(self, kv, layout, layer, plan, q, weights, heads, top_k)
    }

    fn indexer_select(
        &self,
        kv: &KvView<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        q: &mut ShardBuf<B>,
        weights: &mut ShardBuf<B>,
        heads: usize,
        top_k: usize,
        rope: &RopeTable,
        weight_scale: f32,
    ) -> Selection<Self> {
        seq_ops::indexer_select(self, kv, layout, layer, plan, q, weights, heads, top_k, rope, weight_scale)
    }

    fn attention(
        &self,
        kv: &KvView<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        q: &ShardBuf<B>,
        new_kv: &ShardBuf<B>,
        selected: Option<&Selection<Self>>,
        sinks: &ShardBuf<B>,
        heads: usize,
        scale: f32,
        out: &mut ShardBuf<B>,
    ) {
        seq_ops::attention(self, kv, layout, layer, plan, q, new_kv, selected, sinks, heads, scale, out)
    }

    fn attention_projected(
        &self,
        kv: &KvView<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        io: AttentionIo<'_, Self>,
        proj: &OutputProjection<'_, Self>,
        out: &mut ShardBuf<B>,
    ) {
        seq_ops::attention_projected(self, kv, (layout, layer, plan), io, proj, out)
    }

    fn attention_preps_query(&self, layout: &KvLayout, layer: usize, plan: &BatchPlan, heads: usize) -> bool {
        seq_ops::attention_preps_query(self, layout, layer, plan, heads)
    }

    fn store_window(
        &self,
        kv: &mut KvViewMut<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        new_kv: &ShardBuf<B>,
    ) {
        seq_ops::store_window(self, kv, layout, layer, plan, new_kv)
    }
}
