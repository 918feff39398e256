//! Attention over window + compressed entries, the lightning indexer's scores (its
//! top-k in `topk.rs`), and the window-ring update, on the GPU.

use cudarc::driver::DeviceRepr;

use super::CudaBackend;
pub(crate) use super::attention_io::AttnOut;
use super::memory::{CudaBuf, CudaIdx, dtype_code};
use super::rows::RopeParams;
use super::runtime::{Gpu, cfg, cfg_elems, env_rows, launch};
use crate::Activations;
use crate::backend::{KvView, KvViewMut, QueryPrep, Selection};
use crate::kv_layout::{AttnKind, Branch, KvLayout};
use crate::plan::BatchPlan;
use crate::rope::RopeTable;

/// Largest head dimension the attention kernel holds per warp.
const ATT_HD_MAX: usize = 512;
/// Keys per shared-memory tile (`ATT_T` in attention.cu).
const ATT_T: usize = 16;
/// Heads (warps) sharing one block's key tiles.
const ATT_HEADS_PER_BLOCK: usize = 16;
/// Heads per block of the tensor-core kernel (`TC_HEADS` in attention_mma.cu).
const MMA_HEADS_PER_BLOCK: usize = 32;
/// Threads of a tensor-core block (`TC_THREADS`): 2 head groups × 8 dim groups of a warp.
const MMA_THREADS: u32 = 512;
/// Keys per tile of the tensor-core kernel (`TC_KEYS`).
const MMA_KEYS: usize = 32;
/// Dynamic shared memory of a tensor-core block (`TC_DYN_SMEM`): two tiles of keys, rows
/// of `ATT_HD_MAX + 8` bf16. Past the 48 KiB a block gets without asking, so the backend
/// opts in at load (`runtime::big_shared`).
pub(crate) const MMA_DYN_SMEM: usize = 2 * MMA_KEYS * (ATT_HD_MAX + 8) * 2;
/// Heads a block of the warpgroup kernel (`AW_HEADS` in attention_wg.cu).
const WG_HEADS: usize = 64;
/// The one head dimension the warpgroup kernel takes (V4's).
const WG_HEAD_DIM: usize = 512;
/// Keys a tile of the warpgroup kernel (`AW_KEYS`).
const WG_KEYS: usize = 64;
/// Threads of a warpgroup-kernel block: two warpgroups.
const WG_THREADS: u32 = 256;
/// FP8 dims of an entry the warpgroup kernel takes (`AW_N8`): V4's 448, a bf16 tail of 64.
const WG_FP8_DIMS: usize = 448;
/// Its dynamic shared memory (`AW_DYN_SMEM`): q and two key tiles as bf16 (64 KiB each),
/// the next tile's fp8 codes and scale bytes (456 bytes a key), 1 KiB of alignment.
pub(crate) const WG_DYN_SMEM: usize = 1024 + 3 * 64 * 1024 + WG_KEYS * (WG_FP8_DIMS + 8);

/// `struct IndexGeom` in indexer.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct IndexGeom {
    heads: i32,
    dim: i32,
    ratio: i32,
    n_max: i32,
    dtype: i32,
    stride: i32,
    page_elems: i32,
    page_off: i32,
    per_page: i32,
}

// SAFETY: #[repr(C)] ints, laid out as the C struct.
unsafe impl DeviceRepr for IndexGeom {}

/// `struct AttnGeom` in attention.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct AttnGeom {
    heads: i32,
    hd: i32,
    window: i32,
    kind: i32,
    ratio: i32,
    top_k: i32,
    dtype: i32,
    tail: i32,
    stride: i32,
    ring_elems: i32,
    ring_off: i32,
    page_elems: i32,
    page_off: i32,
    per_page: i32,
    splits: i32,
    keys_per_split: i32,
    scale: f32,
    /// `window - 1` when the window is a power of two, else -1: a ring slot by mask.
    win_mask: i32,
    /// log2(`per_page`) when it is a power of two, else -1: a page by shift.
    page_shift: i32,
    /// 1 when `new_kv` is passed as bf16 (the tensor-core kernel of a prefill-sized batch).
    new_bf16: i32,
    /// 1: the tensor-core kernel multiplies q and the softmax weights as one bf16 part
    /// each, not hi + lo (`Activations::Bf16`, the default: the reference model's bf16
    /// attention inputs; half the products). The SIMT kernel ignores it.
    one_part: i32,
    /// 1: `attention_wg` gets q raw and norms each head (`q_eps`, no weight) and applies
    /// RoPE to it while staging it ([`preps_query`]); the other kernels ignore it.
    q_prep: i32,
    q_eps: f32,
    /// 1: `attention_wg` (one split) writes bf16 rows rotated back ([`AttnOut::Bf16Rotated`]).
    out_bf16: i32,
}

/// Fewest rows whose new entries the tensor-core kernel reads as bf16 (rounded once by
/// `round_bf16_rows`, exactly: they already hold the entry dtype's values) instead of
/// f32: in a prefill most window keys are this chunk's own rows, and a 16-byte bf16
/// piece is one load where an f32 one is two loads and eight conversions, in every tile of
/// every block that sees them. A decode row sees one new key, so batches of about one row
/// a sequence keep the f32 rows (and the launch they would cost).
const NEW_KV_BF16_ROWS: usize = 64;

/// `v - 1` when `v` is a power of two, else -1.
fn pow2_mask(v: usize) -> i32 {
    if v.is_power_of_two() { (v - 1) as i32 } else { -1 }
}

// SAFETY: #[repr(C)] ints and a float, laid out as the C struct.
unsafe impl DeviceRepr for AttnGeom {}

/// The indexer's preparation of its inputs that the scoring may do itself
/// ([`crate::backend::Backend::indexer_select`]): q rotated by `rope` at the rows'
/// positions, the head weights times `weight_scale`.
#[derive(Clone, Copy)]
pub(crate) struct IndexerPrep<'a> {
    pub rope: &'a RopeTable,
    pub weight_scale: f32,
}

/// Whether [`index_topk`] takes an [`IndexerPrep`] for this batch: its rows either see no
/// more entries than `top_k` (nothing is scored, so nothing needs preparing) or are scored
/// on the tensor cores with q staged in shared memory (`index_q_frags` rotates it as it
/// stages it; `SLUICE_CUDA_INDEXER_PREP=0`: never, the rotation and the scale run as their
/// own launches first, to compare).
pub(crate) fn takes_prep(
    b: &CudaBackend,
    layout: &KvLayout,
    layer: usize,
    plan: &BatchPlan,
    heads: usize,
    top_k: usize,
) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if !*ON.get_or_init(|| std::env::var("SLUICE_CUDA_INDEXER_PREP").map_or(true, |v| v != "0")) {
        return false;
    }
    let lk = &layout.layers[layer];
    let (ratio, dim, rows) = (lk.spec.ratio, lk.spec.index_dim, plan.rows());
    let most = plan.positions.iter().map(|&t| (t as usize + 1) / ratio).max().unwrap_or(0);
    if rows == 0 || top_k == 0 || most <= top_k {
        return true;
    }
    let staged = heads * dim <= INDEX_Q_STAGE;
    staged && mma_keys_per_block(layout, layer, heads, rows, scored_candidates(most), b.gpu.sms).is_some()
}

/// Floats of a row's q `index_q_frags` stages in shared memory (`IDX_Q_STAGE`).
const INDEX_Q_STAGE: usize = 8192;

#[allow(clippy::too_many_arguments)]
pub(crate) fn index_topk(
    b: &CudaBackend,
    kv: &KvView<'_, CudaBackend>,
    layout: &KvLayout,
    layer: usize,
    plan: &BatchPlan,
    q: &CudaBuf,
    weights: &CudaBuf,
    heads: usize,
    top_k: usize,
    prep: Option<IndexerPrep<'_>>,
) -> Selection<CudaBackend> {
    assert!(
        prep.is_none() || takes_prep(b, layout, layer, plan, heads, top_k),
        "the indexer's scoring cannot rotate q and scale its weights for this batch (takes_prep)"
    );
    let lk = &layout.layers[layer];
    assert_eq!(lk.kind(), AttnKind::Csa, "layer {layer} has no indexer");
    let dim = lk.spec.index_dim;
    let rows = plan.rows();
    assert_eq!(q.len, rows * heads * dim, "indexer q is not [rows, heads, index_dim]");
    assert_eq!(weights.len, rows * heads, "indexer weights are not [rows, heads]");
    let g = &b.gpu;
    let sel = CudaIdx { mem: g.alloc::<i32>(rows * top_k), len: rows * top_k };
    if rows == 0 || top_k == 0 {
        return Selection { indices: sel, top_k };
    }
    let ratio = lk.spec.ratio;
    let most = plan.positions.iter().map(|&t| (t as usize + 1) / ratio).max().unwrap_or(0);
    let n_max = scored_candidates(most);
    let dp = b.plans.get(g, plan);
    let visible: usize = plan.positions.iter().map(|&t| (t as usize + 1) / ratio).sum();
    g.traffic.add_kv(visible * lk.index.bytes());
    let scores = b.alloc_buf(rows * n_max);
    if most > top_k {
        let smem = (heads * dim + heads) * 4;
        assert!(smem <= 48 * 1024, "indexer q of {heads}x{dim} exceeds the kernel's shared memory");
        let geom = IndexGeom {
            heads: heads as i32,
            dim: dim as i32,
            ratio: ratio as i32,
            n_max: n_max as i32,
            dtype: dtype_code(layout.dtype),
            stride: lk.stride(Branch::Indexer) as i32,
            page_elems: layout.page_elems as i32,
            page_off: lk.page_offset(Branch::Indexer) as i32,
            per_page: lk.entries_per_page(layout.block) as i32,
        };
        if let Some(rpb) = super::indexer_wg::rows_per_block(g, layout, layer, plan, heads, n_max) {
            // Prefill-sized runs of rows a sequence: keys kept while the rows stream past.
            let io = super::indexer_wg::ScoresIo {
                q: g.ptr(&q.mem),
                weights: g.ptr(&weights.mem),
                page_base: g.ptr(&kv.pages.mem),
                scores: g.ptr(&scores.mem),
                weight_scale: prep.map_or(1.0, |p| p.weight_scale),
            };
            super::indexer_wg::scores(g, &dp, rows, n_max, &io, geom, rpb, prep.map(|p| p.rope));
        } else if let Some(kpb) = mma_keys_per_block(layout, layer, heads, rows, n_max, g.sms) {
            // FP8 and BF16 keys: tensor cores (indexer_mma.cu), q as f16 (bf16) fragments first.
            let bf16 = layout.dtype == crate::EntryDtype::Bf16;
            let frags = g.alloc::<u32>(rows * dim * 64);
            let qscale = g.alloc::<f32>(rows);
            let (fp, qp) = (g.ptr(&frags), g.ptr(&qscale));
            // Blocks a row for its fragments (dim / 16 k-steps × 16 n-tiles × 32 lanes):
            // one a 1,024 of them (V4: 4 a row) while the rows alone do not fill the SMs.
            let frag_blocks = if rows < g.sms { (dim * 32).div_ceil(1024).max(1) } else { 1 };
            let (rope_at, rope) = match prep {
                Some(p) => (g.ptr(&dp.positions), RopeParams::new(p.rope)),
                None => (0, RopeParams::none()),
            };
            launch!(
                g,
                "index_q_frags",
                cfg((rows as u32, frag_blocks as u32, 1), 1024, 0),
                g.ptr(&q.mem),
                fp,
                qp,
                heads as i32,
                dim as i32,
                bf16 as i32,
                rope_at,
                rope,
            );
            launch!(
                g,
                if bf16 { "index_scores_mma_bf16" } else { "index_scores_mma" },
                cfg((n_max.div_ceil(kpb) as u32, rows as u32, 1), 256, (dim * 256 + 64 * 4) as u32),
                fp,
                qp,
                g.ptr(&weights.mem),
                g.ptr(&dp.positions),
                g.ptr(&dp.row_seq),
                g.ptr(&dp.seqs),
                g.ptr(&dp.pages),
                g.ptr(&kv.pages.mem),
                g.ptr(&scores.mem),
                geom,
                kpb as i32,
                prep.map_or(1.0f32, |p| p.weight_scale),
            );
        } else {
            // Few rows (decode): heads across warps, 32 candidates a block, so the grid
            // fills the GPU; otherwise one thread per candidate.
            let heads_parallel = rows * n_max.div_ceil(256) < 2 * g.sms;
            let (name, grid, smem) = if heads_parallel {
                ("index_scores_heads", (n_max.div_ceil(32) as u32, rows as u32, 1), smem + 256 * 4)
            } else {
                ("index_scores", (n_max.div_ceil(256) as u32, rows as u32, 1), smem)
            };
            launch!(
                g,
                name,
                cfg(grid, 256, smem as u32),
                g.ptr(&q.mem),
                g.ptr(&weights.mem),
                g.ptr(&dp.positions),
                g.ptr(&dp.row_seq),
                g.ptr(&dp.seqs),
                g.ptr(&dp.pages),
                g.ptr(&kv.pages.mem),
                g.ptr(&scores.mem),
                geom,
            );
        }
    }
    super::topk::select_topk(g, g.ptr(&scores.mem), n_max, g.ptr(&dp.positions), rows, ratio, top_k, g.ptr(&sel.mem));
    Selection { indices: sel, top_k }
}

/// Score slots a row gets for a batch whose rows see at most `most` entries: `most`
/// rounded up to a granule of about a sixteenth of it (at least 64), so the decode steps
/// between two granules (a row sees one more entry every `ratio` tokens) launch the same
/// grids with the same arguments and replay one CUDA graph (`step_graph`). Slots past a
/// row's visible count score -inf and are never selected, so results do not change.
fn scored_candidates(most: usize) -> usize {
    if most == 0 {
        return 0;
    }
    most.next_multiple_of((most.next_power_of_two() / 16).max(64))
}

/// Blocks an SM the tensor-core indexer's grid aims for ([`mma_keys_per_block`]):
/// `SLUICE_CUDA_INDEXER_FILL` (read once), default 2.
fn indexer_fill() -> usize {
    static FILL: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *FILL.get_or_init(|| env_rows("SLUICE_CUDA_INDEXER_FILL").unwrap_or(2).max(1))
}

/// Keys a block of the tensor-core indexer scores (`index_scores_mma`, `_bf16`), if it
/// takes this layer: FP8 or BF16 keys with entries aligned to 8 elements, at most 64
/// heads in groups of 4, whole 64-dim blocks of at most 128 dims (the q fragments' 32 KiB
/// of shared memory), and
/// `SLUICE_CUDA_INDEXER_MMA` not `0` (read once; `0` keeps the SIMT kernels, to compare);
/// [`keys_per_block`] of them.
fn mma_keys_per_block(
    layout: &KvLayout,
    layer: usize,
    heads: usize,
    rows: usize,
    n_max: usize,
    sms: usize,
) -> Option<usize> {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("SLUICE_CUDA_INDEXER_MMA").map_or(true, |v| v != "0"));
    let lk = &layout.layers[layer];
    let dim = lk.spec.index_dim;
    let aligned = [lk.stride(Branch::Indexer), lk.page_offset(Branch::Indexer), layout.page_elems]
        .iter()
        .all(|v| v.is_multiple_of(8));
    let fits = heads.is_multiple_of(4) && heads <= 64 && dim.is_multiple_of(64) && dim <= 128;
    let dtype = matches!(layout.dtype, crate::EntryDtype::Fp8 | crate::EntryDtype::Bf16);
    if !(on && dtype && aligned && fits) {
        return None;
    }
    Some(keys_per_block(rows, n_max, indexer_fill() * sms))
}

/// Keys a block of the tensor-core indexer takes: the fewest (16, 32, 64, then multiples
/// of 128, the 8 warps' 16 keys each, up to 1,024) whose grid fits the GPU's `places`
/// block places in one wave; 512 where none does (a prefill's many rows, many waves
/// anyway). A grid just past one wave pays a second round for a few blocks:
/// the halving rule before gave a batch of 32 at an 8K context 288 blocks of 256 keys on
/// 264 places, ~22 µs a CSA layer (flash-bench, H200).
fn keys_per_block(rows: usize, n_max: usize, places: usize) -> usize {
    [16, 32, 64]
        .into_iter()
        .chain((128..=1024).step_by(128))
        .find(|&kpb| rows * n_max.div_ceil(kpb) <= places)
        .unwrap_or(512)
}

/// Splits of the key axis: about enough blocks to fill `slots` block places when rows are
/// few (a decode batch: a row's heads are only 2 tensor-core blocks or 4 SIMT ones), each
/// split a whole number of `tile`-key tiles and at least `min_tiles` of them where a row
/// has that many; one split when the rows alone fill the places.
fn key_splits(slots: usize, blocks: usize, n_max: usize, tile: usize, min_tiles: usize) -> (usize, usize) {
    let want = slots / blocks.max(1);
    let splits = want.clamp(1, (n_max.div_ceil(tile) / min_tiles.max(1)).max(1));
    let per = n_max.div_ceil(splits).div_ceil(tile) * tile;
    (n_max.div_ceil(per.max(1)).max(1), per.max(tile))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    b: &CudaBackend,
    kv: &KvView<'_, CudaBackend>,
    layout: &KvLayout,
    layer: usize,
    plan: &BatchPlan,
    q: &CudaBuf,
    new_kv: &CudaBuf,
    selected: Option<&Selection<CudaBackend>>,
    sinks: &CudaBuf,
    heads: usize,
    scale: f32,
    prep: Option<&QueryPrep<'_>>,
    out: AttnOut<'_>,
) {
    let lk = &layout.layers[layer];
    let hd = lk.spec.head_dim;
    let rows = plan.rows();
    assert!(hd <= ATT_HD_MAX, "head_dim {hd} exceeds the CUDA attention kernel's {ATT_HD_MAX}");
    assert_eq!(q.len, rows * heads * hd, "attention q is not [rows, heads, head_dim]");
    assert_eq!(new_kv.len, rows * hd, "attention new_kv is not [rows, head_dim]");
    if let AttnOut::F32(out) = &out {
        assert_eq!(out.len, rows * heads * hd, "attention output is not [rows, heads, head_dim]");
    }
    assert_eq!(sinks.len, heads, "one sink per head");
    if rows == 0 {
        return;
    }
    let (kind, top_k) = match (lk.kind(), selected) {
        (AttnKind::Window, _) => (0, 0),
        (AttnKind::Csa, Some(s)) => (1, s.top_k),
        (AttnKind::Csa, None) => panic!("CSA layer {layer} attention needs the indexer's selection"),
        (AttnKind::Hca, _) => (2, 0),
    };
    let g = &b.gpu;
    let dp = b.plans.get(g, plan);
    let window = layout.window;
    let n_max = plan
        .positions
        .iter()
        .map(|&t| {
            let t = t as usize;
            (t + 1).min(window)
                + match kind {
                    1 => top_k,
                    2 => (t + 1) / lk.spec.ratio,
                    _ => 0,
                }
        })
        .max()
        .unwrap_or(1);
    let keys: usize = plan
        .positions
        .iter()
        .map(|&t| {
            let t = t as usize;
            (t + 1).min(window)
                + match kind {
                    1 => top_k.min((t + 1) / lk.spec.ratio),
                    2 => (t + 1) / lk.spec.ratio,
                    _ => 0,
                }
        })
        .sum();
    g.traffic.add_kv(keys * lk.main.bytes());
    let (kernel, new_bf16) = attention_kernel(g, layout, layer, plan, heads);
    let (mma, wg) = (kernel != "attention", kernel == "attention_wg");
    assert!(prep.is_none() || wg, "only attention_wg takes a raw query (preps_query says when)");
    // Block places: the tensor-core kernels hold one block an SM (`attention_mma` 198
    // registers a thread; `attention_wg` 255 and ~225 KiB of shared memory), the SIMT
    // kernel aims for two.
    let (hpb, slots, tile, min_tiles) = if wg {
        (WG_HEADS, g.sms, WG_KEYS, wg_split_tiles())
    } else if mma {
        (MMA_HEADS_PER_BLOCK, g.sms, MMA_KEYS, 1)
    } else {
        (ATT_HEADS_PER_BLOCK.min(heads), 2 * g.sms, ATT_T, 1)
    };
    let hgroups = heads.div_ceil(hpb);
    let (splits, per) = key_splits(slots, rows * hgroups, n_max, tile, min_tiles);
    let part = if splits > 1 { Some(b.alloc_buf(rows * heads * splits * (hd + 2))) } else { None };
    // bf16 rows rotated back straight from `attention_wg` where one split holds each row;
    // otherwise f32 rows first (merged), then the `rope` launch and the rounding.
    // Split keys leave the kernel's output in `part` alone, so where the merge also rotates
    // and rounds (`merged`) no f32 rows are made and the kernel gets no output address.
    let (out_at, out_rope, rotated, merged) = match out {
        AttnOut::F32(o) => (g.ptr(&o.mem), None, None, None),
        AttnOut::Bf16Rotated { at, rope } if wg && splits == 1 => (at, Some(rope), None, None),
        AttnOut::Bf16Rotated { at, rope } if splits > 1 && merges_rotated(hd) => (0, None, None, Some((at, rope))),
        AttnOut::Bf16Rotated { at, rope } => {
            let f32_rows = b.alloc_buf(rows * heads * hd);
            (g.ptr(&f32_rows.mem), None, Some((f32_rows, at, rope)), None)
        }
    };
    let new_bf16 = new_bf16.then(|| {
        let xb = g.alloc::<u16>(rows * hd);
        super::cublas_bf16::round_rows(g, g.ptr(&xb), g.ptr(&new_kv.mem), rows, hd, hd);
        xb
    });
    let per_page = lk.entries_per_page(layout.block).max(1);
    let geom = AttnGeom {
        heads: heads as i32,
        hd: hd as i32,
        window: window as i32,
        kind,
        ratio: lk.spec.ratio.max(1) as i32,
        top_k: top_k as i32,
        dtype: dtype_code(layout.dtype),
        tail: lk.main.tail as i32,
        stride: lk.stride(Branch::Main) as i32,
        ring_elems: layout.ring_elems as i32,
        ring_off: lk.ring as i32,
        page_elems: layout.page_elems as i32,
        page_off: lk.page_offset(Branch::Main) as i32,
        per_page: per_page as i32,
        splits: splits as i32,
        keys_per_split: per as i32,
        scale,
        win_mask: pow2_mask(window),
        page_shift: if per_page.is_power_of_two() { per_page.trailing_zeros() as i32 } else { -1 },
        new_bf16: new_bf16.is_some() as i32,
        one_part: i32::from(g.activations == Activations::Bf16),
        q_prep: prep.is_some() as i32,
        q_eps: prep.map_or(0.0, |p| p.eps),
        out_bf16: out_rope.is_some() as i32,
    };
    let (threads, smem) = if wg {
        (WG_THREADS, WG_DYN_SMEM as u32)
    } else if mma {
        (MMA_THREADS, MMA_DYN_SMEM as u32)
    } else {
        (32 * hpb as u32, 0)
    };
    let launch_cfg = cfg((hgroups as u32, splits as u32, rows as u32), threads, smem);
    let new_at = new_bf16.as_ref().map_or(g.ptr(&new_kv.mem), |xb| g.ptr(xb));
    let (rings, pages, sel) =
        (g.ptr(&kv.rings.mem), g.ptr(&kv.pages.mem), selected.map_or(0, |s| g.ptr(&s.indices.mem)));
    let (sinks_at, pos, row_seq, seqs) = (g.ptr(&sinks.mem), g.ptr(&dp.positions), g.ptr(&dp.row_seq), g.ptr(&dp.seqs));
    let (q, part_at) = (g.ptr(&q.mem), part.as_ref().map_or(0, |p| g.ptr(&p.mem)));
    // The RoPE of a raw query and of a bf16 output (`attention_wg`'s; the other kernels
    // take and ignore it): one table, the layer's.
    let table = match (prep.map(|p| p.rope), out_rope) {
        (Some(a), Some(b)) => {
            assert!(std::ptr::eq(a, b), "attention_wg rotates q and its output with one table");
            Some(a)
        }
        (a, b) => a.or(b),
    };
    let rope = table.map_or(RopeParams::none(), RopeParams::new);
    let dp_pages = g.ptr(&dp.pages);
    let function = if wg && !wg_splits_keys() { "attention_wg_whole" } else { kernel };
    launch!(
        g, function, launch_cfg, q, new_at, rings, pages, dp_pages, sel, sinks_at, pos, row_seq, seqs, out_at, part_at,
        geom, rope
    );
    // A split output rotated back in bf16: the merge, the inverse RoPE and the rounding in
    // one launch where a thread holds one value (`SLUICE_CUDA_ATT_MERGE_ROPE=0` runs three).
    if let (Some(part), Some((at, rope))) = (&part, merged) {
        assert!(rope.dims() <= hd && rope.dims() % 2 == 0, "RoPE over {} of {hd} dims", rope.dims());
        launch!(
            g,
            "attention_merge_rope_bf16",
            cfg(((rows * heads) as u32, 1, 1), hd as u32, (4 * splits) as u32),
            g.ptr(&part.mem),
            g.ptr(&sinks.mem),
            at,
            pos,
            heads as i32,
            hd as i32,
            splits as i32,
            RopeParams::new(rope)
        );
        return;
    }
    if let Some(part) = &part {
        launch!(
            g,
            "attention_merge",
            // A thread per output value (up to 512): with 128 a thread walked four values'
            // splits one after another (~25 µs for 40 splits at batch 1).
            cfg(((rows * heads) as u32, 1, 1), hd.next_multiple_of(32).clamp(32, 512) as u32, (4 * splits) as u32),
            g.ptr(&part.mem),
            g.ptr(&sinks.mem),
            out_at,
            heads as i32,
            hd as i32,
            splits as i32
        );
    }
    if let Some((mut f32_rows, at, rope)) = rotated {
        super::rows::rope(b, &mut f32_rows, heads, hd, &plan.positions, rope, true);
        super::cublas_bf16::round_rows(g, at, out_at, rows, heads * hd, heads * hd);
    }
}

/// Whether `attention_merge_rope_bf16` takes a split output rotated back in bf16: a
/// thread a value (head_dim a multiple of 64, at most a block's 1,024 threads), so each
/// rotated pair sits in neighbouring lanes. `SLUICE_CUDA_ATT_MERGE_ROPE=0` (read once)
/// keeps `attention_merge`, `rope` and the rounding as three launches, to compare.
fn merges_rotated(hd: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("SLUICE_CUDA_ATT_MERGE_ROPE").map_or(true, |v| v != "0"));
    on && hd.is_multiple_of(64) && hd <= 1024
}

/// Whether this layer's attention runs on the tensor cores: any batch (decode rows with
/// key splits) over bf16 or fp8 entries (both exact as bf16 operands: fp8 codes times a
/// power-of-two scale need 4 significant bits) whose geometry the kernel handles
/// (head_dim a multiple of 128, so each of the 8 dim groups is whole 16-dim mma steps;
/// every entry 16-byte aligned for bf16, 8-byte for fp8 records, whose FP8 and BF16 parts
/// then come in whole 8-dim pieces); f32 entries take the SIMT kernel.
/// `SLUICE_CUDA_ATTENTION=simt` keeps the SIMT kernel everywhere, and
/// `SLUICE_CUDA_ATT_MMA_FROM=N` below N rows (64 was the rule before decode batches took
/// the tensor cores), for comparisons.
fn use_mma(layout: &KvLayout, layer: usize, rows: usize) -> bool {
    static SIMT_ONLY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let simt_only = *SIMT_ONLY.get_or_init(|| std::env::var("SLUICE_CUDA_ATTENTION").is_ok_and(|v| v == "simt"));
    static MIN_ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let min_rows = *MIN_ROWS.get_or_init(|| env_rows("SLUICE_CUDA_ATT_MMA_FROM").unwrap_or(1));
    let lk = &layout.layers[layer];
    let hd = lk.spec.head_dim;
    let aligned =
        [layout.ring_elems, lk.ring, layout.page_elems, lk.page_offset(Branch::Main), lk.stride(Branch::Main)]
            .iter()
            .all(|v| v % 8 == 0);
    let dtype_ok = match layout.dtype {
        crate::EntryDtype::Bf16 => true,
        crate::EntryDtype::Fp8 => lk.main.tail.is_multiple_of(8),
        crate::EntryDtype::F32 => false,
    };
    !simt_only && rows >= min_rows && dtype_ok && hd.is_multiple_of(128) && hd <= ATT_HD_MAX && aligned
}

/// The kernel a batch's attention runs in (`attention`, `attention_mma` or
/// `attention_wg`), and whether its new entries are passed as bf16.
pub(crate) fn attention_kernel(
    g: &Gpu,
    layout: &KvLayout,
    layer: usize,
    plan: &BatchPlan,
    heads: usize,
) -> (&'static str, bool) {
    let rows = plan.rows();
    let mma = use_mma(layout, layer, rows);
    let wg = mma && use_wg(g, layout, layer, heads);
    let new_bf16 = mma && ((rows >= NEW_KV_BF16_ROWS && rows >= 2 * plan.seqs.len()) || (wg && rows >= wg_from_rows()));
    let kernel = if new_bf16 && wg {
        "attention_wg"
    } else if mma {
        "attention_mma"
    } else {
        "attention"
    };
    (kernel, new_bf16)
}

/// Fewest rows of a decode-like batch (about a row a sequence) that take the warpgroup
/// kernel, their new entries rounded to bf16 for it (one small launch; exact: they hold
/// the entry dtype's values); `SLUICE_CUDA_ATT_WG_FROM=N`, read once, default 16: 1–2%
/// faster steps from there (20 Flash layers on one H200, all of V4-Flash on two). Off
/// for one round, after decode batches of 64 over all of V4-Flash on two H200s stopped on
/// an illegal address with them on it; the step arena's overflow, fixed since, was the
/// cause (docs/perf.md "The indexer's prefill scores on `wgmma`").
fn wg_from_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| env_rows("SLUICE_CUDA_ATT_WG_FROM").unwrap_or(16))
}

/// Fewest key tiles an `attention_wg` split takes (`SLUICE_CUDA_ATT_WG_SPLIT_TILES`, read
/// once; default 1). A block's row start (its q staged and normed) and end cost about what
/// two to three tiles do, and a key split adds `attention_merge`, the `rope` launch and the
/// output's rounding where one split writes the rotated bf16 rows itself.
fn wg_split_tiles() -> usize {
    static TILES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *TILES.get_or_init(|| env_rows("SLUICE_CUDA_ATT_WG_SPLIT_TILES").unwrap_or(1).max(1))
}

/// Whether `attention_wg`'s two warpgroups split each key tile for q · Kᵀ and exchange the
/// softmax weights through shared memory (default) or both compute the whole tile's logits
/// (`attention_wg_whole`, `SLUICE_CUDA_ATT_WG_HALVES=0`, for comparisons): the same
/// numbers but for the order in which the row's weight sum is added.
fn wg_splits_keys() -> bool {
    static WHOLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !*WHOLE.get_or_init(|| std::env::var("SLUICE_CUDA_ATT_WG_HALVES").is_ok_and(|v| v == "0"))
}

/// Whether the warpgroup kernel (attention_wg.cu) can take a layer's batches (those whose
/// new entries are passed as bf16: prefill-sized ones, and decode batches from
/// [`wg_from_rows`] rows): Hopper, bf16 activations (the kernel rounds q and the softmax
/// weights once, as `attention_mma`'s `one_part`; split activations keep that kernel and
/// its f32 distance), V4's head_dim and fp8 layout (448 FP8 dims, a bf16 tail of 64) and
/// whole blocks of 64 heads. The entry dtypes and alignments are `use_mma`'s.
/// `SLUICE_CUDA_ATT_WGMMA=0` keeps `attention_mma`, for comparisons.
fn use_wg(g: &Gpu, layout: &KvLayout, layer: usize, heads: usize) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("SLUICE_CUDA_ATT_WGMMA").is_ok_and(|v| v == "0"));
    let lk = &layout.layers[layer];
    let fp8_ok = layout.dtype != crate::EntryDtype::Fp8 || lk.main.tail == WG_HEAD_DIM - WG_FP8_DIMS;
    !off && g.cc.0 == 9
        && g.activations == Activations::Bf16
        && lk.spec.head_dim == WG_HEAD_DIM
        && fp8_ok
        && heads.is_multiple_of(WG_HEADS)
}

pub(crate) fn store_window(
    b: &CudaBackend,
    kv: &mut KvViewMut<'_, CudaBackend>,
    layout: &KvLayout,
    layer: usize,
    plan: &BatchPlan,
    new_kv: &CudaBuf,
) {
    let lk = &layout.layers[layer];
    let hd = lk.spec.head_dim;
    let rows = plan.rows();
    assert_eq!(new_kv.len, rows * hd, "store_window new_kv is not [rows, head_dim]");
    if rows == 0 {
        return;
    }
    let g = &b.gpu;
    let dp = b.plans.get(g, plan);
    // FP8: a warp per FP8 block of a row and one for the rest (attention.cu).
    let warps_per_row = match layout.dtype {
        crate::EntryDtype::Fp8 => (hd - lk.main.tail).div_ceil(crate::kv_layout::FP8_SCALE_BLOCK) + 1,
        _ => 1,
    };
    launch!(
        g,
        "store_window",
        cfg_elems(rows * warps_per_row * 32),
        g.ptr(&new_kv.mem),
        g.ptr(&kv.rings.mem),
        g.ptr(&dp.row_seq),
        g.ptr(&dp.seqs),
        rows as i32,
        hd as i32,
        layout.window as i32,
        dtype_code(layout.dtype),
        lk.main.tail as i32,
        lk.stride(Branch::Main) as i32,
        layout.ring_elems as i32,
        lk.ring as i32,
    );
}

#[cfg(test)]
mod tests {
    use super::{key_splits, keys_per_block, scored_candidates};

    #[test]
    fn indexer_blocks_fit_one_wave() {
        // 264 places (132 SMs, two blocks each), 2,304 candidates a row (an 8K context).
        assert_eq!(keys_per_block(1, 2304, 264), 16);
        assert_eq!(keys_per_block(8, 2304, 264), 128);
        assert_eq!(keys_per_block(32, 2304, 264), 384);
        assert_eq!(keys_per_block(64, 2304, 264), 640);
        assert_eq!(keys_per_block(4096, 2304, 264), 512);
        for rows in 1..200 {
            for n in [64, 1000, 2304, 16384] {
                let kpb = keys_per_block(rows, n, 264);
                assert!(kpb == 512 || rows * n.div_ceil(kpb) <= 264, "{rows} rows of {n}: {kpb}");
                assert!(kpb.is_multiple_of(16) && kpb <= 1024);
            }
        }
    }

    #[test]
    fn scored_candidates_cover_every_entry_in_few_granules() {
        assert_eq!(scored_candidates(0), 0);
        assert_eq!(scored_candidates(1), 64);
        assert_eq!(scored_candidates(64), 64);
        assert_eq!(scored_candidates(2047), 2048);
        assert_eq!(scored_candidates(2049), 2304);
        for most in 1..40_000 {
            let n = scored_candidates(most);
            assert!(n >= most && n - most < 64.max(most / 8), "{most} -> {n}");
        }
        // Steps of a growing context share a layout for whole granules.
        let layouts: std::collections::BTreeSet<usize> = (1000..2000).map(scored_candidates).collect();
        assert!(layouts.len() <= 10, "{} layouts for 1000 contexts", layouts.len());
    }

    #[test]
    fn key_splits_fill_the_block_places_and_cover_every_key() {
        // Batch 1 with 2 blocks a row and 132 places, tiles of 16 keys: a CSA row of 128
        // window + 512 selected keys takes one tile a split, a window row 8 splits.
        assert_eq!(key_splits(132, 2, 640, 16, 1), (40, 16));
        assert_eq!(key_splits(132, 2, 128, 16, 1), (8, 16));
        // The tensor-core kernel's tiles of 32: half the splits, each one tile.
        assert_eq!(key_splits(132, 2, 640, 32, 1), (20, 32));
        assert_eq!(key_splits(132, 2, 192, 32, 1), (6, 32));
        // Batch 8: 16 blocks, so 8 splits; an HCA row of 192 keys in 6 of 32.
        assert_eq!(key_splits(132, 16, 640, 16, 1), (8, 80));
        assert_eq!(key_splits(132, 16, 192, 16, 1), (6, 32));
        // Rows that fill the places alone: one split over every key.
        assert_eq!(key_splits(132, 2 * 64, 640, 16, 1), (1, 640));
        // Batch 32 of the warpgroup kernel (a block a row, tiles of 64): a CSA row of 640
        // keys in 4 splits of 3 tiles, an HCA row of 192 in 3 of one tile; at least 2
        // tiles a split, the HCA row whole; at least 3, the CSA row in 3 splits of 4.
        assert_eq!(key_splits(132, 32, 640, 64, 1), (4, 192));
        assert_eq!(key_splits(132, 32, 192, 64, 1), (3, 64));
        assert_eq!(key_splits(132, 32, 640, 64, 2), (4, 192));
        assert_eq!(key_splits(132, 32, 192, 64, 2), (1, 192));
        assert_eq!(key_splits(132, 32, 640, 64, 3), (3, 256));
        for (slots, tile) in [(132, 16), (264, 16), (132, 32), (132, 64)] {
            for blocks in [1, 2, 3, 16, 32, 131, 132, 500] {
                for n in (1..3000).step_by(7) {
                    for min_tiles in [1, 2, 3, 5] {
                        let (splits, per) = key_splits(slots, blocks, n, tile, min_tiles);
                        let at = format!("({slots}, {blocks}, {n}, {min_tiles})");
                        assert_eq!(per % tile, 0, "whole tiles {at}");
                        assert!(splits * per >= n && (splits - 1) * per < n, "every split holds keys {at}");
                        assert!(splits == 1 || splits * blocks <= slots, "one round of places {at}");
                        assert!(splits == 1 || per >= min_tiles * tile, "at least {min_tiles} tiles a split {at}");
                    }
                }
            }
        }
    }
}
