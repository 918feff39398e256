//! Manifold-constrained hyper-connections: the 4-stream residual's mixing around
//! every sub-block, and the final collapse.

use rayon::prelude::*;

use super::simd::axpy;
use super::{CpuBackend, matmul::matmul, rows::rms_norm};
use crate::backend::{HcHeadWeights, HcWeights};

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Mixing logits from the unweighted-RMS-normalised flattened streams.
fn mix_logits(streams: &[f32], rows: usize, width: usize, w: &super::CpuMatrix, eps: f32) -> Vec<f32> {
    let mut normed = streams.to_vec();
    rms_norm(&mut normed, width, None, eps);
    let mut mix = vec![0f32; rows * w.rows];
    matmul(&normed, rows, w, &mut mix);
    mix
}

/// Sinkhorn projection of one `hc × hc` logit matrix onto (nearly) doubly
/// stochastic matrices: row softmax + eps, column-normalise, then `iters - 1` rounds of
/// row- and column-normalisation.
pub(crate) fn sinkhorn(c: &mut [f32], hc: usize, iters: usize, eps: f32) {
    for j in 0..hc {
        let row = &mut c[j * hc..(j + 1) * hc];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut s = 0f32;
        for v in row.iter_mut() {
            *v = (*v - m).exp();
            s += *v;
        }
        row.iter_mut().for_each(|v| *v = *v / s + eps);
    }
    let normalise_cols = |c: &mut [f32]| {
        for k in 0..hc {
            let s: f32 = (0..hc).map(|j| c[j * hc + k]).sum::<f32>() + eps;
            (0..hc).for_each(|j| c[j * hc + k] /= s);
        }
    };
    normalise_cols(c);
    for _ in 1..iters {
        for j in 0..hc {
            let row = &mut c[j * hc..(j + 1) * hc];
            let s: f32 = row.iter().sum::<f32>() + eps;
            row.iter_mut().for_each(|v| *v /= s);
        }
        normalise_cols(c);
    }
}

pub(crate) fn hc_pre(
    streams: &[f32],
    rows: usize,
    w: &HcWeights<CpuBackend>,
    collapsed: &mut [f32],
    post: &mut [f32],
    comb: &mut [f32],
) {
    let (hc, d) = (w.hc, w.hidden);
    assert_eq!(streams.len(), rows * hc * d);
    let mix = mix_logits(streams, rows, hc * d, &w.mix, w.norm_eps);
    let mixn = (2 + hc) * hc;
    let [s_pre, s_post, s_comb] = w.scale;
    collapsed.par_chunks_mut(d).zip(post.par_chunks_mut(hc)).zip(comb.par_chunks_mut(hc * hc)).enumerate().for_each(
        |(r, ((col, post), comb))| {
            let m = &mix[r * mixn..(r + 1) * mixn];
            let mut pre = vec![0f32; hc];
            for j in 0..hc {
                pre[j] = sigmoid(m[j] * s_pre + w.base[j]) + w.hc_eps;
                post[j] = 2.0 * sigmoid(m[hc + j] * s_post + w.base[hc + j]);
            }
            for i in 0..hc * hc {
                comb[i] = m[2 * hc + i] * s_comb + w.base[2 * hc + i];
            }
            sinkhorn(comb, hc, w.sinkhorn_iters, w.hc_eps);
            let s = &streams[r * hc * d..(r + 1) * hc * d];
            col.fill(0.0);
            for (j, &p) in pre.iter().enumerate() {
                axpy(col, p, &s[j * d..(j + 1) * d]);
            }
        },
    );
}

pub(crate) fn hc_post(streams: &mut [f32], rows: usize, hc: usize, out: &[f32], post: &[f32], comb: &[f32]) {
    let d = out.len() / rows;
    assert_eq!(streams.len(), rows * hc * d);
    streams.par_chunks_mut(hc * d).enumerate().for_each(|(r, s)| {
        let old = s.to_vec();
        let o = &out[r * d..(r + 1) * d];
        let c = &comb[r * hc * hc..(r + 1) * hc * hc];
        for k in 0..hc {
            let p = post[r * hc + k];
            let dst = &mut s[k * d..(k + 1) * d];
            dst.iter_mut().zip(o).for_each(|(v, o)| *v = p * o);
            for j in 0..hc {
                axpy(dst, c[j * hc + k], &old[j * d..(j + 1) * d]);
            }
        }
    });
}

pub(crate) fn hc_head(streams: &[f32], rows: usize, w: &HcHeadWeights<CpuBackend>, out: &mut [f32]) {
    let (hc, d) = (w.hc, w.hidden);
    assert_eq!(streams.len(), rows * hc * d);
    let mix = mix_logits(streams, rows, hc * d, &w.mix, w.norm_eps);
    out.par_chunks_mut(d).enumerate().for_each(|(r, o)| {
        o.fill(0.0);
        let s = &streams[r * hc * d..(r + 1) * hc * d];
        for j in 0..hc {
            let p = sigmoid(mix[r * hc + j] * w.scale + w.base[j]) + w.hc_eps;
            axpy(o, p, &s[j * d..(j + 1) * d]);
        }
    });
}
