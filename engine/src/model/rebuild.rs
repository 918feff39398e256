//! Rebuilding the sliding-window state of a restored prefix from its compressed
//! entries alone (the `zero` SWA policy, DESIGN §6).
//!
//! After a prefix of `p` tokens is restored from cached pages, every layer still needs
//! its window ring (the KV of the last `window` positions) and the CSA compressors
//! their slots. Layer `l`'s ring entries are a function of its inputs at those
//! positions; those inputs are layer `l-1`'s outputs, whose attention reads layer
//! `l-1`'s window one `window` further back, and so on. So layer `l` needs its inputs
//! for the last `window · (layers - l)` positions, and everything older comes from the
//! cached compressed entries, which attention and the indexer read as usual.
//!
//! The pass embeds the first needed position onward, runs each layer over the rows it
//! needs, and drops the oldest `window` rows before the next layer. Rows whose window
//! reaches before the rows of their layer attend to stale ring slots: their outputs
//! are wrong, but they are exactly the rows dropped before any later layer reads them.
//! Compressors refill their slots but never write entries (the plan's
//! `pages_final_until` is `p`): every entry inside the prefix is already cached, and
//! the first ones a pass could compute would lack the window before it.

use kernels::{Backend, BatchPlan, KvState, SeqSlice};

use super::Model;
use super::forward::Streams;

impl<B: Backend> Model<B> {
    /// Rebuild the window rings and compressor slots of the sequence in `slot` after
    /// its first `prefix.len()` tokens (a multiple of the block) were restored into
    /// `pages`. Returns the token-layers computed.
    pub fn rebuild_window(&self, kv: &mut KvState<B>, slot: usize, pages: &[u32], prefix: &[u32]) -> usize {
        let b = &self.backend;
        let c = &self.config;
        let (d, hc) = (c.hidden_size, c.hc_mult);
        let p = prefix.len();
        let layers = self.weights.layers.len();
        let window = self.layout.window;
        let first = |l: usize| p.saturating_sub(window * (layers - l));
        if p == 0 {
            return 0;
        }

        let plan_from = |from: usize| BatchPlan {
            seqs: vec![SeqSlice {
                first_row: 0,
                rows: p - from,
                start_pos: from,
                slot,
                pages: pages.to_vec(),
                pages_final_until: p,
            }],
            positions: (from..p).map(|t| t as u32).collect(),
            tokens: prefix[from..].to_vec(),
        };
        let start = first(0);
        let mut x = b.output((p - start) * d);
        b.embed(&self.weights.embed, &plan_from(start), &mut x);
        // Every residual stream starts as the embedding.
        let mut streams = Streams::Copies(x);

        let mut work = 0;
        for (l, lw) in self.weights.layers.iter().enumerate() {
            let from = first(l);
            let rows = p - from;
            let plan = plan_from(from);
            let mut made = self.layer(l, lw, streams, kv, &plan);
            work += rows;
            if l + 1 < layers {
                let drop = first(l + 1) - from;
                if drop > 0 {
                    let keep: Vec<usize> = (drop..rows).collect();
                    made = b.gather_rows(&made, hc * d, &keep);
                }
            }
            streams = Streams::Made(made);
        }
        work
    }
}
