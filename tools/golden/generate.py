#!/usr/bin/env python3
"""Golden fixtures for sluice's conformance tests.

Builds tiny random DeepSeek-V4 models with Hugging Face transformers'
`DeepseekV4ForCausalLM` (the numerical oracle), saves them as checkpoints in the
official DeepSeek tensor layout and in the HF layout, runs prompts through them
and records the logits that the Rust engine must reproduce:

  <out>/<config>/model/            config.json + safetensors (+ index when sharded)
  <out>/<config>/expected.safetensors   case<i>.prefill [T, V], case<i>.decode [S, V]
  <out>/<config>/cases.json        prompts, uneven chunk schedules, greedy tokens

Selection inside the model is discrete (lightning-indexer top-k, MoE top-k, greedy
argmax). A fixture whose scores sit within rounding distance of a selection boundary
would make the comparison depend on summation order, so every run is watched and a
prompt whose scores come near a tie is rejected and drawn again.

Usage: python tools/golden/generate.py --out engine/tests/golden --sluice target/release/sluice
"""

import argparse
import json
import math
import shutil
import subprocess
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4

PINNED_TRANSFORMERS = "5.17.0"

YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}

# Relative distance (to the row's largest |score|) under which two candidates at a
# selection boundary count as tied. Reordered f32 sums move these scores by ~1e-6
# relative (the reference's own chunked and one-shot runs differ by ~3e-6 in the
# logits), so this leaves a margin of ~10x.
TIE_EPS = 3e-5

CONFIGS = {
    # Official layout, f32 weights. Flash-like pattern with all three layer kinds,
    # every required prompt length, hash + top-k MoE, top-k smaller than the
    # number of visible compressed entries.
    "tiny-official": {
        "layout": "official",
        "quant": None,
        "seed": 1,
        "prompt_lengths": [1, 3, 4, 5, 127, 128, 129, 333],
        "decode_steps": 16,
        "hf": dict(
            vocab_size=160,
            hidden_size=64,
            moe_intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            head_dim=32,
            qk_rope_head_dim=16,
            q_lora_rank=32,
            o_groups=2,
            o_lora_rank=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            # Enough indexer heads that a score is almost never an exact ReLU zero
            # (with 4 heads 1/16 of the entries score exactly 0 and tie).
            index_n_heads=16,
            index_head_dim=32,
            index_topk=8,
            compress_ratios=[0, 4, 128, 4, 0],
            num_hash_layers=1,
        ),
    },
    # HF layout (save_pretrained: new-style config keys, fused expert tensors).
    # Pro-like pattern: HCA bootstrap layers, two hash layers, three experts per token.
    "tiny-hf": {
        "layout": "hf",
        "quant": None,
        "seed": 2,
        "prompt_lengths": [2, 130, 301],
        "decode_steps": 20,
        "hf": dict(
            vocab_size=128,
            hidden_size=48,
            moe_intermediate_size=24,
            num_hidden_layers=5,
            num_attention_heads=6,
            head_dim=32,
            qk_rope_head_dim=16,
            q_lora_rank=24,
            o_groups=3,
            o_lora_rank=16,
            n_routed_experts=6,
            num_experts_per_tok=3,
            index_n_heads=12,
            index_head_dim=16,
            index_topk=4,
            compress_ratios=[128, 128, 4, 128, 4, 0],
            num_hash_layers=2,
        ),
    },
    # Official layout as DeepSeek ships it: FP8 e4m3 linears with ue8m0 128x128 block
    # scales (dims chosen so some blocks are partial), FP4 e2m1 routed experts with
    # ue8m0 per-32 scales, BF16 embeddings / head / compressors, two shards + index.
    "tiny-quant": {
        "layout": "official",
        "quant": "fp8-fp4",
        "shards": 2,
        "seed": 3,
        "prompt_lengths": [6, 200],
        "decode_steps": 16,
        "hf": dict(
            vocab_size=144,
            hidden_size=160,
            moe_intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            head_dim=48,
            qk_rope_head_dim=16,
            q_lora_rank=96,
            o_groups=2,
            o_lora_rank=40,
            n_routed_experts=4,
            num_experts_per_tok=2,
            index_n_heads=10,
            index_head_dim=32,
            index_topk=6,
            compress_ratios=[0, 4, 128, 0],
            num_hash_layers=1,
        ),
    },
}

# A checkpoint written by `sluice model init` (not by this script), so the reference
# also vouches for the checkpoints sluice generates itself.
INIT_FIXTURE = {"name": "tiny-init", "preset": "tiny", "seed": 11, "dtype": "bf16",
                "prompt_lengths": [7, 150], "decode_steps": 16}

CHUNK_PATTERN = [1, 7, 60, 129, 3, 50, 2, 90]


def chunk_schedule(length):
    """Uneven chunks that cross window and block boundaries at odd offsets."""
    chunks, i = [], 0
    while sum(chunks) < length:
        chunks.append(min(CHUNK_PATTERN[i % len(CHUNK_PATTERN)], length - sum(chunks)))
        i += 1
    return chunks


class TieWatch:
    """Records how close each discrete selection came to a tie."""

    def __init__(self):
        self.near_ties = []
        self.selection_rows = 0  # indexer rows where top-k actually dropped entries
        self.clamped = 0  # SwiGLU pre-activations the ±limit clamps changed
        self.activations = 0

    def boundary(self, kind, row, k):
        if row.numel() <= k:
            return
        top = torch.sort(row.double(), descending=True).values
        scale = top.abs().max().item()
        gap = (top[k - 1] - top[k]).item()
        if gap <= TIE_EPS * max(scale, 1e-30):
            self.near_ties.append((kind, gap, scale))


WATCH = TieWatch()


def install_watchers():
    indexer_forward = dsv4.DeepseekV4Indexer.forward
    router_forward = dsv4.DeepseekV4TopKRouter.forward

    def watched_indexer(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx):
        captured = {}
        scorer = self.scorer

        def scorer_forward(q, compressed_kv, hs):
            scores = type(scorer).forward(scorer, q, compressed_kv, hs)
            captured["scores"] = scores
            return scores

        scorer.forward = scorer_forward
        try:
            out = indexer_forward(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx)
        finally:
            del scorer.forward
        scores = captured.get("scores")
        if scores is not None:
            visible = (position_ids + 1) // self.compress_rate
            for b in range(scores.shape[0]):
                for t in range(scores.shape[1]):
                    n = int(visible[b, t])
                    if n > self.index_topk:
                        WATCH.selection_rows += 1
                    WATCH.boundary("indexer", scores[b, t, :n], self.index_topk)
        return out

    def watched_router(self, hidden_states):
        out = router_forward(self, hidden_states)
        logits = out[0]
        biased = self.score_fn(logits) + self.e_score_correction_bias
        for row in biased:
            WATCH.boundary("router", row, self.top_k)
        return out

    apply_gate = dsv4.DeepseekV4Experts._apply_gate

    def watched_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        WATCH.clamped += int((gate > self.limit).sum() + (up.abs() > self.limit).sum())
        WATCH.activations += gate.numel() + up.numel()
        return apply_gate(self, gate_up)

    dsv4.DeepseekV4Experts._apply_gate = watched_gate
    dsv4.DeepseekV4Indexer.forward = watched_indexer
    dsv4.DeepseekV4TopKRouter.forward = watched_router


def hf_config(spec):
    return DeepseekV4Config(
        rope_scaling=dict(YARN),
        max_position_embeddings=1048576,
        sliding_window=128,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        rms_norm_eps=1e-6,
        hc_eps=1e-6,
        swiglu_limit=10.0,
        routed_scaling_factor=1.5,
        **spec["hf"],
    )


def randomize(model, cfg, gen):
    """Weights with O(1) activations so that every path (clamps, sinks, YaRN,
    position biases, Sinkhorn) visibly shapes the logits."""

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen) * std + mean

    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if name.endswith("norm.weight"):
                p.copy_(normal(shape, 0.1, 1.0))
            elif name.endswith("sinks"):
                p.copy_(normal(shape, 0.7))
            elif name.endswith("position_bias"):
                p.copy_(normal(shape, 0.7))
            elif name.endswith(".base") or name.endswith("hc_base"):
                p.copy_(normal(shape, 0.5))
            elif name.endswith(".scale") or name.endswith("hc_scale"):
                p.copy_(torch.rand(shape, generator=gen) + 0.5)
            elif name.endswith("experts.gate_up_proj"):
                # Large enough that the ±swiglu_limit clamps trigger.
                p.copy_(normal(shape, 6.0 / math.sqrt(shape[-1])))
            elif name.endswith("experts.down_proj"):
                p.copy_(normal(shape, 1.0 / math.sqrt(shape[-1])))
            elif name.endswith("shared_experts.gate_proj.weight") or name.endswith("shared_experts.up_proj.weight"):
                p.copy_(normal(shape, 6.0 / math.sqrt(shape[-1])))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(normal(shape, 1.0))
            elif len(shape) == 2:
                p.copy_(normal(shape, 1.0 / math.sqrt(shape[-1])))
            else:
                raise SystemExit(f"no init rule for {name} {shape}")
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(normal(tuple(b.shape), 0.2))
            elif name.endswith("tid2eid"):
                vocab, k = b.shape
                rows = [torch.randperm(cfg.n_routed_experts, generator=gen)[:k] for _ in range(vocab)]
                b.copy_(torch.stack(rows))


# --- official tensor names -------------------------------------------------------------

LAYER_RENAMES = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("attn_hc.fn", "hc_attn_fn"),
    ("attn_hc.base", "hc_attn_base"),
    ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"),
    ("ffn_hc.base", "hc_ffn_base"),
    ("ffn_hc.scale", "hc_ffn_scale"),
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight"),
    ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn.wq_b.weight"),
    ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("self_attn.kv_norm.weight", "attn.kv_norm.weight"),
    ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn.wo_b.weight"),
    ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
    ("self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
    ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("mlp.gate.weight", "ffn.gate.weight"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
]

TOP_RENAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "head.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}


def official_state_dict(model, cfg):
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().clone().contiguous()
        if name in TOP_RENAMES:
            out[TOP_RENAMES[name]] = t
            continue
        if not name.startswith("model.layers."):
            raise SystemExit(f"unmapped tensor {name}")
        rest = name[len("model.layers."):]
        layer, leaf = rest.split(".", 1)
        prefix = f"layers.{layer}."
        if leaf == "mlp.experts.gate_up_proj":
            inter = cfg.moe_intermediate_size
            for e in range(t.shape[0]):
                out[f"{prefix}ffn.experts.{e}.w1.weight"] = t[e, :inter].contiguous()
                out[f"{prefix}ffn.experts.{e}.w3.weight"] = t[e, inter:].contiguous()
            continue
        if leaf == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}ffn.experts.{e}.w2.weight"] = t[e].contiguous()
            continue
        for hf_leaf, off_leaf in LAYER_RENAMES:
            if leaf == hf_leaf:
                if off_leaf == "ffn.gate.tid2eid":
                    t = t.to(torch.int32)  # the official checkpoints ship int32 tables
                out[prefix + off_leaf] = t
                break
        else:
            raise SystemExit(f"unmapped tensor {name}")
    return out


def legacy_config_json(cfg, spec, dtype):
    """config.json in the form DeepSeek ships (legacy keys: compress_ratios incl. MTP,
    num_hash_layers, qk_rope_head_dim, rope_scaling)."""
    h = spec["hf"]
    conf = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": h["vocab_size"],
        "hidden_size": h["hidden_size"],
        "moe_intermediate_size": h["moe_intermediate_size"],
        "num_hidden_layers": h["num_hidden_layers"],
        "num_attention_heads": h["num_attention_heads"],
        "num_key_value_heads": 1,
        "head_dim": h["head_dim"],
        "qk_rope_head_dim": h["qk_rope_head_dim"],
        "q_lora_rank": h["q_lora_rank"],
        "o_groups": h["o_groups"],
        "o_lora_rank": h["o_lora_rank"],
        "n_routed_experts": h["n_routed_experts"],
        "n_shared_experts": 1,
        "num_experts_per_tok": h["num_experts_per_tok"],
        "norm_topk_prob": True,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "swiglu_limit": cfg.swiglu_limit,
        "index_n_heads": h["index_n_heads"],
        "index_head_dim": h["index_head_dim"],
        "index_topk": h["index_topk"],
        "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "hc_eps": cfg.hc_eps,
        "rms_norm_eps": cfg.rms_norm_eps,
        "sliding_window": cfg.sliding_window,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": dict(YARN),
        "compress_ratios": h["compress_ratios"],
        "num_hash_layers": h["num_hash_layers"],
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": dtype,
    }
    if spec["quant"] == "fp8-fp4":
        conf["expert_dtype"] = "fp4"
        conf["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        }
    return conf


# --- quantisation (what the real checkpoints ship) -------------------------------------

FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def ue8m0_scale(amax, qmax):
    """Power-of-two scale (ue8m0) so that amax / scale fits in qmax."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / qmax)))


def quantize_fp8_block(w):
    rows, cols = w.shape
    br, bc = -(-rows // 128), -(-cols // 128)
    padded = torch.zeros(br * 128, bc * 128)
    padded[:rows, :cols] = w
    blocks = padded.view(br, 128, bc, 128)
    scale = ue8m0_scale(blocks.abs().amax(dim=(1, 3)), 448.0)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[:, None, :, None]).view(br * 128, bc * 128)[:rows, :cols]
    q = q.view(br * 128, bc * 128)[:rows, :cols].contiguous()
    return q, scale.to(torch.float8_e8m0fnu), deq.contiguous()


def quantize_fp4_rows(w):
    rows, cols = w.shape
    assert cols % 32 == 0
    groups = w.view(rows, cols // 32, 32)
    scale = ue8m0_scale(groups.abs().amax(dim=-1), 6.0)
    scaled = groups / scale[..., None]
    codes = (scaled[..., None] - FP4_VALUES).abs().argmin(dim=-1).to(torch.uint8)  # nearest e2m1
    deq = (FP4_VALUES[codes.long()] * scale[..., None]).view(rows, cols)
    codes = codes.view(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed.contiguous(), scale.to(torch.float8_e8m0fnu), deq.contiguous()


FP8_LEAVES = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
              "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.weight")


def quantize_official(tensors):
    """Quantise like the real checkpoint; returns (stored tensors, dequantised f32 view)."""
    stored, dequant = {}, {}
    for name, t in tensors.items():
        if name.endswith(FP8_LEAVES):
            q, s, d = quantize_fp8_block(t.float())
            stored[name], stored[name[: -len(".weight")] + ".scale"], dequant[name] = q, s, d
        elif ".ffn.experts." in name:
            q, s, d = quantize_fp4_rows(t.float())
            stored[name], stored[name[: -len(".weight")] + ".scale"], dequant[name] = q, s, d
        elif t.dtype.is_floating_point and t.dim() == 2:
            b = t.to(torch.bfloat16)
            stored[name], dequant[name] = b, b.float()
        else:
            stored[name], dequant[name] = t, t
    return stored, dequant


def load_official_into(model, dequant, cfg):
    """Push the dequantised official tensors back into the HF model (inverse mapping)."""
    back = {v: k for k, v in TOP_RENAMES.items()}
    sd = model.state_dict()
    new = {}
    for name in sd:
        if name in TOP_RENAMES:
            new[name] = dequant[TOP_RENAMES[name]]
    for name in sd:
        if not name.startswith("model.layers."):
            continue
        layer, leaf = name[len("model.layers."):].split(".", 1)
        prefix = f"layers.{layer}."
        if leaf == "mlp.experts.gate_up_proj":
            e_n = sd[name].shape[0]
            new[name] = torch.stack([torch.cat([dequant[f"{prefix}ffn.experts.{e}.w1.weight"],
                                                dequant[f"{prefix}ffn.experts.{e}.w3.weight"]]) for e in range(e_n)])
        elif leaf == "mlp.experts.down_proj":
            e_n = sd[name].shape[0]
            new[name] = torch.stack([dequant[f"{prefix}ffn.experts.{e}.w2.weight"] for e in range(e_n)])
        else:
            off = dict(LAYER_RENAMES)[leaf]
            new[name] = dequant[prefix + off].to(sd[name].dtype)
    missing = set(sd) - set(new) - set(back)
    assert not missing, missing
    model.load_state_dict({k: v.float() if v.dtype.is_floating_point else v for k, v in new.items()}, strict=True)


def write_sharded(tensors, model_dir, shards):
    names = sorted(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    total = 0
    for s in range(shards):
        part = names[s * per:(s + 1) * per]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(model_dir / fname), metadata={"format": "pt"})
        for n in part:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def add_mtp_tensors(tensors, cfg, gen):
    """Real checkpoints carry one MTP block; the engine must load around it."""
    d = cfg.hidden_size
    tensors["mtp.0.enorm.weight"] = torch.ones(d)
    tensors["mtp.0.hnorm.weight"] = torch.ones(d)
    tensors["mtp.0.e_proj.weight"] = torch.randn(d, d, generator=gen)
    tensors["mtp.0.attn_norm.weight"] = torch.ones(d)


# --- reference runs ----------------------------------------------------------------------

@torch.no_grad()
def run_case(model, cfg, prompt, chunks, decode_steps):
    ids = torch.tensor([prompt])
    WATCH.near_ties.clear()
    one_shot = model(input_ids=ids, use_cache=False).logits[0].float()

    cache = dsv4.DynamicCache(config=cfg)
    pos, pieces = 0, []
    for c in chunks:
        out = model(input_ids=ids[:, pos:pos + c], past_key_values=cache, use_cache=True,
                    position_ids=torch.arange(pos, pos + c)[None])
        pieces.append(out.logits[0].float())
        pos += c
    chunked = torch.cat(pieces)
    rel = ((chunked - one_shot).abs().max() / one_shot.abs().max()).item()

    # Greedy decode continuing from the chunked prefill's cache.
    tokens, rows = [], []
    last = chunked[-1]
    for step in range(decode_steps):
        WATCH.boundary("argmax", last, 1)
        nxt = int(last.argmax())
        tokens.append(nxt)
        pos = len(prompt) + step
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[pos]]))
        last = out.logits[0, -1].float()
        rows.append(last)
    WATCH.boundary("argmax", last, 1)
    ties = list(WATCH.near_ties)
    if not ties and rel > 1e-5:
        # Without a near-tie the two schedules must agree; anything else is a bug in
        # the reference's cache path and the fixture would be worthless.
        raise SystemExit(f"reference disagrees with itself: chunked vs one-shot rel {rel:.2e}")
    return one_shot, torch.stack(rows), tokens, ties


def record_cases(name, model, cfg, root, seed, prompt_lengths, decode_steps, extra_meta):
    expected, cases = {}, []
    prompt_gen = torch.Generator().manual_seed(1000 + seed)
    redraws = 0
    for i, length in enumerate(prompt_lengths):
        for attempt in range(200):
            prompt = torch.randint(0, cfg.vocab_size, (length,), generator=prompt_gen).tolist()
            chunks = chunk_schedule(length)
            rows_before = WATCH.selection_rows
            one_shot, decode, tokens, ties = run_case(model, cfg, prompt, chunks, decode_steps)
            if not ties:
                break
            WATCH.selection_rows = rows_before
            redraws += 1
        else:
            raise SystemExit(f"{name}: no tie-free prompt of length {length} after 200 draws")
        expected[f"case{i}.prefill"] = one_shot.contiguous()
        expected[f"case{i}.decode"] = decode.contiguous()
        cases.append({"prompt": prompt, "chunks": chunks, "greedy_tokens": tokens})
        print(f"  {name} case{i}: length {length}, chunks {chunks}, tokens {tokens[:6]}…")

    save_file(expected, str(root / "expected.safetensors"))
    meta = {
        "generator": "tools/golden/generate.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seed": seed,
        **extra_meta,
        "tie_eps": TIE_EPS,
        "prompt_redraws": redraws,
        "indexer_rows_with_selection": WATCH.selection_rows,
        "swiglu_clamped_fraction": WATCH.clamped / max(1, WATCH.activations),
        "cases": cases,
    }
    (root / "cases.json").write_text(json.dumps(meta) + "\n")
    print(f"{name}: {len(cases)} cases, {redraws} redraws, {WATCH.selection_rows} indexer rows with real selection, "
          f"{meta['swiglu_clamped_fraction']:.1%} of routed SwiGLU inputs clamped")
    WATCH.selection_rows = WATCH.clamped = WATCH.activations = 0


def build_from_init(sluice, out_root):
    spec = INIT_FIXTURE
    root = out_root / spec["name"]
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    model_dir = root / "model"
    subprocess.run([sluice, "model", "init", "--preset", spec["preset"], "--seed", str(spec["seed"]),
                    "--dtype", spec["dtype"], "--out", str(model_dir)], check=True)
    model = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    record_cases(spec["name"], model, model.config, root, spec["seed"], spec["prompt_lengths"], spec["decode_steps"],
                 {"layout": "official", "quant": None, "written_by": f"sluice model init --preset {spec['preset']} "
                  f"--seed {spec['seed']} --dtype {spec['dtype']}"})


def build(name, spec, out_root):
    torch.manual_seed(spec["seed"])
    gen = torch.Generator().manual_seed(spec["seed"])
    cfg = hf_config(spec)
    cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    randomize(model, cfg, gen)

    root = out_root / name
    if root.exists():
        shutil.rmtree(root)
    model_dir = root / "model"
    model_dir.mkdir(parents=True)

    if spec["layout"] == "hf":
        # HF module names (model.layers.L.self_attn.q_a_proj.weight, fused experts) with
        # the config keys transformers writes...
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(sd, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        cfg.to_json_file(str(model_dir / "config.json"))
        # ...and what transformers' own save_pretrained writes (it maps names back
        # towards the official ones under a `model.` prefix).
        saved_dir = root / "model-saved"
        model.save_pretrained(saved_dir)
        (saved_dir / "generation_config.json").unlink(missing_ok=True)
        for d in (model_dir, saved_dir):
            reloaded = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            probe = torch.arange(min(40, cfg.vocab_size))[None]
            if not torch.equal(model(input_ids=probe, use_cache=False).logits,
                               reloaded(input_ids=probe, use_cache=False).logits):
                raise SystemExit(f"{name}: reload of {d.name} differs from the model that wrote it")
    else:
        tensors = official_state_dict(model, cfg)
        if spec["quant"] == "fp8-fp4":
            tensors, dequant = quantize_official(tensors)
            load_official_into(model, dequant, cfg)
            dtype = "bfloat16"
        else:
            dtype = "float32"
        add_mtp_tensors(tensors, cfg, gen)
        if spec.get("shards", 1) > 1:
            write_sharded(tensors, model_dir, spec["shards"])
        else:
            save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        (model_dir / "config.json").write_text(json.dumps(legacy_config_json(cfg, spec, dtype), indent=2) + "\n")
        if spec["quant"] is None:
            # Cross-check our official names against transformers' own conversion mapping.
            reloaded = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            probe = torch.arange(min(40, cfg.vocab_size))[None]
            a = model(input_ids=probe, use_cache=False).logits
            b = reloaded(input_ids=probe, use_cache=False).logits
            if not torch.equal(a, b):
                raise SystemExit(f"{name}: official-layout reload differs from the model that wrote it")

    record_cases(name, model, cfg, root, spec["seed"], spec["prompt_lengths"], spec["decode_steps"],
                 {"layout": spec["layout"], "quant": spec["quant"]})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("engine/tests/golden"))
    ap.add_argument("--only", nargs="*", help="config names to (re)build")
    ap.add_argument("--sluice", help="path to a built `sluice` binary; adds the tiny-init fixture "
                                     "(a checkpoint written by `sluice model init`)")
    args = ap.parse_args()
    if transformers.__version__ != PINNED_TRANSFORMERS:
        raise SystemExit(f"transformers {transformers.__version__} found; fixtures are pinned to {PINNED_TRANSFORMERS}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    install_watchers()
    for name, spec in CONFIGS.items():
        if args.only and name not in args.only:
            continue
        build(name, spec, args.out)
    if args.sluice and (not args.only or INIT_FIXTURE["name"] in args.only):
        build_from_init(args.sluice, args.out)


if __name__ == "__main__":
    main()
