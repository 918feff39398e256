//! What the router knows about the served model: its name, vocabulary, context limit
//! and tokenizer. Read from the model directory; no weights are loaded.

use std::path::Path;

use model_spec::ModelConfig;
use model_spec::text::TextCodec;

pub struct ModelInfo {
    pub name: String,
    pub vocab: usize,
    pub max_position: usize,
    pub codec: Option<TextCodec>,
    /// Layers and window length: what restoring a cached prefix costs depends on them.
    pub layers: usize,
    pub window: usize,
}

impl ModelInfo {
    pub fn load(dir: &Path, name: String) -> Result<Self, String> {
        let cfg = ModelConfig::from_file(&dir.join("config.json")).map_err(|e| e.to_string())?;
        let codec = TextCodec::load(dir).map_err(|e| e.to_string())?;
        Ok(ModelInfo {
            name,
            vocab: cfg.vocab_size,
            max_position: cfg.max_position,
            codec,
            layers: cfg.num_layers,
            window: cfg.window,
        })
    }
}
