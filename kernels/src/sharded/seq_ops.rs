//! The ops that read and write KV: each device runs its sequences (with their local
//! slot and page ids) over its own part of the pools.

use std::sync::Arc;

use super::Sharded;
use super::buf::{ShardBuf, ShardIdx};
use super::ops::prepare;
use super::split::StepSplit;
use crate::backend::{AttentionIo, Backend, CompressorParams, KvView, KvViewMut, OutputProjection, Selection};
use crate::kv_layout::{Branch, KvLayout};
use crate::plan::BatchPlan;
use crate::rope::RopeTable;

/// Device `r`'s KV regions.
fn view<'a, B: Backend>(kv: &'a KvView<'_, Sharded<B>>, r: usize) -> KvView<'a, B> {
    KvView { pages: &kv.pages.parts[r], rings: &kv.rings.parts[r], comp: &kv.comp.parts[r] }
}

fn view_mut<'a, B: Backend>(kv: &'a mut KvViewMut<'_, Sharded<B>>, r: usize) -> KvViewMut<'a, B> {
    KvViewMut { pages: &mut kv.pages.parts[r], rings: &mut kv.rings.parts[r], comp: &mut kv.comp.parts[r] }
}

/// The step's split, checked against the rows `x` holds.
fn step<B: Backend>(s: &Sharded<B>, plan: &BatchPlan, x: &ShardBuf<B>) -> Arc<StepSplit> {
    let step = s.split(plan);
    let (split, _) = x.rows_at(plan.rows());
    assert!(
        Arc::ptr_eq(&split, &step.rows) || *split == *step.rows,
        "a sharded KV op got rows laid out differently from its plan"
    );
    step
}

#[allow(clippy::too_many_arguments)]
pub(super) fn compress<B: Backend>(
    s: &Sharded<B>,
    kv: &mut KvViewMut<'_, Sharded<B>>,
    layout: &KvLayout,
    layer: usize,
    branch: Branch,
    plan: &BatchPlan,
    proj_kv: &ShardBuf<B>,
    proj_score: &ShardBuf<B>,
    p: &CompressorParams<'_, Sharded<B>>,
) {
    let step = step(s, plan, proj_kv);
    let (kvp, sp) = (proj_kv.rows().1, proj_score.rows().1);
    for (r, b) in s.ranks.iter().enumerate() {
        if step.plans[r].seqs.is_empty() {
            continue;
        }
        let pr = CompressorParams { ape: p.ape.on(r), norm: p.norm.on(r), eps: p.eps, rope: p.rope };
        b.compress(&mut view_mut(kv, r), layout, layer, branch, &step.plans[r], &kvp[r], &sp[r], &pr);
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn index_topk<B: Backend>(
    s: &Sharded<B>,
    kv: &KvView<'_, Sharded<B>>,
    layout: &KvLayout,
    layer: usize,
    plan: &BatchPlan,
    q: &ShardBuf<B>,
    weights: &ShardBuf<B>,
    heads: usize,
    top_k: usize,
) -> Selection<Sharded<B>> {
    let step = step(s, plan, q);
    let (qp, wp) = (q.rows().1, weights.rows().1);
    let parts = s
        .ranks
        .iter()
        .enumerate()
        .map(|(r, b)| {
            (!step.plans[r].seqs.is_empty())
                .then(|| b.index_topk(&view(kv, r), layout, layer, &step.plans[r], &qp[r], &wp[r], heads, top_k))
        })
        .collect();
    Selection { indices: ShardIdx { split: step.rows.clone(), parts }, top_k }
}

/// [`Backend::indexer_select`](crate::backend::Backend::indexer_select) on every device
/// holding rows (with its rows' positions), so a device that folds the query's rotation
/// and the weights' scale into its scoring (CUDA) does here too.
#[allow(clippy::too_many_arguments)]
pub(super) fn indexer_select<B: Backend>(
    s: &Sharded<B>,
    kv: &KvView<'_, Sharded<B>>,
    layout: &KvLayout,
    layer: usize,
    plan: &BatchPlan,
    q: &mut ShardBuf<B>,
    weights: &mut ShardBuf<B>,
    heads: usize,
    top_k: usize,
    rope: &RopeTable,
    weight_scale: f32,
) -> Selection<Sharded<B>> {
    let step = step(s, plan, q);
    let (_, qp) = q.rows_mut();
    let (_, wp) = weights.rows_mut();
    let parts = s
        .ranks
        .iter()
        .zip(qp.iter_mut().zip(wp.iter_mut()))
        .enumerate()
        .map(|(r, (b, (qr, wr)))| {
            (!step.plans[r].seqs.is_empty()).then(|| {
                let local = &step.plans[r];
                b.indexer_select(&view(kv, r), layout, layer, local, qr, wr, heads, top_k, rope, weight_scale)
            })
        })
        .collect();
    Selection { indices: ShardIdx { split: step.rows.clone(), parts }, top_k }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn attention<B: Backend>(
    s: &Sharded<B>,
    kv: &KvView<'_, Sharded<B>>,
    layout: &KvLayout,
    layer: usize,
    plan: &BatchPlan,
    q: &ShardBuf<B>,
    new_kv: &ShardBuf<B>,
    selected: Option<&Selection<Sharded<B>>>,
    sinks: &ShardBuf<B>,
    heads: usize,
    scale: f32,
    out: &mut ShardBuf<B>,
) {
    let step = step(s, plan, q);
    let (qp, kp) = (q.rows().1, new_kv.rows().1);
    each_rank(s, kv, &step, selected, out, |r, b, v, p, sel, o| {
        b.attention(v, layout, layer, p, &qp[r], &kp[r], sel, sinks.on(r), heads, scale, o)
    });
}

/// `Backend::attention_projected`: each device's share through its own (so a GPU that
/// keeps the output in bf16 for `wo_a` does so for its rows).
pub(super) fn attention_projected<B: Backend>(
    s: &Sharded<B>,
    kv: &KvView<'_, Sharded<B>>,
    (layout, layer, plan): (&KvLayout, usize, &BatchPlan),
    io: AttentionIo<'_, Sharded<B>>,
    proj: &OutputProjection<'_, Sharded<B>>,
    out: &mut ShardBuf<B>,
) {
    let AttentionIo { q, new_kv, selected, sinks, heads, scale, prep } = io;
    let step = step(s, plan, q);
    let (qp, kp) = (q.rows_mut().1, new_kv.rows().1);
    each_rank(s, kv, &step, selected, out, |r, b, v, p, sel, o| {
        let io = AttentionIo { q: &mut qp[r], new_kv: &kp[r], selected: sel, sinks: sinks.on(r), heads, scale, prep };
        let (wo_a, wo_b) = (proj.wo_a.on(r), proj.wo_b.on(r));
        let proj = OutputProjection { rope: proj.rope, groups: proj.groups, wo_a, wo_b };
        b.attention_projected(v, layout, layer, p, io, &proj, o)
    });
}

/// `f(rank, backend, its view, its plan, its selection, its output)` for every device
/// that holds rows of the step, the output's parts laid out first.
fn each_rank<B: Backend>(
    s: &Sharded<B>,
    kv: &KvView<'_, Sharded<B>>,
    step: &StepSplit,
    selected: Option<&Selection<Sharded<B>>>,
    out: &mut ShardBuf<B>,
    mut f: impl FnMut(usize, &B, &KvView<'_, B>, &BatchPlan, Option<&Selection<B>>, &mut B::Buf),
) {
    prepare(s, out, &step.rows);
    let (_, outs) = out.rows_mut();
    for (r, (b, o)) in s.ranks.iter().zip(outs.iter_mut()).enumerate() {
        if step.plans[r].seqs.is_empty() {
            continue;
        }
        let sel =
            selected.map(|sel| sel.indices.parts[r].as_ref().expect("a selection for every device that holds rows"));
        f(r, b, &view(kv, r), &step.plans[r], sel, o);
    }
}

/// Whether any device's share of the batch folds a raw query's prep into its attention
/// (the others prep their share first: its `attention_projected`, `attention_of_raw_query`).
pub(super) fn attention_preps_query<B: Backend>(
    s: &Sharded<B>,
    layout: &KvLayout,
    layer: usize,
    plan: &BatchPlan,
    heads: usize,
) -> bool {
    let step = s.split(plan);
    s.ranks.iter().zip(&step.plans).any(|(b, p)| !p.seqs.is_empty() && b.attention_preps_query(layout, layer, p, heads))
}

pub(super) fn store_window<B: Backend>(
    s: &Sharded<B>,
    kv: &mut KvViewMut<'_, Sharded<B>>,
    layout: &KvLayout,
    layer: usize,
    plan: &BatchPlan,
    new_kv: &ShardBuf<B>,
) {
    let step = step(s, plan, new_kv);
    let kp = new_kv.rows().1;
    for (r, b) in s.ranks.iter().enumerate() {
        if !step.plans[r].seqs.is_empty() {
            b.store_window(&mut view_mut(kv, r), layout, layer, &step.plans[r], &kp[r]);
        }
    }
}
