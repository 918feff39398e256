//! The model: config, weights on a backend, RoPE tables and the KV layout they imply.

mod forward;
pub mod load_progress;
mod rebuild;
pub mod weights;

use kernels::{Backend, EntryDtype, KvLayout, RopeTable};

use crate::config::ModelConfig;
pub use forward::LaunchedReadout;
pub use weights::ModelWeights;

/// What a step reads out of one logit row: its greedy token and that token's
/// log-probability (what [`crate::sampling::Sampler`] gives a greedy sequence without
/// top logprobs), and the logits themselves when the caller asked for them.
#[derive(Clone, Debug, PartialEq)]
pub struct Readout {
    pub token: u32,
    pub logprob: f32,
    pub logits: Option<Vec<f32>>,
}

pub struct Model<B: Backend> {
    pub config: ModelConfig,
    pub weights: ModelWeights<B>,
    pub layout: KvLayout,
    pub backend: B,
    main_rope: RopeTable,
    compress_rope: RopeTable,
}

impl<B: Backend> Model<B> {
    pub fn new(config: ModelConfig, weights: ModelWeights<B>, backend: B, kv_dtype: EntryDtype) -> Self {
        Model {
            layout: config.kv_layout(kv_dtype),
            main_rope: main_rope(&config),
            compress_rope: compress_rope(&config),
            config,
            weights,
            backend,
        }
    }
}

/// RoPE table of window-only layers.
pub fn main_rope(c: &ModelConfig) -> RopeTable {
    RopeTable::plain(c.rope_theta, c.rope_head_dim)
}

/// RoPE table of compressor layers (queries, window KV, entries, indexer).
pub fn compress_rope(c: &ModelConfig) -> RopeTable {
    match c.yarn {
        Some(y) => RopeTable::yarn(c.compress_rope_theta, c.rope_head_dim, y, c.yarn_attention_factor),
        None => RopeTable::plain(c.compress_rope_theta, c.rope_head_dim),
    }
}
