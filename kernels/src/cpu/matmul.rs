//! Matrix products. Weights are `[out, in]` row-major (torch `Linear`), so
//! `y = x · Wᵀ`. Many-row products go through the `gemm` crate (runtime-dispatched
//! SIMD, rayon threads); one- to three-row products (decode) are memory-bound dot
//! products over weight rows, split across threads by output block.

use gemm::{Parallelism, gemm};
use rayon::prelude::*;

use super::CpuMatrix;

/// Rows at or above which the blocked GEMM beats row-parallel dot products.
const GEMM_MIN_ROWS: usize = 4;
/// Output features per rayon task in the dot-product path.
const GEMV_BLOCK: usize = 32;

/// `out[rows, w.rows] = x[rows, w.cols] · wᵀ`, where `x`'s rows are `x_stride` apart
/// and `out`'s rows `out_stride` apart (so callers can address column blocks).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_strided(
    x: &[f32],
    x_stride: usize,
    rows: usize,
    w: &[f32],
    w_rows: usize,
    k: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    if rows == 0 || w_rows == 0 {
        return;
    }
    assert!(x.len() >= (rows - 1) * x_stride + k, "matmul input too short");
    assert!(out.len() >= (rows - 1) * out_stride + w_rows, "matmul output too short");
    assert!(w.len() >= w_rows * k, "matmul weight too short");
    if rows < GEMM_MIN_ROWS {
        gemv(x, x_stride, rows, w, w_rows, k, out, out_stride);
        return;
    }
    let threads = rayon::current_num_threads();
    let par = if threads > 1 && rows * w_rows * k > 1 << 16 { Parallelism::Rayon(threads) } else { Parallelism::None };
    // SAFETY: the asserts above bound every element gemm touches: lhs rows are
    // x_stride apart with k columns, rhs is wᵀ (k x w_rows, column stride k), dst rows
    // are out_stride apart with w_rows columns. Slices are distinct borrows.
    unsafe {
        gemm(
            rows,
            w_rows,
            k,
            out.as_mut_ptr(),
            1,
            out_stride as isize,
            false,
            x.as_ptr(),
            1,
            x_stride as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

#[allow(clippy::too_many_arguments)]
fn gemv(
    x: &[f32],
    x_stride: usize,
    rows: usize,
    w: &[f32],
    w_rows: usize,
    k: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let blocks: Vec<(usize, Vec<f32>)> = (0..w_rows.div_ceil(GEMV_BLOCK))
        .into_par_iter()
        .map(|b| {
            let lo = b * GEMV_BLOCK;
            let hi = (lo + GEMV_BLOCK).min(w_rows);
            let mut acc = vec![0f32; rows * (hi - lo)];
            for o in lo..hi {
                let wr = &w[o * k..(o + 1) * k];
                for r in 0..rows {
                    acc[r * (hi - lo) + (o - lo)] = dot(&x[r * x_stride..r * x_stride + k], wr);
                }
            }
            (lo, acc)
        })
        .collect();
    for (lo, acc) in blocks {
        let width = acc.len() / rows;
        for r in 0..rows {
            out[r * out_stride + lo..r * out_stride + lo + width].copy_from_slice(&acc[r * width..(r + 1) * width]);
        }
    }
}

/// Dot product with independent partial sums so the compiler can vectorise it.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let chunks = a.len() / 16;
    for c in 0..chunks {
        let (xa, xb) = (&a[c * 16..c * 16 + 16], &b[c * 16..c * 16 + 16]);
        for i in 0..16 {
            acc[i] += xa[i] * xb[i];
        }
    }
    let mut tail = 0f32;
    for i in chunks * 16..a.len() {
        tail += a[i] * b[i];
    }
    let mut s = 0f32;
    for v in acc {
        s += v;
    }
    s + tail
}

pub(crate) fn matmul(x: &[f32], rows: usize, w: &CpuMatrix, out: &mut [f32]) {
    assert_eq!(x.len(), rows * w.cols, "matmul input is not [rows, {}]", w.cols);
    assert_eq!(out.len(), rows * w.rows, "matmul output is not [rows, {}]", w.rows);
    matmul_strided(x, w.cols, rows, &w.data, w.rows, w.cols, out, w.rows);
}

pub(crate) fn grouped_matmul(x: &[f32], rows: usize, groups: usize, w: &CpuMatrix, out: &mut [f32]) {
    let g_in = w.cols;
    let g_out = w.rows / groups;
    assert_eq!(w.rows % groups, 0, "grouped weight rows not divisible by groups");
    assert_eq!(x.len(), rows * groups * g_in);
    assert_eq!(out.len(), rows * groups * g_out);
    for g in 0..groups {
        matmul_strided(
            &x[g * g_in..],
            groups * g_in,
            rows,
            &w.data[g * g_out * g_in..(g + 1) * g_out * g_in],
            g_out,
            g_in,
            &mut out[g * g_out..],
            groups * g_out,
        );
    }
}
