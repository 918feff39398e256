//! Row-wise ops of the sharded backend: each device runs the op on the rows it holds.

use std::sync::Arc;

use super::Sharded;
use super::buf::{ShardBuf, ShardIdx, ShardWeight};
use super::split::RowSplit;
use crate::backend::{Backend, HeadNormJob, HeadNormShared};
use crate::plan::BatchPlan;

/// Make `out` a batch buffer with `split`'s rows (`out.len()` values over
/// `split.rows()` rows): allocated on each device unless it already is.
pub(super) fn prepare<B: Backend>(s: &Sharded<B>, out: &mut ShardBuf<B>, split: &Arc<RowSplit>) {
    if let ShardBuf::Rows { split: have, .. } = out
        && (Arc::ptr_eq(have, split) || **have == **split)
    {
        return;
    }
    let len = out.len();
    let rows = split.rows();
    assert!(rows == 0 && len == 0 || rows > 0 && len.is_multiple_of(rows), "{len} values over {rows} rows");
    let width = len.checked_div(rows).unwrap_or(0);
    let parts = s.ranks.iter().enumerate().map(|(r, b)| b.output(split.count(r) * width)).collect();
    *out = ShardBuf::Rows { len, split: split.clone(), parts };
}

/// `f(rank, device, x part, rows there, out part)` on every device holding rows of `x`;
/// `out` gets `x`'s rows.
pub(super) fn each_rows<B: Backend>(
    s: &Sharded<B>,
    x: &ShardBuf<B>,
    rows: usize,
    out: &mut ShardBuf<B>,
    mut f: impl FnMut(usize, &B, &B::Buf, usize, &mut B::Buf),
) {
    let (split, parts) = x.rows_at(rows);
    prepare(s, out, &split);
    let (_, outs) = out.rows_mut();
    for (r, (b, (xr, o))) in s.ranks.iter().zip(parts.iter().zip(outs.iter_mut())).enumerate() {
        let n = split.count(r);
        if n > 0 {
            f(r, b, xr, n, o);
        }
    }
}

/// [`each_rows`] with several outputs, each getting `x`'s rows: `f(rank, device, x part,
/// rows there, the outputs' parts)`.
pub(super) fn each_rows_many<B: Backend>(
    s: &Sharded<B>,
    x: &ShardBuf<B>,
    rows: usize,
    outs: &mut [&mut ShardBuf<B>],
    mut f: impl FnMut(usize, &B, &B::Buf, usize, &mut [&mut B::Buf]),
) {
    let (split, parts) = x.rows_at(rows);
    for out in outs.iter_mut() {
        prepare(s, out, &split);
    }
    let mut per_rank: Vec<Vec<&mut B::Buf>> = s.ranks.iter().map(|_| Vec::with_capacity(outs.len())).collect();
    for out in outs.iter_mut() {
        for (r, part) in out.rows_mut().1.iter_mut().enumerate() {
            per_rank[r].push(part);
        }
    }
    for (r, (b, (xr, os))) in s.ranks.iter().zip(parts.iter().zip(per_rank.iter_mut())).enumerate() {
        let n = split.count(r);
        if n > 0 {
            f(r, b, xr, n, os);
        }
    }
}

/// `f(rank, device, part)` on every device holding rows of `x`.
pub(super) fn each_in_place<B: Backend>(
    s: &Sharded<B>,
    x: &mut ShardBuf<B>,
    mut f: impl FnMut(usize, &B, &mut B::Buf),
) {
    let (split, parts) = x.rows_mut();
    let split = split.clone();
    for (r, (b, part)) in s.ranks.iter().zip(parts.iter_mut()).enumerate() {
        if split.count(r) > 0 {
            f(r, b, part);
        }
    }
}

pub(super) fn embed<B: Backend>(s: &Sharded<B>, table: &ShardWeight<B>, plan: &BatchPlan, out: &mut ShardBuf<B>) {
    let step = s.split(plan);
    let split = step.rows.clone();
    prepare(s, out, &split);
    let (_, outs) = out.rows_mut();
    for (r, (b, o)) in s.ranks.iter().zip(outs.iter_mut()).enumerate() {
        if split.count(r) > 0 {
            b.embed(table.on(r), &step.plans[r], o);
        }
    }
}

pub(super) fn gather_rows<B: Backend>(s: &Sharded<B>, src: &ShardBuf<B>, width: usize, rows: &[usize]) -> ShardBuf<B> {
    let (split, parts) = src.rows_at(src.len().checked_div(width).unwrap_or(0));
    let (picked, local) = split.pick(rows);
    let parts = s
        .ranks
        .iter()
        .zip(parts)
        .zip(&local)
        .map(|((b, part), idx)| if idx.is_empty() { b.output(0) } else { b.gather_rows(part, width, idx) })
        .collect();
    ShardBuf::Rows { len: rows.len() * width, split: Arc::new(picked), parts }
}

/// A buffer of rows read back a row a part (a decode step's logits) straight from each
/// rank's rows, no whole-batch host buffer; other splits download the whole buffer.
pub(super) fn download_parts<B: Backend>(s: &Sharded<B>, buf: &ShardBuf<B>, lens: &[usize]) -> Vec<Vec<f32>> {
    if let ShardBuf::Rows { split, parts, .. } = buf {
        let width = buf.width();
        if lens.len() == split.rows() && lens.iter().all(|&n| n == width) {
            let mut out: Vec<Vec<f32>> = vec![Vec::new(); lens.len()];
            for (r, (b, part)) in s.ranks.iter().zip(parts).enumerate() {
                if split.count(r) == 0 {
                    continue;
                }
                let rows = b.download_parts(part, &vec![width; split.count(r)]);
                for (&g, row) in split.held[r].iter().zip(rows) {
                    out[g] = row;
                }
            }
            return out;
        }
    }
    crate::backend::split_parts(&download(s, buf), lens)
}

/// Greedy read-out of a buffer of rows (a step's logits): each rank picks its own rows
/// (on its device), so no logits cross to the host; other splits are downloaded.
pub(super) fn greedy_rows<B: Backend>(s: &Sharded<B>, buf: &ShardBuf<B>, rows: usize, vocab: usize) -> Vec<(u32, f32)> {
    match buf {
        ShardBuf::Rows { split, parts, .. } if split.rows() == rows => {
            let mut out = vec![(0, 0f32); rows];
            for (r, (b, part)) in s.ranks.iter().zip(parts).enumerate() {
                if split.count(r) == 0 {
                    continue;
                }
                for (&g, pick) in split.held[r].iter().zip(b.greedy_rows(part, split.count(r), vocab)) {
                    out[g] = pick;
                }
            }
            out
        }
        ShardBuf::Replicated { parts, .. } => s.ranks[0].greedy_rows(&parts[0], rows, vocab),
        _ => download(s, buf).chunks(vocab.max(1)).map(crate::backend::greedy_pick).collect(),
    }
}

pub(super) fn download<B: Backend>(s: &Sharded<B>, buf: &ShardBuf<B>) -> Vec<f32> {
    match buf {
        ShardBuf::Replicated { parts, .. } => s.ranks[0].download(&parts[0]),
        ShardBuf::Pending { .. } => panic!("download of a buffer nothing has written"),
        ShardBuf::Rows { len, split, parts } => {
            let width = buf.width();
            let mut out = vec![0f32; *len];
            for (r, (b, part)) in s.ranks.iter().zip(parts).enumerate() {
                if split.count(r) == 0 {
                    continue;
                }
                let v = b.download(part);
                for (i, &g) in split.held[r].iter().enumerate() {
                    out[g * width..(g + 1) * width].copy_from_slice(&v[i * width..(i + 1) * width]);
                }
            }
            out
        }
    }
}

pub(super) fn buf_write<B: Backend>(s: &Sharded<B>, buf: &mut ShardBuf<B>, offset: usize, data: &[f32]) {
    match buf {
        ShardBuf::Replicated { parts, .. } => {
            s.ranks.iter().zip(parts.iter_mut()).for_each(|(b, p)| b.buf_write(p, offset, data))
        }
        ShardBuf::Pending { .. } => panic!("buf_write into a buffer with no rows yet"),
        ShardBuf::Rows { .. } => {
            let width = buf.width();
            let (split, parts) = buf.rows_mut();
            let split = split.clone();
            // Row by row, each piece to the device holding that row.
            let mut at = offset;
            let end = offset + data.len();
            while at < end {
                let (row, col) = (at / width, at % width);
                let n = (width - col).min(end - at);
                let (r, i) = split.owner[row];
                s.ranks[r].buf_write(&mut parts[r], i * width + col, &data[at - offset..at - offset + n]);
                at += n;
            }
        }
    }
}

pub(super) fn idx_download<B: Backend>(s: &Sharded<B>, idx: &ShardIdx<B>) -> Vec<i32> {
    let split = &idx.split;
    let k = idx.parts.iter().flatten().map(|p| p.top_k).next().unwrap_or(0);
    let mut out = vec![-1i32; split.rows() * k];
    for (r, (b, part)) in s.ranks.iter().zip(&idx.parts).enumerate() {
        let Some(sel) = part else { continue };
        let v = b.idx_download(&sel.indices);
        for (i, &g) in split.held[r].iter().enumerate() {
            out[g * k..(g + 1) * k].copy_from_slice(&v[i * k..(i + 1) * k]);
        }
    }
    out
}

/// Each device's rows through its own `hc_post_pre` (the rows stay where they are).
#[allow(clippy::too_many_arguments)]
pub(super) fn hc_post_pre<B: Backend>(
    s: &Sharded<B>,
    streams: &mut ShardBuf<B>,
    rows: usize,
    hc: usize,
    out: &ShardBuf<B>,
    w: &[B::Hc],
    norm: Option<(&ShardBuf<B>, f32)>,
    collapsed: &mut ShardBuf<B>,
    post: &mut ShardBuf<B>,
    comb: &mut ShardBuf<B>,
) {
    let (split, o) = out.rows_at(rows);
    prepare(s, collapsed, &split);
    let (c, p, m) = (collapsed.rows_mut().1, post.rows_mut().1, comb.rows_mut().1);
    let st = streams.rows_mut().1;
    for (r, b) in s.ranks.iter().enumerate() {
        let n = split.count(r);
        if n > 0 {
            let nw = norm.map(|(nw, eps)| (nw.on(r), eps));
            b.hc_post_pre(&mut st[r], n, hc, &o[r], &w[r], nw, &mut c[r], &mut p[r], &mut m[r]);
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn hc_pre<B: Backend>(
    s: &Sharded<B>,
    streams: &ShardBuf<B>,
    rows: usize,
    w: &[B::Hc],
    norm: Option<(&ShardBuf<B>, f32)>,
    collapsed: &mut ShardBuf<B>,
    post: &mut ShardBuf<B>,
    comb: &mut ShardBuf<B>,
) {
    let (split, parts) = streams.rows_at(rows);
    for out in [&mut *collapsed, &mut *post, &mut *comb] {
        prepare(s, out, &split);
    }
    let (c, p, m) = (collapsed.rows_mut().1, post.rows_mut().1, comb.rows_mut().1);
    for (r, b) in s.ranks.iter().enumerate() {
        let n = split.count(r);
        if n > 0 {
            b.hc_pre(&parts[r], n, &w[r], norm.map(|(nw, eps)| (nw.on(r), eps)), &mut c[r], &mut p[r], &mut m[r]);
        }
    }
}

/// [`Backend::head_norm_rope2`](crate::backend::Backend::head_norm_rope2) on every
/// device holding rows: both tensors' parts there in one call, so a device that fuses
/// the two (CUDA) does here too.
pub(super) fn head_norm_rope2<B: Backend>(
    s: &Sharded<B>,
    first: &mut HeadNormJob<'_, Sharded<B>>,
    second: &mut HeadNormJob<'_, Sharded<B>>,
    shared: &HeadNormShared<'_>,
) {
    let rows = shared.positions.len();
    let split = first.x.rows_at(rows).0;
    assert_eq!(split.held, second.x.rows_at(rows).0.held, "head_norm_rope2 of tensors split differently");
    let (_, xs) = first.x.rows_mut();
    let (_, ys) = second.x.rows_mut();
    for (r, (b, (x, y))) in s.ranks.iter().zip(xs.iter_mut().zip(ys.iter_mut())).enumerate() {
        if split.held[r].is_empty() {
            continue;
        }
        let positions: Vec<u32> = split.held[r].iter().map(|&g| shared.positions[g]).collect();
        let here = HeadNormShared { positions: &positions, ..*shared };
        let mut a = HeadNormJob { x, heads: first.heads, weight: first.weight.map(|w| w.on(r)), round: first.round };
        let mut c =
            HeadNormJob { x: y, heads: second.heads, weight: second.weight.map(|w| w.on(r)), round: second.round };
        b.head_norm_rope2(&mut a, &mut c, &here);
    }
}
