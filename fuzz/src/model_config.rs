//! `config.json` in both forms DeepSeek-V4 checkpoints ship (Hugging Face and the
//! reference `inference/config.json`; `model-spec/src/config/`), and what every service
//! derives from an accepted config: the layer table and the KV layout in each dtype.
//!
//! Asserts: parsing never panics; a refusal names a field; an accepted config passes
//! its own validation, has one attention kind, ratio and MLP kind per layer, and yields
//! a KV layout in every entry dtype (f32, bf16, fp8) whose page, ring and state sizes
//! are computed without overflow.

use model_spec::config::{ConfigError, ModelConfig};
use model_spec::layout::EntryDtype;

pub fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    match ModelConfig::from_json_str(text) {
        Ok(cfg) => accepted(&cfg),
        Err(ConfigError::Missing { field } | ConfigError::Invalid { field, .. }) => assert!(!field.is_empty()),
        Err(ConfigError::Read { reason, .. }) => assert!(!reason.is_empty()),
    }
}

fn accepted(cfg: &ModelConfig) {
    cfg.validate().expect("an accepted config validates");
    assert_eq!(cfg.attn_kinds.len(), cfg.num_layers);
    assert_eq!(cfg.compress_ratios.len(), cfg.num_layers);
    assert_eq!(cfg.mlp_kinds.len(), cfg.num_layers);
    assert_eq!(cfg.layer_specs().len(), cfg.num_layers);
    for dtype in [EntryDtype::F32, EntryDtype::Bf16, EntryDtype::Fp8] {
        let layout = cfg.kv_layout(dtype);
        assert_eq!(layout.layers.len(), cfg.num_layers);
        let sizes = [layout.page_elems, layout.ring_elems, layout.comp_elems];
        assert!(sizes.iter().all(|&n| n.checked_mul(dtype.size().max(4)).is_some()), "KV sizes fit in memory sizes");
        let _ = (layout.page_bytes(), layout.state_bytes());
    }
}
