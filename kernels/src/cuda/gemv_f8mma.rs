//! FP8 products of one or two decode rows on the FP8 tensor cores (cu/gemv_f8mma.cu):
//! which products they take ([`f8mma_plan`]) and their launch. [`super::matmul`] tries
//! them before the v2 kernels; `SLUICE_CUDA_F8MMA=0` leaves every product to v2.

use cudarc::driver::DeviceRepr;

use super::matmul::{Operand, weight_ptrs};
use super::memory::{CudaWeight, WeightData};
use super::runtime::{Gpu, cfg, launch};

/// The kernels, by rows (`gemv_f8mma_r1`, `gemv_f8mma_r2`).
pub(crate) const F8MMA_KERNELS: [&str; 2] = ["gemv_f8mma_r1", "gemv_f8mma_r2"];
/// Inputs of a streamed chunk (`F8_KC`): K must be a multiple.
const CHUNK_INPUTS: usize = 1024;
/// Chunks in a block's ring (`F8_STAGES`), each 16 rows of `CHUNK_INPUTS + 16` bytes.
const STAGES: usize = 6;
/// Most dynamic shared memory the kernels are launched with (opted in at load): the ring
/// and a row's three e4m3 parts for K up to 8192 at two rows. 148 KiB, as the v2 kernels,
/// so the opt-in succeeds on every part that runs these sources.
pub(crate) const F8MMA_MAX_SMEM: usize = 148 * 1024;
/// Warps of a block (`F8_WARPS`).
const WARPS: usize = 16;

/// `F8Args` in gemv_f8mma.cu (pointers first, so both sides lay it out without padding).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct F8Args {
    out: u64,
    x: u64,
    w: u64,
    scales: u64,
    rows: i32,
    n: i32,
    k: i32,
    x_stride: i32,
    out_stride: i32,
    g_out: i32,
    tiles: i32,
}

// SAFETY: a plain #[repr(C)] struct of integers, `struct F8Args` in gemv_f8mma.cu.
unsafe impl DeviceRepr for F8Args {}

/// One launch: the kernel, its grid (one block an SM at most) and shared memory.
pub(crate) struct F8Plan {
    pub name: &'static str,
    tiles: usize,
    grid: usize,
    smem: usize,
}

/// Dynamic shared memory of a block: the ring and the activations' parts.
fn smem(rows: usize, k: usize) -> usize {
    STAGES * 16 * (CHUNK_INPUTS + 16) + 3 * rows * (k + 16)
}

/// Whether these kernels may take products (`SLUICE_CUDA_F8MMA=0`: never, to compare).
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_F8MMA").map(|v| v != "0").unwrap_or(true))
}

/// The plan for `op` over `w` when these kernels take it: FP8 weights on an sm_89+ GPU
/// (FP8 mma), one or two rows, K a multiple of 1024 and at least 2048, whole 16-row tiles (in every group
/// of a grouped product), 16-byte aligned activation rows, and at least one tile an SM
/// (smaller products leave SMs idle here; the v2 kernels split their K instead).
pub(crate) fn f8mma_plan(gpu: &Gpu, op: &Operand, w: &CudaWeight) -> Option<F8Plan> {
    if !enabled() {
        return None;
    }
    f8mma_plan_always(gpu, op, w)
}

/// [`f8mma_plan`] whatever `SLUICE_CUDA_F8MMA` says (the benchmark's kernel table).
pub(crate) fn f8mma_plan_always(gpu: &Gpu, op: &Operand, w: &CudaWeight) -> Option<F8Plan> {
    if !matches!(w.data, WeightData::Fp8 { .. }) || gpu.cc < (8, 9) || !(1..=2).contains(&op.rows) {
        return None;
    }
    let (n, k) = (w.rows, w.cols);
    let grouped = op.groups > 1;
    let whole_tiles =
        n.is_multiple_of(16) && (!grouped || (n.is_multiple_of(op.groups) && (n / op.groups).is_multiple_of(16)));
    let aligned = op.x.is_multiple_of(16) && op.x_stride.is_multiple_of(4);
    let smem = smem(op.rows, k);
    let tiles = n / 16;
    if op.groups == 0 || !k.is_multiple_of(CHUNK_INPUTS) || !whole_tiles || !aligned || smem > F8MMA_MAX_SMEM {
        return None;
    }
    // K of one chunk (wq_b's 1024) measured slower than v2 (15.8 against 15.2 µs for
    // 32768 × 1024 on the H200; 14.1 against 16.2 µs for 8192 × 4096): a tile a chunk pays
    // the tile's reduction every chunk.
    if tiles < gpu.sms || k < 2 * CHUNK_INPUTS || n.checked_mul(k).is_none_or(|b| b >= 1 << 31) {
        return None;
    }
    Some(F8Plan { name: F8MMA_KERNELS[op.rows - 1], tiles, grid: tiles.min(gpu.sms), smem })
}

/// Launch `plan` for `op` over `w`.
pub(crate) fn f8mma_gemv(gpu: &Gpu, plan: &F8Plan, op: Operand, w: &CudaWeight) {
    let (wp, sp) = weight_ptrs(gpu, w);
    let args = F8Args {
        out: op.out,
        x: op.x,
        w: wp,
        scales: sp,
        rows: op.rows as i32,
        n: w.rows as i32,
        k: w.cols as i32,
        x_stride: op.x_stride as i32,
        out_stride: op.out_stride as i32,
        g_out: op.g_out(w),
        tiles: plan.tiles as i32,
    };
    launch!(gpu, plan.name, cfg((plan.grid as u32, 1, 1), (WARPS * 32) as u32, plan.smem as u32), args);
}
