//! The model's weights on a backend, loaded from a checkpoint with every shape
//! checked against the config. Weights go to the backend as typed views of the mapped
//! checkpoint bytes (a GPU keeps FP8/FP4 as they are), layers in parallel, so a device
//! backend streams them through its bounded staging buffers and host memory does not
//! grow with the model.

use kernels::backend::{ExpertWeights, HcHeadWeights, HcWeights, MoeWeights, Routing};
use kernels::{AttnKind, Backend};
use rayon::prelude::*;

use super::load_progress::{LoadProgress, LoadStats};
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::config::{MlpKind, ModelConfig};

pub struct CompressorWeights<B: Backend> {
    pub wkv: B::Weight,
    pub wgate: B::Weight,
    /// Learned position bias `[ratio, width]` added to the scores.
    pub ape: B::Buf,
    pub norm: B::Buf,
}

pub struct IndexerWeights<B: Backend> {
    pub wq_b: B::Weight,
    pub weights_proj: B::Weight,
    pub compressor: CompressorWeights<B>,
}

pub struct AttentionWeights<B: Backend> {
    pub wq_a: B::Weight,
    pub q_norm: B::Buf,
    pub wq_b: B::Weight,
    pub wkv: B::Weight,
    pub kv_norm: B::Buf,
    pub wo_a: B::Weight,
    pub wo_b: B::Weight,
    pub sinks: B::Buf,
    pub compressor: Option<CompressorWeights<B>>,
    pub indexer: Option<IndexerWeights<B>>,
}

pub struct LayerWeights<B: Backend> {
    pub attn_norm: B::Buf,
    pub ffn_norm: B::Buf,
    pub hc_attn: B::Hc,
    pub hc_ffn: B::Hc,
    pub attn: AttentionWeights<B>,
    pub moe: B::Moe,
}

pub struct ModelWeights<B: Backend> {
    pub embed: B::Weight,
    pub layers: Vec<LayerWeights<B>>,
    pub norm: B::Buf,
    pub head: B::Weight,
    pub hc_head: B::HcHead,
}

struct Loader<'a, B: Backend> {
    ck: &'a Checkpoint,
    cfg: &'a ModelConfig,
    b: &'a B,
    progress: &'a LoadProgress,
}

impl<B: Backend> Loader<'_, B> {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<B::Weight, CheckpointError> {
        let view = self.ck.weight(name, rows, cols)?;
        let bytes = view.stored_bytes();
        let w = self.b.weight(view);
        self.progress.add(bytes);
        Ok(w)
    }

    fn floats(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, CheckpointError> {
        let v = self.ck.floats(name, shape)?;
        self.progress.add(self.ck.stored_bytes(name));
        Ok(v)
    }

    fn vector(&self, name: &str, len: usize) -> Result<B::Buf, CheckpointError> {
        Ok(self.b.upload(&self.floats(name, &[len])?))
    }

    fn hc(&self, prefix: &str) -> Result<B::Hc, CheckpointError> {
        let (hc, d) = (self.cfg.hc_mult, self.cfg.hidden_size);
        let mix = (2 + hc) * hc;
        let scale = self.floats(&format!("{prefix}_scale"), &[3])?;
        Ok(self.b.hc_weights(HcWeights {
            mix: self.matrix(&format!("{prefix}_fn"), mix, hc * d)?,
            base: self.floats(&format!("{prefix}_base"), &[mix])?,
            scale: [scale[0], scale[1], scale[2]],
            hc,
            hidden: d,
            sinkhorn_iters: self.cfg.hc_sinkhorn_iters,
            norm_eps: self.cfg.rms_norm_eps as f32,
            hc_eps: self.cfg.hc_eps as f32,
        }))
    }

    fn compressor(
        &self,
        prefix: &str,
        ratio: usize,
        dim: usize,
        overlap: bool,
    ) -> Result<CompressorWeights<B>, CheckpointError> {
        let width = if overlap { 2 * dim } else { dim };
        let d = self.cfg.hidden_size;
        Ok(CompressorWeights {
            wkv: self.matrix(&format!("{prefix}.wkv.weight"), width, d)?,
            wgate: self.matrix(&format!("{prefix}.wgate.weight"), width, d)?,
            ape: self.b.upload(&self.floats(&format!("{prefix}.ape"), &[ratio, width])?),
            norm: self.vector(&format!("{prefix}.norm.weight"), dim)?,
        })
    }

    fn attention(&self, l: usize) -> Result<AttentionWeights<B>, CheckpointError> {
        let c = self.cfg;
        let p = format!("layers.{l}.attn");
        let (d, h, hd, g) = (c.hidden_size, c.num_heads, c.head_dim, c.o_groups);
        let ratio = c.compress_ratios[l];
        let kind = c.attn_kinds[l];
        let compressor = match kind {
            AttnKind::Window => None,
            AttnKind::Csa => Some(self.compressor(&format!("{p}.compressor"), ratio, hd, true)?),
            AttnKind::Hca => Some(self.compressor(&format!("{p}.compressor"), ratio, hd, false)?),
        };
        let indexer = match kind {
            AttnKind::Csa => Some(IndexerWeights {
                wq_b: self.matrix(
                    &format!("{p}.indexer.wq_b.weight"),
                    c.index_heads * c.index_head_dim,
                    c.q_lora_rank,
                )?,
                weights_proj: self.matrix(&format!("{p}.indexer.weights_proj.weight"), c.index_heads, d)?,
                compressor: self.compressor(&format!("{p}.indexer.compressor"), ratio, c.index_head_dim, true)?,
            }),
            _ => None,
        };
        Ok(AttentionWeights {
            wq_a: self.matrix(&format!("{p}.wq_a.weight"), c.q_lora_rank, d)?,
            q_norm: self.vector(&format!("{p}.q_norm.weight"), c.q_lora_rank)?,
            wq_b: self.matrix(&format!("{p}.wq_b.weight"), h * hd, c.q_lora_rank)?,
            wkv: self.matrix(&format!("{p}.wkv.weight"), hd, d)?,
            kv_norm: self.vector(&format!("{p}.kv_norm.weight"), hd)?,
            wo_a: self.matrix(&format!("{p}.wo_a.weight"), g * c.o_lora_rank, h * hd / g)?,
            wo_b: self.matrix(&format!("{p}.wo_b.weight"), d, g * c.o_lora_rank)?,
            sinks: self.vector(&format!("{p}.attn_sink"), h)?,
            compressor,
            indexer,
        })
    }

    fn moe(&self, l: usize) -> Result<B::Moe, CheckpointError> {
        let c = self.cfg;
        let p = format!("layers.{l}.ffn");
        let (d, n, k, inter) = (c.hidden_size, c.n_routed_experts, c.experts_per_token, c.moe_intermediate_size);
        let routing = match c.mlp_kinds[l] {
            MlpKind::TopKMoe => Routing::TopK { bias: self.floats(&format!("{p}.gate.bias"), &[n])? },
            MlpKind::HashMoe => {
                let name = format!("{p}.gate.tid2eid");
                let table = self.ck.ints(&name, &[c.vocab_size, k])?;
                self.progress.add(self.ck.stored_bytes(&name));
                if let Some(bad) = table.iter().find(|&&e| e < 0 || e as usize >= n) {
                    return Err(CheckpointError::Value {
                        tensor: name,
                        reason: format!("expert id {bad} outside 0..{n}"),
                    });
                }
                Routing::Hash { tid2eid: table.into_iter().map(|e| e as u32).collect() }
            }
        };
        // Each expert goes where the backend keeps it (one device of several under
        // expert parallelism).
        let to_b = |(e, m): (usize, [kernels::WeightView<'_>; 3])| {
            self.progress.add(m.iter().map(|v| v.stored_bytes()).sum());
            let [w1, w2, w3] = m;
            let place = |v| self.b.expert_weight(v, e, n);
            ExpertWeights { w1: place(w1), w2: place(w2), w3: place(w3) }
        };
        let experts = self.ck.experts(l, n, inter, d)?.into_iter().enumerate().map(to_b).collect();
        let shared = if c.n_shared_experts > 0 {
            let si = c.n_shared_experts * inter;
            Some(ExpertWeights {
                w1: self.matrix(&format!("{p}.shared_experts.w1.weight"), si, d)?,
                w2: self.matrix(&format!("{p}.shared_experts.w2.weight"), d, si)?,
                w3: self.matrix(&format!("{p}.shared_experts.w3.weight"), si, d)?,
            })
        } else {
            None
        };
        Ok(self.b.moe_weights(MoeWeights {
            gate: self.matrix(&format!("{p}.gate.weight"), n, d)?,
            routing,
            experts,
            expert_base: 0,
            shared,
            top_k: k,
            route_scale: c.route_scale as f32,
            swiglu_limit: c.swiglu_limit as f32,
        }))
    }

    fn layer(&self, l: usize) -> Result<LayerWeights<B>, CheckpointError> {
        let d = self.cfg.hidden_size;
        Ok(LayerWeights {
            attn_norm: self.vector(&format!("layers.{l}.attn_norm.weight"), d)?,
            ffn_norm: self.vector(&format!("layers.{l}.ffn_norm.weight"), d)?,
            hc_attn: self.hc(&format!("layers.{l}.hc_attn"))?,
            hc_ffn: self.hc(&format!("layers.{l}.hc_ffn"))?,
            attn: self.attention(l)?,
            moe: self.moe(l)?,
        })
    }
}

impl<B: Backend> ModelWeights<B> {
    /// Load every tensor the forward pass needs. Layers load in parallel; MTP tensors and
    /// anything else unused are left untouched in the mapping. A progress bar shows on a
    /// terminal; the totals are returned and logged.
    pub fn load(ck: &Checkpoint, cfg: &ModelConfig, b: &B) -> Result<(Self, LoadStats), CheckpointError> {
        let progress = LoadProgress::new(ck.bytes_to_load(), &b.describe());
        let ld = Loader { ck, cfg, b, progress: &progress };
        let (v, d, hc) = (cfg.vocab_size, cfg.hidden_size, cfg.hc_mult);
        let done = std::sync::atomic::AtomicUsize::new(0);
        let layers = (0..cfg.num_layers)
            .into_par_iter()
            .map(|l| {
                let w = ld.layer(l)?;
                let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                tracing::debug!(layer = l, "loaded layer {n}/{}", cfg.num_layers);
                Ok(w)
            })
            .collect::<Result<Vec<_>, CheckpointError>>()?;
        let head_scale = ld.floats("hc_head_scale", &[1])?;
        let weights = ModelWeights {
            embed: ld.matrix("embed.weight", v, d)?,
            layers,
            norm: ld.vector("norm.weight", d)?,
            head: ld.matrix("head.weight", v, d)?,
            hc_head: b.hc_head_weights(HcHeadWeights {
                mix: ld.matrix("hc_head_fn", hc, hc * d)?,
                base: ld.floats("hc_head_base", &[hc])?,
                scale: head_scale[0],
                hc,
                hidden: d,
                norm_eps: cfg.rms_norm_eps as f32,
                hc_eps: cfg.hc_eps as f32,
            }),
        };
        b.finish_load();
        let stats = progress.finish();
        tracing::info!(
            device = %b.describe(),
            gb = format!("{:.2}", stats.bytes as f64 / 1e9),
            seconds = format!("{:.1}", stats.seconds),
            gb_per_s = format!("{:.2}", stats.gb_per_s()),
            peak_host_mb = stats.peak_extra_host_bytes.map(|p| p / (1 << 20)),
            "loaded weights ({:.2} GB in {:.1} s, {:.2} GB/s; peak host memory beyond the page cache {})",
            stats.bytes as f64 / 1e9,
            stats.seconds,
            stats.gb_per_s(),
            stats.peak_extra_host_bytes.map(|p| format!("{} MiB", p >> 20)).unwrap_or_else(|| "unknown".into())
        );
        Ok((weights, stats))
    }
}
