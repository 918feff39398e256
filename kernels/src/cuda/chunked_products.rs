//! A layer's small BF16 products of one input, at decode batches on cuBLAS, as one
//! batched cuBLAS call over 64-row chunks of their weights, then one kernel that moves
//! the chunks' outputs into each product's rows (`products_from_chunks`, cu/gemv.cu).
//!
//! Why: a CSA layer's seven projections of its input (`wq_a`, `wkv`, both compressors'
//! `wkv` and `wgate`, the indexer's `weights_proj`: 0.1–8 MB each) issued one by one are
//! seven cuBLAS calls of ~7 µs each at 9–64 rows, most of it each call's ramp and tail:
//! ~54 µs for 34 MB at 32 rows on the H200, against ~12 µs for the same bytes as one
//! batched call of 64-row chunks (docs/perf.md, "A layer's input projections in one
//! cuBLAS call"). The chunks are equal shapes, so `cublasGemmBatchedEx` over pointer
//! arrays takes them whatever the products' widths; their weights stay where they are.
//!
//! `SLUICE_CUDA_CHUNKED_PRODUCTS=0` (read once) issues the products one by one again.

use super::blas_op::BlasOp;
use super::cublas_bf16::RoundedRows;
use super::matmul::{Operand, count_product};
use super::matmul_many::{GEMV_MANY_MAX, GemvMany};
use super::memory::{CudaWeight, WeightData};
use super::runtime::{DevBuf, Gpu, cfg_elems, launch};
use crate::Activations;

/// Weight rows a chunk holds (every V4 projection's width is a multiple).
pub(crate) const CHUNK: usize = 64;

/// Most rows the batched call takes: past them the products are no longer bound by their
/// launches (a prefill's are compute-bound, and each takes cuBLAS's own tiling).
const MAX_ROWS: usize = 64;

/// Widest product that joins the call: wider ones (`wq_b`: 32,768 rows) stream at
/// 75–85% of the copy bandwidth alone, and cut into chunks they were no faster.
const MAX_WIDTH: usize = 4096;

fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_CHUNKED_PRODUCTS").map(|v| v != "0").unwrap_or(true))
}

/// Whether a product of `rows` rows over `w` may join a batched call of chunks (the
/// caller has checked that it runs on cuBLAS from bf16 rows).
pub(crate) fn joins(rows: usize, w: &CudaWeight) -> bool {
    enabled()
        && rows <= MAX_ROWS
        && matches!(w.data, WeightData::Bf16(_))
        && w.rows.is_multiple_of(CHUNK)
        && w.rows <= MAX_WIDTH
        && w.cols.is_multiple_of(8)
}

/// Fewest rows whose products join a batched call where cuBLAS would not take them
/// (`SLUICE_CUDA_CHUNKED_MIN_ROWS`, read once; default 3). From 3 to 8 rows each product
/// was a tensor-core gemv launch of its own over the unrounded rows; the rows rounded to
/// bf16 once and one batched call made a flash-bench step at batch 8 ~5% faster (H200,
/// docs/perf.md). 9 keeps those products as they were.
fn min_rows() -> usize {
    static ONCE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ONCE.get_or_init(|| super::runtime::env_rows("SLUICE_CUDA_CHUNKED_MIN_ROWS").unwrap_or(3))
}

/// Whether products of `rows` rows that cuBLAS does not take (fewer rows than it starts
/// at) still go to one batched call of chunks: bf16 activations, at least
/// `SLUICE_CUDA_CHUNKED_MIN_ROWS` rows (3 or more: 1-2 rows are one `gemv_many` launch),
/// and two or more of `ws` joining.
pub(crate) fn below_cublas<'a>(gpu: &Gpu, rows: usize, ws: impl Iterator<Item = &'a CudaWeight>) -> bool {
    gpu.activations == Activations::Bf16
        && rows >= min_rows().max(3)
        && ws.filter(|w| super::cublas_bf16::takes(MAX_ROWS, w) && joins(rows, w)).count() > 1
}

/// `items` as (those to chunk, the others): the ones `joining` admits where two or more
/// do, else none (one product alone gains nothing from a batched call of chunks).
pub(crate) fn chunk_joining<T>(items: &[T], joining: impl Fn(&T) -> bool) -> (Vec<&T>, Vec<&T>) {
    let (joined, others): (Vec<&T>, Vec<&T>) = items.iter().partition(|t| joining(t));
    if joined.len() > 1 { (joined, others) } else { (Vec::new(), items.iter().collect()) }
}

/// Products of the rounded rows `xb` (a SwiGLU pair's): those that [`joins`] admits with
/// dense outputs as one batched call of chunks where two or more do, the others one
/// cuBLAS call each.
pub(crate) fn products_of_rounded(gpu: &Gpu, xb: &RoundedRows<'_>, ops: &[(Operand, &CudaWeight)]) {
    let (joined, alone) = chunk_joining(ops, |(o, w)| o.groups == 1 && o.out_stride == w.rows && joins(o.rows, w));
    if let Some((first, _)) = joined.first() {
        assert!(joined.iter().all(|(o, _)| o.rows == first.rows), "products of one input share its rows");
        products(gpu, xb, first.rows, &joined.iter().map(|(o, w)| (*w, o.out)).collect::<Vec<_>>());
    }
    for &&(o, w) in &alone {
        count_product(gpu, o.rows, w);
        xb.product(gpu, o, w);
    }
}

/// `outs[i] = x · ws[i]ᵀ` from the rounded rows `xb` for products that [`joins`] admits
/// (each output dense `[rows, ws[i].rows]` f32), up to [`GEMV_MANY_MAX`] a call.
pub(crate) fn products(gpu: &Gpu, xb: &RoundedRows<'_>, rows: usize, ws: &[(&CudaWeight, u64)]) {
    for group in ws.chunks(GEMV_MANY_MAX) {
        products_of_group(gpu, xb, rows, group);
    }
}

fn products_of_group(gpu: &Gpu, xb: &RoundedRows<'_>, rows: usize, ws: &[(&CudaWeight, u64)]) {
    let k = ws[0].0.cols;
    assert!(ws.iter().all(|(w, _)| w.cols == k), "products of one input share its width");
    let chunks: usize = ws.iter().map(|(w, _)| w.rows / CHUNK).sum();
    let sums = gpu.alloc::<f32>(chunks * rows * CHUNK);
    let sums_at = gpu.ptr(&sums);
    let x_at = xb.ptr(gpu);
    let mut t = GemvMany::empty(ws.len());
    // Pointer arrays: each chunk's weight rows, the shared input, the chunk's sums.
    let mut a = Vec::with_capacity(chunks);
    for (p, &(w, out)) in ws.iter().enumerate() {
        let WeightData::Bf16(d) = &w.data else { unreachable!("joins admits BF16 weights only") };
        count_product(gpu, rows, w);
        t.out[p] = out;
        t.n[p] = w.rows as i32;
        t.first[p] = a.len() as i32;
        let base = gpu.ptr(d);
        a.extend((0..w.rows / CHUNK).map(|c| base + (c * CHUNK * k * 2) as u64));
    }
    let mut table = a;
    table.extend(std::iter::repeat_n(x_at, chunks));
    table.extend((0..chunks).map(|i| sums_at + (i * rows * CHUNK * 4) as u64));
    let (at, _upload) = address_table(gpu, &table);
    let arrays = [at, at + 8 * chunks as u64, at + 16 * chunks as u64];
    // SAFETY: the arrays hold `chunks` addresses each: CHUNK × k bf16 weight rows (inside
    // their weights: w.rows is a multiple of CHUNK), the k-wide bf16 rows of `xb` (`rows`
    // of them) and `rows × CHUNK` f32 sums in `sums`, all live until the step's work is
    // done (arena or owned buffers), uploaded before the call on the same stream.
    unsafe { gpu.blas(BlasOp::PointerArrays { arrays, m: CHUNK, n: rows, k, batch: chunks }) };
    launch!(gpu, "products_from_chunks", cfg_elems(chunks * rows * CHUNK / 4), t, sums_at, rows as i32, chunks as i32);
}

/// Most tables [`address_table`] keeps (each a few KB at most): past them the tables are
/// uploaded with each call again.
const MAX_KEPT_TABLES: usize = 4096;

/// The device address of a table of device addresses for one batched call, and the
/// buffer to keep until the call is issued where it was uploaded for this call alone.
/// While a decode step records into the step arena, the arena's addresses repeat from
/// step to step, so such a table's words do too: it is kept (`Gpu::constant_table`) and
/// later steps issue no host-to-device copy for it (each such copy sat between two of the
/// step's graph segments, ~2.5 µs of an idle device, docs/perf.md).
pub(crate) fn address_table(gpu: &Gpu, table: &[u64]) -> (u64, Option<DevBuf<u64>>) {
    if gpu.arena_active()
        && let Some(at) = gpu.constant_table_within(table, MAX_KEPT_TABLES)
    {
        return (at, None);
    }
    let buf = gpu.upload(table);
    (gpu.ptr(&buf), Some(buf))
}
