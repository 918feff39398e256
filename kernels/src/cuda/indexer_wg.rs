//! The lightning indexer's scores of prefill-sized batches on Hopper's `wgmma`
//! (cu/indexer_wg.cu): a block keeps 256 keys of one sequence in registers, as bf16,
//! while that sequence's rows stream past them, each row's q a ready shared-memory image
//! (`index_q_tile`). [`rows_per_block`] says when it runs; otherwise `index_scores_mma`
//! (a block a row, keys loaded again for every row) scores the batch.

use super::devplan::DevPlan;
use super::rows::RopeParams;
use super::runtime::{Gpu, cfg, launch};
use crate::kv_layout::{Branch, KvLayout};
use crate::plan::BatchPlan;

/// Keys a block (`IW_KEYS`: four warpgroups of 64) and its threads (`IW_THREADS`).
const KEYS: usize = 256;
const THREADS: u32 = (KEYS / 64 * 128) as u32;
/// The one indexer geometry the kernel takes: V4's 64 heads × 128 dims (`IW_COLS` = 2 ×
/// 64 columns: each head's hi and lo halves).
const HEADS: usize = 64;
const DIM: usize = 128;
/// Bytes of a row's q image (`IW_TILE`).
const TILE_BYTES: usize = 2 * HEADS * DIM * 2;
/// Dynamic shared memory (`IW_DYN_SMEM`): two row images and 1 KiB of alignment.
pub(crate) const IW_DYN_SMEM: usize = 1024 + 2 * TILE_BYTES;
// Within what an H200's block may opt in to (227 KiB).
const _: () = assert!(TILE_BYTES == 32 * 1024 && IW_DYN_SMEM <= 227 * 1024);
/// Fewest rows a sequence (on average) that take it: the keys are converted once a block
/// and serve that many rows; a decode-like batch (a row a sequence) keeps `index_scores_mma`.
const MIN_ROWS_PER_SEQ: usize = 32;

/// Rows a block of `index_scores_wg` for this batch, if the kernel takes it: Hopper, V4's
/// indexer geometry, FP8 or BF16 keys at 8-element aligned places, and prefill-sized runs
/// of rows a sequence. As many rows a block (64 at most, 8 at least) as leave at least
/// four blocks an SM. `SLUICE_CUDA_INDEXER_WG=0` keeps `index_scores_mma`, for comparisons.
pub(super) fn rows_per_block(
    g: &Gpu,
    layout: &KvLayout,
    layer: usize,
    plan: &BatchPlan,
    heads: usize,
    n_max: usize,
) -> Option<usize> {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("SLUICE_CUDA_INDEXER_WG").is_ok_and(|v| v == "0"));
    let lk = &layout.layers[layer];
    let rows = plan.rows();
    let aligned = [lk.stride(Branch::Indexer), lk.page_offset(Branch::Indexer), layout.page_elems]
        .iter()
        .all(|v| v.is_multiple_of(8));
    let dtype = matches!(layout.dtype, crate::EntryDtype::Fp8 | crate::EntryDtype::Bf16);
    let takes = !off
        && g.cc.0 == 9
        && heads == HEADS
        && lk.spec.index_dim == DIM
        && dtype
        && aligned
        && rows >= MIN_ROWS_PER_SEQ * plan.seqs.len().max(1);
    takes.then(|| block_rows(rows, n_max, g.sms))
}

/// Rows a block: the most (64, 32, 16, 8) that still give `4 · sms` blocks.
fn block_rows(rows: usize, n_max: usize, sms: usize) -> usize {
    let tiles = n_max.div_ceil(KEYS);
    let mut rpb = 64;
    while rpb > 8 && tiles * rows.div_ceil(rpb) < 4 * sms {
        rpb /= 2;
    }
    rpb
}

/// What the scores read and where they go (device addresses).
pub(super) struct ScoresIo {
    pub q: u64,
    pub weights: u64,
    pub page_base: u64,
    pub scores: u64,
    pub weight_scale: f32,
}

/// q's images (`index_q_tile`, rotated there when `rope` is given), then the scores of
/// every row against every key slot up to `n_max` (`index_scores_wg`; `geom` is
/// attention.rs's `IndexGeom`, n_max slots a row).
#[allow(clippy::too_many_arguments)]
pub(super) fn scores<G: cudarc::driver::DeviceRepr>(
    g: &Gpu,
    dp: &DevPlan,
    rows: usize,
    n_max: usize,
    io: &ScoresIo,
    geom: G,
    rows_per_block: usize,
    rope: Option<&crate::rope::RopeTable>,
) {
    let tiles = g.alloc::<u16>(rows * TILE_BYTES / 2);
    let tp = g.ptr(&tiles);
    let (rope_at, rope) = match rope {
        Some(r) => (g.ptr(&dp.positions), RopeParams::new(r)),
        None => (0, RopeParams::none()),
    };
    launch!(g, "index_q_tile", cfg((rows as u32, 1, 1), 256, 0), io.q, tp, HEADS as i32, rope_at, rope);
    launch!(
        g,
        "index_scores_wg",
        cfg((n_max.div_ceil(KEYS) as u32, rows.div_ceil(rows_per_block) as u32, 1), THREADS, IW_DYN_SMEM as u32),
        tp,
        io.weights,
        g.ptr(&dp.positions),
        g.ptr(&dp.row_seq),
        g.ptr(&dp.seqs),
        g.ptr(&dp.pages),
        io.page_base,
        io.scores,
        geom,
        rows as i32,
        rows_per_block as i32,
        io.weight_scale,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_take_fewer_rows_until_the_grid_fills_the_gpu() {
        // An 8K prefill's CSA layer: 2,048 key slots, 8 tiles; 64 rows a block is 1,024 blocks.
        assert_eq!(block_rows(8192, 2048, 132), 64);
        // 1,024 rows over 2 tiles: 64 rows give 32 blocks, 8 rows 256 (the floor).
        assert_eq!(block_rows(1024, 512, 132), 8);
        // 4,096 rows, 4 tiles: 16 rows give 1,024 blocks, 32 would give 512 (< 528).
        assert_eq!(block_rows(4096, 1024, 132), 16);
    }
}
