//! The second-version decode products (cu/decode2.cu, `SLUICE_CUDA_DECODE_KERNELS=v2`):
//! their kernel table, argument block, weight formats, batch-row layout (`D2Cols`), the
//! plan of one launch (kernel, K split, grid, shared memory: [`d2_plan`]) and the launch
//! itself. [`super::matmul`] decides when a product takes them; the routed experts'
//! variants are planned in [`super::moe_v2`].

use cudarc::driver::DeviceRepr;

use super::matmul::{GEMV_MAX_ROWS, Operand};
use super::memory::{CudaWeight, WeightData};
use super::runtime::{Gpu, cfg, launch};

/// Warps of a v2 block (`D2_WARPS` in decode2.cu); they split a block's inputs.
const D2_WARPS: usize = 8;
/// Most dynamic shared memory a v2 kernel is launched with (opted in at load). With the
/// down kernel's 8 KiB of static shared memory it stays under the 163 KiB an A100 allows
/// a block, so the opt-in succeeds on every part that runs compute_80 and later.
pub(crate) const D2_MAX_SMEM: usize = 148 * 1024;
/// Dynamic shared memory up to which two v2 blocks fit an SM of a Hopper (228 KiB).
pub(crate) const D2_TWO_BLOCKS_SMEM: usize = 100 * 1024;
/// The v2 kernels (all take up to [`D2_MAX_SMEM`] of dynamic shared memory).
pub(crate) const D2_KERNELS: [&str; 15] = [
    "d2gemv_fp8_n1",
    "d2gemv_fp8_n2",
    "d2gemv_fp8_r16",
    "d2gemv_fp8_r32",
    "d2gemv_fp4_n1",
    "d2gemv_fp4_n2",
    "d2gemv_fp4_r16",
    "d2swiglu_fp8_n1",
    "d2swiglu_fp8_n2",
    "d2swiglu_fp4_n1",
    "d2swiglu_fp4_n2",
    "d2moe_swiglu_fp4_n1",
    "d2moe_swiglu_fp4_n2",
    "d2moe_down_fp4_n1",
    "d2moe_down_fp4_n2",
];

/// `D2Args` in decode2.cu (pointers first, so both sides lay it out without padding).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct D2Args {
    pub out: u64,
    pub x: u64,
    pub w: u64,
    pub s: u64,
    pub w3: u64,
    pub s3: u64,
    pub wtab: u64,
    pub active: u64,
    pub n_active: u64,
    pub hb: u64,
    pub partials: u64,
    pub tickets: u64,
    pub rows: i32,
    pub n: i32,
    pub k: i32,
    pub x_stride: i32,
    pub out_stride: i32,
    pub tiles: i32,
    pub parts: i32,
    pub rw_max: i32,
    pub limit: f32,
    pub h_scale: f32,
    pub g_out: i32,
    /// Zero: no padding, whose bytes would be undefined (a recorded decode step compares
    /// launches' argument bytes to find the steps it can replay as graphs).
    pub pad: i32,
}

// SAFETY: a plain #[repr(C)] struct of integers and floats without padding, `struct
// D2Args` in decode2.cu.
unsafe impl DeviceRepr for D2Args {}
const _: () = assert!(std::mem::size_of::<D2Args>() == 12 * 8 + 12 * 4, "D2Args has padding");

/// How a v2 product runs: its kernel, grid, shared memory and the args it depends on.
pub(crate) struct D2Plan {
    pub name: String,
    pub tiles: usize,
    pub parts: usize,
    pub rw_max: usize,
    pub smem: usize,
    pub grid_x: usize,
}

/// A weight format the v2 kernels take (`WT` in decode2.cu).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum D2Fmt {
    Fp8,
    Fp4,
}

impl D2Fmt {
    /// Kernel-name suffix.
    fn fam(self) -> &'static str {
        match self {
            D2Fmt::Fp8 => "fp8",
            D2Fmt::Fp4 => "fp4",
        }
    }

    /// Stored bytes of a row of `k` inputs.
    fn row_bytes(self, k: usize) -> usize {
        match self {
            D2Fmt::Fp8 => k,
            D2Fmt::Fp4 => k / 2,
        }
    }
}

/// Inputs a v2 round covers per row (64 bytes of either format: FP8 64, FP4 128): K must
/// be a multiple.
pub(crate) fn d2_round(fmt: D2Fmt) -> usize {
    match fmt {
        D2Fmt::Fp8 => 64,
        D2Fmt::Fp4 => 128,
    }
}

/// How a v2 launch lays out its batch rows: `nb` column blocks of the mma's n, each 4
/// rows as f16 hi + lo pairs (1-8 rows) or 8 rows as f16 alone (`wide`: the 16- and
/// 32-row plain products; `H` in decode2.cu).
#[derive(Clone, Copy)]
pub(crate) struct D2Cols {
    pub nb: usize,
    pub wide: bool,
}

impl D2Cols {
    /// The layout for `rows` rows: up to 8 as pairs, 9-16 and 17-32 as 2 and 4 blocks of 8.
    pub(crate) fn for_rows(rows: usize) -> D2Cols {
        if rows <= GEMV_MAX_ROWS {
            D2Cols { nb: if rows <= 4 { 1 } else { 2 }, wide: false }
        } else {
            D2Cols { nb: rows.div_ceil(8).next_power_of_two(), wide: true }
        }
    }

    /// Columns of a unit's sums and K-part partials (`D2Cols` in decode2.cu): one a row.
    fn sums(self) -> usize {
        if self.wide { 8 * self.nb } else { 8 }
    }
}

/// Dynamic shared memory of a v2 block: the warps' activations (`cols.nb` column blocks
/// of `rw_max` rounds) and the double-buffered unit sums (`d2_red` in decode2.cu).
pub(crate) fn d2_smem(fmt: D2Fmt, cols: D2Cols, rw_max: usize, mt: usize, dual: bool) -> usize {
    let q = d2_round(fmt) / 32;
    cols.nb * D2_WARPS * rw_max * q * 32 * 16 + 2 * (1 + usize::from(dual)) * D2_WARPS * 16 * mt * cols.sums() * 4
}

/// Most rows one v2 launch of a plain product takes: 32 (FP8) or 16 (FP4: its
/// activation fragments are twice as many registers), capped by
/// `SLUICE_CUDA_D2_ROWS=8|16|32` (read once; 8 = launches of 8 rows, the earlier rule).
pub(crate) fn d2_max_rows(fmt: D2Fmt) -> usize {
    static CAP: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cap = *CAP.get_or_init(|| match std::env::var("SLUICE_CUDA_D2_ROWS").ok().as_deref() {
        None => 32,
        Some(v) => match v.parse() {
            Ok(n @ (8 | 16 | 32)) => n,
            _ => {
                tracing::warn!(value = v, "SLUICE_CUDA_D2_ROWS is not 8, 16 or 32: using 32");
                32
            }
        },
    });
    cap.min(if fmt == D2Fmt::Fp4 { 16 } else { 32 })
}

/// FP8, or FP4 with scales the f16 decode multiplies exactly: the formats v2 takes.
pub(crate) fn d2_format(w: &CudaWeight) -> Option<D2Fmt> {
    match &w.data {
        WeightData::Fp8 { .. } => Some(D2Fmt::Fp8),
        WeightData::Fp4 { tc: true, .. } => Some(D2Fmt::Fp4),
        _ => None,
    }
}

/// The v2 plan for a product of up to 8 rows (plain products: up to [`d2_max_rows`]),
/// when v2 takes it: FP8 or FP4 weights (a SwiGLU pair of one format), K a multiple of
/// the round, 16-byte aligned activation rows, a matrix of under 4 GiB and activations
/// that fit shared memory. Small products split K over blockIdx.y parts so that the grid
/// fills the GPU (about two units per SM; every warp keeps at least one round). A grouped product (the attention output's
/// `wo_a`: each group of output rows reads its own slice of x) is taken when a unit's
/// rows lie in one group and every unit gets a block of its own, so a block stages one
/// group's activations once.
pub(crate) fn d2_plan(gpu: &Gpu, op: &Operand, w: &CudaWeight, w3: Option<&CudaWeight>) -> Option<D2Plan> {
    let fmt = d2_format(w)?;
    if let Some(w3) = w3
        && (d2_format(w3) != Some(fmt) || (w3.rows, w3.cols) != (w.rows, w.cols))
    {
        return None;
    }
    let (n, k) = (w.rows, w.cols);
    let round = d2_round(fmt);
    let aligned = op.x.is_multiple_of(16) && op.x_stride.is_multiple_of(4);
    let row_bytes = fmt.row_bytes(k);
    let dual = w3.is_some();
    let grouped = op.groups > 1;
    let most_rows = if dual || grouped { GEMV_MAX_ROWS } else { d2_max_rows(fmt).max(GEMV_MAX_ROWS) };
    if op.groups == 0 || op.rows == 0 || op.rows > most_rows || !k.is_multiple_of(round) || !aligned {
        return None;
    }
    if n.checked_mul(row_bytes).is_none_or(|b| b >= 1 << 32) {
        return None;
    }
    let cols = D2Cols::for_rows(op.rows);
    // Two m-tiles a unit; one for SwiGLU pairs and for 32 rows (registers).
    let mt = if dual || (cols.wide && cols.nb == 4) { 1 } else { 2 };
    if grouped && (dual || !n.is_multiple_of(op.groups) || !(n / op.groups).is_multiple_of(16 * mt) || !d2_grouped()) {
        return None;
    }
    let fam = fmt.fam();
    let name = if cols.wide {
        format!("d2gemv_{fam}_r{}", 8 * cols.nb)
    } else {
        format!("d2{}_{fam}_n{}", if dual { "swiglu" } else { "gemv" }, cols.nb)
    };
    let tiles = n.div_ceil(16 * mt);
    let rounds = k / round;
    let most_parts = (rounds / D2_WARPS).max(1);
    let rw_of = |parts: usize| rounds.div_ceil(parts).div_ceil(D2_WARPS);
    // More parts shrink each block's activations: the fewest parts with which two blocks
    // fit an SM (one block of 8 warps keeps too few loads in flight), or at least one.
    let fits = |parts: usize, limit: usize| d2_smem(fmt, cols, rw_of(parts), mt, dual) <= limit;
    let fewest = (1..=most_parts)
        .find(|&p| fits(p, D2_TWO_BLOCKS_SMEM))
        .or_else(|| (1..=most_parts).find(|&p| fits(p, D2_MAX_SMEM)))?;
    let kernel = *D2_KERNELS.iter().find(|&&x| x == name)?;
    // Blocks loop over units (a row tile × a K part) and the grid is what is resident, so
    // a step lasts (units of the busiest block) × (rounds a warp per unit). Take the K
    // split that makes this shortest, fewer parts on a tie (each part adds a partial-sum
    // pass). E.g. 128 tiles of K 8192 on 132 SMs: 3 parts gave 88 blocks a part, of which
    // 40 took two tiles (10.7 rounds); 2 parts give every block one tile (8 rounds).
    let plan_of = |parts: usize| {
        let smem = d2_smem(fmt, cols, rw_of(parts), mt, dual);
        let cap = gpu.resident_blocks(kernel, 256, smem as u32) * gpu.sms;
        let grid_x = tiles.min((cap / parts).max(1));
        (tiles.div_ceil(grid_x) * rw_of(parts), parts, smem, grid_x)
    };
    // Shared memory only shrinks with more parts, so every count from `fewest` fits.
    let (_, parts, smem, grid_x) = (fewest..=most_parts)
        .map(plan_of)
        .filter(|&(.., grid_x)| !grouped || grid_x == tiles)
        .min_by_key(|&(cost, parts, ..)| (cost, parts))?;
    let rw_max = rw_of(parts);
    Some(D2Plan { name, tiles, parts, rw_max, smem, grid_x })
}

/// Whether v2 takes grouped products (`SLUICE_CUDA_D2_GROUPED=0` leaves them to the v1
/// tensor-core gemv, to compare).
fn d2_grouped() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_D2_GROUPED").map(|v| v != "0").unwrap_or(true))
}

/// Launch a v2 product (one launch: at most 8 rows, plain products [`d2_max_rows`]).
pub(crate) fn d2_gemv(gpu: &Gpu, plan: &D2Plan, op: Operand, w: &CudaWeight, w3: Option<&CudaWeight>, limit: f32) {
    let (wp, sp) = w.ptrs();
    let (wp3, sp3) = w3.map(CudaWeight::ptrs).unwrap_or((0, 0));
    let dual = w3.is_some();
    let cols = D2Cols::for_rows(op.rows).sums();
    let (partials, tickets) = if plan.parts > 1 {
        (
            gpu.scratch("d2_partials", plan.parts * cols * w.rows * (1 + usize::from(dual))),
            gpu.scratch("d2_tickets", plan.tiles),
        )
    } else {
        (0, 0)
    };
    let args = D2Args {
        out: op.out,
        x: op.x,
        w: wp,
        s: sp,
        w3: wp3,
        s3: sp3,
        partials,
        tickets,
        rows: op.rows as i32,
        n: w.rows as i32,
        k: w.cols as i32,
        x_stride: op.x_stride as i32,
        out_stride: op.out_stride as i32,
        tiles: plan.tiles as i32,
        parts: plan.parts as i32,
        rw_max: plan.rw_max as i32,
        limit,
        g_out: op.g_out(w),
        ..D2Args::default()
    };
    launch!(gpu, plan.name.as_str(), cfg((plan.grid_x as u32, plan.parts as u32, 1), 256, plan.smem as u32), args);
}
