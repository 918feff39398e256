#!/usr/bin/env python3
"""Time transformers' eager DeepseekV4ForCausalLM on a sluice model directory, the same
way `sluice bench engine` times the sluice engine: the median of N one-shot prefills of
a fixed prompt (tokens/s), then the median decode step with the KV cache (ms/step).

Prints one JSON line. Run it with the same thread count as the sluice run
(--threads, default: all cores), e.g.:

  python tools/bench/transformers_cpu.py --model /tmp/small --prompt-tokens 512 \
      --decode-steps 32 --threads 2
"""

import argparse
import json
import statistics
import time

import torch
from transformers import DeepseekV4ForCausalLM
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DynamicCache


def bench_prompt(length, vocab, salt):
    """The same LCG as `sluice bench engine` (cli/src/bench_cmd.rs)."""
    mask = (1 << 64) - 1
    x = (0x9E3779B97F4A7C15 ^ salt) & mask
    out = []
    for _ in range(length):
        x = (x * 6364136223846793005 + 1442695040888963407) & mask
        out.append((x >> 33) % vocab)
    return out


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = DeepseekV4ForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = model.config
    prompt = torch.tensor([bench_prompt(args.prompt_tokens, cfg.vocab_size, 1)])

    model(input_ids=prompt[:, :16], use_cache=True, past_key_values=DynamicCache(config=cfg))  # warm-up
    prefill = []
    for _ in range(max(1, args.repeat)):
        cache = DynamicCache(config=cfg)
        t = time.perf_counter()
        model(input_ids=prompt, use_cache=True, past_key_values=cache, logits_to_keep=1)
        prefill.append(time.perf_counter() - t)

    cache = DynamicCache(config=cfg)
    p = torch.tensor([bench_prompt(args.prompt_tokens, cfg.vocab_size, 100)])
    out = model(input_ids=p, use_cache=True, past_key_values=cache, logits_to_keep=1)
    nxt = out.logits[0, -1].argmax()
    steps = []
    pos = args.prompt_tokens
    for _ in range(args.decode_steps):
        t = time.perf_counter()
        out = model(input_ids=nxt.view(1, 1), use_cache=True, past_key_values=cache,
                    position_ids=torch.tensor([[pos]]))
        steps.append(time.perf_counter() - t)
        nxt = out.logits[0, -1].argmax()
        pos += 1
    step_ms = statistics.median(steps) * 1e3
    print(json.dumps({
        "engine": "transformers-eager",
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "batch": 1,
        "prefill_tokens_per_s": args.prompt_tokens / statistics.median(prefill),
        "decode_ms_per_step": step_ms,
        "decode_tokens_per_s": 1e3 / step_ms,
    }))


if __name__ == "__main__":
    main()
