//! FP8 products of one or two decode rows on the FP8 tensor cores (cu/gemv_f8mma.cu):
//! which products they take ([`f8mma_plan`]) and their launch. [`super::matmul`] tries
//! them before the v2 kernels; `SLUICE_CUDA_F8MMA=0` leaves every product to v2. Two
//! kinds: chunks of 2048 inputs where K is a multiple (`gemv_f8mma_w_*`), else of 1024.

use cudarc::driver::DeviceRepr;

use super::matmul::Operand;
use super::memory::{CudaWeight, WeightData};
use super::runtime::{Gpu, cfg, launch};

/// The kernels: chunks of 1024 inputs by rows (`gemv_f8mma_r1`, `_r2`), then chunks of
/// 2048 (`gemv_f8mma_w_r1`, `_w_r2`).
pub(crate) const F8MMA_KERNELS: [&str; 4] = ["gemv_f8mma_r1", "gemv_f8mma_r2", "gemv_f8mma_w_r1", "gemv_f8mma_w_r2"];

/// How a block streams its weight rows: inputs of a chunk (`KC` in the kernel; K must be
/// a multiple) and chunks in its ring (`STAGES`), each 16 rows of `inputs + 16` bytes.
#[derive(Clone, Copy)]
struct Chunks {
    inputs: usize,
    stages: usize,
    /// Index of the one-row kernel in [`F8MMA_KERNELS`].
    kernel: usize,
}

const NARROW: Chunks = Chunks { inputs: 1024, stages: 6, kernel: 0 };
const WIDE: Chunks = Chunks { inputs: 2048, stages: 4, kernel: 2 };

/// The chunks for K inputs: of 2048 in a ring of four where K is a multiple (half the
/// loop's waits, copy requests and scale loads a byte: a 12-layer Flash step at one and
/// two rows 1-1.5% faster on the H200), else of 1024 in a ring of six;
/// `SLUICE_CUDA_F8MMA_CHUNK=1024` (read once) keeps every product on the latter.
fn chunks(k: usize) -> Chunks {
    static NARROW_ONLY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let narrow_only = *NARROW_ONLY.get_or_init(|| super::runtime::env_rows("SLUICE_CUDA_F8MMA_CHUNK") == Some(1024));
    if !narrow_only && k.is_multiple_of(WIDE.inputs) { WIDE } else { NARROW }
}

/// Fewest inputs a product needs for these kernels: K = 1024 (wq_b) measured slower than
/// v2 (15.8 against 15.2 µs for 32768 × 1024 on the H200; 14.1 against 16.2 µs for 8192
/// × 4096), a tile's reduction paid every 1024 inputs.
const MIN_K: usize = 2048;

/// Most dynamic shared memory the kernels are launched with (opted in at load): either
/// ring and a row's three e4m3 parts for K up to 8192 at two rows.
pub(crate) const F8MMA_MAX_SMEM: usize = 184 * 1024;
/// Warps of a block (`F8_WARPS`).
const WARPS: usize = 16;

/// `F8Args` in gemv_f8mma.cu (pointers first, so both sides lay it out without padding;
/// gemv_f8wg.cu takes it too).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct F8Args {
    pub out: u64,
    pub x: u64,
    pub w: u64,
    pub scales: u64,
    pub rows: i32,
    pub n: i32,
    pub k: i32,
    pub x_stride: i32,
    pub out_stride: i32,
    pub g_out: i32,
    pub tiles: i32,
    /// Zero: no padding, whose bytes would be undefined (a recorded decode step compares
    /// launches' argument bytes to find the steps it can replay as graphs).
    pub pad: i32,
}

// SAFETY: a plain #[repr(C)] struct of integers without padding, `struct F8Args` in
// gemv_f8mma.cu.
unsafe impl DeviceRepr for F8Args {}
const _: () = assert!(std::mem::size_of::<F8Args>() == 4 * 8 + 8 * 4, "F8Args has padding");

impl F8Args {
    /// The arguments of `op` over `w` in `tiles` tiles.
    pub(crate) fn new(op: &Operand, w: &CudaWeight, tiles: usize) -> Self {
        let (wp, sp) = w.ptrs();
        F8Args {
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
            tiles: tiles as i32,
            pad: 0,
        }
    }
}

/// One launch: the kernel, its grid (one block an SM at most) and shared memory.
pub(crate) struct F8Plan {
    pub name: &'static str,
    tiles: usize,
    grid: usize,
    smem: usize,
}

/// Dynamic shared memory of a block: the ring and the activations' parts.
fn smem(c: Chunks, rows: usize, k: usize) -> usize {
    c.stages * 16 * (c.inputs + 16) + 3 * rows * (k + 16)
}

/// Whether these kernels may take products (`SLUICE_CUDA_F8MMA=0`: never, to compare).
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_F8MMA").map(|v| v != "0").unwrap_or(true))
}

/// The plan for `op` over `w` when these kernels take it: FP8 weights on an sm_89+ GPU
/// (FP8 mma), one or two rows, K a multiple of the chunk and at least [`MIN_K`], whole
/// 16-row tiles (in every group of a grouped product), 16-byte aligned activation rows,
/// and at least one tile an SM (smaller products leave SMs idle here; the v2 kernels
/// split their K instead).
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
    let c = chunks(k);
    let smem = smem(c, op.rows, k);
    let tiles = n / 16;
    if op.groups == 0 || !k.is_multiple_of(c.inputs) || !whole_tiles || !aligned || smem > F8MMA_MAX_SMEM {
        return None;
    }
    if tiles < gpu.sms || k < MIN_K || n.checked_mul(k).is_none_or(|b| b >= 1 << 31) {
        return None;
    }
    Some(F8Plan { name: F8MMA_KERNELS[c.kernel + op.rows - 1], tiles, grid: tiles.min(gpu.sms), smem })
}

/// Launch `plan` for `op` over `w`.
pub(crate) fn f8mma_gemv(gpu: &Gpu, plan: &F8Plan, op: Operand, w: &CudaWeight) {
    let args = F8Args::new(&op, w, plan.tiles);
    launch!(gpu, plan.name, cfg((plan.grid as u32, 1, 1), (WARPS * 32) as u32, plan.smem as u32), args);
}
