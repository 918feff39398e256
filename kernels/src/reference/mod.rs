//! Slow, obviously-correct versions of every backend op, written straight from the
//! model's definition: f64 accumulation, whole token histories instead of rings and
//! pages, no parallelism. Backends are checked against these (kernels/tests/parity.rs);
//! nothing on a serving path calls them.

mod sequence;

pub use sequence::{attention_row, compressed_entries, indexer_select};

use crate::backend::HostMatrix;
use crate::rope::RopeTable;

/// `x[rows, w.cols] · wᵀ`.
pub fn matmul(x: &[f32], rows: usize, w: &HostMatrix) -> Vec<f32> {
    let mut out = vec![0f32; rows * w.rows];
    for r in 0..rows {
        for o in 0..w.rows {
            let mut acc = 0f64;
            for k in 0..w.cols {
                acc += x[r * w.cols + k] as f64 * w.data[o * w.cols + k] as f64;
            }
            out[r * w.rows + o] = acc as f32;
        }
    }
    out
}

/// Block-diagonal product, one group at a time.
pub fn grouped_matmul(x: &[f32], rows: usize, groups: usize, w: &HostMatrix) -> Vec<f32> {
    let g_in = w.cols;
    let g_out = w.rows / groups;
    let mut out = vec![0f32; rows * groups * g_out];
    for g in 0..groups {
        let wg = HostMatrix::new(g_out, g_in, w.data[g * g_out * g_in..(g + 1) * g_out * g_in].to_vec());
        let xg: Vec<f32> = (0..rows).flat_map(|r| x[r * groups * g_in + g * g_in..][..g_in].to_vec()).collect();
        let yg = matmul(&xg, rows, &wg);
        for r in 0..rows {
            out[r * groups * g_out + g * g_out..][..g_out].copy_from_slice(&yg[r * g_out..(r + 1) * g_out]);
        }
    }
    out
}

pub fn rms_norm(x: &[f32], dim: usize, weight: Option<&[f32]>, eps: f32) -> Vec<f32> {
    x.chunks(dim)
        .flat_map(|row| {
            let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            row.iter().enumerate().map(move |(i, &v)| (v as f64 * inv) as f32 * weight.map_or(1.0, |w| w[i]))
        })
        .collect()
}

/// RoPE as the reference writes it: `x·cos + rotate_half(x)·sin` on the trailing
/// rope slice, with `rotate_half` pairing `(2j, 2j+1)` → `(-x[2j+1], x[2j])`.
pub fn rope(x: &[f32], heads: usize, head_dim: usize, positions: &[u32], table: &RopeTable, inverse: bool) -> Vec<f32> {
    let rd = table.dims();
    let mut out = x.to_vec();
    for (r, &pos) in positions.iter().enumerate() {
        for h in 0..heads {
            let head = &mut out[(r * heads + h) * head_dim..(r * heads + h + 1) * head_dim];
            let rope = &mut head[head_dim - rd..];
            let orig = rope.to_vec();
            for i in 0..rd {
                let j = i / 2;
                let angle = (pos as f32 * table.inv_freq[j]) as f64;
                let (c, s) = (angle.cos() * table.attention_factor as f64, angle.sin() * table.attention_factor as f64);
                let s = if inverse { -s } else { s };
                let rotated_half = if i % 2 == 0 { -orig[i + 1] } else { orig[i - 1] };
                rope[i] = (orig[i] as f64 * c + rotated_half as f64 * s) as f32;
            }
        }
    }
    out
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// mHC mapping of one row: `(pre, post, comb)` from the flattened streams.
#[allow(clippy::too_many_arguments)]
pub fn hc_mapping(
    streams: &[f32],
    hc: usize,
    mix: &HostMatrix,
    base: &[f32],
    scale: [f32; 3],
    iters: usize,
    norm_eps: f32,
    hc_eps: f32,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let normed = rms_norm(streams, streams.len(), None, norm_eps);
    let m = matmul(&normed, 1, mix);
    let pre: Vec<f64> =
        (0..hc).map(|j| sigmoid(m[j] as f64 * scale[0] as f64 + base[j] as f64) + hc_eps as f64).collect();
    let post: Vec<f64> =
        (0..hc).map(|j| 2.0 * sigmoid(m[hc + j] as f64 * scale[1] as f64 + base[hc + j] as f64)).collect();
    let eps = hc_eps as f64;
    let mut c: Vec<f64> =
        (0..hc * hc).map(|i| m[2 * hc + i] as f64 * scale[2] as f64 + base[2 * hc + i] as f64).collect();
    for j in 0..hc {
        let row = &mut c[j * hc..(j + 1) * hc];
        let mx = row.iter().copied().fold(f64::MIN, f64::max);
        let z: f64 = row.iter().map(|v| (v - mx).exp()).sum();
        row.iter_mut().for_each(|v| *v = (*v - mx).exp() / z + eps);
    }
    for it in 0..iters {
        if it > 0 {
            for j in 0..hc {
                let s: f64 = c[j * hc..(j + 1) * hc].iter().sum::<f64>() + eps;
                c[j * hc..(j + 1) * hc].iter_mut().for_each(|v| *v /= s);
            }
        }
        for k in 0..hc {
            let s: f64 = (0..hc).map(|j| c[j * hc + k]).sum::<f64>() + eps;
            (0..hc).for_each(|j| c[j * hc + k] /= s);
        }
    }
    (pre, post, c)
}

/// `Σ_j w_j · streams[j]` of one row.
pub fn collapse(streams: &[f32], hc: usize, w: &[f64]) -> Vec<f32> {
    let d = streams.len() / hc;
    (0..d).map(|i| (0..hc).map(|j| w[j] * streams[j * d + i] as f64).sum::<f64>() as f32).collect()
}

/// `post[k]·out + Σ_j comb[j,k]·streams[j]` of one row.
pub fn expand(streams: &[f32], hc: usize, out: &[f32], post: &[f64], comb: &[f64]) -> Vec<f32> {
    let d = out.len();
    let mut next = vec![0f32; hc * d];
    for k in 0..hc {
        for i in 0..d {
            let mixed: f64 = (0..hc).map(|j| comb[j * hc + k] * streams[j * d + i] as f64).sum();
            next[k * d + i] = (post[k] * out[i] as f64 + mixed) as f32;
        }
    }
    next
}

/// Final collapse weights of one row.
pub fn hc_head_weights(
    streams: &[f32],
    hc: usize,
    mix: &HostMatrix,
    base: &[f32],
    scale: f32,
    norm_eps: f32,
    hc_eps: f32,
) -> Vec<f64> {
    let normed = rms_norm(streams, streams.len(), None, norm_eps);
    let m = matmul(&normed, 1, mix);
    (0..hc).map(|j| sigmoid(m[j] as f64 * scale as f64 + base[j] as f64) + hc_eps as f64).collect()
}

/// One SwiGLU expert on one row.
pub fn swiglu(x: &[f32], w1: &HostMatrix, w2: &HostMatrix, w3: &HostMatrix, limit: f32) -> Vec<f32> {
    let g = matmul(x, 1, w1);
    let u = matmul(x, 1, w3);
    let h: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&g, &u)| {
            let g = g.min(limit) as f64;
            (g / (1.0 + (-g).exp()) * u.clamp(-limit, limit) as f64) as f32
        })
        .collect();
    matmul(&h, 1, w2)
}

/// Router of one row: chosen experts (by hash table row, or top-k of score + bias) and
/// their normalised, scaled weights.
pub fn route(
    logits: &[f32],
    top_k: usize,
    bias: Option<&[f32]>,
    hash_row: Option<&[u32]>,
    route_scale: f32,
) -> Vec<(usize, f64)> {
    let scores: Vec<f64> = logits
        .iter()
        .map(|&l| {
            let l = l as f64;
            let sp = if l > 20.0 { l } else { l.exp().ln_1p() };
            sp.sqrt()
        })
        .collect();
    let chosen: Vec<usize> = match (hash_row, bias) {
        (Some(row), _) => row.iter().map(|&e| e as usize).collect(),
        (None, Some(bias)) => {
            let mut order: Vec<usize> = (0..scores.len()).collect();
            order.sort_by(|&a, &b| (scores[b] + bias[b] as f64).total_cmp(&(scores[a] + bias[a] as f64)));
            order.truncate(top_k);
            order
        }
        (None, None) => panic!("route needs a bias (top-k) or a hash row"),
    };
    let sum: f64 = chosen.iter().map(|&e| scores[e]).sum();
    chosen.into_iter().map(|e| (e, scores[e] / (sum + 1e-20) * route_scale as f64)).collect()
}
