//! Built-in model shapes for `sluice model init`. All keep V4's structure (all three
//! attention kinds or CSA/HCA interleave, hash and top-k MoE layers, 128-token window,
//! YaRN on compressor layers, 4 residual streams): `tiny` and `small` at sizes a CPU
//! runs comfortably, `flash-bench` with V4-Flash's attention at full size for the GPU
//! benchmark, and `flash` / `pro`: the released V4-Flash and V4-Pro configs
//! (`configs/`, as DeepSeek publishes them), optionally truncated to their first layers.

use serde_json::{Value, json};

const FLASH_CONFIG: &str = include_str!("configs/deepseek-v4-flash.json");
const PRO_CONFIG: &str = include_str!("configs/deepseek-v4-pro.json");

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// A few hundred thousand parameters: tests and quick demos.
    Tiny,
    /// ~70M parameters: the local cluster's default model and the CPU benchmark.
    Small,
    /// V4-Flash attention dimensions (hidden 4096, 64 heads x 512, q_lora 1024, indexer
    /// 64 x 128, top-k 512, window 128, CSA/HCA interleave) in 4 layers with a small MoE
    /// (8 experts of 1024, top-2, one shared) and a 32K vocabulary: ~1.2G parameters,
    /// the GPU benchmark's checkpoint (`sluice bench engine --device cuda:0`).
    FlashBench,
    /// DeepSeek-V4-Flash as released: 43 layers, 256 routed experts of 2048 (FP4), ~155 GB.
    Flash,
    /// DeepSeek-V4-Pro as released: 61 layers, 384 routed experts of 3072 (FP4), ~875 GB.
    Pro,
}

impl Preset {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "tiny" => Some(Preset::Tiny),
            "small" => Some(Preset::Small),
            "flash-bench" => Some(Preset::FlashBench),
            "flash" => Some(Preset::Flash),
            "pro" => Some(Preset::Pro),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Small => "small",
            Preset::FlashBench => "flash-bench",
            Preset::Flash => "flash",
            Preset::Pro => "pro",
        }
    }

    /// Whether this is a released model's config (written sharded, in the shipped
    /// formats, streamed), as opposed to a small test shape.
    pub fn is_full_size(self) -> bool {
        matches!(self, Preset::Flash | Preset::Pro)
    }

    /// `config.json` of a full-size preset, truncated to its first `layers` layers when
    /// given. What truncation keeps: every width, the first `layers` entries of
    /// `compress_ratios` (plus the MTP entry, the list's last), and at most `layers - 1`
    /// hash-routed layers, so at least one layer routes by top-k. With 4 or more layers
    /// of Flash (`[0, 0, 4, 128, …]`, 3 hash layers) every attention kind (window, CSA,
    /// HCA) and both MoE kinds are present; Pro's pattern (`[128, 128, 4, 128, …]`) has
    /// no window-only layer at any depth.
    pub fn full_config(self, layers: Option<usize>) -> Result<Value, String> {
        let text = match self {
            Preset::Flash => FLASH_CONFIG,
            Preset::Pro => PRO_CONFIG,
            other => return Err(format!("preset {} is not a released model config", other.name())),
        };
        let mut v: Value = serde_json::from_str(text).expect("embedded config is JSON");
        let Some(n) = layers else { return Ok(v) };
        let m = v.as_object_mut().expect("object");
        let total = m["num_hidden_layers"].as_u64().expect("num_hidden_layers") as usize;
        if n == 0 || n > total {
            return Err(format!("--layers {n}: {} has {total} layers; choose 1 to {total}", self.name()));
        }
        let ratios: Vec<Value> = m["compress_ratios"].as_array().expect("compress_ratios").clone();
        let mut kept: Vec<Value> = ratios[..n].to_vec();
        kept.push(ratios.last().expect("MTP entry").clone());
        let hash = m["num_hash_layers"].as_u64().expect("num_hash_layers") as usize;
        m.insert("num_hidden_layers".into(), json!(n));
        m.insert("compress_ratios".into(), Value::Array(kept));
        m.insert("num_hash_layers".into(), json!(hash.min(n.saturating_sub(1))));
        Ok(v)
    }

    /// `config.json` in the form DeepSeek ships (legacy HF keys, MTP entry included).
    pub fn config_json(self) -> Value {
        if self.is_full_size() {
            return self.full_config(None).expect("full-size preset");
        }
        let (shape, ratios, hash_layers, max_pos) = match self {
            Preset::Tiny => (
                json!({
                    "vocab_size": 320, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
                    "num_attention_heads": 4, "head_dim": 32, "qk_rope_head_dim": 16, "q_lora_rank": 32,
                    "o_groups": 2, "o_lora_rank": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
                    "index_n_heads": 8, "index_head_dim": 32, "index_topk": 8
                }),
                vec![0, 4, 128, 4, 0],
                1,
                4096,
            ),
            Preset::Small => (
                json!({
                    "vocab_size": 8192, "hidden_size": 512, "moe_intermediate_size": 256, "num_hidden_layers": 8,
                    "num_attention_heads": 8, "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 256,
                    "o_groups": 4, "o_lora_rank": 128, "n_routed_experts": 16, "num_experts_per_tok": 4,
                    "index_n_heads": 8, "index_head_dim": 64, "index_topk": 64
                }),
                vec![0, 4, 128, 4, 128, 4, 128, 4, 0],
                2,
                32768,
            ),
            Preset::FlashBench => (
                json!({
                    "vocab_size": 32768, "hidden_size": 4096, "moe_intermediate_size": 1024, "num_hidden_layers": 4,
                    "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024,
                    "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 8, "num_experts_per_tok": 2,
                    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512
                }),
                vec![4, 128, 4, 128, 0],
                1,
                1048576,
            ),
            Preset::Flash | Preset::Pro => unreachable!("handled above"),
        };
        let mut v = shape;
        let m = v.as_object_mut().expect("object");
        for (k, val) in [
            ("architectures", json!(["DeepseekV4ForCausalLM"])),
            ("model_type", json!("deepseek_v4")),
            ("num_key_value_heads", json!(1)),
            ("n_shared_experts", json!(1)),
            ("norm_topk_prob", json!(true)),
            ("routed_scaling_factor", json!(1.5)),
            ("scoring_func", json!("sqrtsoftplus")),
            ("topk_method", json!("noaux_tc")),
            ("swiglu_limit", json!(10.0)),
            ("hc_mult", json!(4)),
            ("hc_sinkhorn_iters", json!(20)),
            ("hc_eps", json!(1e-6)),
            ("rms_norm_eps", json!(1e-6)),
            ("sliding_window", json!(128)),
            ("max_position_embeddings", json!(max_pos)),
            ("rope_theta", json!(10000)),
            ("compress_rope_theta", json!(160000)),
            (
                "rope_scaling",
                json!({"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                       "beta_fast": 32, "beta_slow": 1}),
            ),
            ("compress_ratios", json!(ratios)),
            ("num_hash_layers", json!(hash_layers)),
            ("num_nextn_predict_layers", json!(1)),
            ("hidden_act", json!("silu")),
            ("tie_word_embeddings", json!(false)),
            ("bos_token_id", json!(0)),
            ("eos_token_id", json!(1)),
        ] {
            m.insert(k.to_string(), val);
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{MlpKind, parse_hf};
    use kernels::AttnKind;

    #[test]
    fn released_configs_parse_with_their_published_sizes() {
        let flash = parse_hf(&Preset::Flash.config_json()).unwrap();
        assert_eq!((flash.num_layers, flash.hidden_size, flash.n_routed_experts), (43, 4096, 256));
        let pro = parse_hf(&Preset::Pro.config_json()).unwrap();
        assert_eq!((pro.num_layers, pro.hidden_size, pro.n_routed_experts), (61, 7168, 384));
    }

    #[test]
    fn four_flash_layers_hold_every_attention_kind_and_both_moe_kinds() {
        let cfg = parse_hf(&Preset::Flash.full_config(Some(4)).unwrap()).unwrap();
        assert_eq!(cfg.num_layers, 4);
        assert_eq!(cfg.hidden_size, 4096, "widths stay real");
        for kind in [AttnKind::Window, AttnKind::Csa, AttnKind::Hca] {
            assert!(cfg.attn_kinds.contains(&kind), "{kind:?} missing from {:?}", cfg.attn_kinds);
        }
        assert!(cfg.mlp_kinds.contains(&MlpKind::HashMoe) && cfg.mlp_kinds.contains(&MlpKind::TopKMoe));
        // Two layers: both window-only (Flash's first two), one hash and one top-k layer.
        let two = parse_hf(&Preset::Flash.full_config(Some(2)).unwrap()).unwrap();
        assert_eq!(two.mlp_kinds, vec![MlpKind::HashMoe, MlpKind::TopKMoe]);
    }

    #[test]
    fn truncation_refuses_impossible_layer_counts() {
        assert!(Preset::Flash.full_config(Some(0)).unwrap_err().contains("choose 1 to 43"));
        assert!(Preset::Pro.full_config(Some(62)).unwrap_err().contains("choose 1 to 61"));
        assert!(Preset::Small.full_config(Some(2)).is_err());
    }
}
