//! Matrix products `y = x · Wᵀ`, plain and block-diagonal (grouped), and the fused
//! SwiGLU pair product of the MoE experts, over weights in their checkpoint format.
//!
//! - Up to [`GEMV_MAX_ROWS`] rows (decode): the tensor-core gemv (cu/tcgemv.cu) for
//!   stored BF16/FP8/FP4 weights — the batch is the mma's n, weights are dequantised
//!   straight into its A fragments, activations staged once per block as 16-bit hi/lo —
//!   else the SIMT gemv kernels (f32 weights, shapes it does not tile), which stream each
//!   weight once with f32 activations and accumulation. Experts' SwiGLU pairs take this
//!   path up to 32 rows, 8 per launch.
//! - Plain products of 9 to [`gemv_loop_max_rows`] rows (32; larger decode batches): the
//!   same gemv kernels, each launch streaming the weight again — up to 32 rows a launch
//!   where the v2 kernels take the weight ([`gemv_launch_rows`]: FP8, FP4 up to 16), else
//!   8 — which beats a GEMM whose 128-row tiles would be mostly empty; up to 64 rows too
//!   when the GEMM would have few output tiles ([`gemv_loops`]). FP8 weights take
//!   `fp8wg_gemm` from 9 rows instead ([`fp8_rows_on_wgmma`]), the narrow ones split
//!   along K ([`fp8_splits`]).
//! - BF16 weights of 9 to 32 rows when `SLUICE_CUDA_GEMM_ROWS` asks (`gemm_rows_plan`):
//!   one tensor-core launch that splits the activations itself (cu/gemm_rows.cu; off by
//!   default, slower than cuBLAS on the H200); then BF16 weights from 9 rows
//!   (`cublas_bf16::takes`): cuBLAS, which multiplies the stored weight as it is
//!   (cublas_bf16.rs). Both come before the two cases below.
//! - More rows (prefill): `gemm_{bf16,fp8,fp4}` (cu/gemm.cu), tensor-core tiles fed by a
//!   cp.async pipeline, whose weight tiles are dequantised to bf16 in shared memory and
//!   whose f32 activations are first split into two bf16 parts (~16 mantissa bits
//!   together, `split_bf16`, once per product), so the product stays near the f32 one
//!   the CPU computes. f32 weights (rare: mHC mixing, tests) use a plain
//!   cuBLAS f32 GEMM. Shapes the tensor-core kernel does not tile (K not a multiple of
//!   32, block-diagonal groups narrower than its 128-output tile: tiny test models) run
//!   through the gemv kernels, 8 rows a launch.
//! - `SLUICE_CUDA_DECODE_KERNELS=v2` (read once; the default, `v1` the fallback): FP8 and FP4
//!   decode products (and SwiGLU pairs) up to 8 rows (plain products up to 32) take the
//!   second-version kernels of cu/decode2.cu instead (blocks that keep their activations
//!   and stream many weight rows, [`d2_plan`]); what they cannot take stays on the paths
//!   above. Before them, plain and grouped FP8 products of 1-2 rows with K ≥ 2048 and at
//!   least a 16-row tile an SM take the FP8 tensor-core gemv (`gemv_f8mma`: weights
//!   streamed through shared memory in whole rows, multiplied as stored); before that, on
//!   sm_90, FP8 products of 1-2 rows in whole 64-row tiles take the warpgroup gemv
//!   (`gemv_f8wg`: `wgmma` over e4m3 tiles in shared memory, K split by clusters).

use cudarc::cublas::sys::cudaDataType;

use super::blas_op::BlasOp;
use super::cublas_bf16;
use super::decode_v2::{d2_format, d2_gemv, d2_max_rows, d2_plan};
use super::gemm_rows::{gemm_rows, gemm_rows_plan};
use super::gemv_f8mma::{f8mma_gemv, f8mma_plan};
use super::gemv_f8wg::{f8wg_gemv, f8wg_pair, f8wg_pair_plan, f8wg_plan};
use super::memory::{CudaWeight, WeightData};
use super::runtime::{Gpu, cfg, cfg_elems, launch};

/// Rows one gemv launch covers (its kernels are instantiated for 1, 2, 4 and 8).
const GEMV_ROWS: usize = 8;
/// Rows at or below which products use the gemv kernels.
pub(crate) const GEMV_MAX_ROWS: usize = GEMV_ROWS;

/// Rows at or below which plain products ([`matmul`]) stream the weight once per
/// [`GEMV_ROWS`] rows through the gemv kernels instead of a tiled GEMM, whose 128-row
/// tiles are mostly empty at decode batch sizes: 32 by default (8 Flash layers on an
/// H200, decode at 16 / 32 / 64 rows: 28.3 → 20.0, 38.7 → 33.1, 54.5 → 54.7 ms a step
/// against the GEMM above 8 rows; docs/perf.md). `SLUICE_CUDA_GEMV_MAX_ROWS` (read once,
/// 8 to 64) moves it, to measure the crossover again.
pub(crate) fn gemv_loop_max_rows() -> usize {
    const DEFAULT: usize = 32;
    static ONCE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ONCE.get_or_init(|| {
        let v = std::env::var("SLUICE_CUDA_GEMV_MAX_ROWS").ok();
        match v.as_deref().map(str::parse::<usize>) {
            None => DEFAULT,
            Some(Ok(n)) if (GEMV_MAX_ROWS..=64).contains(&n) => n,
            Some(_) => {
                tracing::warn!(value = ?v, "SLUICE_CUDA_GEMV_MAX_ROWS is not a number of rows from 8 to 64: using 32");
                DEFAULT
            }
        }
    })
}

/// Most rows a product takes through the gemv loop when its tiled GEMM would have few
/// tiles ([`gemv_loops`]).
const SMALL_GRID_GEMV_MAX_ROWS: usize = 64;

/// Whether a product of `rows` rows and `n_out` outputs streams its weight through the
/// gemv kernels, 8 rows a launch: up to [`gemv_loop_max_rows`] rows always, and up to
/// [`SMALL_GRID_GEMV_MAX_ROWS`] when the tiled GEMM (a block per 128 × 128 tile, no K
/// split) would have at most a quarter as many tiles as SMs. At 64 rows the GEMM of
/// `wq_a` (1,024 outputs: 8 tiles) took 150 µs on 8 SMs and the router's (256 outputs)
/// 123 µs on 2 (H200, tools/bench/step_trace.sh; docs/perf.md).
pub(crate) fn gemv_loops(gpu: &Gpu, rows: usize, n_out: usize) -> bool {
    rows <= gemv_loop_max_rows() || small_gemm_grid(gpu, rows, n_out)
}

/// Whether an FP8 product of a decode batch past [`GEMV_MAX_ROWS`] rows (up to 64) runs on
/// `fp8wg_gemm` (the prefill kernel: the weight streamed once, its codes turned into bf16
/// in registers, `wgmma` over the rows' bf16 parts, tiles of at most 64 rows) instead
/// of the gemv loops, where that kernel takes the weight, split along K where its blocks
/// would not fill the GPU ([`fp8_splits`]). On 20 Flash layers a batch-32 step ran 6%
/// faster with `wq_b` and the grouped `wo_a` here (docs/perf.md, "A decode step as the
/// device ran it"), and batches of 16 / 32 / 64 rows 10% / 15% / 20% faster with the narrow
/// ones — `wq_a`, `wkv`, `wo_b`, the shared expert's, whose GEMM has few tiles
/// ([`small_gemm_grid`]) — and the grouped `wo_a` split (with the shared expert's pair here
/// too and the parts sliced; docs/perf.md, "Narrow FP8 products split along K").
/// `SLUICE_CUDA_FP8WG_DECODE=0` keeps up to 32 rows on the loops,
/// `SLUICE_CUDA_FP8WG_SPLIT_BLOCKS=0` the narrow ones.
pub(crate) fn fp8_rows_on_wgmma(gpu: &Gpu, op: &Operand, w: &CudaWeight) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    op.rows >= fp8wg_from_rows()
        && op.rows <= SMALL_GRID_GEMV_MAX_ROWS.max(gemv_loop_max_rows())
        && (split_blocks(gpu) > 0 || !small_gemm_grid(gpu, op.rows, w.rows))
        && *ON.get_or_init(|| std::env::var("SLUICE_CUDA_FP8WG_DECODE").map_or(true, |v| v != "0"))
        && super::moe_fp4wg::fp8_takes(gpu, op, w)
}

/// Fewest rows of an FP8 decode product on `fp8wg_gemm` (`SLUICE_CUDA_FP8WG_FROM_ROWS`,
/// read once, 2 to 9; default 9: up to 8 rows the gemv kernels take it, 25% / 10% / 1%
/// faster a step at batches 2 / 4 / 8 on 20 Flash layers; docs/perf.md).
fn fp8wg_from_rows() -> usize {
    static ONCE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ONCE.get_or_init(|| {
        super::runtime::env_rows("SLUICE_CUDA_FP8WG_FROM_ROWS").unwrap_or(GEMV_MAX_ROWS + 1).clamp(2, GEMV_MAX_ROWS + 1)
    })
}

/// Blocks an FP8 product of a decode batch split along K aims for
/// (`SLUICE_CUDA_FP8WG_SPLIT_BLOCKS`, read once; default the GPU's SMs, 0 = no split:
/// narrow products of decode batches stay on the gemv loops).
fn split_blocks(gpu: &Gpu) -> usize {
    static ONCE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| super::runtime::env_rows("SLUICE_CUDA_FP8WG_SPLIT_BLOCKS")).unwrap_or(gpu.sms)
}

/// Most slices a product is split into along K, and fewest chunks (64 inputs) a slice:
/// each slice's plane of partial sums costs a write and a read, and a slice of few chunks
/// leaves the block's ring of stages mostly filling.
const MAX_SPLITS: usize = 16;
const MIN_SLICE_CHUNKS: usize = 4;

/// Most rows of an FP8 product split along K (`SLUICE_CUDA_FP8WG_SPLIT_ROWS`, read once;
/// default 1,024). Past the decode batches a prefill of a few hundred rows leaves the
/// narrow products few blocks too (`wq_a` 24 at 300 rows, each streaming all of K): split,
/// a 300-token prefill of 20 Flash layers went from 4,150 / 4,141 to 4,511 / 4,516
/// tokens/s and 1,100 tokens stayed where they were (8,318 / 8,453 against 8,330 / 8,335;
/// docs/perf.md "Small prefills' narrow FP8 products split").
fn fp8_split_max_rows() -> usize {
    const DEFAULT: usize = 1024;
    static ONCE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ONCE.get_or_init(|| super::runtime::env_rows("SLUICE_CUDA_FP8WG_SPLIT_ROWS").unwrap_or(DEFAULT))
}

/// Slices along K for an FP8 product of `op` on `fp8wg_gemm`: up to
/// [`fp8_split_max_rows`] rows (decode batches and small prefills), products whose blocks
/// (128 outputs × a tile of rows) fall short of [`split_blocks`], enough to reach it, at
/// most [`MAX_SPLITS`] and at least [`MIN_SLICE_CHUNKS`] chunks a slice; else 1. At 64
/// rows on the gemv loops `wo_b` took ~140 µs, `wq_a` and `wkv` ~100 and the shared
/// expert's down ~75 of a ~1.9 ms layer, and the grouped `wo_a` unsplit (64 blocks) ~105
/// (docs/perf.md, "Narrow FP8 products split along K").
pub(crate) fn fp8_splits(gpu: &Gpu, op: &Operand, w: &CudaWeight) -> usize {
    let target = split_blocks(gpu);
    let blocks = (w.rows / GEMM_BN).max(1) * op.rows.div_ceil(GEMM_BM);
    if target == 0 || op.rows > fp8_split_max_rows() || blocks >= target {
        return 1;
    }
    let most = (w.cols / super::moe_fp4wg::FP8_CHUNK_INPUTS / MIN_SLICE_CHUNKS).clamp(1, MAX_SPLITS);
    target.div_ceil(blocks).clamp(1, most)
}

/// Up to [`SMALL_GRID_GEMV_MAX_ROWS`] rows whose tiled GEMM would have at most a quarter
/// as many tiles as SMs.
fn small_gemm_grid(gpu: &Gpu, rows: usize, n_out: usize) -> bool {
    rows <= SMALL_GRID_GEMV_MAX_ROWS && 4 * rows.div_ceil(GEMM_BM) * n_out.div_ceil(GEMM_BN) <= gpu.sms
}

/// The experts' SwiGLU pair takes the gemv path up to this many rows, in launches of
/// [`GEMV_ROWS`]: an expert's weights are small, and re-streaming them per 8 rows costs
/// less than a tiled product's separate gate and up passes and temporaries (measured on
/// the H200 with the earlier cuBLAS path: MoE of a 32-row decode batch 4.2 -> 2.2 ms).
const SWIGLU_GEMV_MAX_ROWS: usize = 32;
/// Rows and outputs of one tensor-core tile (`GEMM_BM`, `GEMM_BN` in gemm.cu), the K
/// step (which also fixes what K the kernel accepts), pipeline stages and padded row.
pub(crate) const GEMM_BM: usize = 128;
const GEMM_BN: usize = 128;
const GEMM_BK: usize = 32;
const GEMM_STAGES: usize = 3;
const GEMM_LD: usize = 40;

/// Dynamic shared memory of a GEMM kernel (`GemmSmem` in gemm.cu).
pub(crate) fn gemm_smem(name: &str) -> usize {
    if name == "gemm_fp4_f8" {
        // Per stage x bytes and scales, FP4 bytes; then the e4m3 tile and its scales (gemm_f8.cu).
        const F8_LD: usize = 48;
        return GEMM_STAGES * (GEMM_BM * F8_LD + GEMM_BM * 4 + GEMM_BN * GEMM_BK / 2) + GEMM_BN * F8_LD + GEMM_BN * 4;
    }
    let split = !name.ends_with("_hi");
    let x = GEMM_BM * GEMM_LD * 2;
    let (w, deq) = if name.starts_with("gemm_bf16") {
        (GEMM_BN * GEMM_LD * 2, 0)
    } else if name.starts_with("gemm_fp8") {
        (GEMM_BN * GEMM_BK, GEMM_BN * GEMM_LD * 2)
    } else {
        (GEMM_BN * GEMM_BK / 2, GEMM_BN * GEMM_LD * 2)
    };
    (x * if split { 2 } else { 1 } + w) * GEMM_STAGES + deq
}

/// The GEMM kernels and the most dynamic shared memory each takes (opted in at load).
pub(crate) const GEMM_KERNELS: [&str; 7] =
    ["gemm_bf16", "gemm_fp8", "gemm_fp4", "gemm_bf16_hi", "gemm_fp8_hi", "gemm_fp4_hi", "gemm_fp4_f8"];

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

impl Operand {
    /// The product's rows in parts of at most `rows` (one gemv launch each).
    fn gemv_parts(self, rows: usize) -> impl Iterator<Item = Operand> {
        (0..self.rows).step_by(rows).map(move |r0| Operand {
            x: self.x + (4 * r0 * self.x_stride) as u64,
            out: self.out + (4 * r0 * self.out_stride) as u64,
            rows: (self.rows - r0).min(rows),
            ..self
        })
    }

    /// Outputs of each diagonal block over `w` as the kernels' `g_out` argument: 0 for a
    /// plain product.
    pub(crate) fn g_out(&self, w: &CudaWeight) -> i32 {
        if self.groups > 1 { (w.rows / self.groups) as i32 } else { 0 }
    }
}

/// Kernel-name suffix of a weight format and the weights its gemv vector loads take at once.
pub(crate) fn family(w: &CudaWeight) -> (&'static str, usize) {
    match &w.data {
        WeightData::F32(_) => ("f32", 8),
        WeightData::Bf16(_) => ("bf16", 8),
        WeightData::Fp8 { .. } => ("fp8", 16),
        WeightData::Fp4 { .. } => ("fp4", 32),
    }
}

/// Outputs per block so the grid has about two blocks per multiprocessor or more
/// (`SLUICE_CUDA_GEMV_BLOCKS_PER_SM`, read once, moves the two).
pub(crate) fn outputs_per_block(gpu: &Gpu, n: usize) -> usize {
    static PER_SM: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let per_sm = *PER_SM.get_or_init(|| super::runtime::env_rows("SLUICE_CUDA_GEMV_BLOCKS_PER_SM").unwrap_or(2).max(1));
    let want = per_sm * gpu.sms;
    [8, 4, 2].into_iter().find(|&opb| n / opb >= want).unwrap_or(1)
}

/// Whether the gemv kernels' 16-byte loads apply (otherwise they go element by element).
fn gemv_vectorised(op: &Operand, w: &CudaWeight) -> bool {
    let (_, chunk) = family(w);
    let k = w.cols;
    k.is_multiple_of(chunk) && op.x_stride.is_multiple_of(4) && (op.groups == 1 || k.is_multiple_of(4))
}

/// Inputs and outputs of one tensor-core gemv block (`TC_KB`, `TC_OUT` in tcgemv.cu).
const TC_KB: usize = 512;
const TC_OUT: usize = 64;

impl Operand {
    /// `x[rows, groups · K]` times `w` (block-diagonal over `groups`) into `out[rows, N]`,
    /// both contiguous.
    pub(crate) fn contiguous(x: u64, out: u64, rows: usize, groups: usize, w: &CudaWeight) -> Operand {
        Operand { x, x_stride: groups * w.cols, out, out_stride: w.rows, rows, groups }
    }
}

/// Whether decode products may use the tensor-core gemv (`SLUICE_CUDA_TC_GEMV=0` keeps
/// them on the SIMT kernels, for comparisons).
fn tc_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_TC_GEMV").map(|v| v != "0").unwrap_or(true))
}

/// Suffix of the tensor-core gemv for a weight, when it takes the product: stored
/// BF16/FP8/FP4 (FP4 with scales its f16 path multiplies exactly), K a multiple of 128,
/// block-diagonal groups of whole 64-output blocks, at least one such block.
pub(crate) fn tc_family(op: &Operand, w: &CudaWeight) -> Option<&'static str> {
    let fam = match &w.data {
        WeightData::Bf16(_) => "bf16",
        WeightData::Fp8 { .. } => "fp8",
        WeightData::Fp4 { tc: true, .. } => "fp4",
        _ => return None,
    };
    let g_out = w.rows / op.groups;
    let fits = tc_enabled()
        && w.cols.is_multiple_of(128)
        && w.rows >= TC_OUT
        && op.x_stride.is_multiple_of(2)
        && (op.groups == 1 || g_out.is_multiple_of(TC_OUT));
    fits.then_some(fam)
}

/// Scratch for split-K partial sums and per-block tickets of tensor-core gemv launches.
pub(crate) fn tc_scratch(gpu: &Gpu, partial_floats: usize, tickets: usize) -> (u64, u64) {
    (gpu.scratch("tc_partials", partial_floats), gpu.scratch("tc_tickets", tickets))
}

/// Rows a gemv launch of a plain product takes: up to [`d2_max_rows`] when the v2 kernels
/// take a launch that wide, else [`GEMV_ROWS`].
fn gemv_launch_rows(gpu: &Gpu, op: &Operand, w: &CudaWeight, variant: Decode) -> usize {
    if op.rows <= GEMV_ROWS || variant != Decode::V2 {
        return GEMV_ROWS;
    }
    let Some(fmt) = d2_format(w) else { return GEMV_ROWS };
    let rows = d2_max_rows(fmt).min(op.rows);
    let first = Operand { rows, ..*op };
    if d2_plan(gpu, &first, w, None).is_some() { d2_max_rows(fmt) } else { GEMV_ROWS }
}

/// Tensor-core gemv in launches of up to 8 rows (the mma's n).
fn tc_gemv(gpu: &Gpu, fam: &str, op: Operand, w: &CudaWeight, w3: Option<&CudaWeight>, limit: f32) {
    let (n, k) = (w.rows, w.cols);
    let (bx, ks) = (n.div_ceil(TC_OUT), k.div_ceil(TC_KB));
    let dual = w3.is_some();
    let (partials, tickets) = tc_scratch(gpu, ks * 8 * n * if dual { 2 } else { 1 }, bx);
    let name = format!("{}_{fam}", if dual { "tcswiglu" } else { "tcgemv" });
    let (wp, sp) = w.ptrs();
    let (wp3, sp3) = w3.map(CudaWeight::ptrs).unwrap_or((0, 0));
    for r0 in (0..op.rows).step_by(GEMV_ROWS) {
        launch!(
            gpu,
            name.as_str(),
            cfg((bx as u32, ks as u32, 1), 256, 0),
            op.out + (4 * r0 * op.out_stride) as u64,
            op.x + (4 * r0 * op.x_stride) as u64,
            wp,
            wp3,
            sp,
            sp3,
            (op.rows - r0).min(GEMV_ROWS) as i32,
            n as i32,
            k as i32,
            op.x_stride as i32,
            op.out_stride as i32,
            (n / op.groups) as i32,
            limit,
            partials,
            tickets,
        );
    }
}

/// gemv in launches of up to [`GEMV_ROWS`] rows: with `variant` v2, the FP8 warpgroup
/// gemv where it takes the product or SwiGLU pair (`f8wg_plan`, `f8wg_pair_plan`, sm_90),
/// then (plain products) the FP8 tensor-core gemv
/// (`f8mma_plan`), then the v2 kernels ([`d2_plan`]);
/// else tensor cores where the weight allows, except BF16 at one or two rows, where the
/// SIMT kernel streams faster (measured on the H200: 8192 × 4096 at one row 20.8 µs SIMT
/// vs 29.6 µs tensor cores; FP8 and FP4 are even or faster on tensor cores, and every
/// format is 3-6x faster there at 8 rows).
fn gemv(gpu: &Gpu, op: Operand, w: &CudaWeight, w3: Option<&CudaWeight>, limit: f32, variant: Decode) {
    if variant == Decode::V2
        && let Some(w3) = w3
        && let Some(plan) = f8wg_pair_plan(gpu, &op, w, w3)
    {
        return f8wg_pair(gpu, &plan, op, w, w3, limit);
    }
    if variant == Decode::V2 && w3.is_none() {
        if let Some(plan) = f8wg_plan(gpu, &op, w) {
            return f8wg_gemv(gpu, &plan, op, w);
        }
        if let Some(plan) = f8mma_plan(gpu, &op, w) {
            return f8mma_gemv(gpu, &plan, op, w);
        }
    }
    if variant == Decode::V2
        && let Some(plan) = d2_plan(gpu, &op, w, w3)
    {
        return d2_gemv(gpu, &plan, op, w, w3, limit);
    }
    let simt_wins = op.rows <= 2 && matches!(w.data, WeightData::Bf16(_));
    if let Some(fam) = tc_family(&op, w)
        && !simt_wins
        && w3.is_none_or(|w3| tc_family(&op, w3) == Some(fam))
    {
        return tc_gemv(gpu, fam, op, w, w3, limit);
    }
    gemv_simt(gpu, op, w, w3, limit);
}

/// The SIMT gemv kernels, in launches of up to [`GEMV_ROWS`] rows.
pub(crate) fn gemv_simt(gpu: &Gpu, op: Operand, w: &CudaWeight, w3: Option<&CudaWeight>, limit: f32) {
    for part in op.gemv_parts(GEMV_ROWS) {
        gemv_launch(gpu, part, w, w3, limit);
    }
}

fn gemv_launch(gpu: &Gpu, op: Operand, w: &CudaWeight, w3: Option<&CudaWeight>, limit: f32) {
    let (fam, _) = family(w);
    let r = op.rows.next_power_of_two();
    let name = format!("{}_{fam}_r{r}", if w3.is_some() { "swiglu" } else { "gemv" });
    let (n, k) = (w.rows, w.cols);
    let g_out = n / op.groups;
    let vec = gemv_vectorised(&op, w);
    let opb = outputs_per_block(gpu, n);
    let (wp, sp) = w.ptrs();
    let (wp3, sp3) = w3.map(CudaWeight::ptrs).unwrap_or((0, 0));
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

/// Name of the tensor-core kernel for a weight, when it can tile the product.
pub(crate) fn gemm_kernel(op: &Operand, w: &CudaWeight) -> Option<&'static str> {
    let name = match &w.data {
        WeightData::Bf16(_) => "gemm_bf16",
        WeightData::Fp8 { .. } => "gemm_fp8",
        WeightData::Fp4 { .. } => "gemm_fp4",
        WeightData::F32(_) => return None,
    };
    let g_out = w.rows / op.groups;
    let fits = w.cols.is_multiple_of(GEMM_BK) && (op.groups == 1 || g_out.is_multiple_of(GEMM_BN));
    fits.then_some(name)
}

/// The rows a grouped tensor-core launch covers: `tiles` holds (group, first row, rows)
/// per tile on the device, `wtab` (weights, scales) per group.
pub(crate) struct Tiles {
    pub tiles: u64,
    pub count: usize,
    pub wtab: u64,
}

/// Activations split for the tensor-core GEMM: `[rows, cols]` bf16 hi and lo parts.
pub(crate) struct SplitX {
    pub hi: super::arena::DevBuf<u16>,
    pub lo: super::arena::DevBuf<u16>,
    pub cols: usize,
}

/// Split `rows` rows of `cols` f32 (rows `x_stride` apart) into bf16 hi + lo.
pub(crate) fn split_x(gpu: &Gpu, x: u64, x_stride: usize, rows: usize, cols: usize) -> SplitX {
    let hi = gpu.alloc::<u16>(rows * cols);
    let lo = gpu.alloc::<u16>(rows * cols);
    let n = rows * cols;
    launch!(gpu, "split_bf16", cfg_elems(n), gpu.ptr(&hi), gpu.ptr(&lo), x, rows as i32, cols as i32, x_stride as i32);
    SplitX { hi, lo, cols }
}

/// Tensor-core product of split activations over all of `op`'s rows (`tiles` None), or
/// over the listed tiles; `op.x` is unused (the split holds the activations).
pub(crate) fn gemm_split(gpu: &Gpu, name: &str, op: Operand, xs: &SplitX, w: &CudaWeight, tiles: Option<&Tiles>) {
    let (n, k) = (w.rows, w.cols);
    let (wp, sp) = w.ptrs();
    let row_tiles = tiles.map(|t| t.count).unwrap_or_else(|| op.rows.div_ceil(GEMM_BM));
    if row_tiles == 0 {
        return;
    }
    launch!(
        gpu,
        name,
        cfg((n.div_ceil(GEMM_BN) as u32, row_tiles as u32, 1), 256, gemm_smem(name) as u32),
        op.out,
        op.out_stride as i32,
        gpu.ptr(&xs.hi),
        gpu.ptr(&xs.lo),
        xs.cols as i32,
        wp,
        sp,
        tiles.map(|t| t.wtab).unwrap_or(0),
        tiles.map(|t| t.tiles).unwrap_or(0),
        op.rows as i32,
        n as i32,
        k as i32,
        (n / op.groups) as i32,
    );
}

/// Tensor-core product over all of `op`'s rows (`tiles` None), or over the listed tiles:
/// splits `op.x` (all `op.groups · K` columns of each row), then multiplies.
pub(crate) fn gemm(gpu: &Gpu, name: &str, op: Operand, w: &CudaWeight, tiles: Option<&Tiles>) {
    let xs = split_x(gpu, op.x, op.x_stride, op.rows, op.groups * w.cols);
    gemm_split(gpu, name, op, &xs, w, tiles);
}

/// The FP8 tensor-core variant of an FP4 product (gemm_f8.cu), measured against the
/// BF16 one by the benchmark and the parity suite but not used by the engine (its e4m3
/// activations cost accuracy; docs/perf.md): the rows quantised to e4m3 with a scale per
/// 32 inputs, then `gemm_fp4_f8` over all of `op`'s rows or the listed tiles.
pub(crate) fn gemm_fp4_f8(gpu: &Gpu, op: Operand, w: &CudaWeight, tiles: Option<&Tiles>) {
    assert!(matches!(w.data, WeightData::Fp4 { .. }), "gemm_fp4_f8 takes FP4 weights");
    assert!(op.groups == 1 && w.cols.is_multiple_of(GEMM_BK), "gemm_fp4_f8: plain products, K a multiple of 32");
    let (n, k) = (w.rows, w.cols);
    let row_tiles = tiles.map(|t| t.count).unwrap_or_else(|| op.rows.div_ceil(GEMM_BM));
    if row_tiles == 0 {
        return;
    }
    let xq = gpu.alloc::<u8>(op.rows * k);
    let xs = gpu.alloc::<f32>(op.rows * k / 32);
    let blocks = op.rows * k / 32;
    launch!(
        gpu,
        "quant_e4m3_rows",
        cfg_elems(blocks),
        gpu.ptr(&xq),
        gpu.ptr(&xs),
        op.x,
        op.rows as i32,
        k as i32,
        op.x_stride as i32
    );
    let (wp, sp) = w.ptrs();
    launch!(
        gpu,
        "gemm_fp4_f8",
        cfg((n.div_ceil(GEMM_BN) as u32, row_tiles as u32, 1), 256, gemm_smem("gemm_fp4_f8") as u32),
        op.out,
        op.out_stride as i32,
        gpu.ptr(&xq),
        gpu.ptr(&xs),
        wp,
        sp,
        tiles.map(|t| t.wtab).unwrap_or(0),
        tiles.map(|t| t.tiles).unwrap_or(0),
        op.rows as i32,
        n as i32,
        k as i32,
    );
}

/// A product of `rows` rows over `w` in the step's byte and FLOP counts: a step's bytes
/// count each weight once, however often a product streams it.
pub(crate) fn count_product(gpu: &Gpu, rows: usize, w: &CudaWeight) {
    gpu.traffic.add_weights(w.device_bytes());
    gpu.traffic.add_flops(2 * rows * w.rows * w.cols);
}

/// `out = x · Wᵀ` (grouped when `op.groups > 1`), with the decode kernels
/// `SLUICE_CUDA_DECODE_KERNELS` selects.
pub(crate) fn matmul(gpu: &Gpu, op: Operand, w: &CudaWeight) {
    matmul_as(gpu, op, w, Decode::from_env())
}

/// [`matmul`] with the decode kernels given (the benchmark and the parity suite run both).
pub(crate) fn matmul_as(gpu: &Gpu, op: Operand, w: &CudaWeight, variant: Decode) {
    if op.rows == 0 || w.rows == 0 {
        return;
    }
    assert!(w.rows.is_multiple_of(op.groups), "grouped weight rows not divisible by groups");
    count_product(gpu, op.rows, w);
    if let Some(plan) = gemm_rows_plan(gpu, &op, w) {
        return gemm_rows(gpu, &plan, op, w);
    }
    if cublas_bf16::takes(op.rows, w) {
        return cublas_bf16::product(gpu, op, w);
    }
    if fp8_on_fp8wg(gpu, &op, w) {
        let splits = fp8_splits(gpu, &op, w);
        return super::moe_fp4wg::fp8_product(gpu, op, w, splits);
    }
    if gemv_loops(gpu, op.rows, w.rows) {
        // One launch up to 8 rows (the v2 kernels: up to 32); past that each launch
        // streams the weight again.
        for part in op.gemv_parts(gemv_launch_rows(gpu, &op, w, variant)) {
            gemv(gpu, part, w, None, 0.0, variant);
        }
        return;
    }
    if let Some(name) = gemm_kernel(&op, w) {
        return gemm(gpu, name, op, w, None);
    }
    match &w.data {
        WeightData::F32(d) => {
            let f32_type = cudaDataType::CUDA_R_32F;
            let (a, m, k) = (gpu.ptr(d), w.rows / op.groups, w.cols);
            let (b, ldb, c, ldc, n, groups) = (op.x, op.x_stride, op.out, op.out_stride, op.rows, op.groups);
            let product = BlasOp::Strided {
                a,
                a_type: f32_type,
                b,
                b_type: f32_type,
                ldb,
                c,
                c_type: f32_type,
                ldc,
                m,
                n,
                k,
                groups,
                beta: 0.0,
            };
            // SAFETY: the weight is groups × (m × k) f32 values; the operand's rows hold
            // groups · k inputs and groups · m outputs (the callers size them).
            unsafe { gpu.blas(product) }
        }
        _ => gemv(gpu, op, w, None, 0.0, variant),
    }
}

/// `out[rows, inter] = silu(min(x·w1ᵀ, limit)) * clamp(x·w3ᵀ, ±limit)`, with the decode
/// kernels given.
pub(crate) fn swiglu_pair(gpu: &Gpu, op: Operand, w1: &CudaWeight, w3: &CudaWeight, limit: f32, variant: Decode) {
    swiglu_pair_of(gpu, op, (w1, w3), limit, variant, None);
}

/// [`swiglu_pair`] where the caller may hold `op`'s rows already rounded to bf16 for both
/// products (`cublas_bf16::rounded_for` over them and more): they are read instead of
/// rounding the rows again, where the pair takes cuBLAS.
pub(crate) fn swiglu_pair_of(
    gpu: &Gpu,
    op: Operand,
    (w1, w3): (&CudaWeight, &CudaWeight),
    limit: f32,
    variant: Decode,
    rounded: Option<&cublas_bf16::RoundedRows>,
) {
    if op.rows == 0 {
        return;
    }
    assert_eq!((w1.rows, w1.cols), (w3.rows, w3.cols), "SwiGLU gate and up shapes differ");
    let on_wgmma = swiglu_on_wgmma(gpu, &op, w1, w3);
    let gemv_rows =
        (op.rows <= SWIGLU_GEMV_MAX_ROWS || small_gemm_grid(gpu, op.rows, w1.rows)) && !cublas_bf16::takes(op.rows, w1);
    if !on_wgmma && gemv_rows && std::mem::discriminant(&w1.data) == std::mem::discriminant(&w3.data) {
        gpu.traffic.add_weights(w1.device_bytes() + w3.device_bytes());
        gpu.traffic.add_flops(4 * op.rows * w1.rows * w1.cols);
        // The v2 kernels take up to 8 rows in one launch; more go through the first version.
        let v = if op.rows <= GEMV_MAX_ROWS { variant } else { Decode::V1 };
        gemv(gpu, op, w1, Some(w3), limit, v);
        return;
    }
    // Two products, the up one into `up` (contiguous, as `swiglu_act` reads both), then
    // the SwiGLU in place.
    let n = op.rows * w1.rows;
    let up = gpu.alloc::<f32>(n);
    let op_up = Operand { out: gpu.ptr(&up), out_stride: w3.rows, ..op };
    let own = if on_wgmma || rounded.is_some() { None } else { cublas_bf16::rounded_for(gpu, &op, &[w1, w3]) };
    if on_wgmma {
        fp8wg_products_sharing_parts(gpu, &[(op, w1), (op_up, w3)]);
    } else if let Some(xb) = rounded.or(own.as_ref()) {
        super::chunked_products::products_of_rounded(gpu, xb, &[(op, w1), (op_up, w3)]);
    } else {
        matmul_as(gpu, op, w1, variant);
        matmul_as(gpu, op_up, w3, variant);
    }
    swiglu_act(gpu, op.out, gpu.ptr(&up), n, limit);
}

/// Whether an FP8 SwiGLU pair runs as two products on `fp8wg_gemm` from one set of the
/// rows' parts ([`fp8_on_fp8wg`], split along K where narrow) and `swiglu_act`: a decode
/// batch past [`GEMV_MAX_ROWS`] rows instead of the pair's gemv loop (8 rows a launch, the
/// weights streamed again each time; batches of 16-64 rows on 20 Flash layers 1.5-5%
/// faster a step, docs/perf.md "Narrow FP8 products split along K"), and a prefill, whose
/// two products would each split the rows into parts of their own.
/// `SLUICE_CUDA_FP8WG_SWIGLU=0` (read once) keeps the loop, and two products apart.
pub(crate) fn swiglu_on_wgmma(gpu: &Gpu, op: &Operand, w1: &CudaWeight, w3: &CudaWeight) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_FP8WG_SWIGLU").map_or(true, |v| v != "0"))
        && fp8_on_fp8wg(gpu, op, w1)
        && fp8_on_fp8wg(gpu, op, w3)
}

/// Whether [`matmul_as`] runs an FP8 product of `op` over `w` on `fp8wg_gemm` (the one
/// rule it and the products sharing parts follow): a decode batch that
/// [`fp8_rows_on_wgmma`] sends there, or rows past the gemv loops' that the kernel takes
/// (prefill). Products of one input that all go there can share one set of the rows'
/// parts ([`fp8wg_products_sharing_parts`]).
pub(crate) fn fp8_on_fp8wg(gpu: &Gpu, op: &Operand, w: &CudaWeight) -> bool {
    fp8_rows_on_wgmma(gpu, op, w) || (!gemv_loops(gpu, op.rows, w.rows) && super::moe_fp4wg::fp8_takes(gpu, op, w))
}

/// FP8 products of one input on `fp8wg_gemm` from one set of the rows' bf16 parts, each
/// split along K as [`fp8_splits`] says: the shared expert's SwiGLU pair, a layer's `wq_a`
/// and `wkv` (`matmul_many`). The operands name the same rows and are not grouped.
pub(crate) fn fp8wg_products_sharing_parts(gpu: &Gpu, products: &[(Operand, &CudaWeight)]) {
    let Some(&(first, w0)) = products.first() else { return };
    let parts = super::moe_fp4wg::parts(gpu, first.x, first.x_stride, first.rows, w0.cols, true);
    for &(op, w) in products {
        assert_eq!(
            (op.x, op.x_stride, op.rows, op.groups),
            (first.x, first.x_stride, first.rows, 1),
            "fp8wg: products of other rows"
        );
        count_product(gpu, op.rows, w);
        super::moe_fp4wg::fp8_product_of(gpu, &parts, op, w, fp8_splits(gpu, &op, w));
    }
}

/// `g = silu(min(g, limit)) * clamp(u, ±limit)` over `n` values, in place in `g`.
pub(crate) fn swiglu_act(gpu: &Gpu, g: u64, u: u64, n: usize, limit: f32) {
    launch!(gpu, "swiglu_act", cfg_elems(n), g, u, n as i64, limit);
}

/// Which decode kernels products and MoE experts use: `SLUICE_CUDA_DECODE_KERNELS=v2`
/// (the default: cu/decode2.cu, kernels/src/cuda/NOTES-decode.md; 9% faster at batch 1
/// on the H200 and through the parity, conformance, multi-GPU and serving tests there,
/// docs/perf.md) or `v1` (the first kernels, kept as the fallback and the comparison).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decode {
    V1,
    V2,
}

impl Decode {
    /// `v1` or `v2`.
    pub(crate) fn parse(s: &str) -> Option<Decode> {
        match s.trim() {
            "v1" => Some(Decode::V1),
            "v2" => Some(Decode::V2),
            _ => None,
        }
    }

    /// The process's choice, read from the environment once (the first backend reads it
    /// at its first product); anything but `v1` means `v2`, an unknown value with a warning.
    pub(crate) fn from_env() -> Decode {
        static ONCE: std::sync::OnceLock<Decode> = std::sync::OnceLock::new();
        *ONCE.get_or_init(|| match std::env::var("SLUICE_CUDA_DECODE_KERNELS") {
            Err(_) => Decode::V2,
            Ok(v) => Decode::parse(&v).unwrap_or_else(|| {
                tracing::warn!(value = %v, "SLUICE_CUDA_DECODE_KERNELS is neither v1 nor v2: using v2");
                Decode::V2
            }),
        })
    }
}
