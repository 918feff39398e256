//! The reference implementation's `inference/config.json` (`dim`, `n_layers`,
//! `n_activated_experts`, `window_size`, `rope_factor`, …). Fields it leaves out take
//! the reference's defaults; the context limit is the YaRN-extended length
//! `original_seq_len · rope_factor`.

use crate::Yarn;
use serde_json::Value;

use super::fields::Fields;
use super::hf::check_scoring;
use super::{ConfigError, ModelConfig, StoredDtype, hash_prefix, invalid, split_ratios};

pub fn parse_reference(v: &Value) -> Result<ModelConfig, ConfigError> {
    let f = Fields::new(v)?;
    check_scoring(f.opt_str("score_func")?, "score_func")?;
    let num_layers = f.usize("n_layers")?;
    let ratios =
        f.opt_usize_list("compress_ratios")?.ok_or_else(|| ConfigError::Missing { field: "compress_ratios".into() })?;
    let (compress_ratios, attn_kinds, mtp_layers) = split_ratios(ratios, num_layers)?;

    let factor = f.opt_f64("rope_factor")?.unwrap_or(1.0);
    let original = f.opt_f64("original_seq_len")?;
    let yarn = match original {
        Some(orig) if factor > 1.0 => Some(Yarn {
            factor,
            original_max_position: orig,
            beta_fast: f.opt_f64("beta_fast")?.unwrap_or(32.0),
            beta_slow: f.opt_f64("beta_slow")?.unwrap_or(1.0),
        }),
        _ => None,
    };
    let max_position = match (f.opt_usize("max_seq_len")?, original) {
        (Some(m), _) => m,
        (None, Some(orig)) => (orig * factor) as usize,
        (None, None) => return Err(ConfigError::Missing { field: "max_seq_len (or original_seq_len)".into() }),
    };
    let dtype = |field: &str, default: StoredDtype| -> Result<StoredDtype, ConfigError> {
        match f.opt_str(field)? {
            Some(s) => StoredDtype::parse(s).ok_or_else(|| invalid(field, format!("unknown dtype `{s}`"))),
            None => Ok(default),
        }
    };
    let dense_dtype = dtype("dtype", StoredDtype::Bf16)?;
    let expert_dtype = dtype("expert_dtype", dense_dtype)?;

    let cfg = ModelConfig {
        vocab_size: f.usize("vocab_size")?,
        hidden_size: f.usize("dim")?,
        num_layers,
        num_heads: f.usize("n_heads")?,
        head_dim: f.usize("head_dim")?,
        rope_head_dim: f.usize("rope_head_dim")?,
        q_lora_rank: f.usize("q_lora_rank")?,
        o_groups: f.usize("o_groups")?,
        o_lora_rank: f.usize("o_lora_rank")?,
        moe_intermediate_size: f.usize("moe_inter_dim")?,
        n_routed_experts: f.usize("n_routed_experts")?,
        n_shared_experts: f.opt_usize("n_shared_experts")?.unwrap_or(1),
        experts_per_token: f.usize("n_activated_experts")?,
        route_scale: f.opt_f64("route_scale")?.unwrap_or(1.0),
        swiglu_limit: f.opt_f64("swiglu_limit")?.unwrap_or(10.0),
        index_heads: f.opt_usize("index_n_heads")?.unwrap_or(0),
        index_head_dim: f.opt_usize("index_head_dim")?.unwrap_or(0),
        index_topk: f.opt_usize("index_topk")?.unwrap_or(0),
        window: f.opt_usize("window_size")?.unwrap_or(128),
        hc_mult: f.opt_usize("hc_mult")?.unwrap_or(4),
        hc_sinkhorn_iters: f.opt_usize("hc_sinkhorn_iters")?.unwrap_or(20),
        hc_eps: f.opt_f64("hc_eps")?.unwrap_or(1e-6),
        rms_norm_eps: f.opt_f64("norm_eps")?.unwrap_or(1e-6),
        rope_theta: f.opt_f64("rope_theta")?.unwrap_or(10000.0),
        compress_rope_theta: f.opt_f64("compress_rope_theta")?.unwrap_or(160000.0),
        yarn,
        yarn_attention_factor: 1.0,
        max_position,
        compress_ratios,
        attn_kinds,
        mlp_kinds: hash_prefix(num_layers, f.opt_usize("n_hash_layers")?.unwrap_or(0)),
        mtp_layers,
        dense_dtype,
        expert_dtype,
    };
    cfg.validate()?;
    Ok(cfg)
}
