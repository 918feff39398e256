//! Tensor naming schemes. The engine asks for weights by their official DeepSeek names
//! (`layers.3.attn.wq_a.weight`). Other checkpoints use
//! - HF module names (`model.layers.3.self_attn.q_a_proj.weight`), with each layer's
//!   routed experts fused into `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`;
//! - what transformers 5's `save_pretrained` writes: its conversion mapping run
//!   backwards, i.e. official leaf names under a `model.` prefix, except that the
//!   attention's `kv_norm` comes out as `attn.norm` and the top-level tensors keep
//!   their HF names (`head.weight` aside).

use super::files::SafetensorsSet;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Naming {
    Official,
    Hf,
    TransformersSaved,
}

impl Naming {
    pub fn detect(set: &SafetensorsSet) -> Option<Naming> {
        if set.contains("embed.weight") {
            Some(Naming::Official)
        } else if set.contains("model.layers.0.hc_attn_fn") {
            Some(Naming::TransformersSaved)
        } else if set.contains("model.embed_tokens.weight") {
            Some(Naming::Hf)
        } else {
            None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Naming::Official => "official",
            Naming::Hf => "hf",
            Naming::TransformersSaved => "transformers-saved",
        }
    }

    /// Stored name of an official tensor name under this scheme (per-expert tensors
    /// of the HF scheme excepted: those are fused, see `Checkpoint::experts`).
    pub fn stored(self, official: &str) -> String {
        match self {
            Naming::Official => official.to_string(),
            Naming::Hf => hf_name(official).unwrap_or_else(|| official.to_string()),
            Naming::TransformersSaved => match official {
                "head.weight" => official.to_string(),
                _ if !official.starts_with("layers.") => hf_name(official).unwrap_or_else(|| official.to_string()),
                _ => format!("model.{}", official.replace(".attn.kv_norm.", ".attn.norm.")),
            },
        }
    }
}

const TOP: &[(&str, &str)] = &[
    ("embed.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("head.weight", "lm_head.weight"),
    ("hc_head_fn", "model.hc_head.hc_fn"),
    ("hc_head_base", "model.hc_head.hc_base"),
    ("hc_head_scale", "model.hc_head.hc_scale"),
];

/// Official leaf under `layers.L.` → HF leaf under `model.layers.L.`.
const LAYER: &[(&str, &str)] = &[
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("hc_attn_fn", "attn_hc.fn"),
    ("hc_attn_base", "attn_hc.base"),
    ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"),
    ("hc_ffn_base", "ffn_hc.base"),
    ("hc_ffn_scale", "ffn_hc.scale"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.wq_a.weight", "self_attn.q_a_proj.weight"),
    ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    ("attn.wq_b.weight", "self_attn.q_b_proj.weight"),
    ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    ("attn.kv_norm.weight", "self_attn.kv_norm.weight"),
    ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"),
    ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"),
    ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    ("attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    ("attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"),
    ("attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight"),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight"),
    ("ffn.gate.weight", "mlp.gate.weight"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
    ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
];

/// HF name of an official tensor name (top-level or per-layer; per-expert names have
/// no single HF tensor and return `None`).
pub fn hf_name(official: &str) -> Option<String> {
    if let Some(&(_, hf)) = TOP.iter().find(|(o, _)| *o == official) {
        return Some(hf.to_string());
    }
    let rest = official.strip_prefix("layers.")?;
    let (layer, leaf) = rest.split_once('.')?;
    let &(_, hf) = LAYER.iter().find(|(o, _)| *o == leaf)?;
    Some(format!("model.layers.{layer}.{hf}"))
}

/// Names under which a checkpoint may store the block scale of a quantised weight.
pub fn scale_names(weight: &str) -> Vec<String> {
    let mut v = Vec::with_capacity(3);
    if let Some(base) = weight.strip_suffix(".weight") {
        v.push(format!("{base}.scale"));
    }
    v.push(format!("{weight}_scale_inv"));
    v.push(format!("{weight}_scale"));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_official_names_to_hf() {
        assert_eq!(hf_name("embed.weight").unwrap(), "model.embed_tokens.weight");
        assert_eq!(hf_name("layers.12.attn.wq_a.weight").unwrap(), "model.layers.12.self_attn.q_a_proj.weight");
        assert_eq!(
            hf_name("layers.0.attn.indexer.compressor.ape").unwrap(),
            "model.layers.0.self_attn.compressor.indexer.position_bias"
        );
        assert_eq!(hf_name("layers.3.ffn.gate.bias").unwrap(), "model.layers.3.mlp.gate.e_score_correction_bias");
        assert!(hf_name("layers.3.ffn.experts.0.w1.weight").is_none());
        assert_eq!(scale_names("layers.1.attn.wkv.weight")[0], "layers.1.attn.wkv.scale");
        let saved = Naming::TransformersSaved;
        assert_eq!(saved.stored("layers.2.attn.kv_norm.weight"), "model.layers.2.attn.norm.weight");
        assert_eq!(saved.stored("layers.2.attn.compressor.norm.weight"), "model.layers.2.attn.compressor.norm.weight");
        assert_eq!(saved.stored("layers.0.ffn.experts.3.w2.weight"), "model.layers.0.ffn.experts.3.w2.weight");
        assert_eq!(saved.stored("head.weight"), "head.weight");
        assert_eq!(saved.stored("embed.weight"), "model.embed_tokens.weight");
    }
}
