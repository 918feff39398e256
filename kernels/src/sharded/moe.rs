//! The expert-parallel MoE block.
//!
//! 1. Every device gathers the whole batch's normed rows, device 0's rows first
//!    ([`super::Collective::all_gather`]).
//! 2. Each device routes every row (the router is replicated, so all pick the same
//!    experts), runs the routed experts it holds on the rows routed to them, and adds
//!    the shared expert on its own block of rows: a partial sum for every row.
//! 3. A reduce-scatter sums each row's partials, device by device in order, onto the
//!    device that owns the row.
//!
//! Gathering every row everywhere moves `devices × rows × hidden` values each way; on a
//! few GPUs of one host, where a top-6 routing of 256 experts sends nearly every row to
//! every device anyway, that is about what an all-to-all dispatch of the routed rows
//! would move, without the per-expert bookkeeping (docs/engine.md has the numbers).

use super::Sharded;
use super::buf::ShardBuf;
use crate::backend::Backend;

pub(super) fn moe<B: Backend>(
    s: &Sharded<B>,
    x: &ShardBuf<B>,
    rows: usize,
    tokens: &[u32],
    w: &[B::Moe],
    out: &mut ShardBuf<B>,
) {
    let (split, parts) = x.rows_at(rows);
    assert_eq!(tokens.len(), rows, "moe tokens");
    if rows == 0 {
        *out = ShardBuf::Rows { len: 0, split, parts: s.ranks.iter().map(|b| b.output(0)).collect() };
        return;
    }
    let d = x.len() / rows;
    let (offsets, total) = split.offsets();
    let counts: Vec<usize> = (0..s.ranks.len()).map(|r| split.count(r) * d).collect();
    let part_refs: Vec<&B::Buf> = parts.iter().collect();
    let gathered = s.comm.all_gather(&s.ranks, &part_refs, &counts);
    // The batch's tokens in gathered (device) order, for hash-routed layers.
    let all_tokens: Vec<u32> = split.held.iter().flatten().map(|&g| tokens[g]).collect();
    let partials: Vec<B::Buf> = s
        .ranks
        .iter()
        .enumerate()
        .map(|(r, b)| {
            let mut p = b.output(total * d);
            let own = offsets[r]..offsets[r] + split.count(r);
            b.moe(&gathered[r], total, &all_tokens, &w[r], own, &mut p);
            p
        })
        .collect();
    let parts = s.comm.reduce_scatter(&s.ranks, &partials, &counts);
    *out = ShardBuf::Rows { len: rows * d, split, parts };
}
