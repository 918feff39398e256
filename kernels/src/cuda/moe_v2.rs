//! The v2 routed-expert kernels of decode batches (cu/decode2.cu, cu/decode2_segments.cu;
//! `SLUICE_CUDA_DECODE_KERNELS=v2`, the default), over FP4 experts with tensor-core
//! scales. Both take the device-side routing lists of `moe_lists` and never read the
//! routing back.
//!
//! - Every decode batch by default, 1 to 256 rows ([`experts_by_segments`]): the rows
//!   staged once as f16 halves, then units of (segment, output tile), a segment being up
//!   to 4 or 8 list positions of one expert, so each chosen expert is streamed once a
//!   projection; the combine is the list-order sum of the grouped path.
//! - Up to 8 rows below `SLUICE_CUDA_MOE_SEGMENTS_FROM` ([`experts_v2`]): every active
//!   expert's gate/up pair over all rows of the batch into h, then each output tile's
//!   down products over the active experts with the combine folded in (two launches).

use cudarc::driver::DeviceRepr;

use super::CudaBackend;
use super::decode_v2::{D2_KERNELS, D2_MAX_SMEM, D2_TWO_BLOCKS_SMEM, D2Args, D2Cols, D2Fmt, d2_round, d2_smem};
use super::matmul::GEMV_MAX_ROWS;
use super::memory::CudaBuf;
use super::moe::{expert_table, tc_experts};
use super::runtime::{cfg, env_rows, launch};
use crate::backend::MoeWeights;

/// `D2DownArgs` in decode2.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct D2DownArgs {
    out: u64,
    hb: u64,
    wtab: u64,
    active: u64,
    n_active: u64,
    chosen: u64,
    weights: u64,
    rows: i32,
    n: i32,
    k: i32,
    top_k: i32,
    tiles: i32,
    h_unscale: f32,
}

// SAFETY: a plain #[repr(C)] struct of integers and floats, `struct D2DownArgs` in decode2.cu.
unsafe impl DeviceRepr for D2DownArgs {}

/// How the v2 expert kernels run a decode batch.
pub(crate) struct ExpertsV2 {
    swiglu: &'static str,
    down: &'static str,
    /// Swiglu kernel: K parts, rounds a warp takes, dynamic shared memory.
    parts: usize,
    rw_max: usize,
    smem: usize,
    /// h is split into f16 halves after multiplying by `h_scale` (a power of two that
    /// keeps |h| ≤ limit·max(limit, 0.28) under 2^14).
    h_scale: f32,
}

/// Whether the v2 expert kernels take these experts, and if so the power of two h is
/// multiplied by before its f16 split: every expert FP4 with tensor-core scales, widths
/// multiples of the 128-input round, a finite positive SwiGLU clamp (it bounds h, whose
/// f16 split needs a fixed scale: |h| ≤ limit·max(limit, 0.28) is kept under 2^14).
fn v2_experts_h_scale(w: &MoeWeights<CudaBackend>) -> Option<f32> {
    let first = w.experts.first()?;
    let (d, inter) = (w.gate.cols, first.w1.rows);
    let round = d2_round(D2Fmt::Fp4);
    if !d.is_multiple_of(round) || !inter.is_multiple_of(round) {
        return None;
    }
    if tc_experts(w, true, d)? != "fp4" || tc_experts(w, false, inter)? != "fp4" || first.w2.rows != d {
        return None;
    }
    let limit = w.swiglu_limit;
    if !(limit.is_finite() && limit > 0.0) {
        return None;
    }
    let bound = limit * limit.max(0.2785);
    let e = bound.log2().ceil() as i32 - 14;
    (-120..=120).contains(&e).then(|| 2f32.powi(-e))
}

/// The v2 plan for a decode batch's routed experts of at most 8 rows, when v2 takes the
/// experts ([`v2_experts_h_scale`]) and the activations fit shared memory.
pub(crate) fn experts_v2_plan(rows: usize, w: &MoeWeights<CudaBackend>) -> Option<ExpertsV2> {
    if rows == 0 || rows > GEMV_MAX_ROWS {
        return None;
    }
    let h_scale = v2_experts_h_scale(w)?;
    let d = w.gate.cols;
    let round = d2_round(D2Fmt::Fp4);
    let nb = if rows <= 4 { 1 } else { 2 };
    // Split K (partials and a ticket per unit, as the plain products) until two blocks
    // fit an SM: at 5-8 rows the activations alone take 128 KiB of a 4096-wide layer.
    let rounds = d / round;
    let rw_of = |parts: usize| rounds.div_ceil(parts).div_ceil(8);
    let mut parts = 1;
    while d2_smem(D2Fmt::Fp4, D2Cols { nb, wide: false }, rw_of(parts), 1, true) > D2_TWO_BLOCKS_SMEM
        && parts < (rounds / 8).max(1)
    {
        parts += 1;
    }
    let rw_max = rw_of(parts);
    let smem = d2_smem(D2Fmt::Fp4, D2Cols { nb, wide: false }, rw_max, 1, true);
    if smem > D2_MAX_SMEM {
        return None;
    }
    let pick = |name: String| D2_KERNELS.iter().copied().find(|&k| k == name);
    Some(ExpertsV2 {
        swiglu: pick(format!("d2moe_swiglu_fp4_n{nb}"))?,
        down: pick(format!("d2moe_down_fp4_n{nb}"))?,
        parts,
        rw_max,
        smem,
        h_scale,
    })
}

/// The routed experts of a decode batch in two launches (the lists, `active` and
/// `n_active`, come from `moe_lists`): gate/up of every active expert over all rows into
/// h (f16 halves, [slot][row][2][inter]), then the down products of each output tile over
/// the active experts with each row's weighted sum, in expert order, into `out`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn experts_v2(
    b: &CudaBackend,
    plan: &ExpertsV2,
    x: &CudaBuf,
    rows: usize,
    w: &MoeWeights<CudaBackend>,
    active: u64,
    n_active: u64,
    (chosen, weights): (u64, u64),
    out: &mut CudaBuf,
) {
    let g = &b.gpu;
    let (n_exp, d, k) = (w.experts.len(), w.gate.cols, w.top_k);
    let inter = w.experts[0].w1.rows;
    let slots = n_exp.min(rows * k);
    let hb = g.alloc::<u16>(slots * rows * 2 * inter);
    let tiles_up = inter.div_ceil(16);
    let cap = g.resident_blocks(plan.swiglu, 256, plan.smem as u32) * g.sms;
    let (partials, tickets) = if plan.parts > 1 {
        (g.scratch("d2_partials", slots * plan.parts * 8 * inter * 2), g.scratch("d2_tickets", slots * tiles_up))
    } else {
        (0, 0)
    };
    let args = D2Args {
        x: g.ptr(&x.mem),
        wtab: expert_table(b, w, false),
        active,
        n_active,
        hb: g.ptr(&hb),
        partials,
        tickets,
        rows: rows as i32,
        n: inter as i32,
        k: d as i32,
        x_stride: d as i32,
        tiles: tiles_up as i32,
        parts: plan.parts as i32,
        rw_max: plan.rw_max as i32,
        limit: w.swiglu_limit,
        h_scale: plan.h_scale,
        ..D2Args::default()
    };
    let grid = (slots * tiles_up).min(cap.div_ceil(plan.parts)).max(1);
    launch!(g, plan.swiglu, cfg((grid as u32, plan.parts as u32, 1), 256, plan.smem as u32), args);
    let tiles_down = d.div_ceil(16);
    let cap = g.resident_blocks(plan.down, 256, 0) * g.sms;
    let args = D2DownArgs {
        out: g.ptr(&out.mem),
        hb: g.ptr(&hb),
        wtab: expert_table(b, w, true),
        active,
        n_active,
        chosen,
        weights,
        rows: rows as i32,
        n: d as i32,
        k: inter as i32,
        top_k: k as i32,
        tiles: tiles_down as i32,
        h_unscale: 1.0 / plan.h_scale,
    };
    launch!(g, plan.down, cfg((tiles_down.min(cap).max(1) as u32, 1, 1), 256, 0), args);
}

/// `D2SegArgs` in decode2_segments.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct D2SegArgs {
    out: u64,
    xb: u64,
    xscale: u64,
    wtab: u64,
    segs: u64,
    n_seg: u64,
    list_rows: u64,
    n: i32,
    k: i32,
    tiles: i32,
    max_segs: i32,
    limit: f32,
    h_scale: f32,
}

// SAFETY: a plain #[repr(C)] struct of integers and floats, `struct D2SegArgs` in
// decode2_segments.cu.
unsafe impl DeviceRepr for D2SegArgs {}

/// The device lists `moe_lists` writes for the segment kernels (device addresses): each
/// list position's batch row and weight index, the segments (3 ints a segment: first
/// position, positions, expert; at most `max_segs`), their number, and each row's list
/// positions (for the combine).
pub(crate) struct SegmentLists {
    pub(crate) rows: u64,
    pub(crate) widx: u64,
    pub(crate) segs: u64,
    pub(crate) n_seg: u64,
    pub(crate) pos: u64,
}

impl SegmentLists {
    /// The lists in `segs_buf` (4·max_segs + 1 ints: the segments, their number, then the
    /// positions), beside the list rows and weight indices.
    pub(crate) fn new(rows: u64, widx: u64, segs_buf: u64, max_segs: usize) -> Self {
        let n_seg = segs_buf + 4 * 3 * max_segs as u64;
        SegmentLists { rows, widx, segs: segs_buf, n_seg, pos: n_seg + 4 }
    }
}

/// How a decode batch runs its routed experts by segments.
pub(crate) struct ExpertsBySegments {
    /// Most list positions of one expert a segment holds (4 or 8: one or two mma column
    /// blocks); `moe_lists` cuts the lists into segments of this size.
    pub(crate) seg_rows: usize,
    swiglu: &'static str,
    down: &'static str,
    h_scale: f32,
}

/// The segment plan for a decode batch (from [`segments_from`] rows), when v2 takes the
/// experts.
/// A segment of 8 rows costs twice the mma work of one of 4 whatever rows it really
/// holds, so segments hold 4 while an expert expects at most two rows (k·rows over all
/// experts, wherever they are held), 8 beyond. `SLUICE_CUDA_MOE_SEGMENT_ROWS` (read once)
/// fixes it to 4 or 8, or with 0 turns segments off (the first version's grouped
/// tensor-core launches of 8 batch rows), to compare them.
pub(crate) fn segments_plan(rows: usize, w: &MoeWeights<CudaBackend>) -> Option<ExpertsBySegments> {
    if rows < segments_from() {
        return None;
    }
    let h_scale = v2_experts_h_scale(w)?;
    let seg_rows = segment_rows_override().unwrap_or(if rows * w.top_k <= 2 * w.gate.rows { 4 } else { 8 });
    if seg_rows == 0 {
        return None;
    }
    let nb = seg_rows / 4;
    let pick = |name: String| SEGMENT_KERNELS.iter().copied().find(|&k| k == name);
    Some(ExpertsBySegments {
        seg_rows,
        swiglu: pick(format!("d2seg_swiglu_fp4_n{nb}"))?,
        down: pick(format!("d2seg_down_fp4_n{nb}"))?,
        h_scale,
    })
}

/// Fewest rows that take the segments (`SLUICE_CUDA_MOE_SEGMENTS_FROM`, 1–9). Default 1:
/// every decode batch. Below it `d2moe_swiglu` / `d2moe_down` run every active expert
/// over all rows of the batch (one launch fewer, no row staging, but each expert's
/// 8-column mma work is paid for every row and the down kernel walks the experts one
/// after another): on 8 Flash layers (H200) 21% slower a step at batch 8 (docs/perf.md,
/// "Programmatic dependent launch").
fn segments_from() -> usize {
    static FROM: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *FROM.get_or_init(|| env_rows("SLUICE_CUDA_MOE_SEGMENTS_FROM").unwrap_or(1).clamp(1, GEMV_MAX_ROWS + 1))
}

const SEGMENT_KERNELS: [&str; 4] =
    ["d2seg_swiglu_fp4_n1", "d2seg_swiglu_fp4_n2", "d2seg_down_fp4_n1", "d2seg_down_fp4_n2"];

fn segment_rows_override() -> Option<usize> {
    static ONCE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *ONCE.get_or_init(|| {
        let v = std::env::var("SLUICE_CUDA_MOE_SEGMENT_ROWS").ok()?;
        match v.parse::<usize>() {
            Ok(n @ (0 | 4 | 8)) => Some(n),
            _ => {
                tracing::warn!(value = %v, "SLUICE_CUDA_MOE_SEGMENT_ROWS is not 0, 4 or 8: choosing by batch");
                None
            }
        }
    })
}

/// The routed experts of a decode batch by segments (`lists` from `moe_lists`, cut at
/// `plan.seg_rows`): the rows staged as f16 halves,
/// gate/up of each segment into h ([list position][2][inter]), down of each segment into
/// y ([list position][d]), then each row's weighted sum in list order into `out`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn experts_by_segments(
    b: &CudaBackend,
    plan: &ExpertsBySegments,
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
    let xb = g.alloc::<u16>(rows * 2 * d);
    let xscale = g.alloc::<f32>(rows);
    let (xbp, xsp) = (g.ptr(&xb), g.ptr(&xscale));
    launch!(g, "d2_rows_f16", cfg((rows as u32, 1, 1), 256, 0), xbp, xsp, g.ptr(&x.mem), rows as i32, d as i32);
    let hb = g.alloc::<u16>(n * 2 * inter);
    let y = b.alloc_buf(n * d);
    // (kernel, output, inputs, weight table, outputs, inputs, h factor)
    let up = (plan.swiglu, g.ptr(&hb), xbp, expert_table(b, w, false), inter, d, plan.h_scale);
    let down = (plan.down, g.ptr(&y.mem), g.ptr(&hb), expert_table(b, w, true), d, inter, 1.0 / plan.h_scale);
    for (kernel, dst, src, wtab, n_out, k_in, h) in [up, down] {
        let tiles = n_out.div_ceil(16);
        let args = D2SegArgs {
            out: dst,
            xb: src,
            xscale: xsp,
            wtab,
            segs: lists.segs,
            n_seg: lists.n_seg,
            list_rows: lists.rows,
            n: n_out as i32,
            k: k_in as i32,
            tiles: tiles as i32,
            max_segs: n as i32,
            limit: w.swiglu_limit,
            h_scale: h,
        };
        // Blocks loop over units; the segments are known on the device only, so the grid
        // is what is resident (or the units the most segments could make).
        let cap = g.resident_blocks(kernel, 256, 0) * g.sms;
        launch!(g, kernel, cfg(((n * tiles).min(cap).max(1) as u32, 1, 1), 256, 0), args);
    }
    super::moe::combine_in_list_order(b, &y, (rows, k, d), (lists.pos, lists.widx), weights, out, shared);
}
