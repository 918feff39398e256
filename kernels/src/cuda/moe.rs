//! The MoE block on the GPU: router product and routing kernel on the device. A decode
//! batch (up to [`GEMV_MAX_ROWS`] rows) stays on the device: the routing lists are
//! built there and one grouped gemv per projection covers every expert (experts that
//! received nothing return at once), so the host issues the whole step without
//! waiting on the GPU. Larger batches read the chosen experts back (one small copy per
//! block), gather every routed row in expert order and run each projection as one
//! grouped tensor-core launch whose tiles are runs of one expert's rows (its weights
//! dequantised tile by tile, FP4 experts included; `moe_host`). Either way the results are
//! accumulated in expert order, as the CPU does, so the sum does not depend on
//! scheduling (and both paths give the same bits).
//!
//! With `SLUICE_CUDA_DECODE_KERNELS=v2` (the default), decode batches of FP4 experts take
//! the v2 kernels instead (`moe_v2`): up to 8 rows every active expert's gate/up pair
//! over all rows, then each output tile's down products with the combine folded in; 9 to
//! 256 rows by segments of one expert's list positions, so each chosen expert is streamed
//! once a projection (expert order, as above). On sm_90, batches of 1 to 8 rows run those
//! segments (of two positions) on `wgmma` instead (`moe_wgmma`).

use cudarc::driver::{DeviceRepr, LaunchConfig};

use super::CudaBackend;
use super::matmul::{
    Decode, GEMV_MAX_ROWS, Operand, count_product, family, matmul_as, outputs_per_block, swiglu_pair_of, tc_family,
    tc_scratch,
};
use super::memory::{CudaBuf, CudaWeight};
use super::moe_v2::{SegmentLists, experts_by_segments, experts_v2, experts_v2_plan, segments_plan};
use super::moe_wgmma::{experts_wgmma, wgmoe_plan, with_flag_set};
use super::runtime::{DevBuf, Gpu, cfg, cfg_elems, launch};
use super::{chunked_products, cublas_bf16, moe_cublas, moe_host};
use crate::backend::{ExpertWeights, MoeWeights, Routing};

/// Most routed experts the routing kernel's by-value bias holds.
const MAX_EXPERTS: usize = 512;

#[repr(C)]
#[derive(Clone, Copy)]
struct F512 {
    v: [f32; MAX_EXPERTS],
}

// SAFETY: a plain #[repr(C)] float array, `struct F512` in moe.cu.
unsafe impl DeviceRepr for F512 {}

/// SwiGLU expert on `x[rows, d]` (contiguous) into a new `[rows, d_out]`.
pub(super) fn expert(
    b: &CudaBackend,
    x: u64,
    rows: usize,
    e: &ExpertWeights<CudaBackend>,
    limit: f32,
    variant: Decode,
    rounded: Option<&cublas_bf16::RoundedRows>,
) -> CudaBuf {
    let g = &b.gpu;
    let y = b.alloc_buf(rows * e.w2.rows);
    if cublas_bf16::swiglu_expert(g, (x, e.w1.cols, rows), (&e.w1, &e.w3, &e.w2), limit, g.ptr(&y.mem)) {
        return y;
    }
    let inter = e.w1.rows;
    let h = b.alloc_buf(rows * inter);
    let op = Operand { x, x_stride: e.w1.cols, out: g.ptr(&h.mem), out_stride: inter, rows, groups: 1 };
    let down =
        Operand { x: g.ptr(&h.mem), x_stride: inter, out: g.ptr(&y.mem), out_stride: e.w2.rows, rows, groups: 1 };
    if let Some(xb) = rounded.filter(|_| shared_swiglu_bf16() && cublas_bf16::reads_bf16_rows(g, &down, &e.w2)) {
        // The pair from rows already in bf16 (which it reads on cuBLAS) into a down product
        // that reads bf16 rows: the SwiGLU is written rounded (`swiglu_bf16`: swiglu_act's
        // value rounded as the down product's own rounding would), where swiglu_act wrote
        // f32 rows for `round_bf16_rows8` to read again — the same bits, one pass less.
        let n = rows * inter;
        let up = g.alloc::<f32>(n);
        // A decode batch's pair as one batched call of weight chunks (chunked_products.rs).
        let pair = [(Operand { out: g.ptr(&h.mem), ..op }, &e.w1), (Operand { out: g.ptr(&up), ..op }, &e.w3)];
        chunked_products::products_of_rounded(g, xb, &pair);
        let hb = g.alloc::<u16>(n);
        cublas_bf16::swiglu_bf16(g, g.ptr(&hb), g.ptr(&h.mem), g.ptr(&up), n, limit);
        count_product(g, rows, &e.w2);
        cublas_bf16::product_of_bf16_rows(g, g.ptr(&hb), rows, &e.w2, g.ptr(&y.mem));
        return y;
    }
    swiglu_pair_of(g, op, (&e.w1, &e.w3), limit, variant, rounded);
    matmul_as(g, down, &e.w2, variant);
    y
}

/// Whether an expert whose SwiGLU pair reads rows already in bf16 writes its SwiGLU in
/// bf16 for the down product ([`expert`]; a prefill's shared expert).
/// `SLUICE_CUDA_SHARED_SWIGLU_BF16=0` (read once) keeps `swiglu_act`'s f32 rows.
fn shared_swiglu_bf16() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_SHARED_SWIGLU_BF16").map_or(true, |v| v != "0"))
}

/// The MoE block with the decode kernels `SLUICE_CUDA_DECODE_KERNELS` selects.
pub(crate) fn moe(
    b: &CudaBackend,
    x: &CudaBuf,
    rows: usize,
    tokens: &[u32],
    w: &MoeWeights<CudaBackend>,
    shared_rows: std::ops::Range<usize>,
    out: &mut CudaBuf,
) {
    moe_as(b, x, rows, tokens, w, shared_rows, out, Decode::from_env())
}

/// [`moe`] with the decode kernels given (the benchmark and the parity suite run both).
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_as(
    b: &CudaBackend,
    x: &CudaBuf,
    rows: usize,
    tokens: &[u32],
    w: &MoeWeights<CudaBackend>,
    shared_rows: std::ops::Range<usize>,
    out: &mut CudaBuf,
    variant: Decode,
) {
    let g = &b.gpu;
    let (n_exp, d, k) = (w.gate.rows, w.gate.cols, w.top_k);
    assert_eq!(x.len, rows * d, "moe input is not [rows, {d}]");
    assert_eq!(out.len, rows * d, "moe output is not [rows, {d}]");
    assert!(n_exp <= MAX_EXPERTS, "{n_exp} experts exceed the CUDA routing kernel's {MAX_EXPERTS}");
    assert!(w.top_k <= 16, "top-{} routing exceeds the CUDA routing kernel's 16", w.top_k);
    if rows == 0 {
        return;
    }
    // The shared expert, as a branch beside the routed ones where both are chains of
    // latency-bound kernels (a recorded step then runs them at once; otherwise this is
    // just its place in the order).
    let branch = rows <= moe_branch_rows();
    // The rows rounded to bf16 once where the router's product and the shared expert's
    // pair both read them so (a prefill's, on cuBLAS): each rounded them itself (an 8K
    // prefill's 128 MB read twice a layer).
    let x_op = Operand { x: g.ptr(&x.mem), x_stride: d, out: 0, out_stride: n_exp, rows, groups: 1 };
    let x_bf16 = w
        .shared
        .as_ref()
        .filter(|_| !branch && shared_rows == (0..rows) && router_shares_rounding())
        .and_then(|s| cublas_bf16::rounded_or_lent(g, &x_op, &[&w.gate, &s.w1, &s.w3], x.bf16.as_ref()));
    let shared_expert = || {
        w.shared.as_ref().filter(|_| !shared_rows.is_empty()).map(|shared| {
            assert!(shared_rows.end <= rows, "shared rows {shared_rows:?} outside the batch's {rows}");
            if branch {
                g.fork();
            }
            let y = b.prof("moe: shared", || {
                let (at, n) = (4 * (shared_rows.start * d) as u64, shared_rows.len());
                expert(b, g.ptr(&x.mem) + at, n, shared, w.swiglu_limit, variant, x_bf16.as_ref())
            });
            if branch {
                g.to_main();
            }
            y
        })
    };
    // Routed on the device, the shared expert goes first; with the routing read back it
    // goes after the read is queued, so that the device runs it while the host waits for
    // the routing and builds the expert lists (those ~0.5 ms a layer of an 8K prefill
    // left the device idle before; docs/perf.md "Where an 8K prefill waits").
    let on_device = device_routable(rows, w, variant);
    let mut shared = if on_device { shared_expert() } else { None };
    let route = b.prof("moe: router", || {
        let logits = b.alloc_buf(rows * n_exp);
        let op = Operand { out: g.ptr(&logits.mem), ..x_op };
        match &x_bf16 {
            Some(xb) => {
                count_product(g, rows, &w.gate);
                xb.product(g, op, &w.gate);
            }
            None => matmul_as(g, op, &w.gate, variant),
        }

        let mut bias = F512 { v: [0.0; MAX_EXPERTS] };
        let hash_rows = match &w.routing {
            Routing::TopK { bias: bv } => {
                bias.v[..bv.len()].copy_from_slice(bv);
                None
            }
            Routing::Hash { tid2eid } => {
                let mut rows_k = Vec::with_capacity(rows * k);
                for &t in &tokens[..rows] {
                    rows_k.extend_from_slice(&tid2eid[t as usize * k..(t as usize + 1) * k]);
                }
                if let Some(&e) = rows_k.iter().find(|&&e| e as usize >= n_exp) {
                    panic!("hash routing table sends a token to expert {e}, outside 0..{n_exp}");
                }
                Some(g.upload(&rows_k))
            }
        };
        RouteLaunch {
            logits,
            hash_rows,
            bias,
            scale: w.route_scale,
            experts: g.alloc::<i32>(rows * k),
            weights: b.alloc_buf(rows * k),
            rows,
            n_exp,
            k,
        }
    });
    // Routed on the device over every expert, the lists kernel takes the routing into its
    // launch (`moe_route_lists`); otherwise the routing runs now.
    let route_with_lists = on_device && n_exp == w.experts.len() && route_lists_fused();
    if !route_with_lists {
        route.launch(g);
    }
    let queued = (!on_device).then(|| {
        let read = g.read_later(&route.experts, rows * k);
        shared = shared_expert();
        read
    });
    // The shared expert's rows go into the combine kernel where the routed experts end in
    // one (after the branch's join there).
    let shared_add = shared.as_ref().map(|y| SharedAdd {
        y: g.ptr(&y.mem),
        first: shared_rows.start,
        rows: shared_rows.len(),
        join: branch,
    });
    let added = if on_device {
        b.prof("moe: experts", || {
            let routing =
                if route_with_lists { ListsRouting::Fused(&route) } else { ListsRouting::Chosen(&route.experts) };
            experts_routed_on_device(b, x, rows, tokens, w, routing, &route.weights, out, variant, shared_add)
        })
    } else {
        let mut host = vec![0i32; rows * k];
        g.finish_read(queued.expect("the routing's read queued"), &mut host);
        b.prof("moe: experts", || {
            moe_host::experts_routed_on_host(b, x, rows, w, &host, &route.weights, out, variant, shared_add)
        })
    };
    if let Some(y) = shared.filter(|_| !added) {
        if branch {
            g.join();
        }
        let (at, n) = (4 * (shared_rows.start * d) as u64, shared_rows.len());
        launch!(g, "add_into", cfg_elems(n * d), g.ptr(&out.mem) + at, g.ptr(&y.mem), (n * d) as i64);
    }
}

/// The shared expert's output, added by the routed experts' combine kernel as it writes
/// the sum (one launch fewer than an `add_into` after it): `y[rows, d]` for batch rows
/// `first .. first + rows`; `join`: the shared expert ran as a branch, joined first.
#[derive(Clone, Copy)]
pub(crate) struct SharedAdd {
    y: u64,
    first: usize,
    rows: usize,
    join: bool,
}

impl SharedAdd {
    /// The combine kernel's three arguments (a null pointer when there is none), after
    /// joining the shared expert's branch.
    pub(super) fn args(shared: Option<SharedAdd>, g: &super::runtime::Gpu) -> (u64, i32, i32) {
        match shared {
            Some(s) => {
                if s.join {
                    g.join();
                }
                (s.y, s.first as i32, s.rows as i32)
            }
            None => (0, 0, 0),
        }
    }
}

/// What `moe_lists` writes and how (`struct MoeListsOut` in moe.cu): device addresses of
/// the lists, the bytes an active expert streams, the segment size and most segments.
#[repr(C)]
#[derive(Clone, Copy)]
struct ListsOut {
    counts: u64,
    offsets: u64,
    list_rows: u64,
    list_widx: u64,
    active: u64,
    n_active: u64,
    traffic: u64,
    segs: u64,
    pos: u64,
    expert_bytes: u64,
    seg_rows: i32,
    max_segs: i32,
}

// SAFETY: #[repr(C)] u64s then two i32s (no padding), laid out as the C struct.
unsafe impl DeviceRepr for ListsOut {}

/// A batch's routing kernel, built but not yet launched: the router product's logits
/// (and a hash layer's table rows) it reads, kept alive until it is, and the chosen
/// experts and weights it writes.
pub(crate) struct RouteLaunch {
    logits: CudaBuf,
    hash_rows: Option<DevBuf<u32>>,
    bias: F512,
    scale: f32,
    experts: DevBuf<i32>,
    weights: CudaBuf,
    rows: usize,
    n_exp: usize,
    k: usize,
}

impl RouteLaunch {
    /// The arguments `moe_route` and `moe_route_lists` open with.
    fn args(&self, g: &Gpu) -> (u64, i32, i32, i32, u64, F512, f32, u64, u64) {
        let hash = self.hash_rows.as_ref().map(|h| g.ptr(h)).unwrap_or(0);
        let (rows, n_exp, k) = (self.rows as i32, self.n_exp as i32, self.k as i32);
        (
            g.ptr(&self.logits.mem),
            rows,
            n_exp,
            k,
            hash,
            self.bias,
            self.scale,
            g.ptr(&self.experts),
            g.ptr(&self.weights.mem),
        )
    }

    /// `moe_route` alone: a block a row.
    fn launch(&self, g: &Gpu) {
        let (logits, rows, n_exp, k, hash, bias, scale, experts, weights) = self.args(g);
        launch!(
            g,
            "moe_route",
            cfg((rows as u32, 1, 1), 256, 0),
            logits,
            rows,
            n_exp,
            k,
            hash,
            bias,
            scale,
            experts,
            weights
        );
    }
}

/// Where `experts_routed_on_device` gets each row's chosen experts: already on the device
/// (`Chosen`), or from the routing kernel it runs in one launch with the lists (`Fused`).
pub(crate) enum ListsRouting<'a> {
    Chosen(&'a cudarc::driver::CudaSlice<i32>),
    Fused(&'a RouteLaunch),
}

/// Whether a decode batch routed on the device runs its routing and lists kernels as one
/// launch (`moe_route_lists`; `SLUICE_CUDA_ROUTE_LISTS=0`: two, to compare).
fn route_lists_fused() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !ROUTE_LISTS_OFF_HERE.get()
        && *ON.get_or_init(|| std::env::var("SLUICE_CUDA_ROUTE_LISTS").map(|v| v != "0").unwrap_or(true))
}

thread_local! {
    static ROUTE_LISTS_OFF_HERE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `f` with this thread's device-routed batches routed by `moe_route` and `moe_lists` as
/// two launches, so the parity suite checks both forms in one run.
pub(crate) fn with_routing_apart<T>(f: impl FnOnce() -> T) -> T {
    with_flag_set(&ROUTE_LISTS_OFF_HERE, f)
}

/// Most rows whose shared expert runs as a branch beside the routed experts
/// (`SLUICE_CUDA_MOE_BRANCH_ROWS`, read once; default 8). With the routed experts on the
/// v2 segment kernels running both at once made an 8-row step 4% slower; with them on
/// `wgmoe` it makes batches 2-8 2.5-5% faster (docs/perf.md, "A decode step as the device
/// ran it"); `cuda_graphs` and `cuda_conformance` passed at 8 before it became the default.
fn moe_branch_rows() -> usize {
    static ONCE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ONCE.get_or_init(|| super::runtime::env_rows("SLUICE_CUDA_MOE_BRANCH_ROWS").unwrap_or(8))
}

/// Whether the batch's experts can run routed on the device: a decode batch (the gemv
/// regime) over experts of one weight format and shape.
fn device_routable(rows: usize, w: &MoeWeights<CudaBackend>, variant: Decode) -> bool {
    let Some(first) = w.experts.first() else { return false };
    let same = |a: &super::CudaWeight, b: &super::CudaWeight| {
        (a.rows, a.cols) == (b.rows, b.cols) && std::mem::discriminant(&a.data) == std::mem::discriminant(&b.data)
    };
    // All experts, or this device's contiguous slice of them (expert parallelism: the
    // routing is localised on the device, so the step never waits for the host).
    let sliced = w.experts.len() < w.gate.rows;
    if sliced && ep_routing_on_host() {
        return false;
    }
    let uniform = w.expert_base + w.experts.len() <= w.gate.rows
        && same(&first.w1, &first.w3)
        && w.experts.iter().all(|e| same(&e.w1, &first.w1) && same(&e.w3, &first.w3) && same(&e.w2, &first.w2));
    if !uniform {
        return false;
    }
    // Up to 8 rows every format works (SIMT grouped gemv as the fallback); larger decode
    // batches when the v2 segment kernels take the experts (up to 256 rows), else when
    // the tensor-core gemv takes both projections of every expert (up to 64 rows: it
    // runs 8 batch rows a launch).
    if rows <= GEMV_MAX_ROWS {
        return true;
    }
    let segments = variant == Decode::V2 && segments_plan(rows, w).is_some();
    let most = device_routed_max_rows().unwrap_or(if segments { SEGMENTS_MAX_ROWS } else { TC_ROUTED_MAX_ROWS });
    let tc = || tc_experts(w, true, first.w1.cols).is_some() && tc_experts(w, false, first.w2.cols).is_some();
    rows <= most && (segments || tc())
}

/// Most rows the first version's device-routed experts take (launches of 8 batch rows).
const TC_ROUTED_MAX_ROWS: usize = 64;
/// Most rows the segment kernels take routed on the device (`moe_lists` stages up to
/// 5,120 pairs in shared memory: 256 rows of up to 16 experts, the routing kernel's most).
const SEGMENTS_MAX_ROWS: usize = 256;

/// `SLUICE_CUDA_EP_ROUTING=host`: a device holding a slice of the experts reads each
/// layer's routing back and runs its experts host-routed, as before the slices were
/// routed on the device (kept to measure the two against each other, docs/perf.md).
fn ep_routing_on_host() -> bool {
    static ONCE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ONCE.get_or_init(|| std::env::var("SLUICE_CUDA_EP_ROUTING").is_ok_and(|v| v == "host"))
}

/// `SLUICE_CUDA_DEVICE_ROUTED_MAX_ROWS` (8 to 256, read once): most rows a batch may have
/// for its experts to run routed on the device (beyond it the routing is read back and
/// experts run as grouped tensor-core tiles), to compare the two paths; by default 256
/// where the segment kernels take the experts, else 64.
fn device_routed_max_rows() -> Option<usize> {
    static ONCE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *ONCE.get_or_init(|| {
        let v = std::env::var("SLUICE_CUDA_DEVICE_ROUTED_MAX_ROWS").ok()?;
        match v.parse::<usize>() {
            Ok(n) if (GEMV_MAX_ROWS..=SEGMENTS_MAX_ROWS).contains(&n) => Some(n),
            _ => {
                tracing::warn!(value = %v, "SLUICE_CUDA_DEVICE_ROUTED_MAX_ROWS is not a number of rows from 8 to 256: ignored");
                None
            }
        }
    })
}

/// The tensor-core gemv family every expert's `swiglu` (gate/up) or down projection
/// takes, if all of them take it.
pub(crate) fn tc_experts(w: &MoeWeights<CudaBackend>, swiglu: bool, k_in: usize) -> Option<&'static str> {
    let op = Operand { x: 0, x_stride: k_in, out: 0, out_stride: 0, rows: 1, groups: 1 };
    fn pick(e: &ExpertWeights<CudaBackend>, swiglu: bool) -> [&super::CudaWeight; 2] {
        if swiglu { [&e.w1, &e.w3] } else { [&e.w2, &e.w2] }
    }
    let fam = tc_family(&op, pick(w.experts.first()?, swiglu)[0])?;
    w.experts.iter().flat_map(|e| pick(e, swiglu)).all(|m| tc_family(&op, m) == Some(fam)).then_some(fam)
}

/// Per-expert weight table for the grouped kernels: (w, w3, scales, scales3) each; its
/// device address (uploaded once).
pub(crate) fn expert_table(b: &CudaBackend, w: &MoeWeights<CudaBackend>, down: bool) -> u64 {
    b.prof("moe: weight table", || {
        let g = &b.gpu;
        let mut t = Vec::with_capacity(4 * w.experts.len());
        for e in &w.experts {
            let (first, second) = if down { (&e.w2, None) } else { (&e.w1, Some(&e.w3)) };
            let (wp, sp) = first.ptrs();
            let (wp3, sp3) = second.map(CudaWeight::ptrs).unwrap_or((0, 0));
            t.extend_from_slice(&[wp, wp3, sp, sp3]);
        }
        g.constant_table(&t)
    })
}

/// The routed experts of a decode batch without the host seeing the routing: lists on
/// the device, rows gathered in expert order, one grouped SwiGLU and one grouped down
/// projection over all experts, then each row's weighted sum in list order.
#[allow(clippy::too_many_arguments)]
pub(crate) fn experts_routed_on_device(
    b: &CudaBackend,
    x: &CudaBuf,
    rows: usize,
    tokens: &[u32],
    w: &MoeWeights<CudaBackend>,
    routing: ListsRouting<'_>,
    weights: &CudaBuf,
    out: &mut CudaBuf,
    variant: Decode,
    shared: Option<SharedAdd>,
) -> bool {
    let g = &b.gpu;
    let (n_exp, d, k) = (w.experts.len(), w.gate.cols, w.top_k);
    let n = rows * k;
    let first = &w.experts[0];
    let inter = first.w1.rows;
    // Only the device knows which experts its rows chose: a slice's share of the pairs is
    // counted as its share of the experts (exact over one device, on average over several).
    g.traffic.add_flops(n * n_exp / w.gate.rows * 2 * (3 * inter * d));
    // A slice of the experts (expert parallelism): ids renumbered to the slice, -1 for
    // experts held elsewhere, which the lists then leave out.
    let (chosen, fused) = match routing {
        ListsRouting::Chosen(c) => (c, None),
        ListsRouting::Fused(r) => (&*r.experts, Some(r)),
    };
    let localized;
    let chosen = if n_exp < w.gate.rows {
        assert!(fused.is_none(), "the routing kernel fused with the lists takes every expert, not a slice");
        localized = g.alloc::<i32>(n);
        launch!(
            g,
            "moe_localize",
            cfg_elems(n),
            g.ptr(&localized),
            g.ptr(chosen),
            n as i32,
            w.expert_base as i32,
            n_exp as i32
        );
        &localized
    } else {
        chosen
    };
    let expert_bytes = first.w1.device_bytes() + first.w3.device_bytes() + first.w2.device_bytes();
    let counts = g.alloc::<i32>(n_exp);
    let offsets = g.alloc::<i32>(n_exp);
    let lists = g.alloc::<i32>(2 * n);
    let (list_rows, list_widx) = (g.ptr(&lists), g.ptr(&lists) + 4 * n as u64);
    // The experts that received rows (at most n of them) and their number.
    let active = g.alloc::<i32>(n_exp + 1);
    let (active_list, n_active) = (g.ptr(&active), g.ptr(&active) + 4 * n_exp as u64);
    // Decode batches run by segments of one expert's list positions: on `wgmma` (sm_90,
    // 1-64 rows, segments of two, or four from 32 rows), else on the v2 segment kernels.
    let wg = if variant == Decode::V2 { wgmoe_plan(g, rows, w) } else { None };
    let by_segments = if variant == Decode::V2 && wg.is_none() { segments_plan(rows, w) } else { None };
    let seg_rows = match (&wg, &by_segments) {
        (Some(p), _) => Some(p.seg_rows),
        (None, Some(p)) => Some(p.seg_rows),
        (None, None) => None,
    };
    // (`segs`: 3 ints a segment, at most n of them, then their number; `pos`: each row's
    // list positions, for the combine.)
    let segs = seg_rows.map(|_| g.alloc::<i32>(4 * n + 1));
    let lists = segs.as_ref().map(|s| SegmentLists::new(list_rows, list_widx, g.ptr(s), n));
    // Without segments, batches past the one-kernel combine take each row's list positions
    // from the lists kernel too (no `moe_positions` launch: ~4 µs a layer at batch 32).
    let row_positions = (seg_rows.is_none() && rows > GEMV_MAX_ROWS).then(|| g.alloc::<i32>(n));
    let (segs_ptr, seg_rows, pos_ptr) = match (&lists, seg_rows) {
        (Some(l), Some(r)) => (l.segs, r as i32, l.pos),
        _ => (0, 0, row_positions.as_ref().map_or(0, |p| g.ptr(p))),
    };
    // The routing and each pair's position are staged in shared memory (2n ints beside
    // the kernel's 4 KiB of counters, under the 48 KiB a block gets by default).
    assert!(8 * n <= 40 * 1024, "moe_lists takes at most 5,120 routed pairs, not {n}");
    let lists_out = ListsOut {
        counts: g.ptr(&counts),
        offsets: g.ptr(&offsets),
        list_rows,
        list_widx,
        active: active_list,
        n_active,
        traffic: g.traffic_counter(),
        segs: segs_ptr,
        pos: pos_ptr,
        expert_bytes: expert_bytes as u64,
        seg_rows,
        max_segs: n as i32,
    };
    let smem = (8 * n) as u32;
    if let Some(route) = fused {
        let (logits, r_rows, r_exp, r_k, hash, bias, scale, experts, route_weights) = route.args(g);
        let ticket = g.scratch("route_tickets", 1);
        let grid = cfg((rows as u32, 1, 1), 256, smem);
        launch!(
            g,
            "moe_route_lists",
            grid,
            logits,
            r_rows,
            r_exp,
            r_k,
            hash,
            bias,
            scale,
            experts,
            route_weights,
            ticket,
            lists_out
        );
    } else {
        let (k, n_exp) = (k as i32, n_exp as i32);
        launch!(g, "moe_lists", cfg((1, 1, 1), 256, smem), g.ptr(chosen), rows as i32, k, n_exp, lists_out);
    }
    if let (Some(plan), Some(lists)) = (&wg, &lists) {
        experts_wgmma(b, plan, x, rows, w, lists, weights, out, shared);
        return shared.is_some();
    }
    if let (Some(plan), Some(lists)) = (&by_segments, &lists) {
        experts_by_segments(b, plan, x, rows, w, lists, weights, out, shared);
        return shared.is_some();
    }
    if variant == Decode::V2
        && let Some(plan) = experts_v2_plan(rows, w)
    {
        let chosen_weights = (g.ptr(chosen), g.ptr(&weights.mem));
        experts_v2(b, &plan, x, rows, w, active_list, n_active, chosen_weights, out);
        return false;
    }
    let most = most_rows_per_expert(rows, tokens, w);
    if let Some(r) = moe_cublas::slot_rows(rows, most, w) {
        let lists = moe_cublas::Lists { counts: g.ptr(&counts), offsets: g.ptr(&offsets), rows: list_rows };
        let y = moe_cublas::experts(b, x, w, r, &lists, n);
        combine(b, &y, (rows, k, d), (list_rows, list_widx, pos_ptr), weights, out, shared);
        return shared.is_some();
    }
    let xg = b.alloc_buf(n * d);
    super::rows::gather_rows_at(g, g.ptr(&xg.mem), g.ptr(&x.mem), list_rows, n, d);
    // Rows per expert are at most `rows` unless a hash table repeats an expert for one
    // token; the kernels loop over R-row parts either way.
    let r = rows.next_power_of_two().min(GEMV_MAX_ROWS);
    let h = b.alloc_buf(n * inter);
    let y = b.alloc_buf(n * d);
    // (gate/up SwiGLU pair, outputs, inputs): x → h, then h → y.
    for (swiglu, n_out, k_in) in [(true, inter, d), (false, d, inter)] {
        let wt = if swiglu { &first.w1 } else { &first.w2 };
        let table = expert_table(b, w, !swiglu);
        let (src, dst) = if swiglu { (g.ptr(&xg.mem), g.ptr(&h.mem)) } else { (g.ptr(&h.mem), g.ptr(&y.mem)) };
        // BF16 experts of 1-2 rows stream faster through the SIMT kernels, as plain BF16
        // products do (`matmul.rs::gemv`): flash-bench's step at batch 2 1.64-1.71 →
        // 1.43 ms (H200, docs/perf.md).
        let tc = tc_experts(w, swiglu, k_in).filter(|&fam| fam != "bf16" || rows > 2);
        if let Some(fam) = tc {
            // Tensor cores over the experts that received rows only (blockIdx.z indexes
            // them); each expert's rows in parts of 8 (more than 8 only when a hash
            // table repeats an expert within a token).
            let slots = n_exp.min(n);
            let (bx, ks) = (n_out.div_ceil(64), k_in.div_ceil(512));
            let parts = most.div_ceil(8);
            let (partials, tickets) = tc_scratch(g, slots * ks * 8 * n_out * if swiglu { 2 } else { 1 }, slots * bx);
            let name = format!("{}_{fam}", if swiglu { "tcmoe_swiglu" } else { "tcmoe_down" });
            for part in 0..parts {
                launch!(
                    g,
                    name.as_str(),
                    cfg((bx as u32, ks as u32, slots as u32), 256, 0),
                    dst,
                    src,
                    table,
                    g.ptr(&counts),
                    g.ptr(&offsets),
                    active_list,
                    n_active,
                    part as i32,
                    n_out as i32,
                    k_in as i32,
                    w.swiglu_limit,
                    partials,
                    tickets,
                );
            }
            continue;
        }
        let (fam, chunk) = family(wt);
        let name = format!("{}_{fam}_r{r}", if swiglu { "moe_swiglu" } else { "moe_down" });
        let opb = outputs_per_block(g, n_out);
        let vec = k_in.is_multiple_of(chunk) as i32;
        launch!(
            g,
            name.as_str(),
            cfg((n_out.div_ceil(opb) as u32, n_exp as u32, 1), 256, 0),
            dst,
            src,
            table,
            g.ptr(&counts),
            g.ptr(&offsets),
            n_out as i32,
            k_in as i32,
            opb as i32,
            vec,
            w.swiglu_limit,
        );
    }
    combine(b, &y, (rows, k, d), (list_rows, list_widx, pos_ptr), weights, out, shared);
    shared.is_some()
}

/// A bound on the rows one expert can receive from a batch of `rows` rows: one a row under
/// top-k routing (its k experts differ); under hash routing one a row times the most
/// times any of the batch's tokens' table rows lists one expert (an expert listed twice
/// for a token counts twice).
fn most_rows_per_expert(rows: usize, tokens: &[u32], w: &MoeWeights<CudaBackend>) -> usize {
    let k = w.top_k;
    match &w.routing {
        Routing::TopK { .. } => rows,
        // Each row gives an expert as many places as its table row lists it (almost always
        // once): rows times the most repeats in any of these rows. A bound that does not
        // move with which tokens happen to share an expert keeps the slot shapes, and so
        // the step's recorded cuBLAS calls and its CUDA graph, the same from step to step
        // (the exact count did: most of a batch-32 step's segments were then new).
        Routing::Hash { tid2eid } => {
            let repeats = |t: u32| {
                let listed = &tid2eid[t as usize * k..(t as usize + 1) * k];
                listed.iter().map(|e| listed.iter().filter(|&x| x == e).count()).max().unwrap_or(0)
            };
            rows * tokens[..rows].iter().map(|&t| repeats(t)).max().unwrap_or(0)
        }
    }
}

/// out[r] = Σ of row r's routed outputs (`y[n, d]` in list order) times their weights, in
/// list order: one kernel up to 8 rows, else through each row's positions (`pos`; 0: `moe_positions`).
fn combine(
    b: &CudaBackend,
    y: &CudaBuf,
    (rows, k, d): (usize, usize, usize),
    (list_rows, list_widx, pos): (u64, u64, u64),
    weights: &CudaBuf,
    out: &mut CudaBuf,
    shared: Option<SharedAdd>,
) {
    let g = &b.gpu;
    let n = rows * k;
    if rows <= GEMV_MAX_ROWS {
        let (sy, sfirst, srows) = SharedAdd::args(shared, g);
        launch!(
            g,
            "moe_combine",
            cfg_elems(rows * d),
            g.ptr(&out.mem),
            g.ptr(&y.mem),
            list_rows,
            list_widx,
            g.ptr(&weights.mem),
            n as i32,
            rows as i32,
            d as i32,
            sy,
            sfirst,
            srows
        );
        return;
    }
    let found = (pos == 0).then(|| g.alloc::<i32>(n));
    if let Some(f) = &found {
        launch!(g, "moe_positions", cfg_elems(rows), g.ptr(f), list_rows, n as i32, rows as i32, k as i32);
    }
    let pos = found.as_ref().map_or(pos, |f| g.ptr(f));
    combine_in_list_order(b, y, (rows, k, d), (pos, list_widx), weights, out, shared);
}

/// Whether a batch's router product and shared expert share one bf16 rounding of the
/// rows where both take cuBLAS. `SLUICE_CUDA_MOE_SHARED_ROUNDING=0` (read once) has each
/// round them, to compare.
fn router_shares_rounding() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_MOE_SHARED_ROUNDING").map_or(true, |v| v != "0"))
}

/// `moe_combine_rows`' kernel and launch shape for `rows` × `d` outputs: four columns a
/// thread (`moe_combine_rows4`: a block's threads share a row, 16-byte accesses) where `d`
/// and the addresses (`out`, `y`, the shared expert's rows) allow it, else a thread a
/// value. `SLUICE_CUDA_MOE_COMBINE4=0` (read once) keeps a thread a value, to compare.
fn combine_rows_launch(rows: usize, d: usize, addrs: [u64; 3]) -> (&'static str, LaunchConfig) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("SLUICE_CUDA_MOE_COMBINE4").map_or(true, |v| v != "0"));
    match super::rows::vector_rows_cfg(rows, d, 4, &addrs) {
        Some(c) if on => ("moe_combine_rows4", c),
        _ => ("moe_combine_rows", cfg_elems(rows * d)),
    }
}

/// out[r] = Σ over row r's list positions i, in list order, of weight(i) · y[i] (batches
/// of more than 8 rows, routed on the device or read back), given each row's positions
/// ascending (`pos[r·k ..]`, -1 after the last): k reads an output instead of a scan of
/// the whole list.
pub(crate) fn combine_in_list_order(
    b: &CudaBackend,
    y: &CudaBuf,
    (rows, k, d): (usize, usize, usize),
    (pos, list_widx): (u64, u64),
    weights: &CudaBuf,
    out: &mut CudaBuf,
    shared: Option<SharedAdd>,
) {
    let g = &b.gpu;
    let (sy, sfirst, srows) = SharedAdd::args(shared, g);
    let (kernel, launch_cfg) = combine_rows_launch(rows, d, [g.ptr(&out.mem), g.ptr(&y.mem), sy]);
    launch!(
        g,
        kernel,
        launch_cfg,
        g.ptr(&out.mem),
        g.ptr(&y.mem),
        pos,
        list_widx,
        g.ptr(&weights.mem),
        k as i32,
        rows as i32,
        d as i32,
        sy,
        sfirst,
        srows
    );
}
