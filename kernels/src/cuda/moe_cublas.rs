//! Routed BF16 experts of decode batches as cuBLAS batched products (cu/moe_slots.cu).
//!
//! The tensor-core gemv launches (`tcmoe_*`) take an expert's rows 8 at a time and stream
//! every active expert again for each 8; on `flash-bench` (8 BF16 experts, top 2) they
//! were 25% of a batch-32 step's kernel time at ~1 TB/s. Here each expert gets a slot of
//! R rows (R: the most rows any expert can receive), its routed rows gathered there in
//! bf16 — rounded once with bf16 activations (the reference's), as split activations
//! (hi rows over lo rows, the same ~16 bits as the other paths) otherwise — and one
//! `cublasGemmBatchedEx` over all experts does a projection, each expert's weight
//! streamed once: gate and up in one call (2·n_exp products), the SwiGLU and the
//! rounding (or split) of h in one kernel, the down products in a second call, then the
//! rows (or the halves summed) into the list order the combine kernels read. Experts
//! nobody chose are multiplied too (their slots are zero), so this path is for batches
//! whose top-k choices can cover every expert ([`slot_rows`]).
//!
//! `SLUICE_CUDA_CUBLAS_EXPERTS=0` (read once) keeps the tensor-core gemv launches (and,
//! for prefill-sized batches, the grouped `gemm_bf16` tiles instead of one cuBLAS product
//! an expert: `moe_host.rs::per_expert_on_cublas`).

use super::CudaBackend;
use super::blas_op::BlasOp;
use super::memory::{CudaBuf, WeightData};
use super::runtime::{Gpu, cfg_elems, launch};
use crate::Activations;
use crate::backend::MoeWeights;

/// Most slot rows over all experts (n_exp · R): bounds the slots' memory and the work
/// spent on padding.
const MAX_SLOT_ROWS: usize = 8192;

/// Columns a thread of the slot kernels takes (`SLOT_VEC` in moe_slots.cu): the experts'
/// widths must be multiples of it.
pub(crate) const SLOT_VEC: usize = 4;

pub(crate) fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_CUBLAS_EXPERTS").map(|v| v != "0").unwrap_or(true))
}

/// Fewest rows that take this path. Up to 8 rows the tensor-core gemv launches take an
/// expert's rows in one launch (measured when a cuBLAS call still ended a step's CUDA
/// graph recording): on flash-bench (H200, docs/perf.md) batch 4 was 1.67-1.77 ms a step
/// here against 1.57, batch 8 even; from 16 rows this path is faster (batch 32 2.27-2.29
/// against 2.55-2.60 ms, batch 64 2.82-3.22 against 3.61-3.76).
const MIN_ROWS: usize = 9;

/// The slot height R when a decode batch of `rows` rows whose experts receive at most
/// `most` rows each takes this path: BF16 experts (widths multiples of [`SLOT_VEC`]), at
/// least [`MIN_ROWS`] rows, top-k choices that can reach every expert (`rows · k ≥
/// n_exp`, so streaming all of them is no waste on average) and at most
/// [`MAX_SLOT_ROWS`] slot rows.
pub(crate) fn slot_rows(rows: usize, most: usize, w: &MoeWeights<CudaBackend>) -> Option<usize> {
    let n_exp = w.experts.len();
    let widths = w.experts.first().is_some_and(|e| e.w1.cols % SLOT_VEC == 0 && e.w1.rows % SLOT_VEC == 0);
    let fits = rows >= MIN_ROWS && rows * w.top_k >= n_exp && n_exp * most <= MAX_SLOT_ROWS && most > 0 && widths;
    (enabled() && bf16_experts(w) && fits).then_some(most)
}

/// Whether every routed expert this device holds is stored in BF16 (all three projections).
pub(crate) fn bf16_experts(w: &MoeWeights<CudaBackend>) -> bool {
    let bf16 = |m: &super::CudaWeight| matches!(m.data, WeightData::Bf16(_));
    w.experts.iter().all(|e| bf16(&e.w1) && bf16(&e.w3) && bf16(&e.w2))
}

/// The routing lists `moe_lists` wrote: rows per expert, first list position of each,
/// and the batch row of each list position (device addresses).
pub(crate) struct Lists {
    pub counts: u64,
    pub offsets: u64,
    pub rows: u64,
}

/// Every routed pair's expert output `y[n, d]` in list order (n = rows · k pairs), the
/// experts run as batched cuBLAS products over slots of `r` rows.
pub(crate) fn experts(
    b: &CudaBackend,
    x: &CudaBuf,
    w: &MoeWeights<CudaBackend>,
    r: usize,
    lists: &Lists,
    n: usize,
) -> CudaBuf {
    let g = &b.gpu;
    let n_exp = w.experts.len();
    let first = &w.experts[0];
    let (d, inter) = (first.w1.cols, first.w1.rows);
    let ptr = |m: &super::CudaWeight| match &m.data {
        WeightData::Bf16(s) => g.ptr(s),
        _ => unreachable!("slot_rows admits BF16 experts only"),
    };
    // Slot rows of an expert: its R rows in bf16, or their hi rows over their lo rows.
    let halves = if g.activations == Activations::Bf16 { 1 } else { 2 };
    let hr = halves * r;
    let xs = g.alloc::<u16>(n_exp * hr * d);
    let (xs_at, slot_x) = (g.ptr(&xs), (hr * d * 2) as u64);
    launch!(
        g,
        "moe_slots_split",
        cfg_elems(n_exp * r * d / SLOT_VEC),
        xs_at,
        g.ptr(&x.mem),
        lists.counts,
        lists.offsets,
        lists.rows,
        n_exp as i32,
        r as i32,
        d as i32,
        halves as i32
    );
    // Gate products, then up products: [2][n_exp, halves·R, inter] f32.
    let gu = g.alloc::<f32>(2 * n_exp * hr * inter);
    let (gu_at, slot_gu) = (g.ptr(&gu), (hr * inter * 4) as u64);
    let mut table: Vec<u64> = Vec::with_capacity(9 * n_exp);
    table.extend(w.experts.iter().map(|e| ptr(&e.w1)).chain(w.experts.iter().map(|e| ptr(&e.w3))));
    table.extend((0..2 * n_exp).map(|i| xs_at + (i % n_exp) as u64 * slot_x));
    table.extend((0..2 * n_exp).map(|i| gu_at + i as u64 * slot_gu));
    let hs = g.alloc::<u16>(n_exp * hr * inter);
    let ys = g.alloc::<f32>(n_exp * hr * d);
    let (hs_at, slot_h) = (g.ptr(&hs), (hr * inter * 2) as u64);
    let (ys_at, slot_y) = (g.ptr(&ys), (hr * d * 4) as u64);
    table.extend(w.experts.iter().map(|e| ptr(&e.w2)));
    table.extend((0..n_exp).map(|i| hs_at + i as u64 * slot_h));
    table.extend((0..n_exp).map(|i| ys_at + i as u64 * slot_y));
    let (t, _upload) = super::chunked_products::address_table(g, &table);
    let at = |i: usize| t + 8 * i as u64;
    batched(g, [at(0), at(2 * n_exp), at(4 * n_exp)], (inter, hr, d), 2 * n_exp);
    launch!(
        g,
        "moe_slots_swiglu",
        cfg_elems(n_exp * r * inter / SLOT_VEC),
        hs_at,
        gu_at,
        lists.counts,
        n_exp as i32,
        r as i32,
        inter as i32,
        w.swiglu_limit,
        halves as i32
    );
    batched(g, [at(6 * n_exp), at(7 * n_exp), at(8 * n_exp)], (d, hr, inter), n_exp);
    let y = b.alloc_buf(n * d);
    launch!(
        g,
        "moe_slots_out",
        cfg_elems(n_exp * r * d / SLOT_VEC),
        g.ptr(&y.mem),
        ys_at,
        lists.counts,
        lists.offsets,
        n_exp as i32,
        r as i32,
        d as i32,
        halves as i32
    );
    y
}

/// `batch` products `C_i(m × n) = A_iᵀ · B_i` in cuBLAS's column-major terms: A_i a
/// row-major `[m, k]` BF16 weight, B_i `n` rows of `k` bf16 activations, C_i `n` rows of
/// `m` f32 outputs; `arrays` holds the device addresses of the A, B and C pointer arrays.
pub(crate) fn batched(g: &Gpu, arrays: [u64; 3], (m, n, k): (usize, usize, usize), batch: usize) {
    // SAFETY: each pointer array holds `batch` device addresses of live allocations of
    // at least m·k (A), n·k (B) and n·m (C) elements, written by the caller's upload,
    // which is ordered before this call on the stream.
    unsafe { g.blas(BlasOp::PointerArrays { arrays, m, n, k, batch }) };
}
