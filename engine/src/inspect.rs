//! `sluice model inspect`: the layer table of a model and what its KV state costs,
//! per token for the paged pools and per running sequence for the state cache.

use std::fmt::Write;

use kernels::{AttnKind, EntryDtype};
use serde_json::{Value, json};

use crate::config::{BLOCK_TOKENS, MlpKind, ModelConfig};

pub struct Report {
    pub text: String,
    pub json: Value,
}

pub fn report(cfg: &ModelConfig, kv_dtype: EntryDtype) -> Report {
    let layout = cfg.kv_layout(kv_dtype);
    let pools = layout.pool_bytes_per_block();
    let per_tok = |b: usize| b as f64 / BLOCK_TOKENS as f64;
    let mut t = String::new();
    let _ = writeln!(
        t,
        "DeepSeek-V4: {} layers (window {}, CSA {}, HCA {}), hidden {}, {} heads x {} (rope {}), vocab {}",
        cfg.num_layers,
        cfg.count(AttnKind::Window),
        cfg.count(AttnKind::Csa),
        cfg.count(AttnKind::Hca),
        cfg.hidden_size,
        cfg.num_heads,
        cfg.head_dim,
        cfg.rope_head_dim,
        cfg.vocab_size
    );
    let _ = writeln!(
        t,
        "MoE: {} routed experts (top {}), {} shared, intermediate {}; weights {} / experts {}; context {}; MTP blocks {}",
        cfg.n_routed_experts,
        cfg.experts_per_token,
        cfg.n_shared_experts,
        cfg.moe_intermediate_size,
        cfg.dense_dtype.name(),
        cfg.expert_dtype.name(),
        cfg.max_position,
        cfg.mtp_layers
    );
    let _ =
        writeln!(t, "\n{:>5}  {:<9} {:>5}  {:<6} entries per 128-token block", "layer", "attention", "ratio", "moe");
    let mut layers = Vec::new();
    for l in 0..cfg.num_layers {
        let kind = cfg.attn_kinds[l];
        let ratio = cfg.compress_ratios[l];
        let moe = match cfg.mlp_kinds[l] {
            MlpKind::HashMoe => "hash",
            MlpKind::TopKMoe => "top-k",
        };
        let entries = match kind {
            AttnKind::Window => "-".to_string(),
            AttnKind::Hca => format!("{} x {}", BLOCK_TOKENS / ratio, cfg.head_dim),
            AttnKind::Csa => format!(
                "{} x {} + indexer {} x {} (top {})",
                BLOCK_TOKENS / ratio,
                cfg.head_dim,
                BLOCK_TOKENS / ratio,
                cfg.index_head_dim,
                cfg.index_topk
            ),
        };
        let r = if ratio == 0 { "-".to_string() } else { ratio.to_string() };
        let _ = writeln!(t, "{l:>5}  {:<9} {r:>5}  {moe:<6} {entries}", kind.name());
        layers.push(json!({"layer": l, "attention": kind.name(), "ratio": ratio, "moe": moe}));
    }
    let compressed = pools.csa_main + pools.csa_index + pools.hca;
    let _ = writeln!(t, "\nKV bytes per token (entries stored as {}):", kv_dtype.name());
    for (name, b) in [("csa_main", pools.csa_main), ("csa_index", pools.csa_index), ("hca", pools.hca)] {
        let _ = writeln!(t, "  {name:<10} {:>10.1} B/token", per_tok(b));
    }
    let _ = writeln!(
        t,
        "  {:<10} {:>10.1} B/token ({} B per page of {BLOCK_TOKENS} tokens)",
        "total",
        per_tok(compressed),
        compressed
    );
    let _ = writeln!(t, "State cache per running sequence:");
    let _ = writeln!(
        t,
        "  {:<10} {:>10} B  (window of {} tokens x {} layers)",
        "swa",
        layout.window_bytes(),
        cfg.window,
        cfg.num_layers
    );
    let _ = writeln!(t, "  {:<10} {:>10} B  (compressor slots, f32)", "compressor", layout.comp_elems * 4);
    let json = json!({
        "layers": layers,
        "kv_dtype": kv_dtype.name(),
        "bytes_per_token": {
            "csa_main": per_tok(pools.csa_main),
            "csa_index": per_tok(pools.csa_index),
            "hca": per_tok(pools.hca),
            "total": per_tok(compressed),
        },
        "page_bytes": layout.page_bytes(),
        "state_bytes_per_sequence": {"swa": layout.window_bytes(), "compressor": layout.comp_elems * 4},
    });
    Report { text: t, json }
}
