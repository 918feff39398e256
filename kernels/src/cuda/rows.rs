//! Row-wise ops on the GPU: embedding gather, row gather, RMSNorm, RoPE, scaling and
//! storage rounding.

use cudarc::driver::{DeviceRepr, LaunchConfig};

use super::CudaBackend;
use super::memory::{CudaBuf, CudaWeight, WeightData};
use super::runtime::{Gpu, cfg, cfg_elems, launch};
use crate::EntryDtype;
use crate::backend::{HeadNormJob, HeadNormShared};
use crate::kv_layout::{EntryFormat, FP8_SCALE_BLOCK};
use crate::rope::RopeTable;

/// Most rotated pairs a head may have (the kernel's by-value table).
pub(crate) const ROPE_MAX_PAIRS: usize = 64;

/// A [`RopeTable`] as the kernels take it, by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct RopeParams {
    inv_freq: [f32; ROPE_MAX_PAIRS],
    attention_factor: f32,
    pairs: i32,
}

// SAFETY: plain #[repr(C)] floats and ints, laid out as `struct RopeParams` in common.cuh.
unsafe impl DeviceRepr for RopeParams {}

impl RopeParams {
    pub(crate) fn new(t: &RopeTable) -> Self {
        let n = t.inv_freq.len();
        assert!(n <= ROPE_MAX_PAIRS, "RoPE over {} dims exceeds the CUDA kernels' {}", 2 * n, 2 * ROPE_MAX_PAIRS);
        let mut inv_freq = [0f32; ROPE_MAX_PAIRS];
        inv_freq[..n].copy_from_slice(&t.inv_freq);
        RopeParams { inv_freq, attention_factor: t.attention_factor, pairs: n as i32 }
    }

    /// No rotation (for kernels that rotate only when given positions).
    pub(crate) fn none() -> Self {
        RopeParams { inv_freq: [0.0; ROPE_MAX_PAIRS], attention_factor: 1.0, pairs: 0 }
    }
}

pub(crate) fn embed(b: &CudaBackend, table: &CudaWeight, tokens: &[u32], out: &mut CudaBuf) {
    let d = table.cols;
    assert_eq!(out.len, tokens.len() * d, "embed output is not [tokens, {d}]");
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= table.rows) {
        panic!("token id {t} outside the embedding table ({} rows)", table.rows);
    }
    if tokens.is_empty() {
        return;
    }
    let g = &b.gpu;
    let tok = g.upload(tokens);
    let (rows, cols) = (tokens.len() as i32, d as i32);
    let c = cfg_elems(tokens.len() * d);
    let (o, t) = (g.ptr(&out.mem), g.ptr(&tok));
    match &table.data {
        WeightData::F32(w) => launch!(g, "embed_f32", c, o, g.ptr(w), t, rows, cols),
        // Eight columns a thread where the rows allow 16-byte accesses.
        WeightData::Bf16(w) if let Some(v) = vector_rows_cfg(tokens.len(), d, 8, &[o, g.ptr(w)]) => {
            launch!(g, "embed_bf16_8", v, o, g.ptr(w), t, rows, cols)
        }
        WeightData::Bf16(w) => launch!(g, "embed_bf16", c, o, g.ptr(w), t, rows, cols),
        WeightData::Fp8 { codes, scales, .. } => {
            launch!(g, "embed_fp8", c, o, g.ptr(codes), g.ptr(scales), t, rows, cols)
        }
        WeightData::Fp4 { packed, scales, .. } => {
            launch!(g, "embed_fp4", c, o, g.ptr(packed), g.ptr(scales), t, rows, cols)
        }
    }
}

/// Each row's greedy token and log-probability, picked on the device (cu/readout.cu) into
/// a buffer of 2 values a row (token and log-probability as f32 bits), without waiting:
/// `Backend::greedy_rows_finish` reads 8 bytes a row back instead of the row.
pub(crate) fn greedy_rows_start(b: &CudaBackend, logits: &CudaBuf, rows: usize, vocab: usize) -> CudaBuf {
    assert_eq!(logits.len, rows * vocab, "greedy rows of a buffer that is not [rows, vocab]");
    assert!(rows > 0, "greedy picks of no rows");
    let out = b.alloc_buf(2 * rows);
    let g = &b.gpu;
    let (parts, span) = greedy_parts(vocab);
    // `GreedyPart` in readout.cu: f32 value, i32 index, f64 sum (16 bytes).
    let part_results = g.alloc::<u64>(2 * rows * parts);
    let (lp, pr) = (g.ptr(&logits.mem), g.ptr(&part_results));
    launch!(g, "greedy_parts", cfg((parts as u32, rows as u32, 1), 256, 0), lp, vocab as i32, span as i32, pr);
    launch!(g, "greedy_finish", cfg((rows as u32, 1, 1), 32, 0), lp, vocab as i32, pr, parts as i32, g.ptr(&out.mem));
    out
}

/// Parts a row of `vocab` logits is read in by `greedy_parts`, and the values each
/// covers: slices of at least 2,048 values (8 a thread) where the row has that many, at
/// most 64 parts (16 for a 32K vocabulary, 63 for V4's 129K).
fn greedy_parts(vocab: usize) -> (usize, usize) {
    const MIN_SPAN: usize = 2048;
    const MAX_PARTS: usize = 64;
    let parts = (vocab / MIN_SPAN).clamp(1, MAX_PARTS);
    (parts, vocab.div_ceil(parts))
}

/// `gather_rows`' kernel and launch shape for `rows` output rows of `width` values: four
/// values a thread (`gather_rows4`: a block's threads share a row, 16-byte accesses)
/// where `width` and the addresses allow it, else a value a thread.
/// `SLUICE_CUDA_GATHER4=0` (read once) keeps a value a thread, to compare.
fn gather_rows_launch(rows: usize, width: usize, addrs: [u64; 2]) -> (&'static str, LaunchConfig) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("SLUICE_CUDA_GATHER4").map_or(true, |v| v != "0"));
    match vector_rows_cfg(rows, width, 4, &addrs) {
        Some(c) if on => ("gather_rows4", c),
        _ => ("gather_rows", cfg_elems(rows * width)),
    }
}

/// `rows` rows of `width` f32 values of `src`, picked by the u32 list at `idx` (an entry
/// of 0xffffffff: a zero row), into `out` (dense), with [`gather_rows_launch`]'s kernel.
pub(crate) fn gather_rows_at(g: &Gpu, out: u64, src: u64, idx: u64, rows: usize, width: usize) {
    let (kernel, launch_cfg) = gather_rows_launch(rows, width, [out, src]);
    launch!(g, kernel, launch_cfg, out, src, idx, rows as i32, width as i32);
}

/// The launch of a kernel that gives each of `rows` rows of `width` values a block row
/// (256 threads a block, `per` values a thread in 16-byte accesses): None where `width`
/// is not a multiple of `per` or an address is not 16-byte aligned.
pub(crate) fn vector_rows_cfg(rows: usize, width: usize, per: usize, addrs: &[u64]) -> Option<LaunchConfig> {
    if !width.is_multiple_of(per) || !addrs.iter().all(|a| a.is_multiple_of(16)) {
        return None;
    }
    Some(cfg((rows.max(1) as u32, (width / per).div_ceil(256).max(1) as u32, 1), 256, 0))
}

pub(crate) fn gather_rows(b: &CudaBackend, src: &CudaBuf, width: usize, rows: &[usize]) -> CudaBuf {
    let g = &b.gpu;
    let out = b.alloc_buf(rows.len() * width);
    if rows.is_empty() || width == 0 {
        return out;
    }
    let n_src = src.len / width;
    assert!(rows.iter().all(|&r| r < n_src), "gather_rows index outside {n_src} rows");
    let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
    let idx = g.upload(&idx);
    gather_rows_at(g, g.ptr(&out.mem), g.ptr(&src.mem), g.ptr(&idx), rows.len(), width);
    out
}

pub(crate) fn rms_norm(b: &CudaBackend, x: &mut CudaBuf, dim: usize, weight: Option<&CudaBuf>, eps: f32) {
    assert!(dim > 0 && x.len.is_multiple_of(dim), "rms_norm length not a multiple of {dim}");
    if let Some(w) = weight {
        assert_eq!(w.len, dim, "rms_norm weight length");
    }
    let rows = x.len / dim;
    if rows == 0 {
        return;
    }
    let g = &b.gpu;
    // A decode batch's few long rows: a thread per 16-byte load of the row (up to 1,024),
    // so each block waits on one round of loads; otherwise as many rows as blocks.
    let threads = if rows < g.sms && dim.is_multiple_of(4) && dim >= 1024 {
        (dim / 4).next_multiple_of(32).min(1024) as u32
    } else if dim >= 1024 {
        256
    } else {
        128
    };
    let w = weight.map(|w| g.ptr(&w.mem)).unwrap_or(0);
    launch!(g, "rms_norm", cfg((rows as u32, 1, 1), threads, 0), g.ptr(&x.mem), w, dim as i32, eps);
}

/// Most 16-byte chunks a lane of `head_norm_rope` holds (`HNR_MAX_V` in rows.cu): heads
/// of up to 1,024 values.
const HNR_MAX_V: usize = 8;

/// Whether the row ops are fused where a kernel takes them together
/// (`SLUICE_CUDA_FUSE_NORMS=0` runs them one launch each, to compare): RMSNorm + RoPE +
/// rounding of a head (`head_norm_rope`), and the sub-block's input RMSNorm inside the
/// mHC pre-mix (`hc_pre_finish`).
pub(crate) fn fuse_norms() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_FUSE_NORMS").map(|v| v != "0").unwrap_or(true))
}

/// `head_norm_rope`'s form of one tensor's job, if the kernel takes its shape (head_dim a
/// multiple of 128 up to 1,024, the FP8 part of an FP8 format whole 64-value blocks, the
/// BF16 tail whole 16-byte chunks): (weight address, round dtype code, tail).
#[allow(clippy::too_many_arguments)]
fn hnr_job(
    b: &CudaBackend,
    x: &CudaBuf,
    rows: usize,
    heads: usize,
    head_dim: usize,
    weight: Option<&CudaBuf>,
    table: &RopeTable,
    round: Option<&EntryFormat>,
) -> Option<(u64, i32, i32)> {
    assert_eq!(x.len, rows * heads * head_dim, "head_norm_rope input is not [rows, heads, head_dim]");
    let (round_dtype, tail): (i32, usize) = match round {
        None => (-1, 0),
        Some(f) => {
            assert_eq!(f.dim, head_dim, "head_norm_rope rounds heads of {head_dim} to entries of {}", f.dim);
            match f.dtype {
                EntryDtype::F32 => (-1, 0),
                EntryDtype::Bf16 => (1, 0),
                EntryDtype::Fp8 => (2, f.tail),
            }
        }
    };
    let fits = fuse_norms()
        && head_dim.is_multiple_of(128)
        && head_dim / 128 <= HNR_MAX_V
        && table.dims() <= head_dim
        && (head_dim - tail).is_multiple_of(FP8_SCALE_BLOCK)
        && tail.is_multiple_of(4)
        && weight.is_none_or(|w| w.len == head_dim);
    fits.then(|| (weight.map(|w| b.gpu.ptr(&w.mem)).unwrap_or(0), round_dtype, tail as i32))
}

/// RMSNorm + RoPE (+ rounding to `round`) of `x[rows, heads, head_dim]` in one launch of
/// `head_norm_rope` when its shape allows ([`hnr_job`]); false when it does not, and the
/// caller runs the three ops.
#[allow(clippy::too_many_arguments)]
pub(crate) fn head_norm_rope(
    b: &CudaBackend,
    x: &mut CudaBuf,
    heads: usize,
    head_dim: usize,
    weight: Option<&CudaBuf>,
    eps: f32,
    positions: &[u32],
    table: &RopeTable,
    round: Option<&EntryFormat>,
) -> bool {
    let Some((w, round_dtype, tail)) = hnr_job(b, x, positions.len(), heads, head_dim, weight, table, round) else {
        return false;
    };
    let n = positions.len() * heads;
    if n == 0 {
        return true;
    }
    let g = &b.gpu;
    let (pos, _held) = positions_on_device(b, positions);
    launch!(
        g,
        "head_norm_rope",
        cfg_elems(n * 32),
        g.ptr(&x.mem),
        w,
        pos,
        positions.len() as i32,
        heads as i32,
        head_dim as i32,
        eps,
        RopeParams::new(table),
        round_dtype,
        tail
    );
    true
}

/// [`head_norm_rope`] of two tensors at the same positions with the same RoPE in one
/// launch of `head_norm_rope2` (`SLUICE_CUDA_HNR_PAIR=0`: one launch each), when the
/// kernel takes both shapes; false when it does not, and the caller runs them apart.
pub(crate) fn head_norm_rope2(
    b: &CudaBackend,
    first: &mut HeadNormJob<'_, CudaBackend>,
    second: &mut HeadNormJob<'_, CudaBackend>,
    shared: &HeadNormShared<'_>,
) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if !*ON.get_or_init(|| std::env::var("SLUICE_CUDA_HNR_PAIR").map(|v| v != "0").unwrap_or(true)) {
        return false;
    }
    let (rows, hd, table) = (shared.positions.len(), shared.head_dim, shared.rope);
    let job = |j: &HeadNormJob<'_, CudaBackend>| hnr_job(b, j.x, rows, j.heads, hd, j.weight, table, j.round);
    let (Some((w1, round1, tail1)), Some((w2, round2, tail2))) = (job(first), job(second)) else {
        return false;
    };
    let n = rows * (first.heads + second.heads);
    if n == 0 {
        return true;
    }
    let g = &b.gpu;
    let (pos, _held) = positions_on_device(b, shared.positions);
    launch!(
        g,
        "head_norm_rope2",
        cfg_elems(n * 32),
        g.ptr(&first.x.mem),
        w1,
        first.heads as i32,
        round1,
        tail1,
        g.ptr(&second.x.mem),
        w2,
        second.heads as i32,
        round2,
        tail2,
        pos,
        rows as i32,
        hd as i32,
        shared.eps,
        RopeParams::new(table),
    );
    true
}

/// Device address of a step's `positions`: the step plan's copy when it has one, else a
/// fresh upload, returned beside the address so that it lives until the launch is issued.
fn positions_on_device(b: &CudaBackend, positions: &[u32]) -> (u64, PositionsHeld) {
    match b.plans.positions_of(positions) {
        Some(p) => (b.gpu.ptr(&p.positions), PositionsHeld { _plan: Some(p), _upload: None }),
        None => {
            let up = b.gpu.upload(positions);
            (b.gpu.ptr(&up), PositionsHeld { _plan: None, _upload: Some(up) })
        }
    }
}

/// What keeps the memory behind [`positions_on_device`]'s address alive.
struct PositionsHeld {
    _plan: Option<std::sync::Arc<super::devplan::DevPlan>>,
    _upload: Option<super::arena::DevBuf<u32>>,
}

pub(crate) fn rope(
    b: &CudaBackend,
    x: &mut CudaBuf,
    heads: usize,
    head_dim: usize,
    positions: &[u32],
    table: &RopeTable,
    inverse: bool,
) {
    assert_eq!(x.len, positions.len() * heads * head_dim, "rope input is not [rows, heads, head_dim]");
    assert!(table.dims() <= head_dim, "rope dims {} exceed head_dim {head_dim}", table.dims());
    let n = positions.len() * heads * table.inv_freq.len();
    if n == 0 {
        return;
    }
    let g = &b.gpu;
    let (pos, _held) = positions_on_device(b, positions);
    launch!(
        g,
        "rope",
        cfg_elems(n),
        g.ptr(&x.mem),
        pos,
        positions.len() as i32,
        heads as i32,
        head_dim as i32,
        RopeParams::new(table),
        inverse as i32
    );
}

pub(crate) fn scale(b: &CudaBackend, x: &mut CudaBuf, factor: f32) {
    if x.len == 0 {
        return;
    }
    let g = &b.gpu;
    launch!(g, "scale_f32", cfg_elems(x.len), g.ptr(&x.mem), x.len as i64, factor);
}

pub(crate) fn round_to(b: &CudaBackend, x: &mut CudaBuf, fmt: &EntryFormat) {
    assert_eq!(x.len % fmt.dim.max(1), 0, "round_to input is not [rows, {}]", fmt.dim);
    if x.len == 0 {
        return;
    }
    let g = &b.gpu;
    match fmt.dtype {
        EntryDtype::F32 => {}
        EntryDtype::Bf16 => launch!(g, "round_to_bf16", cfg_elems(x.len), g.ptr(&x.mem), x.len as i64),
        EntryDtype::Fp8 => {
            let rows = x.len / fmt.dim;
            // A warp per FP8 block of a row, one more for its bf16 tail (rows.cu).
            let warps = rows * ((fmt.dim - fmt.tail).div_ceil(FP8_SCALE_BLOCK) + 1);
            launch!(
                g,
                "round_to_fp8",
                cfg_elems(warps * 32),
                g.ptr(&x.mem),
                rows as i32,
                fmt.dim as i32,
                fmt.tail as i32
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::greedy_parts;

    #[test]
    fn greedy_parts_cover_the_row_in_slices_of_at_least_2048() {
        for vocab in [1, 100, 2048, 2049, 32768, 129_280, 1 << 20] {
            let (parts, span) = greedy_parts(vocab);
            assert!((1..=64).contains(&parts), "{vocab}: {parts} parts");
            assert!(parts * span >= vocab && (parts - 1) * span < vocab, "{vocab}: every part has values");
            assert!(parts == 1 || span >= 2048 || parts == 64, "{vocab}: span {span}");
        }
        assert_eq!(greedy_parts(32768), (16, 2048));
        assert_eq!(greedy_parts(129_280).0, 63);
    }
}
