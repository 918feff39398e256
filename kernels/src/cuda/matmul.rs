//! Matrix products `y = x · Wᵀ`, plain and block-diagonal (grouped), and the fused
//! SwiGLU pair product of the MoE experts.
//!
//! - Up to [`GEMV_MAX_ROWS`] rows (decode): the gemv kernels, which stream each weight
//!   once with f32 activations and f32 accumulation (experts' SwiGLU pairs up to 32
//!   rows, 8 per launch).
//! - More rows (prefill): cuBLAS. f32 weights use a plain f32 GEMM (no TF32). bf16 and
//!   FP8 weights use bf16 tensor cores: the activations are split into two bf16 parts
//!   (`x ≈ hi + lo`, ~16 mantissa bits together), multiplied by two GEMMs accumulating
//!   into the f32 output, which keeps the result near the f32 product while running at
//!   tensor-core speed; FP8 weights are first widened to bf16 in a scratch buffer.

use std::ffi::c_void;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};

use super::memory::{CudaWeight, WeightData};
use super::runtime::{Gpu, cfg, cfg_elems, fail, launch};

/// Rows one gemv launch covers (its kernels are instantiated for 1, 2, 4 and 8).
const GEMV_ROWS: usize = 8;
/// Rows at or below which products use the gemv kernels.
pub(crate) const GEMV_MAX_ROWS: usize = GEMV_ROWS;
/// The experts' SwiGLU pair takes the gemv path up to this many rows, in launches of
/// [`GEMV_ROWS`]: an expert's weights are small, and re-streaming them per 8 rows costs
/// less than the tensor-core path's split, temporaries and launches (measured on the
/// H200: MoE of a 32-row decode batch 4.2 -> 2.2 ms); for the large dense weights the
/// re-streaming loses (matmuls of a 32-row batch 3.2 -> 5.8 ms), so they stop at 8.
const SWIGLU_GEMV_MAX_ROWS: usize = 32;

/// Where a product reads and writes: `x` rows `x_stride` floats apart, `out` rows
/// `out_stride` apart; `groups` blocks on the diagonal (1 for a plain product).
#[derive(Clone, Copy)]
pub(crate) struct Operand {
    pub x: u64,
    pub x_stride: usize,
    pub out: u64,
    pub out_stride: usize,
    pub rows: usize,
    pub groups: usize,
}

/// Kernel-name suffix of a weight format and the weights its vector loads take at once.
pub(crate) fn family(w: &CudaWeight) -> (&'static str, usize) {
    match &w.data {
        WeightData::F32(_) => ("f32", 8),
        WeightData::Bf16(_) => ("bf16", 8),
        WeightData::Fp8 { .. } => ("fp8", 16),
    }
}

pub(crate) fn weight_ptrs(gpu: &Gpu, w: &CudaWeight) -> (u64, u64) {
    match &w.data {
        WeightData::F32(d) => (gpu.ptr(d), 0),
        WeightData::Bf16(d) => (gpu.ptr(d), 0),
        WeightData::Fp8 { codes, scales } => (gpu.ptr(codes), gpu.ptr(scales)),
    }
}

/// Outputs per block so the grid has about two blocks per multiprocessor or more.
pub(crate) fn outputs_per_block(gpu: &Gpu, n: usize) -> usize {
    let want = 2 * gpu.sms;
    [8, 4, 2].into_iter().find(|&opb| n / opb >= want).unwrap_or(1)
}

/// gemv in launches of up to [`GEMV_ROWS`] rows.
fn gemv(gpu: &Gpu, op: Operand, w: &CudaWeight, w3: Option<&CudaWeight>, limit: f32) {
    for r0 in (0..op.rows).step_by(GEMV_ROWS) {
        let part = Operand {
            x: op.x + (4 * r0 * op.x_stride) as u64,
            out: op.out + (4 * r0 * op.out_stride) as u64,
            rows: (op.rows - r0).min(GEMV_ROWS),
            ..op
        };
        gemv_launch(gpu, part, w, w3, limit);
    }
}

fn gemv_launch(gpu: &Gpu, op: Operand, w: &CudaWeight, w3: Option<&CudaWeight>, limit: f32) {
    let (fam, chunk) = family(w);
    let r = op.rows.next_power_of_two();
    let name = format!("{}_{fam}_r{r}", if w3.is_some() { "swiglu" } else { "gemv" });
    let (n, k) = (w.rows, w.cols);
    let g_out = n / op.groups;
    let vec = k.is_multiple_of(chunk) && op.x_stride.is_multiple_of(4) && (op.groups == 1 || k.is_multiple_of(4));
    let opb = outputs_per_block(gpu, n);
    let (wp, sp) = weight_ptrs(gpu, w);
    let (wp3, sp3) = w3.map(|w3| weight_ptrs(gpu, w3)).unwrap_or((0, 0));
    launch!(
        gpu,
        name.as_str(),
        cfg((n.div_ceil(opb) as u32, 1, 1), 256, 0),
        op.out,
        op.x,
        wp,
        wp3,
        sp,
        sp3,
        op.rows as i32,
        n as i32,
        k as i32,
        op.x_stride as i32,
        op.out_stride as i32,
        g_out as i32,
        opb as i32,
        vec as i32,
        limit,
    );
}

/// cuBLAS: `out[rows, N]` (row-major, rows `ldc` apart) = `x · Wᵀ` per group, in column-major
/// terms `C(g_out × rows) = Aᵀ(g_out × k) · B(k × rows)` with A the weight rows.
#[allow(clippy::too_many_arguments)]
fn cublas_gemm(
    gpu: &Gpu,
    a: u64,
    a_type: cudaDataType,
    b: u64,
    b_type: cudaDataType,
    ldb: usize,
    c: u64,
    ldc: usize,
    m: usize,
    n: usize,
    k: usize,
    groups: usize,
    beta: f32,
) {
    let alpha = 1f32;
    let blas = gpu.blas.lock().expect("cuBLAS handle poisoned");
    // SAFETY: A is groups × (m × k) weights, B holds n rows of ldb values whose group g
    // starts at column g·k, C holds n rows of ldc values whose group g starts at g·m; all
    // are live device allocations of at least those sizes (the callers size them).
    let r = unsafe {
        cudarc::cublas::result::gemm_strided_batched_ex(
            *blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            m as i32,
            n as i32,
            k as i32,
            &alpha as *const f32 as *const c_void,
            a as *const c_void,
            a_type,
            k as i32,
            (m * k) as i64,
            b as *const c_void,
            b_type,
            ldb as i32,
            k as i64,
            &beta as *const f32 as *const c_void,
            c as *mut c_void,
            cudaDataType::CUDA_R_32F,
            ldc as i32,
            m as i64,
            groups as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    r.unwrap_or_else(|e| fail("cuBLAS GEMM", e));
}

fn gemm(gpu: &Gpu, op: Operand, w: &CudaWeight) {
    let (n, k) = (w.rows, w.cols);
    let g_out = n / op.groups;
    match &w.data {
        WeightData::F32(d) => cublas_gemm(
            gpu,
            gpu.ptr(d),
            cudaDataType::CUDA_R_32F,
            op.x,
            cudaDataType::CUDA_R_32F,
            op.x_stride,
            op.out,
            op.out_stride,
            g_out,
            op.rows,
            k,
            op.groups,
            0.0,
        ),
        WeightData::Bf16(_) | WeightData::Fp8 { .. } => {
            let widened;
            let wp = match &w.data {
                WeightData::Bf16(d) => gpu.ptr(d),
                WeightData::Fp8 { codes, scales } => {
                    widened = gpu.alloc::<u16>(n * k);
                    launch!(
                        gpu,
                        "fp8_to_bf16",
                        cfg_elems(n * k),
                        gpu.ptr(&widened),
                        gpu.ptr(codes),
                        gpu.ptr(scales),
                        n as i32,
                        k as i32
                    );
                    gpu.ptr(&widened)
                }
                WeightData::F32(_) => unreachable!(),
            };
            // Split the activations: [2·rows, x_width] bf16, hi rows then lo rows.
            let x_width = op.groups * k;
            let split = gpu.alloc::<u16>(2 * op.rows * x_width);
            let xs = if op.x_stride == x_width {
                op.x
            } else {
                fail("split product", "strided activations are only supported by gemv")
            };
            let half = op.rows * x_width;
            let sp = gpu.ptr(&split);
            launch!(gpu, "split_bf16", cfg_elems(half), sp, sp + 2 * half as u64, xs, half as i64);
            // out = W·hi, then out += W·lo: two products on the tensor cores into the
            // f32 output (no temporary; the weights are read twice, which only matters
            // where gemv runs instead).
            for (half_at, beta) in [(0u64, 0f32), (2 * half as u64, 1f32)] {
                cublas_gemm(
                    gpu,
                    wp,
                    cudaDataType::CUDA_R_16BF,
                    sp + half_at,
                    cudaDataType::CUDA_R_16BF,
                    x_width,
                    op.out,
                    op.out_stride,
                    g_out,
                    op.rows,
                    k,
                    op.groups,
                    beta,
                );
            }
        }
    }
}

/// `out = x · Wᵀ` (grouped when `op.groups > 1`).
pub(crate) fn matmul(gpu: &Gpu, op: Operand, w: &CudaWeight) {
    if op.rows == 0 || w.rows == 0 {
        return;
    }
    assert!(w.rows.is_multiple_of(op.groups), "grouped weight rows not divisible by groups");
    gpu.traffic.add_weights(w.device_bytes());
    if op.rows <= GEMV_MAX_ROWS {
        gemv(gpu, op, w, None, 0.0);
    } else {
        gemm(gpu, op, w);
    }
}

/// `out[rows, inter] = silu(min(x·w1ᵀ, limit)) * clamp(x·w3ᵀ, ±limit)`.
pub(crate) fn swiglu_pair(gpu: &Gpu, op: Operand, w1: &CudaWeight, w3: &CudaWeight, limit: f32) {
    if op.rows == 0 {
        return;
    }
    assert_eq!((w1.rows, w1.cols), (w3.rows, w3.cols), "SwiGLU gate and up shapes differ");
    if op.rows <= SWIGLU_GEMV_MAX_ROWS && std::mem::discriminant(&w1.data) == std::mem::discriminant(&w3.data) {
        gpu.traffic.add_weights(w1.device_bytes() + w3.device_bytes());
        gemv(gpu, op, w1, Some(w3), limit);
        return;
    }
    let n = op.rows * w1.rows;
    let up = gpu.alloc::<f32>(n);
    matmul(gpu, op, w1);
    matmul(gpu, Operand { out: gpu.ptr(&up), ..op }, w3);
    launch!(gpu, "swiglu_act", cfg_elems(n), op.out, gpu.ptr(&up), n as i64, limit);
}
