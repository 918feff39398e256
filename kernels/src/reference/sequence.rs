//! Sequence-level reference math over whole token histories: compressed entries,
//! indexer selection and attention of one query row.

use super::{rms_norm, rope};
use crate::rope::RopeTable;

/// Every complete compressed entry of one compressor branch.
///
/// `kv` and `score` are the raw projections of all tokens so far (`[T, width]`,
/// scores without the position bias); `ape` is `[ratio, width]`. With `overlap` (CSA)
/// each token's first `width/2` values feed the next window's entry and the second half
/// its own window's entry.
#[allow(clippy::too_many_arguments)]
pub fn compressed_entries(
    kv: &[f32],
    score: &[f32],
    width: usize,
    ape: &[f32],
    ratio: usize,
    overlap: bool,
    norm: &[f32],
    eps: f32,
    table: &RopeTable,
) -> Vec<Vec<f32>> {
    let tokens = kv.len() / width;
    let dim = if overlap { width / 2 } else { width };
    (0..tokens / ratio)
        .map(|i| {
            let mut sources: Vec<(usize, usize)> = Vec::new();
            if overlap && i > 0 {
                sources.extend((0..ratio).map(|u| (ratio * (i - 1) + u, 0)));
            }
            sources.extend((0..ratio).map(|u| (ratio * i + u, if overlap { dim } else { 0 })));
            let pooled: Vec<f32> = (0..dim)
                .map(|c| {
                    let logit = |&(t, off): &(usize, usize)| {
                        score[t * width + off + c] as f64 + ape[(t % ratio) * width + off + c] as f64
                    };
                    let m = sources.iter().map(logit).fold(f64::MIN, f64::max);
                    let z: f64 = sources.iter().map(|s| (logit(s) - m).exp()).sum();
                    sources.iter().map(|s| (logit(s) - m).exp() / z * kv[s.0 * width + s.1 + c] as f64).sum::<f64>()
                        as f32
                })
                .collect();
            let normed = rms_norm(&pooled, dim, Some(norm), eps);
            rope(&normed, 1, dim, &[(ratio * i) as u32], table, false)
        })
        .collect()
}

/// Indices (ascending) of the `top_k` best of the first `visible` indexer keys for one
/// query: score `Σ_h w_h · relu(q_h · k)`.
pub fn indexer_select(q: &[f32], weights: &[f32], keys: &[Vec<f32>], visible: usize, top_k: usize) -> Vec<usize> {
    let heads = weights.len();
    let dim = q.len() / heads;
    let mut scored: Vec<(f64, usize)> = keys[..visible]
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let s = (0..heads)
                .map(|h| {
                    let d: f64 = (0..dim).map(|c| q[h * dim + c] as f64 * k[c] as f64).sum();
                    weights[h] as f64 * d.max(0.0)
                })
                .sum();
            (s, i)
        })
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut best: Vec<usize> = scored.into_iter().take(top_k).map(|s| s.1).collect();
    best.sort_unstable();
    best
}

/// Attention of one query row (`q[heads, head_dim]`) over `keys` (which are also the
/// values), one softmax per head whose denominator includes `exp(sink_h)`.
pub fn attention_row(q: &[f32], keys: &[Vec<f32>], sinks: &[f32], scale: f32) -> Vec<f32> {
    let heads = sinks.len();
    let hd = q.len() / heads;
    let mut out = vec![0f32; heads * hd];
    for h in 0..heads {
        let qh = &q[h * hd..(h + 1) * hd];
        let logits: Vec<f64> = keys
            .iter()
            .map(|k| qh.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64)
            .collect();
        let m = logits.iter().copied().fold(sinks[h] as f64, f64::max);
        let den: f64 = logits.iter().map(|l| (l - m).exp()).sum::<f64>() + (sinks[h] as f64 - m).exp();
        for c in 0..hd {
            out[h * hd + c] =
                logits.iter().zip(keys).map(|(l, k)| (l - m).exp() / den * k[c] as f64).sum::<f64>() as f32;
        }
    }
    out
}
