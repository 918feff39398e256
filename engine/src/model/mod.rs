//! The model: config, weights on a backend, RoPE tables and the KV layout they imply.

mod forward;
pub mod weights;

use std::path::Path;

use kernels::{Backend, EntryDtype, KvLayout, RopeTable};

use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::config::ModelConfig;
pub use weights::ModelWeights;

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
            main_rope: config.main_rope(),
            compress_rope: config.compress_rope(),
            config,
            weights,
            backend,
        }
    }

    /// Read `config.json` and the weights of a model directory.
    pub fn load(dir: &Path, backend: B, kv_dtype: EntryDtype) -> Result<Self, CheckpointError> {
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let ck = Checkpoint::open(dir)?;
        let weights = ModelWeights::load(&ck, &config, &backend)?;
        Ok(Model::new(config, weights, backend, kv_dtype))
    }
}
