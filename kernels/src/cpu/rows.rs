//! Row-wise ops: embedding gather, RMSNorm, RoPE, storage rounding.

use rayon::prelude::*;

use super::CpuMatrix;
use crate::kv_entry;
use crate::kv_layout::EntryFormat;
use crate::rope::{RopeTable, rotate_with};

/// Rows per rayon task for cheap per-row work.
const ROW_CHUNK: usize = 16;

pub(crate) fn embed(table: &CpuMatrix, tokens: &[u32], out: &mut [f32]) {
    let d = table.cols;
    assert_eq!(out.len(), tokens.len() * d);
    for (row, &t) in out.chunks_exact_mut(d).zip(tokens) {
        let t = t as usize;
        assert!(t < table.rows, "token id {t} outside the embedding table ({} rows)", table.rows);
        table.row_into(t, row);
    }
}

/// `x * rsqrt(mean(x²) + eps)`, times `weight` when given.
#[inline]
pub(crate) fn rms_norm_row(x: &mut [f32], weight: Option<&[f32]>, eps: f32) {
    let mut ss = 0f32;
    for v in x.iter() {
        ss += v * v;
    }
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    match weight {
        Some(w) => x.iter_mut().zip(w).for_each(|(v, w)| *v = w * (*v * inv)),
        None => x.iter_mut().for_each(|v| *v *= inv),
    }
}

pub(crate) fn rms_norm(x: &mut [f32], dim: usize, weight: Option<&[f32]>, eps: f32) {
    assert_eq!(x.len() % dim, 0, "rms_norm length not a multiple of {dim}");
    if let Some(w) = weight {
        assert_eq!(w.len(), dim, "rms_norm weight length");
    }
    x.par_chunks_mut(dim * ROW_CHUNK)
        .for_each(|chunk| chunk.chunks_exact_mut(dim).for_each(|row| rms_norm_row(row, weight, eps)));
}

pub(crate) fn rope(x: &mut [f32], heads: usize, head_dim: usize, positions: &[u32], table: &RopeTable, inverse: bool) {
    let width = heads * head_dim;
    assert_eq!(x.len(), positions.len() * width, "rope input is not [rows, heads, head_dim]");
    let rd = table.dims();
    assert!(rd <= head_dim, "rope dims {rd} exceed head_dim {head_dim}");
    x.par_chunks_mut(width).zip(positions.par_iter()).with_min_len(ROW_CHUNK).for_each(|(row, &pos)| {
        let (cos, sin) = table.angles(pos);
        for h in 0..heads {
            let head = &mut row[h * head_dim..(h + 1) * head_dim];
            rotate_with(&mut head[head_dim - rd..], &cos, &sin, inverse);
        }
    });
}

pub(crate) fn round_to(x: &mut [f32], fmt: &EntryFormat) {
    assert_eq!(x.len() % fmt.dim.max(1), 0, "round_to input is not [rows, {}]", fmt.dim);
    x.par_chunks_mut(fmt.dim.max(1) * ROW_CHUNK).for_each(|rows| kv_entry::round(fmt, rows));
}
