//! What a sharded backend's buffers, weights and KV storage are: one part per device.

use std::sync::Arc;

use super::split::RowSplit;
use crate::EntryDtype;
use crate::backend::{Backend, Selection};

/// An activation buffer or a parameter vector.
pub enum ShardBuf<B: Backend> {
    /// Not written yet: the op that writes it first knows its rows and allocates the
    /// parts where they live.
    Pending { len: usize },
    /// A batch's rows, each on the device of its sequence (`split`); `len` values in all,
    /// the same number per row.
    Rows { len: usize, split: Arc<RowSplit>, parts: Vec<B::Buf> },
    /// The same values on every device (norm weights, sinks, compressor parameters).
    Replicated { len: usize, parts: Vec<B::Buf> },
}

impl<B: Backend> ShardBuf<B> {
    pub fn len(&self) -> usize {
        match self {
            ShardBuf::Pending { len } | ShardBuf::Rows { len, .. } | ShardBuf::Replicated { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The row split and parts of a batch buffer.
    pub(crate) fn rows(&self) -> (&Arc<RowSplit>, &[B::Buf]) {
        match self {
            ShardBuf::Rows { split, parts, .. } => (split, parts),
            ShardBuf::Pending { .. } => panic!("a sharded op read a buffer nothing has written"),
            ShardBuf::Replicated { .. } => panic!("a sharded op expected batch rows, got a parameter vector"),
        }
    }

    /// The row split read as `n` rows ([`RowSplit::regroup`]), and the parts.
    pub(crate) fn rows_at(&self, n: usize) -> (Arc<RowSplit>, &[B::Buf]) {
        let (split, parts) = self.rows();
        if split.rows() == n {
            return (split.clone(), parts);
        }
        (Arc::new(split.regroup(n).unwrap_or_else(|e| panic!("{e}"))), parts)
    }

    pub(crate) fn rows_mut(&mut self) -> (&Arc<RowSplit>, &mut [B::Buf]) {
        match self {
            ShardBuf::Rows { split, parts, .. } => (split, parts),
            ShardBuf::Pending { .. } => panic!("a sharded op updated a buffer nothing has written"),
            ShardBuf::Replicated { .. } => panic!("a sharded op expected batch rows, got a parameter vector"),
        }
    }

    /// Values per row of a batch buffer.
    pub(crate) fn width(&self) -> usize {
        let (split, _) = self.rows();
        self.len().checked_div(split.rows()).unwrap_or(0)
    }

    /// Device `r`'s copy of a parameter vector.
    pub(crate) fn on(&self, r: usize) -> &B::Buf {
        match self {
            ShardBuf::Replicated { parts, .. } => &parts[r],
            _ => panic!("a sharded op expected a parameter vector (uploaded), got batch rows"),
        }
    }
}

/// A weight matrix.
pub enum ShardWeight<B: Backend> {
    /// On every device (dense layers, routers, shared experts, embeddings, the head).
    Replicated(Vec<B::Weight>),
    /// On one device only (a routed expert under expert parallelism).
    Held { rank: usize, weight: B::Weight },
}

impl<B: Backend> ShardWeight<B> {
    /// Device `r`'s copy of a replicated weight.
    pub(crate) fn on(&self, r: usize) -> &B::Weight {
        match self {
            ShardWeight::Replicated(parts) => &parts[r],
            ShardWeight::Held { rank, .. } => {
                panic!("a routed expert (held by device {rank}) was used outside its MoE block")
            }
        }
    }

    pub(crate) fn any(&self) -> &B::Weight {
        match self {
            ShardWeight::Replicated(parts) => &parts[0],
            ShardWeight::Held { weight, .. } => weight,
        }
    }

    /// Every device's copy, in device order.
    pub(crate) fn into_replicas(self) -> Vec<B::Weight> {
        match self {
            ShardWeight::Replicated(parts) => parts,
            ShardWeight::Held { rank, .. } => {
                panic!("a weight held by device {rank} alone where every device needs it")
            }
        }
    }
}

/// KV storage split into equal contiguous parts, device `r` holding elements
/// `r * part_elems .. (r + 1) * part_elems` (whole pages or slots, see `split::Pools`).
pub struct ShardKv<B: Backend> {
    pub(crate) part_elems: usize,
    pub(crate) dtype: EntryDtype,
    pub(crate) parts: Vec<B::Kv>,
}

impl<B: Backend> ShardKv<B> {
    /// Pieces `(device, offset there, elements)` of `elems` elements from global `offset`.
    pub(crate) fn pieces(&self, offset: usize, elems: usize) -> Vec<(usize, usize, usize)> {
        let total = self.part_elems * self.parts.len();
        assert!(offset + elems <= total, "KV access past the end of the storage ({} + {elems} > {total})", offset);
        let mut out = Vec::new();
        let (mut at, end) = (offset, offset + elems);
        while at < end {
            let r = at / self.part_elems;
            let local = at - r * self.part_elems;
            let n = (self.part_elems - local).min(end - at);
            out.push((r, local, n));
            at += n;
        }
        out
    }
}

/// A CSA layer's selected entries: each device's selection for its rows.
pub struct ShardIdx<B: Backend> {
    pub(crate) split: Arc<RowSplit>,
    pub(crate) parts: Vec<Option<Selection<B>>>,
}
