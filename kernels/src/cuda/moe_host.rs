//! The routed experts of a batch whose routing was read back to the host (prefill-sized
//! batches, and decode batches the device-routed paths do not take; [`super::moe`]
//! decides): every routed row gathered once in expert order and each projection run as
//! one grouped tensor-core launch over tiles of one expert's rows (FP4 experts on sm_90:
//! `wgmma`, [`moe_fp4wg`]), or one cuBLAS product
//! an expert for BF16 experts with many rows each, or one product per expert otherwise;
//! then each row's weighted sum in list order, as the CPU adds them.

use super::CudaBackend;
use super::cublas_bf16;
use super::matmul::{Decode, GEMM_BM, Operand, Tiles, gemm, gemm_kernel, gemm_split, split_x, swiglu_act};
use super::memory::CudaBuf;
use super::moe::{SharedAdd, combine_in_list_order, expert};
use super::rows::gather_rows_at;
use super::runtime::{DevBuf, cfg, cfg_elems, launch};
use super::{moe_cublas, moe_fp4wg};
use crate::Activations;
use crate::backend::{ExpertWeights, MoeWeights};

/// The routed experts with the routing read back. Experts of one format and shape
/// that the tensor-core kernel tiles run grouped: every routed row gathered once in
/// expert order, one launch per projection over tiles of one expert's rows, then each
/// row's weighted sum in list order. BF16 experts of a prefill with bf16 activations:
/// the same, each projection one cuBLAS product an expert ([`experts_on_cublas_rows`]).
/// Otherwise one product per expert over its rows. True when the shared expert's
/// `shared` rows were added into `out` too (else the caller adds them).
#[allow(clippy::too_many_arguments)]
pub(super) fn experts_routed_on_host(
    b: &CudaBackend,
    x: &CudaBuf,
    rows: usize,
    w: &MoeWeights<CudaBackend>,
    chosen: &[i32],
    weights: &CudaBuf,
    out: &mut CudaBuf,
    variant: Decode,
    shared: Option<SharedAdd>,
) -> bool {
    let g = &b.gpu;
    let (d, k) = (w.gate.cols, w.top_k);
    let held = w.expert_base..w.expert_base + w.experts.len();
    let lists = RoutedLists::new(chosen, k, w.gate.rows, held);
    let total = lists.total();
    if total == 0 {
        g.memset_zero(&mut out.mem);
        return false;
    }
    if grouped_experts(w) && !per_expert_on_cublas(w, total) {
        let e0 = &w.experts[0];
        g.traffic.add_flops(total * 2 * (2 * e0.w1.rows * e0.w1.cols + e0.w2.rows * e0.w2.cols));
        experts_grouped(b, x, rows, w, lists, weights, out);
        return false;
    }
    if takes_bf16_rows(g, w, total) {
        return experts_on_cublas_rows(b, x, rows, w, lists, weights, out, shared);
    }
    let list_dev = g.upload(&lists.words);
    let lp = g.ptr(&list_dev);
    g.memset_zero(&mut out.mem);
    let mut at = 0usize;
    for (e, &n) in lists.counts.iter().enumerate() {
        if n == 0 {
            continue;
        }
        let xg = b.alloc_buf(n * d);
        gather_rows_at(g, g.ptr(&xg.mem), g.ptr(&x.mem), lp + 4 * at as u64, n, d);
        let y = expert(b, g.ptr(&xg.mem), n, &w.experts[e], w.swiglu_limit, variant, None);
        // A row listed twice for one expert (a hash table may repeat an expert) must be
        // summed in order: then one thread walks each column; otherwise every element
        // has its own thread.
        let mut seen = lists.words[at..at + n].to_vec();
        seen.dedup();
        let (name, c) = if seen.len() == n {
            ("moe_accumulate_rows", cfg_elems(n * d))
        } else {
            ("moe_accumulate", cfg((d.div_ceil(256) as u32, 1, 1), 256, 0))
        };
        launch!(
            g,
            name,
            c,
            g.ptr(&out.mem),
            g.ptr(&y.mem),
            lp + 4 * at as u64,
            lp + 4 * (total + at) as u64,
            g.ptr(&weights.mem),
            n as i32,
            d as i32
        );
        at += n;
    }
    false
}

/// The (row, slot) pairs a batch routed to the experts this device holds, by expert in
/// expert order and by slot within an expert (`slot` = row · k + the row's choice): the
/// rows of all, then their slots (`words`, as the kernels read them), and each held
/// expert's count. Rows routed to experts held elsewhere get nothing from here. A
/// counting sort — two passes, no allocation an expert: an 8K prefill routes 49,152
/// pairs a layer, and the host builds these while the device runs the shared expert.
struct RoutedLists {
    words: Vec<i32>,
    counts: Vec<usize>,
}

impl RoutedLists {
    fn new(chosen: &[i32], k: usize, n_exp: usize, held: std::ops::Range<usize>) -> Self {
        let mut counts = vec![0usize; held.len()];
        let expert_of = |e: i32| {
            let e = usize::try_from(e).ok().filter(|&e| e < n_exp);
            e.unwrap_or_else(|| panic!("routing chose an expert outside 0..{n_exp}"))
        };
        for &e in chosen {
            let e = expert_of(e);
            if held.contains(&e) {
                counts[e - held.start] += 1;
            }
        }
        let total: usize = counts.iter().sum();
        let mut next: Vec<usize> = counts
            .iter()
            .scan(0, |at, &c| {
                *at += c;
                Some(*at - c)
            })
            .collect();
        let mut words = vec![0i32; 2 * total];
        for (i, &e) in chosen.iter().enumerate() {
            let e = expert_of(e);
            if held.contains(&e) {
                let at = &mut next[e - held.start];
                words[*at] = (i / k) as i32;
                words[total + *at] = i as i32;
                *at += 1;
            }
        }
        RoutedLists { words, counts }
    }

    /// Pairs listed (half the words).
    fn total(&self) -> usize {
        self.words.len() / 2
    }
}

/// Appends each batch row's list positions in ascending (expert) order to `words`, whose
/// first `n` words are the list's rows: `k` a row, -1 past a row's pairs held here (what
/// `moe_combine_rows` reads). Returns where they start.
fn append_positions(words: &mut Vec<i32>, n: usize, rows: usize, k: usize) -> usize {
    let pos_at = words.len();
    words.resize(pos_at + rows * k, -1);
    let mut filled = vec![0usize; rows];
    for i in 0..n {
        let r = words[i] as usize;
        words[pos_at + r * k + filled[r]] = i as i32;
        filled[r] += 1;
    }
    pos_at
}

/// Whether the routed rows of BF16 experts run expert by expert through `matmul` (cuBLAS,
/// `cublas_bf16.rs`) rather than as grouped `gemm_bf16` tiles: when the experts this
/// device holds get at least [`PER_EXPERT_MIN_ROWS`] rows each on average (a prefill),
/// where cuBLAS's several times higher rate outweighs a few launches an expert.
/// `SLUICE_CUDA_CUBLAS_EXPERTS=0` keeps the tiles.
fn per_expert_on_cublas(w: &MoeWeights<CudaBackend>, routed_rows: usize) -> bool {
    moe_cublas::enabled() && routed_rows >= PER_EXPERT_MIN_ROWS * w.experts.len() && moe_cublas::bf16_experts(w)
}

/// Average routed rows an expert needs for [`per_expert_on_cublas`].
const PER_EXPERT_MIN_ROWS: usize = 64;

/// Whether `pairs` routed (row, expert) pairs of `w`'s experts run as bf16 rows on cuBLAS
/// ([`experts_on_cublas_rows`]).
pub(super) fn takes_bf16_rows(g: &super::runtime::Gpu, w: &MoeWeights<CudaBackend>, pairs: usize) -> bool {
    per_expert_on_cublas(w, pairs) && rows_in_bf16(g, w)
}

/// Whether [`experts_on_cublas_rows`] takes the routed rows of `w`'s experts (which
/// [`per_expert_on_cublas`] sent to cuBLAS): bf16 activations (the reference's; split
/// activations keep a product of their own an expert), rows of a width the 8-wide gather
/// takes, and one shape for every expert. `SLUICE_CUDA_MOE_BF16_ROWS=0` (read once) keeps
/// the per-expert path.
fn rows_in_bf16(g: &super::runtime::Gpu, w: &MoeWeights<CudaBackend>) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("SLUICE_CUDA_MOE_BF16_ROWS").map_or(true, |v| v != "0"));
    on && g.activations == Activations::Bf16 && uniform_experts(w) && w.experts[0].w1.cols.is_multiple_of(8)
}

/// The routed rows of BF16 experts (a prefill) on cuBLAS, as the reference computes
/// them (bf16 activations), in four passes over the rows where one product an expert
/// took seven launches an expert: every routed row gathered in expert order and rounded
/// to bf16 at once (`gather_rows_bf16`), each expert's gate and up products on its rows,
/// the SwiGLU of all rows rounded to bf16 as it is computed (`swiglu_bf16`), each
/// expert's down product, then one combine of each row's pairs in list order, the shared
/// expert's rows added in it. The per-expert path gathered f32 rows, rounded them,
/// wrote the SwiGLU in f32 and rounded it again, and accumulated each expert's rows into
/// the output in a launch of its own (~10% of a flash-bench 8K prefill, docs/perf.md).
#[allow(clippy::too_many_arguments)]
fn experts_on_cublas_rows(
    b: &CudaBackend,
    x: &CudaBuf,
    rows: usize,
    w: &MoeWeights<CudaBackend>,
    lists: RoutedLists,
    weights: &CudaBuf,
    out: &mut CudaBuf,
    shared: Option<SharedAdd>,
) -> bool {
    let g = &b.gpu;
    let (d, k) = (w.gate.cols, w.top_k);
    let n = lists.total();
    let inter = w.experts[0].w1.rows;
    let counts = lists.counts;
    let mut words = lists.words;
    let pos_at = append_positions(&mut words, n, rows, k);
    let dev = b.upload_staged(&words);
    let word = |i: usize| g.ptr(&dev) + 4 * i as u64;
    let xb = g.alloc::<u16>(n * d);
    match &x.bf16 {
        // The rows' own bf16 values (`CudaBuf::bf16`): gathered as words, two values each.
        Some(rounded) if d.is_multiple_of(2) => {
            super::rows::gather_rows_at(g, g.ptr(&xb), g.ptr(rounded), word(0), n, d / 2)
        }
        _ => cublas_bf16::gather_rows_bf16(g, g.ptr(&xb), g.ptr(&x.mem), word(0), n, d),
    }
    let (h, u) = (b.alloc_buf(n * inter), b.alloc_buf(n * inter));
    let (hb, y) = (g.alloc::<u16>(n * inter), b.alloc_buf(n * d));
    let product = |w: &super::CudaWeight, x_at: u64, out_at: u64, rows: usize| {
        super::matmul::count_product(g, rows, w);
        cublas_bf16::product_of_bf16_rows(g, x_at, rows, w, out_at);
    };
    let each = |f: &dyn Fn(&ExpertWeights<CudaBackend>, usize, usize)| {
        let mut at = 0usize;
        for (e, &count) in counts.iter().enumerate() {
            if count > 0 {
                f(&w.experts[e], at, count);
            }
            at += count;
        }
    };
    // Where list position `at` starts in rows of `width` f32 or bf16 values.
    let f32_rows = |buf: &CudaBuf, at: usize, width: usize| g.ptr(&buf.mem) + 4 * (at * width) as u64;
    let bf16_rows = |buf: &DevBuf<u16>, at: usize, width: usize| g.ptr(buf) + 2 * (at * width) as u64;
    each(&|e, at, count| {
        product(&e.w1, bf16_rows(&xb, at, d), f32_rows(&h, at, inter), count);
        product(&e.w3, bf16_rows(&xb, at, d), f32_rows(&u, at, inter), count);
    });
    drop(xb);
    cublas_bf16::swiglu_bf16(g, g.ptr(&hb), g.ptr(&h.mem), g.ptr(&u.mem), n * inter, w.swiglu_limit);
    drop((h, u));
    each(&|e, at, count| product(&e.w2, bf16_rows(&hb, at, inter), f32_rows(&y, at, d), count));
    let added = shared.is_some();
    combine_in_list_order(b, &y, (rows, k, d), (word(pos_at), word(n)), weights, out, shared);
    added
}

/// Whether every expert has the first one's format and shapes and the tensor-core kernel
/// tiles their products.
fn grouped_experts(w: &MoeWeights<CudaBackend>) -> bool {
    let Some(first) = w.experts.first() else { return false };
    let op = |cols: usize| Operand { x: 0, x_stride: cols, out: 0, out_stride: 0, rows: 0, groups: 1 };
    uniform_experts(w)
        && gemm_kernel(&op(first.w1.cols), &first.w1).is_some()
        && gemm_kernel(&op(first.w2.cols), &first.w2).is_some()
}

/// Whether every expert has the first one's formats and shapes, its gate and up alike
/// (false without experts).
fn uniform_experts(w: &MoeWeights<CudaBackend>) -> bool {
    let Some(first) = w.experts.first() else { return false };
    let same = |a: &super::CudaWeight, b: &super::CudaWeight| {
        (a.rows, a.cols) == (b.rows, b.cols) && std::mem::discriminant(&a.data) == std::mem::discriminant(&b.data)
    };
    w.experts.iter().all(|e| same(&e.w1, &first.w1) && same(&e.w3, &first.w3) && same(&e.w2, &first.w2))
        && same(&first.w1, &first.w3)
}

/// (weights, scales) of one projection of every expert, for a grouped launch.
fn projection_table(
    b: &CudaBackend,
    w: &MoeWeights<CudaBackend>,
    pick: fn(&ExpertWeights<CudaBackend>) -> &super::CudaWeight,
) -> u64 {
    let g = &b.gpu;
    let t: Vec<u64> = w
        .experts
        .iter()
        .flat_map(|e| {
            let (wp, sp) = pick(e).ptrs();
            [wp, sp]
        })
        .collect();
    g.constant_table(&t)
}

#[allow(clippy::too_many_arguments)]
fn experts_grouped(
    b: &CudaBackend,
    x: &CudaBuf,
    rows: usize,
    w: &MoeWeights<CudaBackend>,
    lists: RoutedLists,
    weights: &CudaBuf,
    out: &mut CudaBuf,
) {
    let g = &b.gpu;
    let (d, k) = (w.gate.cols, w.top_k);
    // (row, slot) pairs routed to the experts held here (all of them on one device).
    let n = lists.total();
    let first = &w.experts[0];
    let inter = first.w1.rows;
    // Tiles of at most GEMM_BM rows of one expert, and each row's list positions in
    // ascending (expert) order for the combine (-1 past a row's pairs held here).
    // On `fp4wg_gemm` an expert of more than 192 rows takes tiles of 256 in bf16
    // activations (`moe_fp4wg::wide_tiles`).
    let on_fp4wg = moe_fp4wg::takes(g, w);
    let wide = on_fp4wg && moe_fp4wg::wide_tiles(moe_fp4wg::planes(g), 1);
    let mut tiles: Vec<i32> = Vec::new();
    let mut at = 0usize;
    let mut used = 0usize;
    for (e, &count) in lists.counts.iter().enumerate() {
        used += usize::from(count > 0);
        if on_fp4wg {
            moe_fp4wg::row_tiles_into(&mut tiles, e, at, count, wide);
        } else {
            for t in (0..count).step_by(GEMM_BM) {
                tiles.extend_from_slice(&[e as i32, (at + t) as i32, (count - t).min(GEMM_BM) as i32]);
            }
        }
        at += count;
    }
    // One copy to the device, through pinned memory (`Staging`): the list, then each
    // row's positions, then the tile lists. Copies from pageable memory this large waited
    // for the stream to reach them — for the shared expert queued before — and the host
    // then built and launched the rest while the device sat idle (an 8K prefill's gap
    // after the shared expert: ~0.40 ms a layer before, ~0.13 after; docs/perf.md "Wider
    // tiles for the prefill products").
    let mut words = lists.words;
    words.reserve(rows * k + tiles.len() + 16);
    let pos_at = append_positions(&mut words, n, rows, k);
    let tiles_at = words.len();
    let by_height = on_fp4wg.then(|| moe_fp4wg::tile_lists(&tiles));
    match &by_height {
        Some(lists) => lists.iter().for_each(|l| words.extend_from_slice(l)),
        None => words.extend_from_slice(&tiles),
    }
    let dev = b.upload_staged(&words);
    let word = |i: usize| g.ptr(&dev) + 4 * i as u64;
    g.traffic.add_weights(used * (first.w1.device_bytes() + first.w3.device_bytes() + first.w2.device_bytes()));

    let lp = word(0);
    let h = b.alloc_buf(n * inter);
    let u = b.alloc_buf(n * inter);
    let y = b.alloc_buf(n * d);
    let (t1, t3, t2) =
        (projection_table(b, w, |e| &e.w1), projection_table(b, w, |e| &e.w3), projection_table(b, w, |e| &e.w2));
    if let Some(lists) = &by_height {
        let by_height = moe_fp4wg::DeviceTiles::at(word(tiles_at), lists);
        // The routed rows are gathered in expert order as they are split into parts (the
        // list's first n words are their row ids): no f32 copy of them (`gather_rows` took
        // ~2.5% of an 8K prefill of 20 Flash layers).
        let px = moe_fp4wg::parts_of_rows(g, g.ptr(&x.mem), lp, n, d);
        moe_fp4wg::product(g, &px, &first.w1, &by_height, t1, g.ptr(&h.mem));
        moe_fp4wg::product(g, &px, &first.w3, &by_height, t3, g.ptr(&u.mem));
        drop(px);
        // The SwiGLU computed as its output is split into parts (never written in f32).
        let ph = moe_fp4wg::parts_of_swiglu(g, g.ptr(&h.mem), g.ptr(&u.mem), w.swiglu_limit, n, inter);
        moe_fp4wg::product(g, &ph, &first.w2, &by_height, t2, g.ptr(&y.mem));
    } else {
        let xg = b.alloc_buf(n * d);
        gather_rows_at(g, g.ptr(&xg.mem), g.ptr(&x.mem), lp, n, d);
        let in_x =
            Operand { x: g.ptr(&xg.mem), x_stride: d, out: g.ptr(&h.mem), out_stride: inter, rows: n, groups: 1 };
        let name_up = gemm_kernel(&Operand { x: 0, x_stride: d, out: 0, out_stride: 0, rows: 0, groups: 1 }, &first.w1)
            .expect("checked by grouped_experts");
        let name_down =
            gemm_kernel(&Operand { x: 0, x_stride: inter, out: 0, out_stride: 0, rows: 0, groups: 1 }, &first.w2)
                .expect("checked by grouped_experts");
        let over = |table: u64| Tiles { tiles: word(tiles_at), count: tiles.len() / 3, wtab: table };
        let xs = split_x(g, in_x.x, d, n, d);
        gemm_split(g, name_up, in_x, &xs, &first.w1, Some(&over(t1)));
        gemm_split(g, name_up, Operand { out: g.ptr(&u.mem), ..in_x }, &xs, &first.w3, Some(&over(t3)));
        drop(xs);
        swiglu_act(g, g.ptr(&h.mem), g.ptr(&u.mem), n * inter, w.swiglu_limit);
        let in_h = Operand { x: g.ptr(&h.mem), x_stride: inter, out: g.ptr(&y.mem), out_stride: d, rows: n, groups: 1 };
        gemm(g, name_down, in_h, &first.w2, Some(&over(t2)));
    }
    combine_in_list_order(b, &y, (rows, k, d), (word(pos_at), lp + 4 * n as u64), weights, out, None);
}

#[cfg(test)]
mod tests {
    use super::RoutedLists;

    /// The counting sort lists exactly what pushing each pair onto its expert's list in
    /// slot order lists: rows then slots, expert by expert, only the held experts, rows
    /// that chose one expert twice (a hash table may) listed twice.
    #[test]
    fn routed_lists_are_the_pairs_by_expert_in_slot_order() {
        let mut s = 7u64;
        let mut next = |m: usize| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % m as u64) as usize
        };
        for (rows, k, n_exp, held) in
            [(300, 6, 256, 0..256), (1000, 6, 256, 128..256), (37, 2, 16, 4..9), (1, 4, 8, 0..8)]
        {
            let chosen: Vec<i32> = (0..rows * k).map(|_| next(n_exp) as i32).collect();
            let mut per_expert: Vec<Vec<(i32, i32)>> = vec![Vec::new(); held.len()];
            for (i, &e) in chosen.iter().enumerate() {
                if held.contains(&(e as usize)) {
                    per_expert[e as usize - held.start].push(((i / k) as i32, i as i32));
                }
            }
            let want_rows: Vec<i32> = per_expert.iter().flatten().map(|&(r, _)| r).collect();
            let want_slots: Vec<i32> = per_expert.iter().flatten().map(|&(_, j)| j).collect();
            let lists = RoutedLists::new(&chosen, k, n_exp, held.clone());
            assert_eq!(lists.total(), want_rows.len());
            assert_eq!(lists.words[..lists.total()], want_rows[..]);
            assert_eq!(lists.words[lists.total()..], want_slots[..]);
            assert_eq!(lists.counts, per_expert.iter().map(Vec::len).collect::<Vec<_>>());
        }
        // A row choosing one expert twice.
        let lists = RoutedLists::new(&[3, 3, 1, 3], 2, 4, 0..4);
        assert_eq!(lists.words, [1, 0, 0, 1, 2, 0, 1, 3]);
        assert_eq!(lists.counts, [0, 1, 0, 3]);
    }

    #[test]
    #[should_panic(expected = "routing chose an expert outside 0..4")]
    fn a_route_outside_the_experts_is_refused() {
        RoutedLists::new(&[0, 4], 1, 4, 0..4);
    }
}
