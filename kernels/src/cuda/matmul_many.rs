//! Several products of the same activations (`Backend::matmul_many`): a layer's
//! projections of its hidden state — `wq_a`, `wkv`, the two compressors' `wkv` and
//! `wgate`, the indexer's `weights_proj` — are 0.3–8 MB each on V4 widths. Issued one by
//! one, each is a launch whose ramp and tail cost more than its bytes at one or two rows
//! (4–6 µs for 1–8 MB on the H200, docs/perf.md), and on cuBLAS each splits the same
//! activations again.
//!
//! - The BF16 weights at one or two rows (the SIMT gemv's case, [`matmul`]'s choice
//!   there): one `gemv_many_bf16_r*` launch for up to [`GEMV_MANY_MAX`] products, every
//!   output computed as the one-product kernel computes it with the same block shape.
//! - The BF16 weights at 9-32 rows when `SLUICE_CUDA_GEMM_ROWS` routes them to
//!   `gemm_rows`: product by product (each launch splits x as it streams it).
//! - The BF16 weights on cuBLAS: x split (split activations) or rounded to bf16 once, one
//!   product each; with bf16 activations at 3-64 rows the products of at most 4,096
//!   outputs as one batched call over 64-row chunks (`chunked_products.rs`; below 9 rows,
//!   where cuBLAS does not take a product alone, only where two or more join).
//! - The FP8 weights (`wq_a` and `wkv` of a real checkpoint) at one or two rows on sm_90:
//!   one `gemv_f8wg_many_*` launch (`gemv_f8wg.rs`, [`f8wg_many_plan`]) where it takes
//!   them (`SLUICE_CUDA_F8WG_MANY=0`: one launch each).
//! - Other weights and other row counts: product by product through [`matmul`].
//!
//! `SLUICE_CUDA_FUSED_PRODUCTS=0` (read once) runs every product on its own, to compare.

use cudarc::driver::DeviceRepr;

use super::chunked_products;
use super::cublas_bf16::{self, RoundedRows, SplitRows};
use super::gemm_rows::gemm_rows_plan;
use super::gemv_f8wg::{F8WG_MANY_MAX, f8wg_many, f8wg_many_member, f8wg_many_plan};
use super::matmul::{Operand, count_product, fp8_on_fp8wg, fp8wg_products_sharing_parts, matmul, outputs_per_block};
use super::memory::{CudaWeight, WeightData};
use super::runtime::{DevBuf, Gpu, cfg, launch};
use crate::Activations;

/// Products one `gemv_many_bf16_r*` launch takes (`GEMV_MANY_MAX` in cu/gemv.cu).
pub(crate) const GEMV_MANY_MAX: usize = 8;

/// `struct GemvMany` in cu/gemv.cu: each product's weight, output, outputs and first block.
/// `products_from_chunks` takes it too (`chunked_products.rs`: `first` counts chunks there).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct GemvMany {
    w: [u64; GEMV_MANY_MAX],
    pub(crate) out: [u64; GEMV_MANY_MAX],
    pub(crate) n: [i32; GEMV_MANY_MAX],
    pub(crate) first: [i32; GEMV_MANY_MAX],
    count: i32,
}

impl GemvMany {
    /// A table of `count` products, every entry zero until set.
    pub(crate) fn empty(count: usize) -> GemvMany {
        assert!(count <= GEMV_MANY_MAX, "{count} products exceed a launch's {GEMV_MANY_MAX}");
        GemvMany {
            w: [0; GEMV_MANY_MAX],
            out: [0; GEMV_MANY_MAX],
            n: [0; GEMV_MANY_MAX],
            first: [0; GEMV_MANY_MAX],
            count: count as i32,
        }
    }
}

// SAFETY: #[repr(C)] u64 and i32 arrays and an i32, laid out as the C struct.
unsafe impl DeviceRepr for GemvMany {}

fn fused_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_FUSED_PRODUCTS").map(|v| v != "0").unwrap_or(true))
}

/// `outs[i] = x · ws[i]ᵀ` for contiguous `x[rows, K]` and outputs `[rows, ws[i].rows]`;
/// `lent`: x's rows already rounded to bf16 by their producer (`CudaBuf::bf16`), which
/// the cuBLAS products read where they take bf16 rows.
pub(crate) fn matmul_many(gpu: &Gpu, x: u64, rows: usize, ws: &[(&CudaWeight, u64)], lent: Option<&DevBuf<u16>>) {
    if rows == 0 || ws.is_empty() {
        return;
    }
    // The BF16 weights share a launch or a split (a real checkpoint mixes FP8 `wq_a` and
    // `wkv` with BF16 compressors and indexer weights); the others go one by one.
    let (bf16, others): (Vec<&(&CudaWeight, u64)>, Vec<_>) =
        ws.iter().partition(|(w, _)| fused_enabled() && matches!(w.data, WeightData::Bf16(_)) && w.rows > 0);
    let k = ws[0].0.cols;
    let mut alone = others;
    // In `matmul`'s order: the opt-in 9-32-row kernel (which splits x itself: product by product),
    // cuBLAS where it takes the rows, else the SIMT gemv at 1-2 rows.
    let rows_kernel = bf16
        .first()
        .is_some_and(|&&(w, out)| gemm_rows_plan(gpu, &Operand::contiguous(x, out, rows, 1, w), w).is_some());
    let on_cublas = bf16.len() > 1 && !rows_kernel && cublas_bf16::takes(rows, bf16[0].0);
    if on_cublas && gpu.activations == Activations::Split {
        let xs = SplitRows::new(gpu, x, k, rows, k);
        for &&(w, out) in &bf16 {
            count_product(gpu, rows, w);
            cublas_bf16::product_of_split(gpu, &xs, Operand::contiguous(x, out, rows, 1, w), w);
        }
    } else if on_cublas || (!rows_kernel && chunked_products::below_cublas(gpu, rows, bf16.iter().map(|(w, _)| *w))) {
        // The rows' own bf16 values where their producer wrote them (a prefill's
        // sub-block input, `CudaBuf::bf16`), else rounded here.
        let xb = match lent {
            Some(buf) => RoundedRows::lent(buf, rows, k),
            None => RoundedRows::new(gpu, x, k, rows, k),
        };
        // The small ones (a layer's input projections) in one batched call of chunks.
        let (chunked, single) = chunked_products::chunk_joining(&bf16, |(w, _)| chunked_products::joins(rows, w));
        chunked_products::products(gpu, &xb, rows, &chunked.iter().map(|p| ***p).collect::<Vec<_>>());
        if on_cublas {
            for &&&(w, out) in &single {
                count_product(gpu, rows, w);
                xb.product(gpu, Operand::contiguous(x, out, rows, 1, w), w);
            }
        } else {
            alone.extend(single.into_iter().copied());
        }
    } else if !on_cublas && bf16.len() > 1 && rows <= 2 && k.is_multiple_of(8) {
        for chunk in bf16.chunks(GEMV_MANY_MAX) {
            gemv_many(gpu, x, rows, chunk);
        }
    } else {
        alone.extend(bf16);
    }
    // FP8 products of whole 128-row scale blocks in one warpgroup launch (up to
    // F8WG_MANY_MAX a launch) where it takes them.
    let (fp8, mut alone): (Vec<_>, Vec<_>) =
        alone.into_iter().partition(|(w, _)| fused_enabled() && f8wg_many_member(w));
    for group in fp8.chunks(F8WG_MANY_MAX) {
        let weights: Vec<&CudaWeight> = group.iter().map(|&&(w, _)| w).collect();
        match f8wg_many_plan(gpu, x, rows, &weights) {
            Some(plan) => {
                weights.iter().for_each(|w| count_product(gpu, rows, w));
                let products: Vec<(&CudaWeight, u64)> = group.iter().map(|&&p| p).collect();
                f8wg_many(gpu, &plan, x, rows, &products);
            }
            None => alone.extend(group),
        }
    }
    // FP8 products on `fp8wg_gemm` (`wq_a` and `wkv` of a decode batch past 8 rows or of a
    // prefill) from one set of the rows' parts.
    let (wg, alone): (Vec<_>, Vec<_>) =
        alone.into_iter().partition(|&&(w, out)| fp8_on_fp8wg(gpu, &Operand::contiguous(x, out, rows, 1, w), w));
    let wg: Vec<(Operand, &CudaWeight)> =
        wg.iter().map(|&&(w, out)| (Operand::contiguous(x, out, rows, 1, w), w)).collect();
    fp8wg_products_sharing_parts(gpu, &wg);
    for &(w, out) in alone {
        matmul(gpu, Operand::contiguous(x, out, rows, 1, w), w);
    }
}

/// One launch of the SIMT BF16 gemv over up to [`GEMV_MANY_MAX`] products of one K.
fn gemv_many(gpu: &Gpu, x: u64, rows: usize, ws: &[&(&CudaWeight, u64)]) {
    let total: usize = ws.iter().map(|(w, _)| w.rows).sum();
    let opb = outputs_per_block(gpu, total);
    let mut t = GemvMany::empty(ws.len());
    let mut blocks = 0;
    for (i, &&(w, out)) in ws.iter().enumerate() {
        let WeightData::Bf16(d) = &w.data else { unreachable!("checked by matmul_many") };
        count_product(gpu, rows, w);
        t.w[i] = gpu.ptr(d);
        t.out[i] = out;
        t.n[i] = w.rows as i32;
        t.first[i] = blocks as i32;
        blocks += w.rows.div_ceil(opb);
    }
    let k = ws[0].0.cols;
    let name = if rows == 1 { "gemv_many_bf16_r1" } else { "gemv_many_bf16_r2" };
    launch!(gpu, name, cfg((blocks as u32, 1, 1), 256, 0), t, x, rows as i32, k as i32, opb as i32, 1i32);
}
