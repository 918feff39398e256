//! The KV compressors. Each raw token's projections (`kv`, and `score` with the learned
//! position bias added) go into a small per-sequence ring; when a window of `ratio`
//! tokens completes, the entry is the per-channel softmax(score)-weighted sum of the
//! window's kv, RMS-normalised and roped at position `ratio · i`.
//!
//! CSA compressors overlap: each token carries two series, the first half feeding the
//! *next* window's entry and the second half the *current* one, so entry `i` mixes
//! window `i-1`'s first halves with window `i`'s second halves (entry 0 has no previous
//! window). The ring therefore holds two windows for CSA and one for HCA.

use super::{CpuBackend, CpuKv, rows::rms_norm_row};
use crate::backend::{CompressorParams, KvViewMut};
use crate::kv_layout::{AttnKind, Branch, KvLayout};
use crate::plan::BatchPlan;
use crate::rope::rotate;

#[allow(clippy::too_many_arguments)]
pub(crate) fn compress(
    kv: &mut KvViewMut<'_, CpuBackend>,
    layout: &KvLayout,
    layer: usize,
    branch: Branch,
    plan: &BatchPlan,
    proj_kv: &[f32],
    proj_score: &[f32],
    p: &CompressorParams<'_, CpuBackend>,
) {
    let lk = &layout.layers[layer];
    assert_ne!(lk.kind(), AttnKind::Window, "layer {layer} has no compressor");
    let ratio = lk.spec.ratio;
    let width = lk.comp_width(branch);
    let slots = lk.comp_slots();
    assert_eq!(proj_kv.len(), plan.rows() * width, "compressor kv projection width");
    assert_eq!(proj_score.len(), plan.rows() * width, "compressor score projection width");
    assert_eq!(p.ape.len(), ratio * width, "compressor position bias shape");

    let comp = kv.comp.f32s_mut();
    for seq in &plan.seqs {
        let base = seq.slot * layout.comp_elems + lk.comp_offset(branch);
        for j in 0..seq.rows {
            let t = seq.start_pos + j;
            let row = seq.first_row + j;
            let s = t % slots;
            let kv_dst = base + s * width;
            let sc_dst = base + (slots + s) * width;
            comp[kv_dst..kv_dst + width].copy_from_slice(&proj_kv[row * width..(row + 1) * width]);
            let bias = &p.ape[(t % ratio) * width..(t % ratio + 1) * width];
            for c in 0..width {
                comp[sc_dst + c] = proj_score[row * width + c] + bias[c];
            }
            if (t + 1) % ratio == 0 && t + 1 > seq.pages_final_until {
                let entry_idx = (t + 1) / ratio - 1;
                let entry = pool_window(&comp[base..base + 2 * slots * width], lk.kind(), ratio, width, entry_idx);
                write_entry(kv.pages, layout, layer, branch, &seq.pages, entry_idx, entry, p);
            }
        }
    }
}

/// Softmax-weighted sum over the window(s) of entry `i`, read from the ring.
fn pool_window(ring: &[f32], kind: AttnKind, ratio: usize, width: usize, i: usize) -> Vec<f32> {
    let slots = ring.len() / (2 * width);
    let (kv, score) = ring.split_at(slots * width);
    let overlap = kind == AttnKind::Csa;
    let dim = if overlap { width / 2 } else { width };
    // (slot, channel offset) of every token contributing to entry i.
    let mut sources: Vec<(usize, usize)> = Vec::with_capacity(2 * ratio);
    if overlap && i > 0 {
        sources.extend((0..ratio).map(|u| ((ratio * (i - 1) + u) % slots, 0)));
    }
    let cur_off = if overlap { dim } else { 0 };
    sources.extend((0..ratio).map(|u| ((ratio * i + u) % slots, cur_off)));

    let mut out = vec![0f32; dim];
    for (c, o) in out.iter_mut().enumerate() {
        let m = sources.iter().map(|&(s, off)| score[s * width + off + c]).fold(f32::NEG_INFINITY, f32::max);
        let (mut num, mut den) = (0f32, 0f32);
        for &(s, off) in &sources {
            let e = (score[s * width + off + c] - m).exp();
            den += e;
            num += e * kv[s * width + off + c];
        }
        *o = num / den;
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn write_entry(
    pages: &mut CpuKv,
    layout: &KvLayout,
    layer: usize,
    branch: Branch,
    page_table: &[u32],
    i: usize,
    mut entry: Vec<f32>,
    p: &CompressorParams<'_, CpuBackend>,
) {
    let lk = &layout.layers[layer];
    let dim = entry.len();
    let ratio = lk.spec.ratio;
    rms_norm_row(&mut entry, Some(p.norm), p.eps);
    let rd = p.rope.dims();
    rotate(&mut entry[dim - rd..], (ratio * i) as u32, p.rope, false);
    let per_page = lk.entries_per_page(layout.block);
    let page = *page_table
        .get(i / per_page)
        .unwrap_or_else(|| panic!("page table too short for compressed entry {i} of layer {layer}"))
        as usize;
    let offset = page * layout.page_elems + lk.page_offset(branch) + (i % per_page) * lk.stride(branch);
    pages.write_entry(offset, &lk.format(branch), &entry);
}
