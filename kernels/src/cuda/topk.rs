//! The lightning indexer's top-k on the GPU: each row's k best of its first
//! `(position + 1) / ratio` scores, ascending ids (`cu/indexer.cu`: `topk_select_warp`
//! for a prefill's many short rows, `topk_select` a block a row, `topk_hist` /
//! `topk_gather` over many blocks for long rows).

use super::runtime::{Gpu, cfg, launch};
use super::{CudaBackend, KernelTime};

/// Rows of more candidates than this are split over several blocks.
const TOPK_ONE_BLOCK_MAX: usize = 16384;

/// Threads of a `topk_select` block: 1,024, or 256 where a prefill gives many short rows
/// (at least four blocks an SM, at most 2,048 candidates: 8 a thread). A 1,024-thread
/// block spends a row's three radix passes and its compaction mostly in block barriers
/// with 2 candidates a thread, and only two fit an SM. `SLUICE_CUDA_TOPK_ROW_THREADS=1024`
/// (read once) keeps 1,024 always.
fn topk_row_threads(sms: usize, rows: usize, n_max: usize) -> u32 {
    static FIXED: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    let fixed = *FIXED.get_or_init(|| {
        std::env::var("SLUICE_CUDA_TOPK_ROW_THREADS").ok().and_then(|v| v.parse().ok()).filter(|&t| t == 1024)
    });
    match fixed {
        Some(t) => t,
        None if rows >= 4 * sms && n_max <= 2048 => 256,
        None => 1024,
    }
}
/// Most candidates `topk_select_warp` holds a row (`TKW_MAX`: 64 keys a lane), and its rows a block.
const TOPK_WARP_MAX: usize = 2048;
const TOPK_WARP_ROWS_A_BLOCK: usize = 8;

/// Whether a batch's top-k takes `topk_select_warp` (a warp a row, the keys in registers):
/// a prefill's many short rows (at least four 256-thread blocks an SM for `topk_select`,
/// at most [`TOPK_WARP_MAX`] candidates). Decode batches keep `topk_select`'s blocks, one a
/// row. `SLUICE_CUDA_TOPK_WARP=0` (read once) keeps `topk_select` always.
fn topk_warp_takes(sms: usize, rows: usize, n_max: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("SLUICE_CUDA_TOPK_WARP").map_or(true, |v| v != "0"));
    on && rows >= 4 * sms && n_max <= TOPK_WARP_MAX
}

/// Whether [`select_topk`] of `rows` rows of `n_max` candidates runs `topk_select_warp`
/// (the parity suite asserts which cases do).
pub(crate) fn topk_in_warps(g: &Gpu, rows: usize, n_max: usize) -> bool {
    topk_warp_takes(g.sms, rows, n_max)
}

/// Candidates per block on the multi-launch path.
const TOPK_CHUNK: usize = 2048;
/// Largest k of the multi-block path (`TK_K_MAX` in indexer.cu: the ids are collected
/// in shared memory).
const TOPK_K_MAX: usize = 2048;
/// u32s of per-row state (`TK_STATE`) and digit histogram (`TK_DBINS`).
const TOPK_STATE: usize = 8;
const TOPK_DBINS: usize = 4096;
/// A launch group's candidate lists stay under this many entries (rows × n_max).
const TOPK_GROUP_ENTRIES: usize = 1 << 24;

/// Top-`k` of each row's first `(position + 1) / ratio` scores (`scores[rows, n_max]`),
/// ascending entry ids into `out[rows, k]`, -1 past the visible count.
#[allow(clippy::too_many_arguments)]
pub(crate) fn select_topk(
    g: &Gpu,
    scores: u64,
    n_max: usize,
    positions: u64,
    rows: usize,
    ratio: usize,
    k: usize,
    out: u64,
) {
    let (n_max_i, ratio_i, k_i) = (n_max as i32, ratio as i32, k as i32);
    if topk_warp_takes(g.sms, rows, n_max) {
        let rows_i = rows as i32;
        let blocks = rows.div_ceil(TOPK_WARP_ROWS_A_BLOCK) as u32;
        launch!(
            g,
            "topk_select_warp",
            cfg((blocks, 1, 1), 256, 0),
            scores,
            n_max_i,
            positions,
            ratio_i,
            k_i,
            rows_i,
            out
        );
        return;
    }
    if n_max <= TOPK_ONE_BLOCK_MAX {
        let threads = topk_row_threads(g.sms, rows, n_max);
        launch!(g, "topk_select", cfg((rows as u32, 1, 1), threads, 0), scores, n_max_i, positions, ratio_i, k_i, out);
        return;
    }
    assert!(k <= TOPK_K_MAX, "index top-k of {k} over {n_max} candidates: the CUDA path sorts at most {TOPK_K_MAX}");
    let slices = n_max.div_ceil(TOPK_CHUNK);
    let chunk = TOPK_CHUNK as i32;
    let group = (TOPK_GROUP_ENTRIES / n_max).clamp(1, rows);
    let state = g.scratch("topk_state", TOPK_STATE * group);
    let ghist = g.scratch("topk_hist", TOPK_DBINS * group);
    let tickets = g.scratch("topk_tickets", group);
    let sure = g.scratch("topk_sure", k * group);
    let cand_key = g.scratch("topk_cand_key", n_max * group);
    let cand_idx = g.scratch("topk_cand_idx", n_max * group);
    for r0 in (0..rows).step_by(group) {
        let nr = group.min(rows - r0);
        let (s, pos, o) = (scores + (4 * r0 * n_max) as u64, positions + (4 * r0) as u64, out + (4 * r0 * k) as u64);
        let grid = cfg((slices as u32, nr as u32, 1), 1024, 0);
        for pass in 0..2i32 {
            launch!(g, "topk_hist", grid, s, n_max_i, pos, ratio_i, k_i, chunk, pass, state, ghist, tickets);
        }
        launch!(
            g,
            "topk_gather",
            grid,
            s,
            n_max_i,
            pos,
            ratio_i,
            k_i,
            chunk,
            state,
            tickets,
            sure,
            cand_key,
            cand_idx,
            o
        );
    }
}

/// The selection alone, for the parity suite and the benchmark's kernel table.
impl CudaBackend {
    /// The indexer's top-k selection alone over given scores (`scores[rows, n_max]`,
    /// row r choosing among its first `(positions[r] + 1) / ratio`), as `index_topk`
    /// runs it: ascending ids, -1 past the visible count. For parity tests of the
    /// selection on inputs the indexer would rarely produce (ties, one repeated value).
    pub fn topk_of_scores(&self, scores: &[f32], n_max: usize, positions: &[u32], ratio: usize, k: usize) -> Vec<i32> {
        let g = &self.gpu;
        let rows = positions.len();
        assert_eq!(scores.len(), rows * n_max, "scores are not [rows, n_max]");
        let (s, pos, out) = (g.upload(scores), g.upload(positions), g.alloc::<i32>(rows * k));
        select_topk(g, g.ptr(&s), n_max, g.ptr(&pos), rows, ratio, k, g.ptr(&out));
        let mut host = vec![0i32; rows * k];
        g.read(&out, 0, &mut host);
        host
    }

    /// Whether the top-k of `rows` rows of `n_max` candidates takes a warp a row
    /// (`topk_select_warp`), for the parity suite.
    pub fn topk_in_warps(&self, rows: usize, n_max: usize) -> bool {
        topk_in_warps(&self.gpu, rows, n_max)
    }

    /// Time of the indexer's top-k selection alone (radix select and ordered ids, one
    /// block or several per row as `index_topk` chooses) for one row of `n` random
    /// scores keeping `k`.
    pub fn time_topk(&self, n: usize, k: usize, reps: usize) -> KernelTime {
        let g = &self.gpu;
        let scores: Vec<f32> = super::bench::xorshift_unit(0x2545_f491_4f6c_dd1d, n).collect();
        let s = g.upload(&scores);
        let pos = g.upload(&[(4 * n - 1) as u32]);
        let out = g.alloc::<i32>(k);
        self.time_kernel_us(reps, || select_topk(g, g.ptr(&s), n, g.ptr(&pos), 1, 4, k, g.ptr(&out)))
    }
}
