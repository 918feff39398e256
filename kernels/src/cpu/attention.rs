//! Attention over the sliding window plus compressed entries, the lightning indexer's
//! top-k selection, and window-ring updates.

use rayon::prelude::*;

use super::CpuBackend;
use super::simd::{axpy, dot};
use crate::backend::{KvView, KvViewMut, Selection};
use crate::kv_layout::{AttnKind, Branch, KvLayout};
use crate::plan::{BatchPlan, SeqSlice};

/// Compressed entries visible to the token at position `t`: entry i summarises tokens
/// up to `ratio·(i+1) - 1`.
#[inline]
pub(crate) fn visible_entries(t: usize, ratio: usize) -> usize {
    (t + 1) / ratio
}

/// Element offset of compressed entry `i` of a layer branch.
fn entry_offset(layout: &KvLayout, layer: usize, branch: Branch, pages: &[u32], i: usize) -> usize {
    let lk = &layout.layers[layer];
    let per_page = lk.entries_per_page(layout.block);
    let page = pages[i / per_page] as usize;
    page * layout.page_elems + lk.page_offset(branch) + (i % per_page) * lk.stride(branch)
}

/// Element offset of position `p`'s window entry in a slot's ring for a layer.
pub(crate) fn ring_offset(layout: &KvLayout, layer: usize, slot: usize, p: usize) -> usize {
    let lk = &layout.layers[layer];
    slot * layout.ring_elems + lk.ring + (p % layout.window) * lk.stride(Branch::Main)
}

/// Gather the keys row `t` of `seq` attends to, as `[n, head_dim]`.
fn gather_keys(
    kv: &KvView<'_, CpuBackend>,
    layout: &KvLayout,
    layer: usize,
    seq: &SeqSlice,
    t: usize,
    new_kv: &[f32],
    selected: Option<&[i32]>,
) -> Vec<f32> {
    let lk = &layout.layers[layer];
    let hd = lk.spec.head_dim;
    let window = layout.window;
    let first = (t + 1).saturating_sub(window);
    let mut keys = Vec::with_capacity((t + 1 - first) * hd);
    for p in first..=t {
        if p >= seq.start_pos {
            let row = seq.first_row + p - seq.start_pos;
            keys.extend_from_slice(&new_kv[row * hd..(row + 1) * hd]);
        } else {
            let n = keys.len();
            keys.resize(n + hd, 0.0);
            kv.rings.read_entry(ring_offset(layout, layer, seq.slot, p), &lk.main, &mut keys[n..]);
        }
    }
    let mut push_entry = |i: usize| {
        let n = keys.len();
        keys.resize(n + hd, 0.0);
        kv.pages.read_entry(entry_offset(layout, layer, Branch::Main, &seq.pages, i), &lk.main, &mut keys[n..]);
    };
    match (lk.kind(), selected) {
        (AttnKind::Window, _) => {}
        (AttnKind::Hca, _) => (0..visible_entries(t, lk.spec.ratio)).for_each(&mut push_entry),
        (AttnKind::Csa, Some(sel)) => sel.iter().filter(|&&i| i >= 0).for_each(|&i| push_entry(i as usize)),
        (AttnKind::Csa, None) => panic!("CSA layer {layer} attention needs the indexer's selection"),
    }
    keys
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    kv: &KvView<'_, CpuBackend>,
    layout: &KvLayout,
    layer: usize,
    plan: &BatchPlan,
    q: &[f32],
    new_kv: &[f32],
    selected: Option<&Selection<CpuBackend>>,
    sinks: &[f32],
    heads: usize,
    scale: f32,
    out: &mut [f32],
) {
    let hd = layout.layers[layer].spec.head_dim;
    let width = heads * hd;
    assert_eq!(q.len(), plan.rows() * width, "attention q is not [rows, heads, head_dim]");
    assert_eq!(new_kv.len(), plan.rows() * hd, "attention new_kv is not [rows, head_dim]");
    let owner = plan.row_owner();
    out.par_chunks_mut(width).enumerate().for_each(|(r, o)| {
        let seq = &plan.seqs[owner[r]];
        let t = plan.positions[r] as usize;
        let sel = selected.map(|s| &s.indices[r * s.top_k..(r + 1) * s.top_k]);
        let keys = gather_keys(kv, layout, layer, seq, t, new_kv, sel);
        let n = keys.len() / hd;
        o.par_chunks_mut(hd).enumerate().for_each(|(h, oh)| {
            let qh = &q[r * width + h * hd..r * width + (h + 1) * hd];
            let logits: Vec<f32> = (0..n).map(|j| dot(qh, &keys[j * hd..(j + 1) * hd]) * scale).collect();
            let m = logits.iter().copied().fold(sinks[h], f32::max);
            let weights: Vec<f32> = logits.iter().map(|l| (l - m).exp()).collect();
            let den = weights.iter().sum::<f32>() + (sinks[h] - m).exp();
            oh.fill(0.0);
            for (j, w) in weights.iter().enumerate() {
                axpy(oh, w / den, &keys[j * hd..(j + 1) * hd]);
            }
        });
    });
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn index_topk(
    kv: &KvView<'_, CpuBackend>,
    layout: &KvLayout,
    layer: usize,
    plan: &BatchPlan,
    q: &[f32],
    weights: &[f32],
    heads: usize,
    top_k: usize,
) -> Vec<i32> {
    let lk = &layout.layers[layer];
    assert_eq!(lk.kind(), AttnKind::Csa, "layer {layer} has no indexer");
    let dim = lk.spec.index_dim;
    let width = heads * dim;
    assert_eq!(q.len(), plan.rows() * width, "indexer q is not [rows, heads, index_dim]");
    assert_eq!(weights.len(), plan.rows() * heads, "indexer weights are not [rows, heads]");
    let owner = plan.row_owner();
    let mut indices = vec![-1i32; plan.rows() * top_k];
    indices.par_chunks_mut(top_k.max(1)).enumerate().for_each(|(r, sel)| {
        if top_k == 0 {
            return;
        }
        let seq = &plan.seqs[owner[r]];
        let n = visible_entries(plan.positions[r] as usize, lk.spec.ratio);
        if n <= top_k {
            sel.iter_mut().zip(0..n as i32).for_each(|(s, i)| *s = i);
            return;
        }
        let mut key = vec![0f32; dim];
        let mut scored: Vec<(f32, i32)> = (0..n)
            .map(|i| {
                kv.pages.read_entry(entry_offset(layout, layer, Branch::Indexer, &seq.pages, i), &lk.index, &mut key);
                let mut s = 0f32;
                for h in 0..heads {
                    let qh = &q[r * width + h * dim..r * width + (h + 1) * dim];
                    s += weights[r * heads + h] * dot(qh, &key).max(0.0);
                }
                (s, i as i32)
            })
            .collect();
        let by_score = |a: &(f32, i32), b: &(f32, i32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        scored.select_nth_unstable_by(top_k - 1, by_score);
        let mut best: Vec<i32> = scored[..top_k].iter().map(|s| s.1).collect();
        best.sort_unstable();
        sel.copy_from_slice(&best);
    });
    indices
}

pub(crate) fn store_window(
    kv: &mut KvViewMut<'_, CpuBackend>,
    layout: &KvLayout,
    layer: usize,
    plan: &BatchPlan,
    new_kv: &[f32],
) {
    let lk = &layout.layers[layer];
    let hd = lk.spec.head_dim;
    for seq in &plan.seqs {
        for j in seq.rows.saturating_sub(layout.window)..seq.rows {
            let p = seq.start_pos + j;
            let row = seq.first_row + j;
            kv.rings.write_entry(ring_offset(layout, layer, seq.slot, p), &lk.main, &new_kv[row * hd..(row + 1) * hd]);
        }
    }
}
