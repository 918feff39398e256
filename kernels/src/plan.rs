//! What a batch looks like to the sequence-aware ops: which rows belong to which
//! sequence, where each sequence's state slot and pages are, and every row's position.
//!
//! One forward step may mix sequences at different lengths (batched decode) and
//! sequences contributing many rows (prefill chunks); rows of one sequence are
//! contiguous and in position order.

/// One sequence's share of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqSlice {
    /// First row of this sequence in the batch's activations.
    pub first_row: usize,
    /// Number of new tokens (rows) this step.
    pub rows: usize,
    /// Absolute position of the first new token (tokens already in the state).
    pub start_pos: usize,
    /// State-cache slot of the sequence.
    pub slot: usize,
    /// Page ids in block order; covers every block up to and including the one
    /// holding position `start_pos + rows - 1`.
    pub pages: Vec<u32>,
    /// Compressed entries whose window ends at or before this position are already in
    /// the pages (restored from a prefix cache): compressors keep their slots up to
    /// date but do not write those entries again. 0 for ordinary steps; a window
    /// rebuild that recomputes tokens inside a restored prefix sets it to the prefix
    /// length so that entries it could only compute from partial state never land.
    pub pages_final_until: usize,
}

impl SeqSlice {
    pub fn end_pos(&self) -> usize {
        self.start_pos + self.rows
    }

    pub fn row_range(&self) -> std::ops::Range<usize> {
        self.first_row..self.first_row + self.rows
    }
}

/// A whole batch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchPlan {
    pub seqs: Vec<SeqSlice>,
    /// Absolute position of every row.
    pub positions: Vec<u32>,
    /// Token id of every row (hash-routed MoE layers select experts by token).
    pub tokens: Vec<u32>,
}

impl BatchPlan {
    /// Build a plan from (slot, pages, start position, tokens) per sequence.
    pub fn new(parts: Vec<(usize, Vec<u32>, usize, &[u32])>) -> Self {
        let mut plan = BatchPlan::default();
        for (slot, pages, start_pos, tokens) in parts {
            let first_row = plan.tokens.len();
            plan.seqs.push(SeqSlice { first_row, rows: tokens.len(), start_pos, slot, pages, pages_final_until: 0 });
            plan.tokens.extend_from_slice(tokens);
            plan.positions.extend((start_pos..start_pos + tokens.len()).map(|p| p as u32));
        }
        plan
    }

    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    /// Index of the sequence that owns each row.
    pub fn row_owner(&self) -> Vec<usize> {
        let mut owner = vec![0; self.rows()];
        for (i, s) in self.seqs.iter().enumerate() {
            owner[s.row_range()].fill(i);
        }
        owner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_and_positions_follow_sequences() {
        let a = [5u32, 6, 7];
        let b = [9u32];
        let plan = BatchPlan::new(vec![(2, vec![0], 10, &a), (0, vec![1, 3], 200, &b)]);
        assert_eq!(plan.rows(), 4);
        assert_eq!(plan.positions, vec![10, 11, 12, 200]);
        assert_eq!(plan.tokens, vec![5, 6, 7, 9]);
        assert_eq!(plan.seqs[1].first_row, 3);
        assert_eq!(plan.row_owner(), vec![0, 0, 0, 1]);
        assert_eq!(plan.seqs[0].end_pos(), 13);
    }
}
