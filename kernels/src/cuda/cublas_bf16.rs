//! Products over BF16 weights of many rows (prefill; decode batches past 8 rows) on
//! cuBLAS: the weight is already the BF16 matrix cuBLAS multiplies, so the library's
//! tensor-core GEMM (several times the rate of the `gemm_bf16` tiles, docs/perf.md) takes
//! it as stored. The f32 activations become bf16 first, as one of two precisions
//! ([`Bf16Activations`]):
//!
//! - `Split` (the default): `x ≈ hi + lo`, two bf16 parts (~16 mantissa bits), the same
//!   precision as the tensor-core kernels' split activations, so parity with the f32 CPU
//!   engine stays where it was. Few rows (≤ [`STACKED_MAX_ROWS`], memory-bound decode
//!   batches): hi and lo rows stacked as one product of twice the rows, the weight
//!   streamed once, the two halves of the result summed by `sum_split_halves`. Many rows
//!   (compute-bound prefill): two products into the output (`beta = 1` for the second),
//!   no temporary of twice the output.
//! - `Round` (`SLUICE_CUDA_BF16_ACTIVATIONS=bf16`): x rounded once to bf16 — what the
//!   reference model (BF16 activations) computes — one product, half the work.
//!
//! `SLUICE_CUDA_CUBLAS_BF16_ROWS` (read once): the fewest rows that take this path (9 by
//! default: up to 8 rows the decode gemv kernels stream the weight faster; 0 turns the
//! path off and the products take the gemv loops and `gemm_bf16` tiles as before).
//!
//! The calls go through `Gpu::blas` (`blas_op.rs`): a decode step that is recording for a
//! CUDA graph keeps them with its launches, so they are captured and replayed with it.

use cudarc::cublas::sys::cudaDataType;

use super::matmul::{Operand, cublas_gemm};
use super::memory::{CudaWeight, WeightData};
use super::runtime::{DevBuf, Gpu, cfg_elems, launch};

/// Most rows whose split activations are stacked into one product (the weight streamed
/// once); more rows take two products (compute-bound: no double-height temporary).
const STACKED_MAX_ROWS: usize = 64;

/// How the f32 activations of a cuBLAS BF16 product become bf16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Bf16Activations {
    /// hi + lo bf16 parts (~16 mantissa bits).
    Split,
    /// One bf16 rounding (8 mantissa bits, the reference model's precision).
    Round,
}

impl Bf16Activations {
    /// `SLUICE_CUDA_BF16_ACTIVATIONS` (`split` or `bf16`; read once), `Split` by default.
    pub(crate) fn from_env() -> Bf16Activations {
        static ONCE: std::sync::OnceLock<Bf16Activations> = std::sync::OnceLock::new();
        *ONCE.get_or_init(|| match std::env::var("SLUICE_CUDA_BF16_ACTIVATIONS").ok().as_deref() {
            None | Some("split") => Bf16Activations::Split,
            Some("bf16") => Bf16Activations::Round,
            Some(other) => {
                tracing::warn!(value = other, "SLUICE_CUDA_BF16_ACTIVATIONS is neither split nor bf16: using split");
                Bf16Activations::Split
            }
        })
    }
}

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
/// activations as [`Bf16Activations::from_env`] says.
pub(crate) fn product(gpu: &Gpu, op: Operand, w: &CudaWeight) {
    product_as(gpu, op, w, Bf16Activations::from_env())
}

/// [`product`] with the activations' precision given (the parity suite runs both).
pub(crate) fn product_as(gpu: &Gpu, op: Operand, w: &CudaWeight, mode: Bf16Activations) {
    let rows = op.rows;
    let cols = op.groups * w.cols;
    let n = rows * cols;
    match mode {
        Bf16Activations::Round => {
            let xb = gpu.alloc::<u16>(n);
            launch!(
                gpu,
                "round_bf16_rows",
                cfg_elems(n),
                gpu.ptr(&xb),
                op.x,
                rows as i32,
                cols as i32,
                op.x_stride as i32
            );
            bf16_gemm(gpu, op, w, gpu.ptr(&xb), op.out, op.out_stride, rows, 0.0);
        }
        Bf16Activations::Split => {
            let xs = SplitRows::new(gpu, op.x, op.x_stride, rows, cols);
            product_of_split(gpu, &xs, op, w);
        }
    }
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
    let gemm = |b: u64, c: u64, ldc: usize, n: usize, beta: f32| bf16_gemm(gpu, op, w, b, c, ldc, n, beta);
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
/// the BF16 weight `w` into f32 rows at `c`, `ldc` apart: `c = b · Wᵀ + beta · c`.
#[allow(clippy::too_many_arguments)]
fn bf16_gemm(gpu: &Gpu, op: Operand, w: &CudaWeight, b: u64, c: u64, ldc: usize, n: usize, beta: f32) {
    let WeightData::Bf16(weights) = &w.data else { panic!("cuBLAS BF16 products take BF16 weights") };
    cublas_gemm(
        gpu,
        gpu.ptr(weights),
        cudaDataType::CUDA_R_16BF,
        b,
        cudaDataType::CUDA_R_16BF,
        op.groups * w.cols,
        c,
        ldc,
        w.rows / op.groups,
        n,
        w.cols,
        op.groups,
        beta,
    )
}
