//! Matrix products. Weights are `[out, in]` row-major (torch `Linear`), so
//! `y = x · Wᵀ`. Many-row products go through the `gemm` crate (runtime-dispatched
//! SIMD, rayon threads), bf16 weights widened block by block into a small buffer;
//! one- to three-row products (decode) are memory-bound dot products over weight
//! rows, split across threads by output block.

use gemm::{Parallelism, gemm};
use rayon::prelude::*;

use super::matrix::{CpuMatrix, WRef};

/// Rows at or above which the blocked GEMM beats row-parallel dot products.
const GEMM_MIN_ROWS: usize = 4;
/// Weight rows widened from bf16 at a time for the GEMM path (fits in L2).
const WIDEN_BLOCK: usize = 256;
/// Multiply-adds below which a product is not worth splitting across threads.
const PAR_MIN_MACS: usize = 1 << 15;

/// `out[rows, w_rows] = x[rows, k] · wᵀ`, where `x`'s rows are `x_stride` apart and
/// `out`'s rows `out_stride` apart (so callers can address column blocks).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_strided(
    x: &[f32],
    x_stride: usize,
    rows: usize,
    w: WRef<'_>,
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
        return gemv(x, x_stride, rows, w, w_rows, k, out, out_stride);
    }
    match w {
        WRef::F32(d) => gemm_f32(x, x_stride, rows, d, w_rows, k, out, out_stride),
        WRef::Bf16(_) => {
            let mut buf = vec![0f32; WIDEN_BLOCK.min(w_rows) * k];
            for lo in (0..w_rows).step_by(WIDEN_BLOCK) {
                let hi = (lo + WIDEN_BLOCK).min(w_rows);
                let WRef::Bf16(block) = w.rows(k, lo, hi) else { unreachable!() };
                let wide = &mut buf[..(hi - lo) * k];
                super::simd::widen_bf16(block, wide);
                gemm_f32(x, x_stride, rows, wide, hi - lo, k, &mut out[lo..], out_stride);
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn gemm_f32(
    x: &[f32],
    x_stride: usize,
    rows: usize,
    w: &[f32],
    w_rows: usize,
    k: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let threads = rayon::current_num_threads();
    let par =
        if threads > 1 && rows * w_rows * k >= PAR_MIN_MACS { Parallelism::Rayon(threads) } else { Parallelism::None };
    assert!(
        out.len() >= (rows - 1) * out_stride + w_rows && w.len() >= w_rows * k && x.len() >= (rows - 1) * x_stride + k
    );
    // SAFETY: the assert bounds every element gemm touches: lhs rows are x_stride apart
    // with k columns, rhs is wᵀ (k x w_rows, column stride k), dst rows are out_stride
    // apart with w_rows columns. The slices are distinct borrows.
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
    w: WRef<'_>,
    w_rows: usize,
    k: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let threads = rayon::current_num_threads();
    let serial = threads == 1 || rows * w_rows * k < PAR_MIN_MACS;
    let chunk = if serial { w_rows } else { (w_rows / (4 * threads)).max(16) };
    if rows == 1 {
        let row = &x[..k];
        let body = |(c, o): (usize, &mut [f32])| {
            for (j, v) in o.iter_mut().enumerate() {
                *v = w.row_dot(k, c * chunk + j, row);
            }
        };
        if serial {
            out[..w_rows].chunks_mut(chunk).enumerate().for_each(body);
        } else {
            out[..w_rows].par_chunks_mut(chunk).enumerate().for_each(body);
        }
        return;
    }
    let blocks: Vec<(usize, Vec<f32>)> = (0..w_rows.div_ceil(chunk))
        .into_par_iter()
        .map(|b| {
            let (lo, hi) = (b * chunk, ((b + 1) * chunk).min(w_rows));
            let mut acc = vec![0f32; rows * (hi - lo)];
            for o in lo..hi {
                for r in 0..rows {
                    acc[r * (hi - lo) + (o - lo)] = w.row_dot(k, o, &x[r * x_stride..r * x_stride + k]);
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

pub(crate) fn matmul(x: &[f32], rows: usize, w: &CpuMatrix, out: &mut [f32]) {
    assert_eq!(x.len(), rows * w.cols, "matmul input is not [rows, {}]", w.cols);
    assert_eq!(out.len(), rows * w.rows, "matmul output is not [rows, {}]", w.rows);
    matmul_strided(x, w.cols, rows, w.as_ref(), w.rows, w.cols, out, w.rows);
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
            w.as_ref().rows(g_in, g * g_out, (g + 1) * g_out),
            g_out,
            g_in,
            &mut out[g * g_out..],
            groups * g_out,
        );
    }
}
