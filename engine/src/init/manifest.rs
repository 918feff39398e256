//! Every tensor a DeepSeek-V4 checkpoint holds for a given config, with the shape the
//! loader expects and how `model init` fills it.

use kernels::AttnKind;

use crate::config::{MlpKind, ModelConfig};

/// How a tensor is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fill {
    /// Uniform with standard deviation `gain / sqrt(fan_in)`: activations stay O(1).
    Linear { gain: f32 },
    /// `1 + N(0, 0.1)`: RMSNorm weights.
    Norm,
    /// `N(0, std)`: sinks, position biases, mHC biases, router biases.
    Normal { std: f32 },
    /// `U(0.5, 1.5)`: mHC logit scales.
    Scale,
    /// Distinct random experts per token (hash routing table).
    Tid2eid { experts: usize },
}

/// Storage class, which decides the dtype under `--dtype fp8`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// Small or precision-critical tensors: always f32.
    F32,
    /// Dense matrices kept in BF16 even in FP8 checkpoints (embeddings, head,
    /// compressors, indexer, router), as DeepSeek ships them.
    Dense,
    /// Attention and shared-expert projections: FP8 with 128x128 block scales.
    Fp8,
    /// Routed experts: FP4 with per-32 scales.
    Fp4,
    /// Integer table.
    Int,
}

#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub fill: Fill,
    pub class: Class,
}

fn spec(name: String, shape: &[usize], fill: Fill, class: Class) -> TensorSpec {
    TensorSpec { name, shape: shape.to_vec(), fill, class }
}

pub fn manifest(c: &ModelConfig) -> Vec<TensorSpec> {
    use Class::*;
    let lin = Fill::Linear { gain: 1.0 };
    let (v, d, hc) = (c.vocab_size, c.hidden_size, c.hc_mult);
    let mix = (2 + hc) * hc;
    let mut out = vec![
        spec("embed.weight".into(), &[v, d], Fill::Linear { gain: (d as f32).sqrt() }, Dense),
        spec("head.weight".into(), &[v, d], lin, Dense),
        spec("norm.weight".into(), &[d], Fill::Norm, F32),
        spec("hc_head_fn".into(), &[hc, hc * d], lin, F32),
        spec("hc_head_base".into(), &[hc], Fill::Normal { std: 0.5 }, F32),
        spec("hc_head_scale".into(), &[1], Fill::Scale, F32),
    ];
    for l in 0..c.num_layers {
        let p = format!("layers.{l}");
        for site in ["attn", "ffn"] {
            out.push(spec(format!("{p}.{site}_norm.weight"), &[d], Fill::Norm, F32));
            out.push(spec(format!("{p}.hc_{site}_fn"), &[mix, hc * d], lin, F32));
            out.push(spec(format!("{p}.hc_{site}_base"), &[mix], Fill::Normal { std: 0.5 }, F32));
            out.push(spec(format!("{p}.hc_{site}_scale"), &[3], Fill::Scale, F32));
        }
        let (h, hd, g) = (c.num_heads, c.head_dim, c.o_groups);
        let a = format!("{p}.attn");
        out.extend([
            spec(format!("{a}.wq_a.weight"), &[c.q_lora_rank, d], lin, Fp8),
            spec(format!("{a}.q_norm.weight"), &[c.q_lora_rank], Fill::Norm, F32),
            spec(format!("{a}.wq_b.weight"), &[h * hd, c.q_lora_rank], lin, Fp8),
            spec(format!("{a}.wkv.weight"), &[hd, d], lin, Fp8),
            spec(format!("{a}.kv_norm.weight"), &[hd], Fill::Norm, F32),
            spec(format!("{a}.wo_a.weight"), &[g * c.o_lora_rank, h * hd / g], lin, Fp8),
            spec(format!("{a}.wo_b.weight"), &[d, g * c.o_lora_rank], lin, Fp8),
            spec(format!("{a}.attn_sink"), &[h], Fill::Normal { std: 0.7 }, F32),
        ]);
        let ratio = c.compress_ratios[l];
        let mut compressor = |prefix: String, dim: usize, overlap: bool| {
            let w = if overlap { 2 * dim } else { dim };
            out.extend([
                spec(format!("{prefix}.wkv.weight"), &[w, d], lin, Dense),
                spec(format!("{prefix}.wgate.weight"), &[w, d], lin, Dense),
                spec(format!("{prefix}.ape"), &[ratio, w], Fill::Normal { std: 0.7 }, F32),
                spec(format!("{prefix}.norm.weight"), &[dim], Fill::Norm, F32),
            ]);
        };
        match c.attn_kinds[l] {
            AttnKind::Window => {}
            AttnKind::Hca => compressor(format!("{a}.compressor"), hd, false),
            AttnKind::Csa => {
                compressor(format!("{a}.compressor"), hd, true);
                compressor(format!("{a}.indexer.compressor"), c.index_head_dim, true);
                out.push(spec(
                    format!("{a}.indexer.wq_b.weight"),
                    &[c.index_heads * c.index_head_dim, c.q_lora_rank],
                    lin,
                    Dense,
                ));
                out.push(spec(format!("{a}.indexer.weights_proj.weight"), &[c.index_heads, d], lin, Dense));
            }
        }
        let f = format!("{p}.ffn");
        let (n, inter) = (c.n_routed_experts, c.moe_intermediate_size);
        out.push(spec(format!("{f}.gate.weight"), &[n, d], lin, Dense));
        match c.mlp_kinds[l] {
            MlpKind::TopKMoe => out.push(spec(format!("{f}.gate.bias"), &[n], Fill::Normal { std: 0.2 }, F32)),
            MlpKind::HashMoe => out.push(spec(
                format!("{f}.gate.tid2eid"),
                &[v, c.experts_per_token],
                Fill::Tid2eid { experts: n },
                Int,
            )),
        }
        // Gate/up weights large enough that the SwiGLU clamps take effect sometimes.
        let up = Fill::Linear { gain: 4.0 };
        for e in 0..n {
            out.push(spec(format!("{f}.experts.{e}.w1.weight"), &[inter, d], up, Fp4));
            out.push(spec(format!("{f}.experts.{e}.w2.weight"), &[d, inter], lin, Fp4));
            out.push(spec(format!("{f}.experts.{e}.w3.weight"), &[inter, d], up, Fp4));
        }
        if c.n_shared_experts > 0 {
            let si = c.n_shared_experts * inter;
            out.push(spec(format!("{f}.shared_experts.w1.weight"), &[si, d], up, Fp8));
            out.push(spec(format!("{f}.shared_experts.w2.weight"), &[d, si], lin, Fp8));
            out.push(spec(format!("{f}.shared_experts.w3.weight"), &[si, d], up, Fp8));
        }
    }
    out
}
