//! Routed FP4 experts of decode batches of 1-64 rows on Hopper's warpgroup instruction
//! (cu/moe_wgmma.cu: the e2m1 codes turned into e4m3 in registers, `wgmma` with A from
//! registers, one FP4 scale group per instruction): which batches they take
//! ([`wgmoe_plan`]) and their launches ([`experts_wgmma`]). [`super::moe`] tries them
//! first for decode batches on sm_90; `SLUICE_CUDA_MOE_WGMMA=0` leaves those batches to
//! the v2 segment kernels (cu/decode2_segments.cu), to compare.

use cudarc::driver::DeviceRepr;

use super::CudaBackend;
use super::gemv_f8wg::resident;
use super::memory::CudaBuf;
use super::moe::{combine_in_list_order, expert_table, tc_experts};
use super::moe_v2::SegmentLists;
use super::runtime::{Gpu, cfg, launch};
use crate::backend::MoeWeights;

/// The kernels: gate/up (SwiGLU into h) and down, each with K split over clusters of 1,
/// 2 or 4 blocks (the order of [`SPLITS`]); then the same with the next step's fragments
/// converted while the tensor core works (`_p_`, [`pipelined`], the default); then those
/// with segments of 4 list positions (`_p_r4_`, [`r4_rows`]).
pub(crate) const WGMOE_KERNELS: [&str; 18] = [
    "wgmoe_swiglu_k1",
    "wgmoe_swiglu_k2",
    "wgmoe_swiglu_k4",
    "wgmoe_down_k1",
    "wgmoe_down_k2",
    "wgmoe_down_k4",
    "wgmoe_p_swiglu_k1",
    "wgmoe_p_swiglu_k2",
    "wgmoe_p_swiglu_k4",
    "wgmoe_p_down_k1",
    "wgmoe_p_down_k2",
    "wgmoe_p_down_k4",
    "wgmoe_p_r4_swiglu_k1",
    "wgmoe_p_r4_swiglu_k2",
    "wgmoe_p_r4_swiglu_k4",
    "wgmoe_p_r4_down_k1",
    "wgmoe_p_r4_down_k2",
    "wgmoe_p_r4_down_k4",
];
const SPLITS: [usize; 3] = [1, 2, 4];

/// List positions a segment holds (the kernels' `R`: three e4m3 parts a row fill 6 of the
/// instruction's 8 columns for two rows, 12 of 16 for four); `moe_lists` cuts the experts'
/// lists at the plan's length ([`WgMoePlan::seg_rows`]).
const SEGMENT_ROWS: usize = 2;
const SEGMENT_ROWS_R4: usize = 4;
/// Output rows of a tile (`WM_TILE`), inputs of a chunk (`WM_KC`: 8 FP4 scale groups),
/// bytes of a ring slot (`WM_SLOT`: the chunk's codes and scales), ring slots (the
/// kernels' `S`) and threads of a block (one warpgroup).
const TILE: usize = 64;
const CHUNK_INPUTS: usize = 256;
const SLOT_BYTES: usize = TILE * CHUNK_INPUTS / 2 + TILE * CHUNK_INPUTS / 32;
const STAGES: usize = 4;
const THREADS: u32 = 128;
/// What a unit costs beyond its weight bytes, in inputs of a row: staging a new
/// segment's rows, the wait for the last chunk's products and the sums through shared
/// memory (and the cluster) — counted as two chunks, as gemv_f8wg.rs counts a tile.
const UNIT_COST: usize = 2 * CHUNK_INPUTS;
/// Most dynamic shared memory the kernels are launched with (opted in at load): the
/// ring and the activations' e4m3 parts (8 bytes an input of the block's K part).
pub(crate) const WGMOE_MAX_SMEM: usize = 160 * 1024;

/// `WgMoeArgs` in moe_wgmma.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct WgMoeArgs {
    out: u64,
    x: u64,
    wtab: u64,
    segs: u64,
    n_seg: u64,
    list_rows: u64,
    n: i32,
    k: i32,
    tiles: i32,
    max_segs: i32,
    limit: f32,
    /// Zero: the struct has no padding, whose bytes would be undefined — a recorded decode
    /// step compares launches' argument bytes to find the steps it can replay as graphs.
    pad: u32,
}

// SAFETY: a plain #[repr(C)] struct of integers and floats without padding, `struct
// WgMoeArgs` in moe_wgmma.cu.
unsafe impl DeviceRepr for WgMoeArgs {}
const _: () = assert!(std::mem::size_of::<WgMoeArgs>() == 6 * 8 + 6 * 4, "WgMoeArgs has padding");

/// One projection's launch: the kernel (its name carries the K split, the cluster size),
/// grid and shared memory.
struct Launch {
    name: &'static str,
    grid: usize,
    smem: usize,
}

/// How a decode batch runs its routed experts on these kernels.
pub(crate) struct WgMoePlan {
    swiglu: Launch,
    down: Launch,
    /// List positions a segment (2 or 4), what `moe_lists` cuts the lists at.
    pub(crate) seg_rows: usize,
}

impl WgMoePlan {
    /// The two kernels and their K splits (for the parity suite and the kernel table).
    pub(crate) fn describe(&self) -> String {
        format!("{} ({} blocks) + {} ({} blocks)", self.swiglu.name, self.swiglu.grid, self.down.name, self.down.grid)
    }
}

/// Whether these kernels may take decode batches (`SLUICE_CUDA_MOE_WGMMA=0`: never;
/// inside [`without_wgmoe`]: not on this thread).
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_MOE_WGMMA").map(|v| v != "0").unwrap_or(true)) && !OFF_HERE.get()
}

/// The `_p_` kernels (the default), which convert the next step's codes while the tensor
/// core multiplies this one's (168 registers: three blocks an SM); `SLUICE_CUDA_MOE_WGMMA_PIPE=0`
/// (read once) runs the others, which convert each step's codes before its products (126
/// registers). On 12 Flash layers (H200) steps were 3%, 5% and 11% faster than on the
/// segment kernels at batch 1, 2 and 8 with the pipelined ones, 1%, 5% and 9% with the
/// others (docs/perf.md "Routed FP4 experts on `wgmma`").
fn pipelined() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_MOE_WGMMA_PIPE").map(|v| v != "0").unwrap_or(true))
}

thread_local! {
    static OFF_HERE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `f` with these kernels kept off this thread's routed experts (the segment kernels
/// run instead), so the parity suite and the kernel table reach both paths in one run.
pub(crate) fn without_wgmoe<T>(f: impl FnOnce() -> T) -> T {
    with_flag_set(&OFF_HERE, f)
}

/// `f` with the thread-local `flag` set, restored afterwards: the parity suite's way of
/// keeping one path off this thread's ops to reach the other in the same run.
pub(crate) fn with_flag_set<T>(
    flag: &'static std::thread::LocalKey<std::cell::Cell<bool>>,
    f: impl FnOnce() -> T,
) -> T {
    let before = flag.replace(true);
    let out = f();
    flag.set(before);
    out
}

/// The plan for a decode batch of `rows` rows when these kernels take it
/// (`SLUICE_CUDA_MOE_WGMMA` respected).
pub(crate) fn wgmoe_plan(gpu: &Gpu, rows: usize, w: &MoeWeights<CudaBackend>) -> Option<WgMoePlan> {
    if !enabled() {
        return None;
    }
    wgmoe_plan_always(gpu, rows, w)
}

/// [`wgmoe_plan`] whatever `SLUICE_CUDA_MOE_WGMMA` says: an sm_90 GPU (the kernels are
/// compiled for compute_90a there), 1 to [`max_rows`] rows (an expert's rows are cut
/// into segments of two, each streaming the expert again: past 64 rows that repeats too
/// much of it), every expert FP4 with
/// the tensor-core scales, widths multiples of the 256-input chunk and of the 64-row
/// tile, the down projection back to the hidden width.
pub(crate) fn wgmoe_plan_always(gpu: &Gpu, rows: usize, w: &MoeWeights<CudaBackend>) -> Option<WgMoePlan> {
    let first = w.experts.first()?;
    let (d, inter) = (w.gate.cols, first.w1.rows);
    if gpu.cc.0 != 9 || !(1..=max_rows()).contains(&rows) || first.w2.rows != d || first.w2.cols != inter {
        return None;
    }
    let fits = |n: usize, k: usize| n.is_multiple_of(TILE) && k.is_multiple_of(CHUNK_INPUTS) && n * k < 1 << 31;
    if !fits(inter, d) || !fits(d, inter) || tc_experts(w, true, d)? != "fp4" || tc_experts(w, false, inter)? != "fp4" {
        return None;
    }
    let max_segs = rows * w.top_k;
    let r4 = pipelined() && rows >= r4_rows();
    let kernels_from = if r4 {
        12
    } else if pipelined() {
        6
    } else {
        0
    };
    let seg_rows = if r4 { SEGMENT_ROWS_R4 } else { SEGMENT_ROWS };
    Some(WgMoePlan {
        swiglu: launch_plan(gpu, kernels_from, max_segs * (inter / TILE), d, 2, seg_rows, forced_splits().0)?,
        down: launch_plan(gpu, kernels_from + 3, max_segs * (d / TILE), inter, 1, seg_rows, forced_splits().1)?,
        seg_rows,
    })
}

/// Fewest rows of a batch whose segments hold 4 list positions (the `_p_r4_` kernels:
/// `SLUICE_CUDA_MOE_WGMMA_R4_ROWS`, read once; 0 = never). With segments of two an expert
/// with 3-4 of the batch's rows is streamed twice — at 64 rows (384 routed pairs over 256
/// experts) about a quarter more expert bytes than the experts hold; four rows a segment
/// cost a wider instruction (12 of 16 columns used) and twice the staged activations.
fn r4_rows() -> usize {
    static ONCE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ONCE.get_or_init(|| match std::env::var("SLUICE_CUDA_MOE_WGMMA_R4_ROWS").ok().map(|v| v.parse::<usize>()) {
        None => R4_ROWS,
        Some(Ok(0)) => usize::MAX,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            tracing::warn!("SLUICE_CUDA_MOE_WGMMA_R4_ROWS is not a number of rows: using {R4_ROWS}");
            R4_ROWS
        }
    })
}

/// Default fewest rows for segments of 4: on 20 Flash layers batches of 32 and 64 ran 2%
/// and 10% faster a step with them, batch 16 3% slower (docs/perf.md, "Narrow FP8
/// products split along K; segments of four rows").
const R4_ROWS: usize = 32;

/// Most rows of a batch these kernels take (`SLUICE_CUDA_MOE_WGMMA_ROWS`, read once;
/// default [`WGMOE_MAX_ROWS`]).
fn max_rows() -> usize {
    static ONCE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ONCE.get_or_init(|| super::runtime::env_rows("SLUICE_CUDA_MOE_WGMMA_ROWS").unwrap_or(WGMOE_MAX_ROWS))
}

/// Default most rows: on 20 Flash layers batches of 16, 32 and 64 ran 12%, 9% and 4%
/// faster a step here than on the segment kernels, though an expert with three or more of
/// a batch's rows is streamed once a segment of two (docs/perf.md, "A decode step as the
/// device ran it"); at 8 rows and fewer these were already the default.
const WGMOE_MAX_ROWS: usize = 64;

/// K splits forced on the gate/up and the down launches (`SLUICE_CUDA_WGMOE_SPLIT_GATE_UP`,
/// `SLUICE_CUDA_WGMOE_SPLIT_DOWN`: 1, 2 or 4, or 0 for [`launch_plan`]'s rule; read once),
/// to compare splits by A/B. A forced split that does not fit a projection's shared
/// memory leaves it to the rule.
fn forced_splits() -> (usize, usize) {
    static ONCE: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();
    *ONCE.get_or_init(|| {
        let split = |name: &str| match super::runtime::env_rows(name) {
            Some(n) if n == 0 || SPLITS.contains(&n) => n,
            Some(n) => {
                tracing::warn!("{name}={n}: expected 1, 2 or 4 (0: the rule); using the rule");
                0
            }
            None => 0,
        };
        (split("SLUICE_CUDA_WGMOE_SPLIT_GATE_UP"), split("SLUICE_CUDA_WGMOE_SPLIT_DOWN"))
    })
}

/// The K split of one projection (`first`: its kernels' place in [`WGMOE_KERNELS`]) of
/// at most `units` units over `k` inputs and `matrices` weights a unit: `forced` where it
/// is not 0 and fits, else the one that gives the busiest cluster the least work when the
/// grid is what the GPU holds at once (gemv_f8wg.rs's rule); ties go to the smaller split.
fn launch_plan(
    gpu: &Gpu,
    first: usize,
    units: usize,
    k: usize,
    matrices: usize,
    seg_rows: usize,
    forced: usize,
) -> Option<Launch> {
    // The staged activations: three e4m3 parts a row in the instruction's 8 or 16 columns,
    // a byte a column an input.
    let columns = if seg_rows > SEGMENT_ROWS { 16 } else { 8 };
    // (split, the busiest cluster's work, the launch) of every split that fits.
    let mut fitting: Vec<(usize, usize, Launch)> = Vec::with_capacity(SPLITS.len());
    for (i, &split) in SPLITS.iter().enumerate() {
        if !k.is_multiple_of(split * CHUNK_INPUTS) {
            continue;
        }
        let smem = STAGES * SLOT_BYTES + columns * (k / split);
        if smem > WGMOE_MAX_SMEM {
            continue;
        }
        let name = WGMOE_KERNELS[first + i];
        let clusters = units.min(resident(gpu, name, split, smem)).max(1);
        let busiest = units.div_ceil(clusters) * (matrices * k / split + UNIT_COST);
        fitting.push((split, busiest, Launch { name, grid: clusters * split, smem }));
    }
    let pick = match fitting.iter().position(|&(split, _, _)| split == forced) {
        Some(at) => at,
        // `min_by_key` keeps the first of equal keys: the smaller split.
        None => (0..fitting.len()).min_by_key(|&at| fitting[at].1)?,
    };
    Some(fitting.swap_remove(pick).2)
}

/// The routed experts of a decode batch on these kernels (`lists` from `moe_lists`, cut
/// at the plan's `seg_rows`): gate/up of
/// each segment into h ([list position][inter], f32), down of each segment into y ([list
/// position][d]), then each row's weighted sum in list order into `out`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn experts_wgmma(
    b: &CudaBackend,
    plan: &WgMoePlan,
    x: &CudaBuf,
    rows: usize,
    w: &MoeWeights<CudaBackend>,
    lists: &SegmentLists,
    weights: &CudaBuf,
    out: &mut CudaBuf,
    shared: Option<super::moe::SharedAdd>,
) {
    let g = &b.gpu;
    let (d, k) = (w.gate.cols, w.top_k);
    let (n, inter) = (rows * k, w.experts[0].w1.rows);
    let h = b.alloc_buf(n * inter);
    let y = b.alloc_buf(n * d);
    // (launch, output, inputs, weight table, outputs, inputs)
    let up = (&plan.swiglu, g.ptr(&h.mem), g.ptr(&x.mem), expert_table(b, w, false), inter, d);
    let down = (&plan.down, g.ptr(&y.mem), g.ptr(&h.mem), expert_table(b, w, true), d, inter);
    for (l, dst, src, wtab, n_out, k_in) in [up, down] {
        let args = WgMoeArgs {
            out: dst,
            x: src,
            wtab,
            segs: lists.segs,
            n_seg: lists.n_seg,
            list_rows: lists.rows,
            n: n_out as i32,
            k: k_in as i32,
            tiles: (n_out / TILE) as i32,
            max_segs: n as i32,
            limit: w.swiglu_limit,
            pad: 0,
        };
        launch!(g, l.name, cfg((l.grid as u32, 1, 1), THREADS, l.smem as u32), args);
    }
    combine_in_list_order(b, &y, (rows, k, d), (lists.pos, lists.widx), weights, out, shared);
}
