//! The model description every other part of sluice works from, parsed from either
//! config form DeepSeek-V4 checkpoints ship: Hugging Face `config.json` (legacy keys
//! such as `compress_ratios` or the newer `layer_types`/`rope_parameters`) and the
//! reference `inference/config.json`. Both describe the same architecture; both parse
//! into one validated [`ModelConfig`]. Errors name the offending field.

mod fields;
mod hf;
mod reference;

use std::path::Path;

use thiserror::Error;

use crate::Yarn;
use crate::layout::{AttnKind, EntryDtype, KvLayout, LayerSpec};

pub use hf::parse_hf;
pub use reference::parse_reference;

/// Raw tokens per page: lcm of V4's compression ratios (4 and 128).
pub const BLOCK_TOKENS: usize = 128;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum ConfigError {
    #[error("config field `{field}` is missing")]
    Missing { field: String },
    #[error("config field `{field}` is invalid: {reason}")]
    Invalid { field: String, reason: String },
    #[error("cannot read config {path}: {reason}")]
    Read { path: String, reason: String },
}

pub(crate) fn invalid(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: field.to_string(), reason: reason.into() }
}

/// How weights are stored in the checkpoint (informational; the loader decodes by
/// each tensor's own dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredDtype {
    F32,
    Bf16,
    Fp8,
    Fp4,
}

impl StoredDtype {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "float32" | "f32" | "fp32" => Some(StoredDtype::F32),
            "bfloat16" | "bf16" => Some(StoredDtype::Bf16),
            "fp8" | "float8_e4m3fn" | "e4m3" => Some(StoredDtype::Fp8),
            "fp4" | "e2m1" => Some(StoredDtype::Fp4),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            StoredDtype::F32 => "f32",
            StoredDtype::Bf16 => "bf16",
            StoredDtype::Fp8 => "fp8-e4m3",
            StoredDtype::Fp4 => "fp4-e2m1",
        }
    }
}

/// Which router a MoE layer uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpKind {
    /// Experts fixed per token id (`tid2eid`).
    HashMoe,
    /// Top-k of biased router scores.
    TopKMoe,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    pub rope_head_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub moe_intermediate_size: usize,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub experts_per_token: usize,
    pub route_scale: f64,
    pub swiglu_limit: f64,
    pub index_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    /// Sliding window: the current token and `window - 1` before it.
    pub window: usize,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f64,
    pub rms_norm_eps: f64,
    /// RoPE base of window-only layers.
    pub rope_theta: f64,
    /// RoPE base of layers with a compressor (and their compressors and indexers).
    pub compress_rope_theta: f64,
    /// YaRN scaling applied to compressor layers' RoPE.
    pub yarn: Option<Yarn>,
    pub yarn_attention_factor: f64,
    /// Longest context the model supports.
    pub max_position: usize,
    /// Compression ratio per layer: 0 (window only), 4 (CSA) or 128 (HCA).
    pub compress_ratios: Vec<usize>,
    pub attn_kinds: Vec<AttnKind>,
    pub mlp_kinds: Vec<MlpKind>,
    /// Multi-token-prediction blocks in the checkpoint (not used for decoding yet).
    pub mtp_layers: usize,
    pub dense_dtype: StoredDtype,
    pub expert_dtype: StoredDtype,
}

impl ModelConfig {
    /// Parse a config file, detecting its form: the reference form uses `dim` and
    /// `n_layers`, the HF form `hidden_size` and `num_hidden_layers`.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Read { path: path.display().to_string(), reason: e.to_string() })?;
        Self::from_json_str(&text).map_err(|e| match e {
            ConfigError::Read { reason, .. } => ConfigError::Read { path: path.display().to_string(), reason },
            other => other,
        })
    }

    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| ConfigError::Read { path: "<json>".into(), reason: e.to_string() })?;
        if v.get("dim").is_some() && v.get("hidden_size").is_none() { parse_reference(&v) } else { parse_hf(&v) }
    }

    /// Index heads scale `weights_proj` by `heads^-½ · index_head_dim^-½`.
    pub fn index_weight_scale(&self) -> f32 {
        ((self.index_heads as f64).powf(-0.5) * (self.index_head_dim as f64).powf(-0.5)) as f32
    }

    pub fn attention_scale(&self) -> f32 {
        (self.head_dim as f64).powf(-0.5) as f32
    }

    /// Number of layers of each attention kind.
    pub fn count(&self, kind: AttnKind) -> usize {
        self.attn_kinds.iter().filter(|&&k| k == kind).count()
    }

    pub fn layer_specs(&self) -> Vec<LayerSpec> {
        self.attn_kinds
            .iter()
            .zip(&self.compress_ratios)
            .map(|(&kind, &ratio)| LayerSpec {
                kind,
                ratio,
                head_dim: self.head_dim,
                index_dim: if kind == AttnKind::Csa { self.index_head_dim } else { 0 },
                rope_dim: self.rope_head_dim,
            })
            .collect()
    }

    pub fn kv_layout(&self, dtype: EntryDtype) -> KvLayout {
        KvLayout::new(BLOCK_TOKENS, self.window, dtype, &self.layer_specs())
    }

    /// Check every relation the forward pass relies on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("head_dim", self.head_dim),
            ("q_lora_rank", self.q_lora_rank),
            ("o_groups", self.o_groups),
            ("o_lora_rank", self.o_lora_rank),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("n_routed_experts", self.n_routed_experts),
            ("num_experts_per_tok", self.experts_per_token),
            ("sliding_window", self.window),
            ("hc_mult", self.hc_mult),
            ("hc_sinkhorn_iters", self.hc_sinkhorn_iters),
            ("max_position_embeddings", self.max_position),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(invalid(field, "must be positive"));
            }
        }
        if self.rope_head_dim == 0 || !self.rope_head_dim.is_multiple_of(2) || self.rope_head_dim > self.head_dim {
            return Err(invalid(
                "qk_rope_head_dim",
                format!("must be even, positive and at most head_dim ({}), got {}", self.head_dim, self.rope_head_dim),
            ));
        }
        if !(self.head_dim - self.rope_head_dim).is_multiple_of(2) {
            // FP8 KV entries keep the BF16 RoPE tail 2-byte aligned after the FP8 codes.
            return Err(invalid(
                "head_dim",
                format!(
                    "head_dim ({}) minus qk_rope_head_dim ({}) must be even (FP8 KV entries store those dims)",
                    self.head_dim, self.rope_head_dim
                ),
            ));
        }
        if !self.num_heads.is_multiple_of(self.o_groups) {
            return Err(invalid(
                "o_groups",
                format!("num_attention_heads ({}) must be divisible by o_groups ({})", self.num_heads, self.o_groups),
            ));
        }
        if self.experts_per_token > self.n_routed_experts {
            return Err(invalid(
                "num_experts_per_tok",
                format!("{} exceeds n_routed_experts ({})", self.experts_per_token, self.n_routed_experts),
            ));
        }
        if self.window > BLOCK_TOKENS {
            return Err(invalid("sliding_window", format!("at most {BLOCK_TOKENS} is supported, got {}", self.window)));
        }
        for (field, len) in [("compress_ratios", self.compress_ratios.len()), ("mlp_layer_types", self.mlp_kinds.len())]
        {
            if len != self.num_layers {
                return Err(invalid(field, format!("has {len} entries for {} layers", self.num_layers)));
            }
        }
        for (l, (&ratio, &kind)) in self.compress_ratios.iter().zip(&self.attn_kinds).enumerate() {
            let ok = match kind {
                AttnKind::Window => ratio == 0,
                _ => ratio > 0 && BLOCK_TOKENS.is_multiple_of(ratio),
            };
            if !ok {
                return Err(invalid(
                    &format!("compress_ratios[{l}]"),
                    format!("ratio {ratio} is not valid for a {} layer (must divide {BLOCK_TOKENS})", kind.name()),
                ));
            }
        }
        if self.count(AttnKind::Csa) > 0 {
            for (field, v) in [
                ("index_n_heads", self.index_heads),
                ("index_head_dim", self.index_head_dim),
                ("index_topk", self.index_topk),
            ] {
                if v == 0 {
                    return Err(invalid(field, "must be positive when any layer uses CSA"));
                }
            }
            if self.rope_head_dim > self.index_head_dim {
                return Err(invalid(
                    "index_head_dim",
                    format!("must be at least qk_rope_head_dim ({}), got {}", self.rope_head_dim, self.index_head_dim),
                ));
            }
        }
        for (field, v) in [("rope_theta", self.rope_theta), ("compress_rope_theta", self.compress_rope_theta)] {
            if v.is_nan() || v <= 1.0 {
                return Err(invalid(field, format!("must be greater than 1, got {v}")));
            }
        }
        for (field, v) in [("rms_norm_eps", self.rms_norm_eps), ("hc_eps", self.hc_eps)] {
            if v.is_nan() || v <= 0.0 || v >= 1.0 {
                return Err(invalid(field, format!("must be in (0, 1), got {v}")));
            }
        }
        if self.swiglu_limit.is_nan() || self.swiglu_limit <= 0.0 {
            return Err(invalid("swiglu_limit", format!("must be positive, got {}", self.swiglu_limit)));
        }
        if let Some(y) = self.yarn
            && [y.factor - 1.0, y.original_max_position, y.beta_fast, y.beta_slow]
                .iter()
                .any(|v| v.is_nan() || *v < 0.0)
        {
            return Err(invalid("rope_scaling", format!("implausible YaRN parameters {y:?}")));
        }
        Ok(())
    }
}

/// Layer kind of a legacy compression ratio (the only ratios V4 checkpoints use).
pub(crate) fn kind_of_ratio(ratio: usize, field: &str) -> Result<AttnKind, ConfigError> {
    match ratio {
        0 => Ok(AttnKind::Window),
        4 => Ok(AttnKind::Csa),
        128 => Ok(AttnKind::Hca),
        r => Err(invalid(field, format!("compression ratio {r} is not one of 0 (window), 4 (CSA), 128 (HCA)"))),
    }
}

/// Split a `compress_ratios` list into per-layer ratios and the MTP remainder.
pub(crate) fn split_ratios(
    ratios: Vec<usize>,
    num_layers: usize,
) -> Result<(Vec<usize>, Vec<AttnKind>, usize), ConfigError> {
    if ratios.len() < num_layers {
        return Err(invalid("compress_ratios", format!("has {} entries for {num_layers} layers", ratios.len())));
    }
    let mtp = ratios.len() - num_layers;
    let layer_ratios: Vec<usize> = ratios[..num_layers].to_vec();
    let kinds = layer_ratios
        .iter()
        .enumerate()
        .map(|(l, &r)| kind_of_ratio(r, &format!("compress_ratios[{l}]")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((layer_ratios, kinds, mtp))
}

pub(crate) fn hash_prefix(num_layers: usize, num_hash: usize) -> Vec<MlpKind> {
    (0..num_layers).map(|l| if l < num_hash { MlpKind::HashMoe } else { MlpKind::TopKMoe }).collect()
}

#[cfg(test)]
mod tests;
