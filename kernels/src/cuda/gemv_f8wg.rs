//! FP8 products of one or two decode rows on Hopper's warpgroup tensor-core instruction
//! (cu/gemv_f8wg.cu, `wgmma` with e4m3 operands): which products they take
//! ([`f8wg_plan`], [`f8wg_pair_plan`], [`f8wg_many_plan`]) and their launch.
//! [`super::matmul`] tries them first for FP8 products and SwiGLU pairs (the shared
//! expert's gate and up) of 1-2 rows on sm_90, [`super::matmul_many`] for several FP8
//! products of one input (a layer's `wq_a` and `wkv`); `SLUICE_CUDA_F8WG=0` leaves them
//! to `gemv_f8mma` and v2, `SLUICE_CUDA_F8WG_PAIR=0` the pairs alone to v2,
//! `SLUICE_CUDA_F8WG_MANY=0` runs several products one launch each.

use std::collections::HashMap;
use std::sync::Mutex;

use cudarc::driver::DeviceRepr;
use cudarc::driver::sys::{
    CUresult, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave, CUtensorMapL2promotion,
    CUtensorMapSwizzle, cuTensorMapEncodeTiled,
};

use super::gemv_f8mma::F8Args;
use super::matmul::Operand;
use super::memory::{CudaWeight, WeightData};
use super::runtime::{Gpu, cfg, launch};

/// The kernels by ring (8 chunks, then 4: `_s4_`), rows (1, 2) and the blocks of a
/// cluster that split K (1, 2, 4, 8).
pub(crate) const F8WG_KERNELS: [&str; 16] = [
    "gemv_f8wg_r1_k1",
    "gemv_f8wg_r1_k2",
    "gemv_f8wg_r1_k4",
    "gemv_f8wg_r1_k8",
    "gemv_f8wg_r2_k1",
    "gemv_f8wg_r2_k2",
    "gemv_f8wg_r2_k4",
    "gemv_f8wg_r2_k8",
    "gemv_f8wg_s4_r1_k1",
    "gemv_f8wg_s4_r1_k2",
    "gemv_f8wg_s4_r1_k4",
    "gemv_f8wg_s4_r1_k8",
    "gemv_f8wg_s4_r2_k1",
    "gemv_f8wg_s4_r2_k2",
    "gemv_f8wg_s4_r2_k4",
    "gemv_f8wg_s4_r2_k8",
];
/// The SwiGLU-pair kernels (ring of 4) by rows (1, 2) and K split (1, 2, 4, 8).
pub(crate) const F8WG_PAIR_KERNELS: [&str; 8] = [
    "gemv_f8wg_pair_r1_k1",
    "gemv_f8wg_pair_r1_k2",
    "gemv_f8wg_pair_r1_k4",
    "gemv_f8wg_pair_r1_k8",
    "gemv_f8wg_pair_r2_k1",
    "gemv_f8wg_pair_r2_k2",
    "gemv_f8wg_pair_r2_k4",
    "gemv_f8wg_pair_r2_k8",
];
/// The kernels of several products of one input (ring of 4) by rows (1, 2) and K split
/// (1, 2, 4, 8).
pub(crate) const F8WG_MANY_KERNELS: [&str; 8] = [
    "gemv_f8wg_many_r1_k1",
    "gemv_f8wg_many_r1_k2",
    "gemv_f8wg_many_r1_k4",
    "gemv_f8wg_many_r1_k8",
    "gemv_f8wg_many_r2_k1",
    "gemv_f8wg_many_r2_k2",
    "gemv_f8wg_many_r2_k4",
    "gemv_f8wg_many_r2_k8",
];
/// Products one `gemv_f8wg_many_*` launch takes (`WG_MANY_MAX` in gemv_f8wg.cu).
pub(crate) const F8WG_MANY_MAX: usize = 4;
/// K splits, in the order of [`F8WG_KERNELS`], [`F8WG_PAIR_KERNELS`] and [`F8WG_MANY_KERNELS`].
const SPLITS: [usize; 4] = [1, 2, 4, 8];

/// Output rows of a tile (`WG_TILE`), inputs of a chunk (`WG_KC`: one FP8 scale block)
/// and threads of a block (one warpgroup).
const TILE: usize = 64;
const CHUNK_INPUTS: usize = 128;
const THREADS: u32 = 128;

/// Chunks in a block's ring (`S`): 4 (half the shared memory of 8, so more blocks fit an
/// SM: V4-Flash's `wo_b` 12.7 against 16.0 µs on the H200), or 8 with
/// `SLUICE_CUDA_F8WG_STAGES=8` (read once).
fn stages() -> usize {
    static S: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *S.get_or_init(|| if super::runtime::env_rows("SLUICE_CUDA_F8WG_STAGES") == Some(8) { 8 } else { 4 })
}

/// What a block's tile costs beyond its weight bytes, in inputs of a row: the wait for
/// the last chunk's products, the sums through shared memory and, with a K split, the
/// cluster barrier — about two chunks' time (on the H200, `wq_b`, 32,768 × 1,024, ran in
/// 20.1 µs split by 8, one chunk a tile, when the plan counted bytes alone; 11.8 µs with
/// this cost counted, which keeps its K whole).
const TILE_COST: usize = 2 * CHUNK_INPUTS;

/// Most dynamic shared memory the kernels are launched with (opted in at load): the ring
/// (8 KiB a chunk) and the activations' e4m3 parts (8 bytes an input of the block's K part).
pub(crate) const F8WG_MAX_SMEM: usize = 200 * 1024;
/// Dynamic shared memory a block needs beyond the ring and the activations: the ring's
/// slots are aligned to 1 KiB in the kernel.
const ALIGN_SLACK: usize = 1024;

/// `WgArgs` in gemv_f8wg.cu: the weight's tensor map (a `CUtensorMap`'s 128 bytes), then
/// `F8Args`.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct WgArgs {
    map: [u64; 16],
    a: F8Args,
}

// SAFETY: a plain #[repr(C)] struct of integers, `struct WgArgs` in gemv_f8wg.cu (both
// 64-byte aligned, the map first).
unsafe impl DeviceRepr for WgArgs {}
const _: () = assert!(std::mem::size_of::<WgArgs>() == 128 + 64, "WgArgs has padding");

/// `WgPairArgs` in gemv_f8wg.cu: a SwiGLU pair's two tensor maps, `F8Args` (w1's scales),
/// w3's scales and the clamp; `pad` fills the struct to its 64-byte alignment with zeros
/// (padding bytes would be undefined, and a recorded decode step compares argument bytes).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct WgPairArgs {
    map: [u64; 16],
    map3: [u64; 16],
    a: F8Args,
    scales3: u64,
    limit: f32,
    pad: [u32; 13],
}

// SAFETY: a plain #[repr(C)] struct of integers and floats without padding, `struct
// WgPairArgs` in gemv_f8wg.cu (both 64-byte aligned, the maps first).
unsafe impl DeviceRepr for WgPairArgs {}
const _: () = assert!(std::mem::size_of::<WgPairArgs>() == 2 * 128 + 64 + 8 + 4 + 13 * 4, "WgPairArgs has padding");

/// `WgManyArgs` in gemv_f8wg.cu: up to [`F8WG_MANY_MAX`] products' tensor maps, `F8Args`
/// (the activations, K, rows and the tile total), then each product's scales, output,
/// first tile (and the total after the last) and output width, their count; `pad` fills
/// the struct to its 64-byte alignment with zeros (a recorded step compares argument bytes).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct WgManyArgs {
    maps: [[u64; 16]; F8WG_MANY_MAX],
    a: F8Args,
    scales: [u64; F8WG_MANY_MAX],
    outs: [u64; F8WG_MANY_MAX],
    first: [i32; F8WG_MANY_MAX + 1],
    n: [i32; F8WG_MANY_MAX],
    count: i32,
    pad: [u32; 6],
}

// SAFETY: a plain #[repr(C)] struct of integers without padding, `struct WgManyArgs` in
// gemv_f8wg.cu (both 64-byte aligned, the maps first).
unsafe impl DeviceRepr for WgManyArgs {}
const _: () = assert!(
    std::mem::size_of::<WgManyArgs>() == 4 * 128 + 64 + 2 * 4 * 8 + 5 * 4 + 4 * 4 + 4 + 6 * 4,
    "WgManyArgs has padding"
);

/// The tensor map of an FP8 weight of `n` rows × `k` bytes at device address `w`: boxes of
/// 64 rows × 128 bytes (a chunk), copied into shared memory with the 128-byte swizzle the
/// kernel's wgmma descriptors name.
fn weight_map(w: u64, n: usize, k: usize) -> [u64; 16] {
    let dtype = CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8;
    swizzled_map(w, (dtype, 1), (k, n), [CHUNK_INPUTS as u32, TILE as u32], "an FP8 weight")
}

/// A 2-D tensor map of `rows` rows × `cols` elements (`element`: the driver's type and its
/// bytes) at device address `at`, boxes of `boxes` (elements, rows; 128 bytes wide at
/// most) copied into shared memory with the 128-byte swizzle wgmma descriptors name; rows
/// past the end read as zeros. `what` names the tensor in the panic of a refused map.
pub(crate) fn swizzled_map(
    at: u64,
    element: (CUtensorMapDataType, usize),
    (cols, rows): (usize, usize),
    boxes: [u32; 2],
    what: &str,
) -> [u64; 16] {
    let dims = [cols as u64, rows as u64];
    let strides = [(cols * element.1) as u64];
    let elements = [1u32, 1];
    let mut map = std::mem::MaybeUninit::<CUtensorMap>::zeroed();
    // SAFETY: the arrays outlive the call and hold the rank (2) entries the driver reads
    // (one stride: the outermost dimension's is implied); `map` is written by the driver.
    let r = unsafe {
        cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            element.0,
            2,
            at as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elements.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    assert_eq!(r, CUresult::CUDA_SUCCESS, "cuTensorMapEncodeTiled for {what} of {rows} x {cols} (address {at:#x})");
    // SAFETY: initialised by the successful call above.
    unsafe { map.assume_init() }.opaque
}

/// How many blocks (`split` 1) or clusters of `split` blocks of `name` with `smem` bytes
/// of dynamic shared memory are resident on the GPU at once, from the driver's occupancy
/// calculator (clusters must fit a GPC, so fewer than SMs / split may be), remembered.
pub(crate) fn resident(gpu: &Gpu, name: &'static str, split: usize, smem: usize) -> usize {
    /// (device ordinal, kernel, dynamic shared memory) → blocks or clusters resident.
    type Seen = HashMap<(usize, &'static str, usize), usize>;
    static SEEN: Mutex<Option<Seen>> = Mutex::new(None);
    let key = (gpu.ordinal, name, smem);
    if let Some(&n) = SEEN.lock().unwrap().get_or_insert_with(HashMap::new).get(&key) {
        return n;
    }
    let f = gpu.func(name);
    let n = if split == 1 {
        f.occupancy_max_active_blocks_per_multiprocessor(THREADS, smem, None).map(|b| b as usize * gpu.sms)
    } else {
        let grid = (split * gpu.sms) as u32;
        f.occupancy_max_active_clusters(cfg((grid, 1, 1), THREADS, smem as u32), &gpu.stream).map(|c| c as usize)
    };
    let n = n.unwrap_or_else(|e| panic!("occupancy of {name} with {smem} bytes of shared memory: {e}")).max(1);
    SEEN.lock().unwrap().get_or_insert_with(HashMap::new).insert(key, n);
    n
}

/// One launch: the kernel, the cluster size (K split), the grid and shared memory.
pub(crate) struct F8wgPlan {
    pub name: &'static str,
    split: usize,
    tiles: usize,
    grid: usize,
    smem: usize,
}

/// Whether these kernels may take products (`SLUICE_CUDA_F8WG=0`: never, to compare).
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_F8WG").map(|v| v != "0").unwrap_or(true))
}

/// Whether several FP8 products of one input share a launch (`SLUICE_CUDA_F8WG_MANY=0`:
/// one launch each, to compare).
fn many_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_F8WG_MANY").map(|v| v != "0").unwrap_or(true))
}

/// Whether the pair kernels may take SwiGLU pairs (`SLUICE_CUDA_F8WG_PAIR=0`: never, the
/// v2 pair kernel runs them, to compare).
fn pairs_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_F8WG_PAIR").map(|v| v != "0").unwrap_or(true))
}

/// The plan for `op` over `w` when these kernels take it (`SLUICE_CUDA_F8WG` respected).
pub(crate) fn f8wg_plan(gpu: &Gpu, op: &Operand, w: &CudaWeight) -> Option<F8wgPlan> {
    if !enabled() {
        return None;
    }
    f8wg_plan_always(gpu, op, w)
}

/// [`f8wg_plan`] whatever `SLUICE_CUDA_F8WG` says: FP8 weights on an sm_90 GPU (the
/// kernels are compiled for compute_90a there), one or two rows, whole 64-row tiles (in
/// every group of a grouped product), K a multiple of 128, 16-byte aligned activation
/// rows. The K split is the one that gives the busiest block the least work (its weight
/// bytes and [`TILE_COST`] a tile) when the grid is what the GPU holds at once (the
/// driver's occupancy for the kernel, its shared memory and its cluster size); ties go to
/// the smaller split.
pub(crate) fn f8wg_plan_always(gpu: &Gpu, op: &Operand, w: &CudaWeight) -> Option<F8wgPlan> {
    let stages = stages();
    let names = |rows: usize| &F8WG_KERNELS[if stages == 4 { 8 } else { 0 } + 4 * (rows - 1)..][..4];
    plan_of(gpu, op, w, w.rows, stages, 1, names)
}

/// The plan of several FP8 products of the contiguous activations `x` (`rows` rows)
/// in one launch, when these kernels take them (`SLUICE_CUDA_F8WG` and
/// `SLUICE_CUDA_F8WG_MANY` respected): 2 to [`F8WG_MANY_MAX`] FP8 weights of one K, each
/// of whole 128-row scale blocks (so every product's tiles start a scale row), the
/// rules of [`f8wg_plan_always`] over all their tiles.
pub(crate) fn f8wg_many_plan(gpu: &Gpu, x: u64, rows: usize, ws: &[&CudaWeight]) -> Option<F8wgPlan> {
    let k = ws.first()?.cols;
    let fits = ws.iter().all(|w| f8wg_many_member(w) && w.cols == k);
    if !enabled() || !many_enabled() || !(2..=F8WG_MANY_MAX).contains(&ws.len()) || !fits {
        return None;
    }
    let n = ws.iter().map(|w| w.rows).sum();
    let op = Operand::contiguous(x, 0, rows, 1, ws[0]);
    plan_of(gpu, &op, ws[0], n, 4, 1, |rows| &F8WG_MANY_KERNELS[4 * (rows - 1)..][..4])
}

/// Whether `w` may be one of the products of a `gemv_f8wg_many_*` launch: FP8, of whole
/// 128-row scale blocks (so every product's tiles start a scale row).
pub(crate) fn f8wg_many_member(w: &CudaWeight) -> bool {
    matches!(w.data, WeightData::Fp8 { .. }) && w.rows > 0 && w.rows.is_multiple_of(2 * TILE)
}

/// The plan of a SwiGLU pair `w1`, `w3` (the same shape, both FP8) for `op`, when these
/// kernels take it (`SLUICE_CUDA_F8WG` respected): the rules of [`f8wg_plan_always`] for a
/// plain product, a ring of 4 chunks, each tile streaming both matrices
/// (`SLUICE_CUDA_F8WG_PAIR=0` respected too).
pub(crate) fn f8wg_pair_plan(gpu: &Gpu, op: &Operand, w1: &CudaWeight, w3: &CudaWeight) -> Option<F8wgPlan> {
    let both_fp8 = matches!(w3.data, WeightData::Fp8 { .. }) && (w1.rows, w1.cols) == (w3.rows, w3.cols);
    if !enabled() || !pairs_enabled() || !both_fp8 || op.groups != 1 {
        return None;
    }
    plan_of(gpu, op, w1, w1.rows, 4, 2, |rows| &F8WG_PAIR_KERNELS[4 * (rows - 1)..][..4])
}

/// [`f8wg_plan_always`]'s rules for `n` output rows of weights of `w`'s K and format
/// (`matrices` of them a tile), the kernels of each K split (in [`SPLITS`] order) from
/// `names(rows)`.
fn plan_of(
    gpu: &Gpu,
    op: &Operand,
    w: &CudaWeight,
    n: usize,
    stages: usize,
    matrices: usize,
    names: impl Fn(usize) -> &'static [&'static str],
) -> Option<F8wgPlan> {
    if !matches!(w.data, WeightData::Fp8 { .. }) || gpu.cc.0 != 9 || !(1..=2).contains(&op.rows) || op.groups == 0 {
        return None;
    }
    let k = w.cols;
    let grouped = op.groups > 1;
    let whole_tiles =
        n.is_multiple_of(TILE) && (!grouped || (n.is_multiple_of(op.groups) && (n / op.groups).is_multiple_of(TILE)));
    let aligned = op.x.is_multiple_of(16) && op.x_stride.is_multiple_of(4);
    if !whole_tiles || !aligned || !k.is_multiple_of(CHUNK_INPUTS) || n.checked_mul(k).is_none_or(|b| b >= 1 << 31) {
        return None;
    }
    let tiles = n / TILE;
    let names = names(op.rows);
    let mut best: Option<(usize, F8wgPlan)> = None;
    for (i, &split) in SPLITS.iter().enumerate() {
        if !k.is_multiple_of(split * CHUNK_INPUTS) {
            continue;
        }
        let smem = stages * TILE * CHUNK_INPUTS + 8 * (k / split) + ALIGN_SLACK;
        if smem > F8WG_MAX_SMEM {
            continue;
        }
        let name = names[i];
        let clusters = tiles.min(resident(gpu, name, split, smem));
        let busiest = tiles.div_ceil(clusters) * (matrices * k / split + TILE_COST);
        if best.as_ref().is_none_or(|(b, _)| busiest < *b) {
            best = Some((busiest, F8wgPlan { name, split, tiles, grid: clusters * split, smem }));
        }
    }
    best.map(|(_, plan)| plan)
}

/// Launch `plan` (from [`f8wg_pair_plan`]) for `op` over the SwiGLU pair `w1`, `w3`.
pub(crate) fn f8wg_pair(gpu: &Gpu, plan: &F8wgPlan, op: Operand, w1: &CudaWeight, w3: &CudaWeight, limit: f32) {
    let a = F8Args::new(&op, w1, plan.tiles);
    let (w3p, s3) = w3.ptrs();
    let args = WgPairArgs {
        map: weight_map(a.w, w1.rows, w1.cols),
        map3: weight_map(w3p, w3.rows, w3.cols),
        a,
        scales3: s3,
        limit,
        pad: [0; 13],
    };
    debug_assert!(plan.grid.is_multiple_of(plan.split));
    launch!(gpu, plan.name, cfg((plan.grid as u32, 1, 1), THREADS, plan.smem as u32), args);
}

/// Launch `plan` for `op` over `w`.
pub(crate) fn f8wg_gemv(gpu: &Gpu, plan: &F8wgPlan, op: Operand, w: &CudaWeight) {
    let a = F8Args::new(&op, w, plan.tiles);
    let args = WgArgs { map: weight_map(a.w, w.rows, w.cols), a };
    debug_assert!(plan.grid.is_multiple_of(plan.split));
    launch!(gpu, plan.name, cfg((plan.grid as u32, 1, 1), THREADS, plan.smem as u32), args);
}

/// Launch `plan` (from [`f8wg_many_plan`]) for the products `ws` (weight, contiguous
/// output `[rows, weight rows]`) of the contiguous activations `x`.
pub(crate) fn f8wg_many(gpu: &Gpu, plan: &F8wgPlan, x: u64, rows: usize, ws: &[(&CudaWeight, u64)]) {
    let (w0, out0) = ws[0];
    let mut args = WgManyArgs {
        maps: [[0; 16]; F8WG_MANY_MAX],
        a: F8Args::new(&Operand::contiguous(x, out0, rows, 1, w0), w0, plan.tiles),
        scales: [0; F8WG_MANY_MAX],
        outs: [0; F8WG_MANY_MAX],
        first: [0; F8WG_MANY_MAX + 1],
        n: [0; F8WG_MANY_MAX],
        count: ws.len() as i32,
        pad: [0; 6],
    };
    let mut tile = 0;
    for (i, &(w, out)) in ws.iter().enumerate() {
        let (wp, sp) = w.ptrs();
        args.maps[i] = weight_map(wp, w.rows, w.cols);
        args.scales[i] = sp;
        args.outs[i] = out;
        args.first[i] = tile as i32;
        args.n[i] = w.rows as i32;
        tile += w.rows / TILE;
    }
    // The total after the last product (and in the unused entries' places).
    args.first[ws.len()..].fill(tile as i32);
    debug_assert_eq!(tile, plan.tiles);
    debug_assert!(plan.grid.is_multiple_of(plan.split));
    launch!(gpu, plan.name, cfg((plan.grid as u32, 1, 1), THREADS, plan.smem as u32), args);
}
