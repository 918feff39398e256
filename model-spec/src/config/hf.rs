//! Hugging Face `config.json`, in the form DeepSeek ships it (legacy keys:
//! `compress_ratios` with the MTP entry, `num_hash_layers`, `qk_rope_head_dim`,
//! `rope_scaling`) and in the form transformers writes (`layer_types`,
//! `compress_rates`, `mlp_layer_types`, `partial_rotary_factor`, nested
//! `rope_parameters`).

use crate::Yarn;
use crate::layout::AttnKind;
use serde_json::Value;

use super::fields::Fields;
use super::{ConfigError, MlpKind, ModelConfig, StoredDtype, hash_prefix, invalid, split_ratios};

pub fn parse_hf(v: &Value) -> Result<ModelConfig, ConfigError> {
    let f = Fields::new(v)?;
    if let Some(mt) = f.opt_str("model_type")?
        && mt != "deepseek_v4"
    {
        return Err(invalid("model_type", format!("sluice serves deepseek_v4 models, got `{mt}`")));
    }
    if let Some(act) = f.opt_str("hidden_act")?
        && act != "silu"
    {
        return Err(invalid("hidden_act", format!("DeepSeek-V4 experts use silu, got `{act}`")));
    }
    if let Some(kv_heads) = f.opt_usize("num_key_value_heads")?
        && kv_heads != 1
    {
        return Err(invalid("num_key_value_heads", format!("V4 shares one KV head, got {kv_heads}")));
    }
    check_scoring(f.opt_str("scoring_func")?, "scoring_func")?;

    let num_layers = f.usize("num_hidden_layers")?;
    let head_dim = f.usize("head_dim")?;
    let rope_head_dim = match (f.opt_usize("qk_rope_head_dim")?, f.opt_f64("partial_rotary_factor")?) {
        (Some(r), _) => r,
        (None, Some(p)) => (head_dim as f64 * p).round() as usize,
        (None, None) => head_dim / 8,
    };

    let (compress_ratios, attn_kinds, mtp_from_ratios) = layer_table(&f, num_layers)?;
    let mlp_kinds = match f.opt_str_list("mlp_layer_types")? {
        Some(types) => types
            .iter()
            .take(num_layers)
            .enumerate()
            .map(|(l, t)| match t.as_str() {
                "hash_moe" => Ok(MlpKind::HashMoe),
                "moe" => Ok(MlpKind::TopKMoe),
                other => Err(invalid(&format!("mlp_layer_types[{l}]"), format!("`{other}` is not hash_moe or moe"))),
            })
            .collect::<Result<Vec<_>, _>>()?,
        None => hash_prefix(num_layers, f.opt_usize("num_hash_layers")?.unwrap_or(3)),
    };
    let mtp_layers = match (f.opt_usize("num_nextn_predict_layers")?, mtp_from_ratios) {
        (Some(n), Some(m)) if n != m => {
            return Err(invalid(
                "num_nextn_predict_layers",
                format!("is {n} but compress_ratios has {m} entries beyond num_hidden_layers"),
            ));
        }
        (Some(n), _) => n,
        (None, m) => m.unwrap_or(0),
    };

    let (rope_theta, compress_rope_theta, yarn, yarn_attention_factor) = rope(&f)?;
    let dense_dtype = match f.object("quantization_config")? {
        Some(q) if q.opt_str("quant_method")? == Some("fp8") => StoredDtype::Fp8,
        Some(q) => {
            return Err(invalid(
                "quantization_config.quant_method",
                format!("only fp8 block quantisation is supported, got {:?}", q.opt_str("quant_method")?),
            ));
        }
        None => {
            let name = f.opt_str("torch_dtype")?.or(f.opt_str("dtype")?).unwrap_or("bfloat16");
            StoredDtype::parse(name).ok_or_else(|| invalid("torch_dtype", format!("unknown dtype `{name}`")))?
        }
    };
    let expert_dtype = match f.opt_str("expert_dtype")? {
        Some(s) => StoredDtype::parse(s).ok_or_else(|| invalid("expert_dtype", format!("unknown dtype `{s}`")))?,
        None => dense_dtype,
    };

    let cfg = ModelConfig {
        vocab_size: f.usize("vocab_size")?,
        hidden_size: f.usize("hidden_size")?,
        num_layers,
        num_heads: f.usize("num_attention_heads")?,
        head_dim,
        rope_head_dim,
        q_lora_rank: f.usize("q_lora_rank")?,
        o_groups: f.usize("o_groups")?,
        o_lora_rank: f.usize("o_lora_rank")?,
        moe_intermediate_size: f.usize("moe_intermediate_size")?,
        n_routed_experts: f.usize("n_routed_experts")?,
        n_shared_experts: f.opt_usize("n_shared_experts")?.unwrap_or(1),
        experts_per_token: f.usize("num_experts_per_tok")?,
        route_scale: f.opt_f64("routed_scaling_factor")?.unwrap_or(1.0),
        swiglu_limit: f.opt_f64("swiglu_limit")?.unwrap_or(10.0),
        index_heads: f.opt_usize("index_n_heads")?.unwrap_or(0),
        index_head_dim: f.opt_usize("index_head_dim")?.unwrap_or(0),
        index_topk: f.opt_usize("index_topk")?.unwrap_or(0),
        window: f.opt_usize("sliding_window")?.unwrap_or(128),
        hc_mult: f.opt_usize("hc_mult")?.unwrap_or(4),
        hc_sinkhorn_iters: f.opt_usize("hc_sinkhorn_iters")?.unwrap_or(20),
        hc_eps: f.opt_f64("hc_eps")?.unwrap_or(1e-6),
        rms_norm_eps: f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
        rope_theta,
        compress_rope_theta,
        yarn,
        yarn_attention_factor,
        max_position: f.usize("max_position_embeddings")?,
        compress_ratios,
        attn_kinds,
        mlp_kinds,
        mtp_layers,
        dense_dtype,
        expert_dtype,
    };
    cfg.validate()?;
    Ok(cfg)
}

pub(crate) fn check_scoring(name: Option<&str>, field: &str) -> Result<(), ConfigError> {
    match name {
        None | Some("sqrtsoftplus") => Ok(()),
        Some(other) => Err(invalid(field, format!("V4 routers score with sqrtsoftplus; `{other}` is not supported"))),
    }
}

type LayerTable = (Vec<usize>, Vec<AttnKind>, Option<usize>);

fn layer_table(f: &Fields<'_>, num_layers: usize) -> Result<LayerTable, ConfigError> {
    if let Some(types) = f.opt_str_list("layer_types")? {
        let rates = f.object("compress_rates")?;
        let rate = |key: &str, legacy: &str, default: usize| -> Result<usize, ConfigError> {
            Ok(match &rates {
                Some(r) => r.opt_usize(key)?,
                None => None,
            }
            .or(f.opt_usize(legacy)?)
            .unwrap_or(default))
        };
        let csa = rate("compressed_sparse_attention", "compress_rate_csa", 4)?;
        let hca = rate("heavily_compressed_attention", "compress_rate_hca", 128)?;
        if types.len() < num_layers {
            return Err(invalid("layer_types", format!("has {} entries for {num_layers} layers", types.len())));
        }
        let mut ratios = Vec::with_capacity(num_layers);
        let mut kinds = Vec::with_capacity(num_layers);
        for (l, t) in types.iter().take(num_layers).enumerate() {
            let (kind, ratio) = match t.as_str() {
                "sliding_attention" => (AttnKind::Window, 0),
                "compressed_sparse_attention" => (AttnKind::Csa, csa),
                "heavily_compressed_attention" => (AttnKind::Hca, hca),
                other => return Err(invalid(&format!("layer_types[{l}]"), format!("unknown layer type `{other}`"))),
            };
            ratios.push(ratio);
            kinds.push(kind);
        }
        return Ok((ratios, kinds, None));
    }
    match f.opt_usize_list("compress_ratios")? {
        Some(r) => {
            let (ratios, kinds, mtp) = split_ratios(r, num_layers)?;
            Ok((ratios, kinds, Some(mtp)))
        }
        None => Err(ConfigError::Missing { field: "compress_ratios (or layer_types)".into() }),
    }
}

/// `(rope_theta, compress_rope_theta, yarn, attention_factor)` from `rope_scaling`
/// (legacy) or `rope_parameters` (flat, or nested as `main`/`compress`).
fn rope(f: &Fields<'_>) -> Result<(f64, f64, Option<Yarn>, f64), ConfigError> {
    let mut theta = f.opt_f64("rope_theta")?.unwrap_or(10000.0);
    let mut compress_theta = f.opt_f64("compress_rope_theta")?.unwrap_or(160000.0);
    let params = f.object("rope_parameters")?;
    let scaling = match (&params, f.object("rope_scaling")?) {
        (Some(p), legacy) => {
            if let Some(main) = p.object("main")? {
                theta = main.opt_f64("rope_theta")?.unwrap_or(theta);
                let compress = p
                    .object("compress")?
                    .ok_or_else(|| ConfigError::Missing { field: "rope_parameters.compress".into() })?;
                compress_theta = compress.opt_f64("rope_theta")?.unwrap_or(compress_theta);
                Some(compress)
            } else {
                legacy.or(params)
            }
        }
        (None, legacy) => legacy,
    };
    let Some(s) = scaling else { return Ok((theta, compress_theta, None, 1.0)) };
    let kind = s.opt_str("rope_type")?.or(s.opt_str("type")?).unwrap_or("default");
    match kind {
        "default" => Ok((theta, compress_theta, None, 1.0)),
        "yarn" => {
            let y = Yarn {
                factor: s.f64("factor")?,
                original_max_position: s.f64("original_max_position_embeddings")?,
                beta_fast: s.opt_f64("beta_fast")?.unwrap_or(32.0),
                beta_slow: s.opt_f64("beta_slow")?.unwrap_or(1.0),
            };
            // V4 applies no YaRN magnitude scaling unless a config says otherwise.
            Ok((theta, compress_theta, Some(y), s.opt_f64("attention_factor")?.unwrap_or(1.0)))
        }
        other => Err(invalid("rope_scaling.type", format!("only yarn scaling is supported, got `{other}`"))),
    }
}
