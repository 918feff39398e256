//! Prefill-sized products of FP4 and FP8 weights on Hopper's warpgroup instruction
//! (cu/moe_fp4wg.cu): the rows as bf16 parts (`fp4wg_parts`: one, or two in split
//! activations), then one launch a projection and tile height over tiles of up to 128
//! rows (256 over one plane: [`wide_tiles`]), each block 128 outputs (256 on FP4's short
//! tiles) × one tile, the codes turned into bf16 in registers. [`super::moe_host`] runs
//! the routed FP4 experts on `fp4wg_gemm` (tiles of one expert's rows) and
//! [`super::matmul`] FP8 products of more rows than the gemv launches take on
//! `fp8wg_gemm` (decode batches from 9 rows, split along K where their blocks would not
//! fill the GPU, `fw_split_sum` adding the slices), both on sm_90 instead of the
//! `gemm_fp4` / `gemm_fp8` tiles; `SLUICE_CUDA_FP4WG=0` keeps the tiles.

use cudarc::driver::DeviceRepr;
use cudarc::driver::sys::CUtensorMapDataType;

use super::CudaBackend;
use super::gemv_f8wg::swizzled_map;
use super::matmul::{GEMM_BM, Operand};
use super::memory::{CudaWeight, WeightData};
use super::runtime::{DevBuf, Gpu, cfg, cfg_elems, launch};
use crate::Activations;
use crate::backend::MoeWeights;

/// The kernels: the products (with their dynamic shared memory, opted in at load) — FP4
/// and FP8, each plain and `_p`, each for tiles of 128 rows and `_n64` of 64, then FP4's
/// short tiles, plain and `_p`: `_n32` of 32 rows, `_n32w` (four warpgroups, 256 outputs
/// a block), `_n16` of 16 rows and `_n16w` — then the parts and the sum of a product
/// split along K. A product's index: FP8 + 2 · `_p` + 4 · `_n64`; FP4's short tiles
/// [`ShortTiles::kernel`].
pub(crate) const FP4WG_KERNELS: [&str; 18] = [
    "fp4wg_gemm",
    "fp8wg_gemm",
    "fp4wg_gemm_p",
    "fp8wg_gemm_p",
    "fp4wg_gemm_n64",
    "fp8wg_gemm_n64",
    "fp4wg_gemm_p_n64",
    "fp8wg_gemm_p_n64",
    "fp4wg_gemm_n32",
    "fp4wg_gemm_p_n32",
    "fp4wg_gemm_n32w",
    "fp4wg_gemm_p_n32w",
    "fp4wg_gemm_n16",
    "fp4wg_gemm_p_n16",
    "fp4wg_gemm_n16w",
    "fp4wg_gemm_p_n16w",
    "fp4wg_parts",
    "fw_split_sum",
];
/// The products of [`FP4WG_KERNELS`] (the same index) over one plane of parts: the rows
/// rounded once to bf16 (`Activations::Bf16`, the default; [`Parts`]).
pub(crate) const FP4WG_ONE_PART_KERNELS: [&str; 16] = [
    "fp4wg1_gemm",
    "fp8wg1_gemm",
    "fp4wg1_gemm_p",
    "fp8wg1_gemm_p",
    "fp4wg1_gemm_n64",
    "fp8wg1_gemm_n64",
    "fp4wg1_gemm_p_n64",
    "fp8wg1_gemm_p_n64",
    "fp4wg1_gemm_n32",
    "fp4wg1_gemm_p_n32",
    "fp4wg1_gemm_n32w",
    "fp4wg1_gemm_p_n32w",
    "fp4wg1_gemm_n16",
    "fp4wg1_gemm_p_n16",
    "fp4wg1_gemm_n16w",
    "fp4wg1_gemm_p_n16w",
];
/// Outputs of a block (`FW_BN`: two warpgroups; four in the `w` kernels), rows of a full
/// tile (the host's [`GEMM_BM`]) and of a small one; the parts' rows are a multiple of
/// FP4's chunk of inputs (FP8's is 64).
const BLOCK_OUTPUTS: usize = 128;
const WIDE_BLOCK_OUTPUTS: usize = 256;
const TILE_ROWS: usize = 128;
const SMALL_TILE_ROWS: usize = 64;
/// Rows of FP8's wide tiles (`fp8wg1_gemm_p_n256`: one plane of parts).
const WIDE_TILE_ROWS: usize = 256;
/// Rows of FP4's short tiles (the `_n32` and `_n16` kernels).
const TINY_TILE_ROWS: usize = 32;
const SHORTEST_TILE_ROWS: usize = 16;
const CHUNK_INPUTS: usize = 128;
/// Inputs of an FP8 chunk (`FW_KC`): the unit a product split along K is cut in.
pub(crate) const FP8_CHUNK_INPUTS: usize = 64;
const _: () = assert!(TILE_ROWS == GEMM_BM, "fp4wg_gemm's token tiles are the grouped tiles' row tiles");
/// Dynamic shared memory of a product kernel of `chunk` inputs a chunk, `stages` stages,
/// tiles of `rows` rows and `outputs` outputs a block (`FW_STAGE`: the tile's two bf16
/// parts, the block's codes — 64 bytes a row — and FP4's scale bytes), and 1 KiB to align
/// them.
const fn smem(chunk: usize, stages: usize, rows: usize, outputs: usize) -> usize {
    stages * (2 * 2 * rows * chunk + outputs * 64 + 1024) + 1024
}
/// Products over one plane of parts in tiles of 256 rows ([`wide_tiles`]), FP8 and FP4,
/// with their shared memory: `FW_S` stages (FP8 5, FP4 3) of one plane's 256-row boxes,
/// the codes and 1 KiB, and 1 KiB to align them.
pub(crate) const WIDE_KERNELS: [(&str, usize); 2] = [
    ("fp8wg1_gemm_p_n256", 5 * (2 * WIDE_TILE_ROWS * FP8_CHUNK_INPUTS + BLOCK_OUTPUTS * 64 + 1024) + 1024),
    ("fp4wg1_gemm_p_n256", 3 * (2 * WIDE_TILE_ROWS * CHUNK_INPUTS + BLOCK_OUTPUTS * 64 + 1024) + 1024),
];

/// Whether a product's rows (a plain FP8 product's, or each FP4 expert's) go in tiles of
/// 256 ([`WIDE_KERNELS`]): one plane of parts (bf16 activations), the `_p` kernels, no
/// split along K. Each converted weight fragment and each chunk's barrier and waits then
/// serve twice the products of a 128-row tile (`SLUICE_CUDA_FP4WG_N256=0`, read once:
/// tiles of at most 128).
pub(crate) fn wide_tiles(planes: usize, splits: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("SLUICE_CUDA_FP4WG_N256").map(|v| v != "0").unwrap_or(true));
    on && planes == 1 && splits == 1 && pipelined()
}

/// Planes of parts a product on `gpu` reads: 1 in bf16 activations, 2 split.
pub(crate) fn planes(gpu: &Gpu) -> usize {
    if gpu.activations == Activations::Bf16 { 1 } else { 2 }
}

/// Rows are cut into 256-row tiles while more than this many are left (every wide tile
/// at least three quarters full), the rest into 128s.
const WIDE_MIN_ROWS: usize = 192;

/// [`WIDE_MIN_ROWS`], or `SLUICE_CUDA_FP4WG_N256_FROM` (read once, 128–255): an expert of
/// 129–192 rows then takes one wide tile instead of 128 rows and a short tile that
/// streams its weights again.
fn wide_min_rows() -> usize {
    static ONCE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ONCE.get_or_init(|| {
        super::runtime::env_rows("SLUICE_CUDA_FP4WG_N256_FROM").map_or(WIDE_MIN_ROWS, |r| r.clamp(TILE_ROWS, 255))
    })
}

/// Tiles (expert, first row, rows) of `rows` rows of expert `expert` from row `first`:
/// 256 rows while more than [`WIDE_MIN_ROWS`] are left when `wide`, then 128.
pub(crate) fn row_tiles_into(tiles: &mut Vec<i32>, expert: usize, first: usize, rows: usize, wide: bool) {
    let mut r = 0;
    while r < rows {
        let n = if wide && rows - r > wide_min_rows() { WIDE_TILE_ROWS } else { TILE_ROWS }.min(rows - r);
        tiles.extend_from_slice(&[expert as i32, (first + r) as i32, n as i32]);
        r += n;
    }
}

/// A plain product's row tiles ([`row_tiles_into`] of expert 0 from row 0).
fn row_tiles(rows: usize, wide: bool) -> Vec<i32> {
    let mut tiles = Vec::new();
    row_tiles_into(&mut tiles, 0, 0, rows, wide);
    tiles
}

/// Dynamic shared memory of the products, in [`FP4WG_KERNELS`]' order (`FW_S`: FP4's
/// shorter tiles have smaller stages and more of them).
pub(crate) const FP4WG_SMEM: [usize; 16] = [
    smem(128, 3, 128, 128),
    smem(64, 4, 128, 128),
    smem(128, 3, 128, 128),
    smem(64, 4, 128, 128),
    smem(128, 5, 64, 128),
    smem(64, 4, 64, 128),
    smem(128, 5, 64, 128),
    smem(64, 4, 64, 128),
    smem(128, 8, 32, 128),
    smem(128, 8, 32, 128),
    smem(128, 6, 32, 256),
    smem(128, 6, 32, 256),
    smem(128, 8, 16, 128),
    smem(128, 8, 16, 128),
    smem(128, 8, 16, 256),
    smem(128, 8, 16, 256),
];

/// Which kernels FP4's short tiles take (`SLUICE_CUDA_FP4WG_SHORT`, read once): `n16w`
/// (the default: tiles of at most 16 rows on `_n16w`, 17-32 on `_n32w`, four warpgroups
/// a block), `n16` (on `_n16` and `_n32`, two), `n32w` (at most 32 rows on `_n32w`),
/// `n32` (on `_n32`); `off` (or `SLUICE_CUDA_FP4WG_N32=0`): on `_n64`. A 300-token
/// prefill of 20 V4-Flash layers (~7 rows an expert): `n16w` 3,762 / 3,863 tokens/s
/// against `n32`'s 3,690 / 3,602 (docs/perf.md, "Shorter and wider expert tiles").
#[derive(Clone, Copy, Debug, PartialEq)]
enum ShortTiles {
    Off,
    N32,
    N32Wide,
    N16,
    N16Wide,
}

impl ShortTiles {
    fn from_env() -> Self {
        static ONCE: std::sync::OnceLock<ShortTiles> = std::sync::OnceLock::new();
        *ONCE.get_or_init(|| {
            if std::env::var("SLUICE_CUDA_FP4WG_N32").is_ok_and(|v| v == "0") {
                return ShortTiles::Off;
            }
            match std::env::var("SLUICE_CUDA_FP4WG_SHORT").ok().as_deref() {
                Some("off") => ShortTiles::Off,
                Some("n32") => ShortTiles::N32,
                Some("n32w") => ShortTiles::N32Wide,
                Some("n16") => ShortTiles::N16,
                None | Some("n16w") => ShortTiles::N16Wide,
                Some(other) => {
                    tracing::warn!(
                        value = other,
                        "SLUICE_CUDA_FP4WG_SHORT is none of off, n32, n32w, n16, n16w: using n16w"
                    );
                    ShortTiles::N16Wide
                }
            }
        })
    }

    /// The kernel ([`FP4WG_KERNELS`]' index) of list `list` (2: tiles of 17-32 rows, 3: of
    /// at most 16; [`split_tiles`]) for a product of `outputs` outputs: a wide kernel only
    /// where the outputs are whole 256-output blocks.
    fn kernel(self, list: usize, pipelined: bool, outputs: usize) -> usize {
        let wide =
            matches!(self, ShortTiles::N32Wide | ShortTiles::N16Wide) && outputs.is_multiple_of(WIDE_BLOCK_OUTPUTS);
        let n16 = list == 3 && matches!(self, ShortTiles::N16 | ShortTiles::N16Wide);
        8 + 4 * usize::from(n16) + 2 * usize::from(wide) + usize::from(pipelined)
    }
}

/// Outputs a block of kernel `kernel` computes, and its threads.
fn block_shape(kernel: usize) -> (usize, u32) {
    if FP4WG_KERNELS[kernel].ends_with('w') { (WIDE_BLOCK_OUTPUTS, 512) } else { (BLOCK_OUTPUTS, 256) }
}

/// Rows of the tiles kernel `kernel` takes (`BT`: its name's `_n64`, `_n32`, `_n16`; else 128).
fn tile_rows(kernel: usize) -> usize {
    let name = FP4WG_KERNELS[kernel];
    [("_n64", SMALL_TILE_ROWS), ("_n32", TINY_TILE_ROWS), ("_n16", SHORTEST_TILE_ROWS)]
        .into_iter()
        .find(|(tag, _)| name.contains(tag))
        .map_or(TILE_ROWS, |(_, rows)| rows)
}

/// Box rows of [`Parts::maps`], in order (the lists of [`split_tiles`]).
const MAP_ROWS: [usize; 5] = [TILE_ROWS, SMALL_TILE_ROWS, TINY_TILE_ROWS, SHORTEST_TILE_ROWS, WIDE_TILE_ROWS];

/// `Fp4wgArgs` in moe_fp4wg.cu.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Fp4wgArgs {
    parts: [u64; 16],
    out: u64,
    wtab: u64,
    tiles: u64,
    k: i32,
    plane: i32,
    g_out: i32,
    out_stride: i32,
    /// Blocks along K (the launch's z): each writes its slice's sums to its own plane.
    splits: i32,
    /// Floats between two slices' planes in `out` (when `splits` > 1).
    split_stride: i32,
    /// Zero: no undefined padding bytes in a launch's arguments.
    pad: [u32; 20],
}

// SAFETY: a plain #[repr(C)] struct of integers without padding, `struct Fp4wgArgs` in
// moe_fp4wg.cu (both 64-byte aligned, the map first).
unsafe impl DeviceRepr for Fp4wgArgs {}
const _: () = assert!(std::mem::size_of::<Fp4wgArgs>() == 128 + 3 * 8 + 26 * 4, "Fp4wgArgs has padding");

fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_FP4WG").map(|v| v != "0").unwrap_or(true))
}

/// Whether the routed experts' products take these kernels: an sm_90 GPU (compiled for
/// compute_90a there), every projection of every expert FP4 with scales in 2^-23..2^1
/// (the codes' bf16 scaling is exact there), widths multiples of the block's 128 outputs
/// and the 128-input chunk (V4-Flash: 2048 and 4096).
pub(crate) fn takes(gpu: &Gpu, w: &MoeWeights<CudaBackend>) -> bool {
    let fits = |m: &CudaWeight| {
        matches!(m.data, WeightData::Fp4 { tc: true, .. })
            && m.rows.is_multiple_of(BLOCK_OUTPUTS)
            && m.cols.is_multiple_of(CHUNK_INPUTS)
            && m.rows * m.cols < 1 << 31
    };
    available(gpu) && w.experts.iter().all(|e| fits(&e.w1) && fits(&e.w3) && fits(&e.w2))
}

/// The `_p` kernels, which convert a chunk's codes while the chunk before is multiplied
/// (only S − 2 chunks of the ring ahead); `SLUICE_CUDA_FP4WG_PIPE=0` (read once) runs the
/// others, which wait for each chunk's products before converting the next.
fn pipelined() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_FP4WG_PIPE").map(|v| v != "0").unwrap_or(true))
}

/// Whether tiles of at most 64 rows take the `_n64` kernels (`SLUICE_CUDA_FP4WG_N64=0`,
/// read once: every tile takes the 128-row ones).
fn small_tiles() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_FP4WG_N64").map(|v| v != "0").unwrap_or(true))
}

/// A tile list (expert, first row, rows; at most 256 rows a tile) split for the launches:
/// tiles of 65-128 rows, those of at most 64, (FP4's, `fp4`) those of 17-32 and of at
/// most 16 ([`ShortTiles`]: into the second with `off`; all in the first with
/// `SLUICE_CUDA_FP4WG_N64=0`), and the wide ones of more than 128 ([`row_tiles_into`]).
fn split_tiles(tiles: &[i32], fp4: bool) -> [Vec<i32>; 5] {
    let short = fp4 && ShortTiles::from_env() != ShortTiles::Off;
    let mut lists = [Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    for t in tiles.chunks_exact(3) {
        let rows = t[2] as usize;
        let list = if rows > TILE_ROWS {
            4
        } else if !small_tiles() || rows > SMALL_TILE_ROWS {
            0
        } else if !short || rows > TINY_TILE_ROWS {
            1
        } else if rows > SHORTEST_TILE_ROWS {
            2
        } else {
            3
        };
        lists[list].extend_from_slice(t);
    }
    lists
}

/// A product's tiles on the device, by height ([`split_tiles`]): (address, count) each.
pub(crate) struct DeviceTiles {
    lists: [(u64, usize); 5],
    /// Held while the launches are queued (uploaded lists; empty for cached tables).
    _bufs: Vec<DevBuf<i32>>,
}

/// An expert tile list (different every prefill) by height, as [`DeviceTiles::at`]
/// finds them once copied to the device one after another.
pub(crate) fn tile_lists(tiles: &[i32]) -> [Vec<i32>; 5] {
    split_tiles(tiles, true)
}

/// An expert tile list uploaded for the launches (the benchmark's; the engine copies its
/// lists with the rest of a MoE block's, `moe_host.rs`).
pub(crate) fn upload_tiles(gpu: &Gpu, tiles: &[i32]) -> DeviceTiles {
    let lists = tile_lists(tiles);
    let buf = gpu.upload(&lists.concat());
    DeviceTiles::at(gpu.ptr(&buf), &lists).holding(buf)
}

impl DeviceTiles {
    fn holding(mut self, buf: DevBuf<i32>) -> DeviceTiles {
        self._bufs.push(buf);
        self
    }

    /// The lists of [`tile_lists`] copied to device address `at` one after another (the
    /// caller keeps that memory while the launches are queued).
    pub(crate) fn at(at: u64, lists: &[Vec<i32>; 5]) -> DeviceTiles {
        let mut next = at;
        let lists = std::array::from_fn(|i| {
            let l = &lists[i];
            let here = (if l.is_empty() { 0 } else { next }, l.len() / 3);
            next += 4 * l.len() as u64;
            here
        });
        DeviceTiles { lists, _bufs: Vec::new() }
    }
}

/// Whether the kernels run here at all: an sm_90 GPU and `SLUICE_CUDA_FP4WG` not 0.
pub(crate) fn available(gpu: &Gpu) -> bool {
    enabled() && gpu.cc.0 == 9
}

/// Whether an FP8 product of `op` over `w` takes `fp8wg_gemm`: an sm_90 GPU, block scales
/// where the codes' bf16 scaling is exact, whole 128-output blocks in every group, K a
/// multiple of 128 (V4-Flash: every FP8 projection).
pub(crate) fn fp8_takes(gpu: &Gpu, op: &Operand, w: &CudaWeight) -> bool {
    let g_out = w.rows / op.groups.max(1);
    matches!(w.data, WeightData::Fp8 { bf16_exact: true, .. })
        && available(gpu)
        && g_out.is_multiple_of(BLOCK_OUTPUTS)
        && w.cols.is_multiple_of(CHUNK_INPUTS)
        && w.rows * w.cols < 1 << 31
        && op.rows > 0
}

/// `op.out = op.x · Wᵀ` (or grouped: group g of outputs reads inputs gK..gK+K) on
/// `fp8wg_gemm`, every row in tiles of 128 or 256 ([`fp8_takes`] holds), its inputs cut into
/// `splits` slices of whole chunks ([`fp8_product_of`]).
pub(crate) fn fp8_product(gpu: &Gpu, op: Operand, w: &CudaWeight, splits: usize) {
    let parts = parts(gpu, op.x, op.x_stride, op.rows, op.groups * w.cols, true);
    fp8_product_of(gpu, &parts, op, w, splits);
}

/// [`fp8_product`] from the rows' parts made already (`op.x` unread: products of one
/// input share them). With more than one slice along K (at most one a chunk) each
/// slice's blocks write partial sums to a plane of their own and `fw_split_sum` adds the
/// planes in order into `op.out`: the few blocks of a narrow product at decode batch
/// sizes then still fill the GPU ([`super::matmul::fp8_splits`]).
pub(crate) fn fp8_product_of(gpu: &Gpu, parts: &Parts, op: Operand, w: &CudaWeight, splits: usize) {
    assert_eq!((parts.rows, parts.k), (op.rows, op.groups * w.cols), "fp8wg: parts of another shape");
    let splits = splits.clamp(1, w.cols / FP8_CHUNK_INPUTS);
    let tiles = row_tiles(op.rows, wide_tiles(parts.planes, splits));
    // The tile lists as the i32 words of cached device tables (the same for every product
    // of this many rows — bounded by the largest batch — and safe to name from a recorded
    // decode step).
    let lists = split_tiles(&tiles, false).map(|l| {
        let words: Vec<u64> =
            l.chunks(2).map(|p| u64::from(p[0] as u32) | u64::from(*p.get(1).unwrap_or(&0) as u32) << 32).collect();
        if l.is_empty() { (0, 0) } else { (gpu.constant_table(&words), l.len() / 3) }
    });
    let (wp, sp) = w.ptrs();
    let wtab = gpu.constant_table(&[wp, sp]);
    let tiles = DeviceTiles { lists, _bufs: Vec::new() };
    if splits == 1 {
        let out = Output { at: op.out, stride: op.out_stride, splits: 1, split_stride: 0 };
        return launch_products(gpu, true, parts, w, &tiles, wtab, out, w.rows / op.groups);
    }
    let plane = op.rows * w.rows;
    let partial = gpu.alloc::<f32>(splits * plane);
    let out = Output { at: gpu.ptr(&partial), stride: w.rows, splits, split_stride: plane };
    launch_products(gpu, true, parts, w, &tiles, wtab, out, w.rows / op.groups);
    launch!(
        gpu,
        "fw_split_sum",
        cfg_elems(plane),
        op.out,
        op.out_stride as i32,
        gpu.ptr(&partial),
        op.rows as i32,
        w.rows as i32,
        splits as i32
    );
}

/// Where a product's sums go: `stride` floats a row, and with `splits` slices along K a
/// plane of partial sums a slice, `split_stride` floats apart.
struct Output {
    at: u64,
    stride: usize,
    splits: usize,
    split_stride: usize,
}

/// Rows rounded once to bf16 (`Activations::Bf16`, the default: the reference model's
/// activations, one plane of `rows × k` values), or as two bf16 parts (`Split`: two
/// planes, twice the bytes and products, results at f32 distance from the CPU engine),
/// in a kernel's input order.
pub(crate) struct Parts {
    /// Held while the parts are in use: the map points into it.
    _values: DevBuf<u16>,
    rows: usize,
    k: usize,
    /// Planes: 2 (hi + lo) or 1 (hi alone).
    planes: usize,
    /// Tensor maps of boxes of 128, 64 (the `_n64` kernels'), 32 and 16 rows (`_n32`,
    /// `_n16`: FP4's order only, zeros for FP8's, whose tiles never take those kernels)
    /// and 256 (one plane of more than 192 rows only: [`WIDE_KERNELS`]).
    maps: [[u64; 16]; 5],
}

/// `rows` rows of `k` f32 values at `x` (`x_stride` apart) as [`Parts`] in the FP4
/// (`fp8` false) or the FP8 kernel's input order: a block a row, and at decode batch
/// sizes several ([`parts_slices`]).
pub(crate) fn parts(gpu: &Gpu, x: u64, x_stride: usize, rows: usize, k: usize, fp8: bool) -> Parts {
    parts_from(gpu, PartsOf { x, x_stride, rows_of: 0, up: 0, limit: 0.0 }, rows, k, fp8)
}

/// [`parts`] (FP4 order) of the rows `rows_of` names (`rows` i32 row indices of x, `k`
/// apart, on the device): a MoE block's routed rows in expert order, gathered as they are
/// split.
pub(crate) fn parts_of_rows(gpu: &Gpu, x: u64, rows_of: u64, rows: usize, k: usize) -> Parts {
    parts_from(gpu, PartsOf { x, x_stride: k, rows_of, up: 0, limit: 0.0 }, rows, k, false)
}

/// [`parts`] (FP4 order) of `silu(min(h, limit)) * clamp(up, ±limit)` over `rows` rows of
/// `k` (the experts' SwiGLU, as `swiglu_act` computes it, bit for bit), without writing
/// it to memory first.
pub(crate) fn parts_of_swiglu(gpu: &Gpu, h: u64, up: u64, limit: f32, rows: usize, k: usize) -> Parts {
    parts_from(gpu, PartsOf { x: h, x_stride: k, rows_of: 0, up, limit }, rows, k, false)
}

/// What `fp4wg_parts` splits: rows of x (`rows_of`: device row indices, or 0 for in
/// order), or the SwiGLU of x and `up` (same layout; `up` 0: none).
struct PartsOf {
    x: u64,
    x_stride: usize,
    rows_of: u64,
    up: u64,
    limit: f32,
}

fn parts_from(gpu: &Gpu, of: PartsOf, rows: usize, k: usize, fp8: bool) -> Parts {
    let PartsOf { x, x_stride, rows_of, up, limit } = of;
    assert!(k.is_multiple_of(CHUNK_INPUTS) && rows > 0, "fp4wg_parts: {rows} rows of {k} inputs");
    let planes = planes(gpu);
    let values = gpu.alloc::<u16>(planes * rows * k);
    launch!(
        gpu,
        "fp4wg_parts",
        cfg((rows as u32, parts_slices(gpu, rows, k) as u32, 1), 128, 0),
        gpu.ptr(&values),
        x,
        rows as i32,
        k as i32,
        x_stride as i32,
        rows as i32,
        i32::from(fp8),
        i32::from(planes == 2),
        rows_of,
        up,
        limit
    );
    let at = gpu.ptr(&values);
    // (The maps are encoded on the host for every set of parts, FP8's of each decode
    // product of 9-64 rows too: the short tiles' only where they can be used.)
    let maps = MAP_ROWS.map(|box_rows| {
        let used = match (fp8, box_rows) {
            (_, WIDE_TILE_ROWS) => planes == 1 && rows > wide_min_rows(),
            (true, r) => r >= SMALL_TILE_ROWS,
            (false, _) => true,
        };
        if used { parts_map(at, planes * rows, k, box_rows) } else { [0; 16] }
    });
    Parts { _values: values, rows, k, planes, maps }
}

/// Blocks a row of `fp4wg_parts`: enough for `SLUICE_CUDA_FP4WG_PARTS_BLOCKS` blocks in
/// all (read once; default twice the SMs; 0 or 1: a block a row), each at least 1,024
/// inputs (a pass of its 128 threads). A block a row left a decode batch's 64 rows of
/// `wo_a`'s 32,768 inputs ~65 µs on 64 SMs (docs/perf.md).
fn parts_slices(gpu: &Gpu, rows: usize, k: usize) -> usize {
    static ONCE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let target = ONCE.get_or_init(|| super::runtime::env_rows("SLUICE_CUDA_FP4WG_PARTS_BLOCKS")).unwrap_or(2 * gpu.sms);
    target.div_ceil(rows).clamp(1, (k / 1024).max(1))
}

/// `out[position][w.rows] = parts · Wᵀ` over the listed tiles of one expert's positions
/// (`wtab`: (codes, scale bytes) of each expert's matrix; `w` any one of them, for the
/// shape), the parts in the FP4 order.
pub(crate) fn product(gpu: &Gpu, parts: &Parts, w: &CudaWeight, tiles: &DeviceTiles, wtab: u64, out: u64) {
    let out = Output { at: out, stride: w.rows, splits: 1, split_stride: 0 };
    launch_products(gpu, false, parts, w, tiles, wtab, out, w.rows);
}

/// The launches of one product, a kernel a tile height: `fp8` picks the FP8 kernels,
/// [`pipelined`] the `_p` ones.
#[allow(clippy::too_many_arguments)]
fn launch_products(
    gpu: &Gpu,
    fp8: bool,
    parts: &Parts,
    w: &CudaWeight,
    tiles: &DeviceTiles,
    wtab: u64,
    out: Output,
    g_out: usize,
) {
    for (list, &(at, count)) in tiles.lists.iter().enumerate() {
        if count == 0 {
            continue;
        }
        assert!(list < 2 || list == 4 || !fp8, "FP8 products have no short-tile kernels");
        let (name, outputs, threads, smem, box_rows) = if list == 4 {
            assert_eq!(parts.planes, 1, "only products over one plane of parts have 256-row tiles");
            let (name, smem) = WIDE_KERNELS[usize::from(!fp8)];
            (name, BLOCK_OUTPUTS, 256, smem, WIDE_TILE_ROWS)
        } else {
            let kernel = match list {
                0 | 1 => usize::from(fp8) + 2 * usize::from(pipelined()) + 4 * list,
                _ => ShortTiles::from_env().kernel(list, pipelined(), w.rows),
            };
            let (outputs, threads) = block_shape(kernel);
            let name = if parts.planes == 1 { FP4WG_ONE_PART_KERNELS[kernel] } else { FP4WG_KERNELS[kernel] };
            (name, outputs, threads, FP4WG_SMEM[kernel], tile_rows(kernel))
        };
        // The parts' map of the kernel's tile height: its TMA boxes must be the bytes its
        // barrier expects (a 32-row kernel given 16-row boxes would wait forever).
        let map = MAP_ROWS.iter().position(|&r| r == box_rows).expect("a map for every tile height");
        assert_ne!(parts.maps[map], [0; 16], "{name}: no tensor map of {box_rows}-row boxes for these parts");
        assert_eq!(parts.k % w.cols, 0, "{name}: the weight's inputs do not divide the parts'");
        let args = Fp4wgArgs {
            parts: parts.maps[map],
            out: out.at,
            wtab,
            tiles: at,
            k: w.cols as i32,
            plane: parts.rows as i32,
            g_out: g_out as i32,
            out_stride: out.stride as i32,
            splits: out.splits as i32,
            split_stride: out.split_stride as i32,
            pad: [0; 20],
        };
        let grid = ((w.rows / outputs) as u32, count as u32, out.splits as u32);
        launch!(gpu, name, cfg(grid, threads, smem as u32), args);
    }
}

/// The tensor map of the parts (`rows` rows of `k` bf16 values at `at`): boxes of 64
/// values (128 bytes) × `box_rows` rows, 128-byte swizzle; rows past the end read as zeros.
fn parts_map(at: u64, rows: usize, k: usize, box_rows: usize) -> [u64; 16] {
    let bf16 = (CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2);
    swizzled_map(at, bf16, (k, rows), [64, box_rows as u32], "fp4wg parts")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tiles go to the kernels of their height: more than 64 rows to the 128-row ones, at
    /// most 64 to `_n64`, and an FP4 expert's of 17-32 and of at most 16 to the short
    /// tiles' lists (FP8 products keep theirs on `_n64`). Unless the knobs turn a height
    /// off in this process's environment.
    #[test]
    fn tiles_go_to_the_kernels_of_their_height() {
        if !small_tiles() || ShortTiles::from_env() == ShortTiles::Off {
            eprintln!("skipped: SLUICE_CUDA_FP4WG_N64 or _N32 is 0 here");
            return;
        }
        // (expert, first row, rows)
        let tiles = [0, 0, 128, 0, 128, 65, 1, 193, 64, 2, 257, 33, 3, 290, 32, 4, 322, 17, 5, 339, 16, 6, 355, 1];
        let [big, n64, n32, n16, wide] = split_tiles(&tiles, true);
        assert!(wide.is_empty());
        assert_eq!(big, [0, 0, 128, 0, 128, 65]);
        assert_eq!(n64, [1, 193, 64, 2, 257, 33]);
        assert_eq!(n32, [3, 290, 32, 4, 322, 17]);
        assert_eq!(n16, [5, 339, 16, 6, 355, 1]);
        let [big, n64, n32, n16, _] = split_tiles(&tiles, false);
        assert_eq!(big, [0, 0, 128, 0, 128, 65]);
        assert_eq!(n64, [1, 193, 64, 2, 257, 33, 3, 290, 32, 4, 322, 17, 5, 339, 16, 6, 355, 1]);
        assert!(n32.is_empty() && n16.is_empty(), "FP8 products have no short-tile kernels");
    }

    /// A plain FP8 product's rows: tiles of 256 while more than 192 rows are left (none
    /// of them less than three quarters full), the rest in 128s (the last to `_n64` when
    /// it is at most 64); all in 128s without wide tiles. Every row in exactly one tile.
    #[test]
    fn wide_row_tiles_cover_the_rows_once() {
        if wide_min_rows() != WIDE_MIN_ROWS {
            eprintln!("skipped: SLUICE_CUDA_FP4WG_N256_FROM is set here");
            return;
        }
        assert_eq!(row_tiles(8192, true).len(), 3 * 32);
        assert!(row_tiles(8192, true).chunks(3).all(|t| t[2] == 256));
        assert_eq!(row_tiles(193, true), [0, 0, 193]);
        assert_eq!(row_tiles(300, true), [0, 0, 256, 0, 256, 44]);
        assert_eq!(row_tiles(450, true), [0, 0, 256, 0, 256, 194]);
        assert_eq!(row_tiles(640, true), [0, 0, 256, 0, 256, 256, 0, 512, 128]);
        assert_eq!(row_tiles(300, false), [0, 0, 128, 0, 128, 128, 0, 256, 44]);
        for rows in [1, 64, 129, 192, 193, 255, 256, 257, 1000, 8191] {
            for wide in [false, true] {
                let t = row_tiles(rows, wide);
                let mut next = 0;
                for tile in t.chunks(3) {
                    assert_eq!(tile[1], next, "{rows} rows: tiles in order, no gap");
                    assert!(tile[2] > 0 && tile[2] as usize <= if wide { 256 } else { 128 });
                    next += tile[2];
                }
                assert_eq!(next as usize, rows);
                let [big, n64, n32, n16, w] = split_tiles(&t, false);
                assert!(n32.is_empty() && n16.is_empty());
                assert_eq!(big.len() + n64.len() + w.len(), t.len());
                assert!(w.chunks(3).all(|t| t[2] as usize > wide_min_rows()));
            }
        }
    }

    /// Lists copied one after another are found where they were copied: each list's
    /// address is the words before it, an empty list none.
    #[test]
    fn device_tiles_find_their_lists_in_one_copy() {
        let lists = [vec![0, 0, 200], vec![], vec![1, 200, 20, 2, 220, 30], vec![3, 250, 9], vec![]];
        let t = DeviceTiles::at(1000, &lists);
        assert_eq!(t.lists, [(1000, 1), (0, 0), (1012, 2), (1036, 1), (0, 0)]);
    }

    /// Each setting of the short tiles picks kernels of the right height and width: the
    /// 16-row ones only for tiles of at most 16 rows, the wide ones only for whole
    /// 256-output blocks.
    #[test]
    fn short_tiles_pick_their_kernels() {
        let name = |mode: ShortTiles, list, outputs| FP4WG_KERNELS[mode.kernel(list, true, outputs)];
        assert_eq!(name(ShortTiles::N32, 2, 4096), "fp4wg_gemm_p_n32");
        assert_eq!(name(ShortTiles::N32, 3, 4096), "fp4wg_gemm_p_n32");
        assert_eq!(name(ShortTiles::N32Wide, 3, 4096), "fp4wg_gemm_p_n32w");
        assert_eq!(name(ShortTiles::N16, 2, 4096), "fp4wg_gemm_p_n32");
        assert_eq!(name(ShortTiles::N16, 3, 4096), "fp4wg_gemm_p_n16");
        assert_eq!(name(ShortTiles::N16Wide, 2, 4096), "fp4wg_gemm_p_n32w");
        assert_eq!(name(ShortTiles::N16Wide, 3, 4096), "fp4wg_gemm_p_n16w");
        assert_eq!(name(ShortTiles::N16Wide, 3, 384), "fp4wg_gemm_p_n16", "384 outputs are not whole wide blocks");
        assert_eq!(FP4WG_KERNELS[ShortTiles::N16Wide.kernel(3, false, 4096)], "fp4wg_gemm_n16w");
        assert_eq!(block_shape(ShortTiles::N16Wide.kernel(3, true, 4096)), (256, 512));
        // The map each kernel is given has its tiles' height (a 16-row list on a 32-row
        // kernel still gets the 32-row boxes).
        assert_eq!(tile_rows(ShortTiles::N32.kernel(3, true, 4096)), 32);
        assert_eq!(tile_rows(ShortTiles::N32Wide.kernel(3, false, 4096)), 32);
        assert_eq!(tile_rows(ShortTiles::N16Wide.kernel(3, true, 4096)), 16);
        assert_eq!(tile_rows(6), 64);
        assert_eq!(tile_rows(3), 128);
        assert_eq!(block_shape(ShortTiles::N16.kernel(3, true, 4096)), (128, 256));
    }

    /// The shared memory the host opts each product kernel in to is what its ring needs
    /// (`FW_S` stages of `FW_STAGE` bytes and the 1 KiB alignment) and fits an sm_90
    /// block's 227 KiB.
    #[test]
    fn product_kernels_fit_their_shared_memory() {
        assert_eq!(FP4WG_SMEM.len() + 2, FP4WG_KERNELS.len(), "a shared-memory size per product kernel");
        for (name, &bytes) in FP4WG_KERNELS.iter().zip(&FP4WG_SMEM) {
            assert!(bytes <= 227 * 1024, "{name}: {bytes} bytes of shared memory");
        }
        // FP4 tiles of 32 rows: 8 stages of two parts' two 32-row boxes, 8 KiB of codes
        // and 1 KiB for the scale bytes; the wide blocks' 6 stages hold 16 KiB of codes.
        assert_eq!(FP4WG_SMEM[8], 8 * (2 * 2 * 32 * 128 + 128 * 64 + 1024) + 1024);
        assert_eq!(FP4WG_SMEM[11], 6 * (2 * 2 * 32 * 128 + 256 * 64 + 1024) + 1024);
        // The wide tiles: FP8 five stages of one plane's 256 × 64 bf16 box and 8 KiB of
        // codes, FP4 three of two such boxes (128 inputs), the codes and the scale bytes.
        assert_eq!(WIDE_KERNELS[0].1, 5 * (256 * 64 * 2 + 128 * 64 + 1024) + 1024);
        assert_eq!(WIDE_KERNELS[1].1, 3 * (2 * 256 * 64 * 2 + 128 * 64 + 1024) + 1024);
        for (name, bytes) in WIDE_KERNELS {
            assert!(bytes <= 227 * 1024, "{name}: {bytes} bytes of shared memory");
        }
    }

    /// Each one-part kernel is its two-part twin's shape (same index, the `1` after the
    /// format): the launch swaps the name only, so tile heights and block shapes agree.
    #[test]
    fn one_part_kernels_mirror_the_two_part_ones() {
        assert_eq!(FP4WG_ONE_PART_KERNELS.len(), FP4WG_SMEM.len());
        for (two, one) in FP4WG_KERNELS.iter().zip(FP4WG_ONE_PART_KERNELS) {
            assert_eq!(one.replacen("wg1_", "wg_", 1), *two);
        }
    }
}
