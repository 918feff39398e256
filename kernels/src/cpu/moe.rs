//! Mixture-of-experts block: router scores `sqrt(softplus(W·x))`, expert choice by
//! hash table or biased top-k, normalised weights, SwiGLU experts with clamps, and
//! the shared expert.

use rayon::prelude::*;

use super::simd::axpy;
use super::{CpuBackend, CpuMatrix, matmul::matmul};
use crate::backend::{ExpertWeights, MoeWeights, Routing};

/// torch's softplus (beta 1, linear above 20).
#[inline]
pub(crate) fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

#[inline]
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Per row: chosen experts and their weights.
pub(crate) fn route(logits: &[f32], rows: usize, tokens: &[u32], w: &MoeWeights<CpuBackend>) -> (Vec<u32>, Vec<f32>) {
    let n_exp = logits.len() / rows;
    let k = w.top_k;
    let mut experts = vec![0u32; rows * k];
    let mut weights = vec![0f32; rows * k];
    for r in 0..rows {
        let scores: Vec<f32> = logits[r * n_exp..(r + 1) * n_exp].iter().map(|&l| softplus(l).sqrt()).collect();
        let chosen = &mut experts[r * k..(r + 1) * k];
        match &w.routing {
            Routing::Hash { tid2eid } => {
                let t = tokens[r] as usize;
                chosen.copy_from_slice(&tid2eid[t * k..(t + 1) * k]);
            }
            Routing::TopK { bias } => {
                let mut order: Vec<u32> = (0..n_exp as u32).collect();
                let key = |e: u32| scores[e as usize] + bias[e as usize];
                order.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
                chosen.copy_from_slice(&order[..k]);
            }
        }
        let sum: f32 = chosen.iter().map(|&e| scores[e as usize]).sum();
        for j in 0..k {
            weights[r * k + j] = scores[chosen[j] as usize] / (sum + 1e-20) * w.route_scale;
        }
    }
    (experts, weights)
}

/// `w2 · (silu(min(w1·x, limit)) * clamp(w3·x, -limit, limit))` on `x[rows, hidden]`.
pub(crate) fn swiglu(x: &[f32], rows: usize, e: &ExpertWeights<CpuBackend>, limit: f32) -> Vec<f32> {
    let inter = e.w1.rows;
    let mut gate = vec![0f32; rows * inter];
    let mut up = vec![0f32; rows * inter];
    matmul(x, rows, &e.w1, &mut gate);
    matmul(x, rows, &e.w3, &mut up);
    for (g, u) in gate.iter_mut().zip(&up) {
        *g = silu(g.min(limit)) * u.clamp(-limit, limit);
    }
    let mut y = vec![0f32; rows * e.w2.rows];
    matmul(&gate, rows, &e.w2, &mut y);
    y
}

fn gather_rows(x: &[f32], d: usize, rows: &[usize]) -> Vec<f32> {
    let mut g = Vec::with_capacity(rows.len() * d);
    for &r in rows {
        g.extend_from_slice(&x[r * d..(r + 1) * d]);
    }
    g
}

pub(crate) fn moe(
    x: &[f32],
    rows: usize,
    tokens: &[u32],
    w: &MoeWeights<CpuBackend>,
    shared_rows: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let gate: &CpuMatrix = &w.gate;
    let d = gate.cols;
    assert_eq!(x.len(), rows * d);
    assert_eq!(out.len(), rows * d);
    let mut logits = vec![0f32; rows * gate.rows];
    matmul(x, rows, gate, &mut logits);
    let (experts, weights) = route(&logits, rows, tokens, w);

    // Rows per expert this device holds, so each expert runs one product over all its
    // tokens; rows routed to experts held elsewhere get nothing from here.
    let held = w.expert_base..w.expert_base + w.experts.len();
    let mut assigned: Vec<Vec<(usize, f32)>> = vec![Vec::new(); w.experts.len()];
    for r in 0..rows {
        for j in 0..w.top_k {
            let e = experts[r * w.top_k + j] as usize;
            if held.contains(&e) {
                assigned[e - w.expert_base].push((r, weights[r * w.top_k + j]));
            }
        }
    }
    let results: Vec<(usize, Vec<f32>)> = assigned
        .par_iter()
        .enumerate()
        .filter(|(_, a)| !a.is_empty())
        .map(|(e, a)| {
            let idx: Vec<usize> = a.iter().map(|(r, _)| *r).collect();
            (e, swiglu(&gather_rows(x, d, &idx), idx.len(), &w.experts[e], w.swiglu_limit))
        })
        .collect();

    out.fill(0.0);
    // Accumulate in expert order so results do not depend on thread scheduling.
    for (e, y) in results {
        for (i, &(r, wt)) in assigned[e].iter().enumerate() {
            axpy(&mut out[r * d..(r + 1) * d], wt, &y[i * d..(i + 1) * d]);
        }
    }
    if let Some(shared) = &w.shared
        && !shared_rows.is_empty()
    {
        assert!(shared_rows.end <= rows, "shared rows {shared_rows:?} outside the batch's {rows}");
        let xs = &x[shared_rows.start * d..shared_rows.end * d];
        let y = swiglu(xs, shared_rows.len(), shared, w.swiglu_limit);
        let os = &mut out[shared_rows.start * d..shared_rows.end * d];
        os.iter_mut().zip(&y).for_each(|(o, v)| *o += v);
    }
}
