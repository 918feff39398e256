//! Products over BF16 weights of many rows (prefill; decode batches past 8 rows) on
//! cuBLAS: the weight is already the BF16 matrix cuBLAS multiplies, so the library's
//! tensor-core GEMM (several times the rate of the `gemm_bf16` tiles, docs/perf.md) takes
//! it as stored. The f32 activations become bf16 first, as one of two precisions
//! ([`Activations`], the backend's `Gpu::activations`):
//!
//! - `Bf16` (the default): x rounded once to bf16 — what the reference model (BF16
//!   activations) computes — one product, half the work.
//! - `Split`: `x ≈ hi + lo`, two bf16 parts (~16 mantissa bits), the same
//!   precision as the tensor-core kernels' split activations, so parity with the f32 CPU
//!   engine stays where it was. Few rows (≤ [`STACKED_MAX_ROWS`], memory-bound decode
//!   batches): hi and lo rows stacked as one product of twice the rows, the weight
//!   streamed once, the two halves of the result summed by `sum_split_halves`. Many rows
//!   (compute-bound prefill): two products into the output (`beta = 1` for the second),
//!   no temporary of twice the output.
//!
//! `SLUICE_CUDA_CUBLAS_BF16_ROWS` (read once): the fewest rows that take this path (9 by
//! default: up to 8 rows the decode gemv kernels stream the weight faster; 0 turns the
//! path off and the products take the gemv loops and `gemm_bf16` tiles as before).
//!
//! The calls go through `Gpu::blas` (`blas_op.rs`): a decode step that is recording for a
//! CUDA graph keeps them with its launches, so they are captured and replayed with it.

use cudarc::cublas::sys::cudaDataType;

use super::blas_op::BlasOp;
use super::matmul::Operand;
use super::memory::{CudaWeight, WeightData};
use super::runtime::{DevBuf, Gpu, cfg_elems, cfg_row_cols, launch};
use crate::Activations;

/// Most rows whose split activations are stacked into one product (the weight streamed
/// once); more rows take two products (compute-bound: no double-height temporary).
const STACKED_MAX_ROWS: usize = 64;

/// Fewest rows a BF16 product needs to take cuBLAS (0: never).
fn min_rows() -> usize {
    const DEFAULT: usize = 9;
    static ONCE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ONCE.get_or_init(|| super::runtime::env_rows("SLUICE_CUDA_CUBLAS_BF16_ROWS").unwrap_or(DEFAULT))
}

/// Whether a product of `rows` rows over `w` goes to cuBLAS.
pub(crate) fn takes(rows: usize, w: &CudaWeight) -> bool {
    let min = min_rows();
    min > 0 && rows >= min && matches!(w.data, WeightData::Bf16(_))
}

/// `out = x · Wᵀ` (block-diagonal when `op.groups > 1`) for a BF16 weight on cuBLAS, the
/// activations as the backend's [`Activations`] say.
pub(crate) fn product(gpu: &Gpu, op: Operand, w: &CudaWeight) {
    product_as(gpu, op, w, gpu.activations)
}

/// [`product`] with the activations' precision given (the parity suite runs both).
pub(crate) fn product_as(gpu: &Gpu, op: Operand, w: &CudaWeight, mode: Activations) {
    let rows = op.rows;
    let cols = op.groups * w.cols;
    match mode {
        Activations::Bf16 => RoundedRows::new(gpu, op.x, op.x_stride, rows, cols).product(gpu, op, w),
        Activations::Split => {
            let xs = SplitRows::new(gpu, op.x, op.x_stride, rows, cols);
            product_of_split(gpu, &xs, op, w);
        }
    }
}

/// `rows` rows of `cols` f32 values (`x_stride` apart) rounded once to bf16 into `out`
/// (`rows × cols`, dense): 8 columns a thread where the shape allows.
pub(crate) fn round_rows(gpu: &Gpu, out: u64, x: u64, rows: usize, cols: usize, x_stride: usize) {
    if cols.is_multiple_of(8) && x_stride.is_multiple_of(4) && x.is_multiple_of(16) {
        let cfg = cfg_row_cols(rows, cols / 8);
        launch!(gpu, "round_bf16_rows8", cfg, out, x, rows as i32, cols as i32, x_stride as i32);
    } else {
        launch!(gpu, "round_bf16_rows", cfg_elems(rows * cols), out, x, rows as i32, cols as i32, x_stride as i32);
    }
}

/// `rows` rows of `src` (f32, `width` apart) picked by the list `idx` (an entry of -1:
/// a zero row) and rounded once to bf16 into `out` (dense `rows × width`; `width` a
/// multiple of 8, `src` 16-byte aligned): the routed rows of BF16 experts in expert order.
pub(crate) fn gather_rows_bf16(gpu: &Gpu, out: u64, src: u64, idx: u64, rows: usize, width: usize) {
    assert!(width.is_multiple_of(8) && src.is_multiple_of(16), "gather_rows_bf16 takes 8-aligned rows");
    let cfg = cfg_row_cols(rows, width / 8);
    launch!(gpu, "gather_rows_bf16", cfg, out, src, idx, rows as i32, width as i32);
}

/// `out = bf16(silu(min(g, limit)) · clamp(u, ±limit))` over `n` values: `swiglu_act`'s
/// SwiGLU rounded as it is written, for a down product that reads bf16 rows.
pub(crate) fn swiglu_bf16(gpu: &Gpu, out: u64, g: u64, u: u64, n: usize, limit: f32) {
    launch!(gpu, "swiglu_bf16", cfg_elems(n), out, g, u, n as i64, limit);
}

/// `out = x · Wᵀ` for `rows` dense bf16 rows at `x` (plain `w`, BF16) into dense f32 rows
/// at `out` (the caller counts the product).
pub(crate) fn product_of_bf16_rows(gpu: &Gpu, x: u64, rows: usize, w: &CudaWeight, out: u64) {
    let op = Operand { x: 0, x_stride: w.cols, out, out_stride: w.rows, rows, groups: 1 };
    bf16_gemm(gpu, op, w, x, (out, F32), w.rows, rows, 0.0);
}

/// f32 activation rows rounded once to bf16 (dense `rows × cols`), for every product
/// that reads them: a layer's projections of its input, a SwiGLU pair's gate and up. Each
/// product rounding the rows itself read an 8K prefill's 128 MB of f32 rows again
/// (`round_bf16_rows8` was ~11% of a flash-bench prefill, docs/perf.md).
pub(crate) struct RoundedRows<'a> {
    buf: Bf16Rows<'a>,
    rows: usize,
    cols: usize,
}

/// Where [`RoundedRows`]' values are: rounded for it, or a buffer's own
/// ([`crate::cuda::CudaBuf`]'s `bf16`, written by the buffer's producer).
enum Bf16Rows<'a> {
    Own(DevBuf<u16>),
    Lent(&'a DevBuf<u16>),
}

impl<'a> RoundedRows<'a> {
    pub(crate) fn new(gpu: &Gpu, x: u64, x_stride: usize, rows: usize, cols: usize) -> RoundedRows<'a> {
        let buf = gpu.alloc::<u16>(rows * cols);
        round_rows(gpu, gpu.ptr(&buf), x, rows, cols, x_stride);
        RoundedRows { buf: Bf16Rows::Own(buf), rows, cols }
    }

    /// Rows already in bf16 (`rows × cols` values in `buf`), e.g. written so by their producer.
    pub(crate) fn from_bf16(buf: DevBuf<u16>, rows: usize, cols: usize) -> RoundedRows<'a> {
        assert!(buf.len() >= rows * cols, "{} bf16 values hold no {rows} rows of {cols}", buf.len());
        RoundedRows { buf: Bf16Rows::Own(buf), rows, cols }
    }

    /// [`RoundedRows::from_bf16`] of a buffer that stays its owner's (a `CudaBuf`'s bf16 rows).
    pub(crate) fn lent(buf: &'a DevBuf<u16>, rows: usize, cols: usize) -> RoundedRows<'a> {
        assert!(buf.len() >= rows * cols, "{} bf16 values hold no {rows} rows of {cols}", buf.len());
        RoundedRows { buf: Bf16Rows::Lent(buf), rows, cols }
    }

    /// The device address of the bf16 rows.
    pub(crate) fn ptr(&self, gpu: &Gpu) -> u64 {
        match &self.buf {
            Bf16Rows::Own(buf) => gpu.ptr(buf),
            Bf16Rows::Lent(buf) => gpu.ptr(*buf),
        }
    }

    /// `out = x · Wᵀ` from these rows (`op.x` is not read; the caller counted the product).
    pub(crate) fn product(&self, gpu: &Gpu, op: Operand, w: &CudaWeight) {
        assert_eq!(
            (self.rows, self.cols),
            (op.rows, op.groups * w.cols),
            "rounded activations do not match the product"
        );
        bf16_gemm(gpu, op, w, self.ptr(gpu), (op.out, F32), op.out_stride, self.rows, 0.0);
    }

    /// [`RoundedRows::product`] with bf16 outputs at `out` (`op.out` is not read):
    /// cuBLAS rounds each f32 sum once as it stores it, for a product that reads the
    /// output as its bf16 input (`wo_a` before `wo_b`) instead of rounding f32 rows again.
    pub(crate) fn product_to_bf16(&self, gpu: &Gpu, op: Operand, w: &CudaWeight, out: u64) {
        assert_eq!(
            (self.rows, self.cols),
            (op.rows, op.groups * w.cols),
            "rounded activations do not match the product"
        );
        bf16_gemm(gpu, op, w, self.ptr(gpu), (out, BF16), op.out_stride, self.rows, 0.0);
    }
}

const F32: cudaDataType = cudaDataType::CUDA_R_32F;
const BF16: cudaDataType = cudaDataType::CUDA_R_16BF;

/// `op`'s rows rounded once for products over every one of `ws` (plain, of one input
/// width) where each would take cuBLAS with bf16 activations; `None` (nothing issued)
/// otherwise, and the products go their own ways.
pub(crate) fn rounded_for<'a>(gpu: &Gpu, op: &Operand, ws: &[&CudaWeight]) -> Option<RoundedRows<'a>> {
    rounded_or_lent(gpu, op, ws, None)
}

/// [`rounded_for`], taking `lent` (the rows' own bf16 values, `CudaBuf::bf16`, of
/// `op.x`'s dense rows) where it is given instead of rounding them.
pub(crate) fn rounded_or_lent<'a>(
    gpu: &Gpu,
    op: &Operand,
    ws: &[&CudaWeight],
    lent: Option<&'a DevBuf<u16>>,
) -> Option<RoundedRows<'a>> {
    let shared = op.groups == 1 && ws.iter().all(|w| w.cols == ws[0].cols && reads_bf16_rows(gpu, op, w));
    let cols = ws.first()?.cols;
    shared.then(|| match lent {
        Some(buf) if op.x_stride == cols => RoundedRows::lent(buf, op.rows, cols),
        _ => RoundedRows::new(gpu, op.x, op.x_stride, op.rows, cols),
    })
}

/// Whether the product of `op` over `w` runs on cuBLAS from bf16 rows: bf16 activations,
/// rows cuBLAS takes ([`takes`]) and no one-launch `gemm_rows` product asked for instead.
/// Where it does, a producer may hand it rows already in bf16 (`RoundedRows`).
pub(crate) fn reads_bf16_rows(gpu: &Gpu, op: &Operand, w: &CudaWeight) -> bool {
    gpu.activations == Activations::Bf16 && takes(op.rows, w) && super::gemm_rows::gemm_rows_plan(gpu, op, w).is_none()
}

/// f32 activation rows split into bf16 hi rows followed by lo rows in one buffer (the
/// stacked product reads them as one operand of 2·rows rows).
pub(crate) struct SplitRows {
    buf: DevBuf<u16>,
    rows: usize,
    cols: usize,
}

impl SplitRows {
    pub(crate) fn new(gpu: &Gpu, x: u64, x_stride: usize, rows: usize, cols: usize) -> SplitRows {
        let n = rows * cols;
        let buf = gpu.alloc::<u16>(2 * n);
        let hi = gpu.ptr(&buf);
        launch!(gpu, "split_bf16", cfg_elems(n), hi, hi + 2 * n as u64, x, rows as i32, cols as i32, x_stride as i32);
        SplitRows { buf, rows, cols }
    }
}

/// `out = x · Wᵀ` from x already split (`op.x` is not read).
pub(crate) fn product_of_split(gpu: &Gpu, xs: &SplitRows, op: Operand, w: &CudaWeight) {
    let (rows, cols) = (xs.rows, xs.cols);
    assert_eq!((rows, cols), (op.rows, op.groups * w.cols), "split activations do not match the product");
    let gemm = |b: u64, c: u64, ldc: usize, n: usize, beta: f32| bf16_gemm(gpu, op, w, b, (c, F32), ldc, n, beta);
    let (hi, lo) = (gpu.ptr(&xs.buf), gpu.ptr(&xs.buf) + 2 * (rows * cols) as u64);
    if rows <= STACKED_MAX_ROWS {
        let halves = gpu.alloc::<f32>(2 * rows * w.rows);
        gemm(hi, gpu.ptr(&halves), w.rows, 2 * rows, 0.0);
        let outputs = rows * w.rows;
        launch!(
            gpu,
            "sum_split_halves",
            cfg_elems(outputs),
            op.out,
            op.out_stride as i32,
            gpu.ptr(&halves),
            rows as i32,
            w.rows as i32
        );
    } else {
        gemm(hi, op.out, op.out_stride, rows, 0.0);
        gemm(lo, op.out, op.out_stride, rows, 1.0);
    }
}

/// One cuBLAS product of `n` bf16 activation rows at `b` (rows `op.groups · K` apart) with
/// the BF16 weight `w` into rows at `c` of `c_type` (f32 or bf16), `ldc` apart:
/// `c = b · Wᵀ + beta · c`.
#[allow(clippy::too_many_arguments)]
fn bf16_gemm(
    gpu: &Gpu,
    op: Operand,
    w: &CudaWeight,
    b: u64,
    (c, c_type): (u64, cudaDataType),
    ldc: usize,
    n: usize,
    beta: f32,
) {
    let WeightData::Bf16(weights) = &w.data else { panic!("cuBLAS BF16 products take BF16 weights") };
    let (a, ldb, m, k, groups) = (gpu.ptr(weights), op.groups * w.cols, w.rows / op.groups, w.cols, op.groups);
    let product = BlasOp::Strided { a, a_type: BF16, b, b_type: BF16, ldb, c, c_type, ldc, m, n, k, groups, beta };
    // SAFETY: the weight is groups × (m × k) bf16 values; b holds n rows of groups · k
    // bf16 activations and c n rows of ldc outputs of c_type (the callers allocate them so).
    unsafe { gpu.blas(product) }
}

/// Whether SwiGLU experts of a decode batch take [`swiglu_expert`]
/// (`SLUICE_CUDA_CUBLAS_SWIGLU`, on unless `0`; read once).
fn swiglu_expert_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_CUBLAS_SWIGLU").map_or(true, |v| v != "0"))
}

/// `y = (silu(min(x·w1ᵀ, limit)) · clamp(x·w3ᵀ, ±limit)) · w2ᵀ` for a decode batch of BF16
/// experts (the shared expert at 9–64 rows) in five launches where three products took
/// ten: x split once, the gate and up products in one batched call over the stacked hi
/// and lo rows, their halves summed and the SwiGLU applied and split again for the down
/// product in one kernel (`moe_slots_swiglu` as one slot of `rows` rows), then the down
/// product and its sum. The values are the separate products' (the same sums of halves,
/// SwiGLU and split), so parity is unchanged. False (nothing issued) where it does not
/// apply: not split activations, more than [`STACKED_MAX_ROWS`] rows, rows cuBLAS does
/// not take, weights not all BF16 of matching shapes, products `gemm_rows` takes, or
/// `SLUICE_CUDA_CUBLAS_SWIGLU=0`.
pub(crate) fn swiglu_expert(
    gpu: &Gpu,
    (x, x_stride, rows): (u64, usize, usize),
    (w1, w3, w2): (&CudaWeight, &CudaWeight, &CudaWeight),
    limit: f32,
    y: u64,
) -> bool {
    let (WeightData::Bf16(a1), WeightData::Bf16(a3), WeightData::Bf16(_)) = (&w1.data, &w3.data, &w2.data) else {
        return false;
    };
    let (inter, d) = (w1.rows, w1.cols);
    let fits = (w3.rows, w3.cols) == (inter, d)
        && w2.cols == inter
        && rows <= STACKED_MAX_ROWS
        && inter.is_multiple_of(super::moe_cublas::SLOT_VEC);
    if !(fits && takes(rows, w1) && swiglu_expert_enabled() && gpu.activations == Activations::Split) {
        return false;
    }
    // The one-launch products, where asked for (`SLUICE_CUDA_GEMM_ROWS`), come first.
    let gate_op = Operand { x, x_stride, out: 0, out_stride: inter, rows, groups: 1 };
    if super::gemm_rows::gemm_rows_plan(gpu, &gate_op, w1).is_some() {
        return false;
    }
    for w in [w1, w3, w2] {
        super::matmul::count_product(gpu, rows, w);
    }
    let xs = SplitRows::new(gpu, x, x_stride, rows, d);
    // Gate products over [hi; lo], then up products: [2][2·rows, inter] f32.
    let gu = gpu.alloc::<f32>(2 * 2 * rows * inter);
    let (gate, up) = (gpu.ptr(&gu), gpu.ptr(&gu) + (2 * rows * inter * 4) as u64);
    let xs_at = gpu.ptr(&xs.buf);
    let table = gpu.upload(&[gpu.ptr(a1), gpu.ptr(a3), xs_at, xs_at, gate, up]);
    let t = gpu.ptr(&table);
    // The two inter × d weights, the 2·rows × d split activations (twice), the two
    // 2·rows × inter outputs allocated above.
    super::moe_cublas::batched(gpu, [t, t + 16, t + 32], (inter, 2 * rows, d), 2);
    let hs = SplitRows { buf: gpu.alloc::<u16>(2 * rows * inter), rows, cols: inter };
    let count = gpu.upload(&[rows as i32]);
    launch!(
        gpu,
        "moe_slots_swiglu",
        cfg_elems(rows * inter / super::moe_cublas::SLOT_VEC),
        gpu.ptr(&hs.buf),
        gate,
        gpu.ptr(&count),
        1i32,
        rows as i32,
        inter as i32,
        limit,
        2i32
    );
    let down = Operand { x: 0, x_stride: inter, out: y, out_stride: w2.rows, rows, groups: 1 };
    product_of_split(gpu, &hs, down, w2);
    true
}
