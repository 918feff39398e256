//! BF16 products of 9 to 32 decode rows in one tensor-core launch (cu/gemm_rows.cu):
//! which products it takes ([`gemm_rows_plan`]) and its launch. [`super::matmul`] tries
//! it before cuBLAS, whose split-activation path costs a decode step three or four
//! launches a product (the split, the stacked product, often a split-K reduce, the sum of
//! the halves). Off by default: on the H200 it streams the weight slower than cuBLAS's
//! product (8192 × 4096 at 32 rows 49.5 µs against 26.2 with the split and sum included;
//! flash-bench batch 32 1.87 → 2.0–2.3 ms a step), so the launches it saves do not pay
//! (docs/perf.md "BF16 products of 9-32 rows in one launch, tried").
//! `SLUICE_CUDA_GEMM_ROWS` (read once) is the fewest rows it takes (e.g. 9; 0, the
//! default, = never); at most 32.

use cudarc::driver::DeviceRepr;

use super::matmul::Operand;
use super::memory::{CudaWeight, WeightData};
use super::runtime::{Gpu, cfg, launch};

/// The kernels, by the blocks that split an output block's K (a thread-block cluster of
/// that many blocks; more than one needs sm_90).
pub(crate) const GEMM_ROWS_KERNELS: [&str; 4] =
    ["gemm_rows_bf16_k1", "gemm_rows_bf16_k2", "gemm_rows_bf16_k4", "gemm_rows_bf16_k8"];
/// Most rows a launch takes (`GR_ROWS`).
pub(crate) const GEMM_ROWS_MAX: usize = 32;
/// Weight rows of a block (`GR_BN`).
const BLOCK_OUTPUTS: usize = 128;
/// Inputs of a streamed chunk (`GR_BK`): K must be a multiple.
const CHUNK_INPUTS: usize = 128;
/// A weight or split tile's row in shared memory, bf16 elements (`GR_LD`: a chunk padded
/// by 16 bytes).
const TILE_ROW: usize = CHUNK_INPUTS + 8;
/// Dynamic shared memory of a block (`GR_SMEM`): two stages of a 128-row weight tile and a
/// pair of 32-row split tiles (85 KiB).
pub(crate) const GEMM_ROWS_SMEM: usize = 2 * BLOCK_OUTPUTS * TILE_ROW * 2 + 2 * GEMM_ROWS_MAX * TILE_ROW * 2;
/// Blocks an SM holds (`__launch_bounds__(256, 2)`, two of [`GEMM_ROWS_SMEM`] fit).
const BLOCKS_PER_SM: usize = 2;

/// `GrArgs` in gemm_rows.cu (pointers first, so both sides lay it out without padding).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct GrArgs {
    out: u64,
    x: u64,
    w: u64,
    rows: i32,
    n: i32,
    k: i32,
    x_stride: i32,
    out_stride: i32,
    g_out: i32,
}

// SAFETY: a plain #[repr(C)] struct of integers, `struct GrArgs` in gemm_rows.cu.
unsafe impl DeviceRepr for GrArgs {}

/// One launch: the kernel, blocks along the outputs and the K split (the cluster size).
pub(crate) struct GemmRowsPlan {
    name: &'static str,
    blocks: usize,
    k_split: usize,
}

/// Fewest rows the kernel takes (`SLUICE_CUDA_GEMM_ROWS`, read once; 0, the default: never).
fn min_rows() -> usize {
    const DEFAULT: usize = 0;
    static ONCE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ONCE.get_or_init(|| super::runtime::env_rows("SLUICE_CUDA_GEMM_ROWS").unwrap_or(DEFAULT))
}

/// The plan for `op` over `w` when the kernel takes it (rows in [`min_rows`] ..= 32).
pub(crate) fn gemm_rows_plan(gpu: &Gpu, op: &Operand, w: &CudaWeight) -> Option<GemmRowsPlan> {
    let min = min_rows();
    if min == 0 || op.rows < min {
        return None;
    }
    gemm_rows_plan_always(gpu, op, w)
}

/// [`gemm_rows_plan`] for any row count from 1 to 32, whatever `SLUICE_CUDA_GEMM_ROWS`
/// says (the parity suite and the benchmark's table): BF16 weights, K a multiple of 128,
/// block-diagonal groups of whole 128-output blocks, 16-byte aligned activation rows.
pub(crate) fn gemm_rows_plan_always(gpu: &Gpu, op: &Operand, w: &CudaWeight) -> Option<GemmRowsPlan> {
    if !matches!(w.data, WeightData::Bf16(_)) || !(1..=GEMM_ROWS_MAX).contains(&op.rows) || op.groups == 0 {
        return None;
    }
    let (n, k) = (w.rows, w.cols);
    let grouped = op.groups > 1;
    let groups_fit = !grouped || (n.is_multiple_of(op.groups) && (n / op.groups).is_multiple_of(BLOCK_OUTPUTS));
    let aligned = op.x.is_multiple_of(16) && op.x_stride.is_multiple_of(4);
    let fits_i32 = n <= i32::MAX as usize && k <= i32::MAX as usize;
    if n == 0 || k == 0 || !fits_i32 || !k.is_multiple_of(CHUNK_INPUTS) || !groups_fit || !aligned {
        return None;
    }
    // Split K (clusters of 2, 4 or 8 blocks, sm_90) while twice the blocks still fit
    // every SM's two slots at once, keeping at least one chunk a block.
    let blocks = n.div_ceil(BLOCK_OUTPUTS);
    let chunks = k / CHUNK_INPUTS;
    let most = if gpu.cc >= (9, 0) { 3 } else { 0 };
    let mut split = 0;
    while split < most && blocks << (split + 1) <= BLOCKS_PER_SM * gpu.sms && 2 << split <= chunks {
        split += 1;
    }
    Some(GemmRowsPlan { name: GEMM_ROWS_KERNELS[split], blocks, k_split: 1 << split })
}

/// Launch `plan` for `op` over `w`.
pub(crate) fn gemm_rows(gpu: &Gpu, plan: &GemmRowsPlan, op: Operand, w: &CudaWeight) {
    let (wp, _) = w.ptrs();
    let args = GrArgs {
        out: op.out,
        x: op.x,
        w: wp,
        rows: op.rows as i32,
        n: w.rows as i32,
        k: w.cols as i32,
        x_stride: op.x_stride as i32,
        out_stride: op.out_stride as i32,
        g_out: op.g_out(w),
    };
    launch!(gpu, plan.name, cfg((plan.blocks as u32, plan.k_split as u32, 1), 256, GEMM_ROWS_SMEM as u32), args);
}
