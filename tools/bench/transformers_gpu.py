#!/usr/bin/env python3
"""Time transformers' eager DeepseekV4ForCausalLM on a GPU on a sluice model directory,
the same way `sluice bench engine --device cuda:N` times the sluice engine:

- prefill: the median of N one-shot prefills of a fixed prompt (tokens/s);
- decode: for each context C, one sequence is prefilled to C tokens (in chunks, with
  the cache), its cache is replicated to each batch size B (identical histories, as
  sluice's export/import does), every row gets its own token, and the median step of
  `--decode-steps` is reported (ms/step, synchronised: argmax on the host each step).

bf16 weights and activations (the checkpoint's dtype), `attn_implementation="eager"`.
A configuration that runs out of GPU memory is reported as such, not skipped silently.
Prints one JSON line (progress on stderr), e.g.:

  python tools/bench/transformers_gpu.py --model /tmp/flash-bench --prefill-tokens 8192 \
      --contexts 8192,65536 --batches 1,8,32
"""

import argparse
import copy
import json
import statistics
import sys
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


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def expand_cache(cache, batch):
    """Replicate a batch-1 cache along the batch axis (every tensor of every layer)."""
    def grow(t):
        return t.expand(batch, *t.shape[1:]).contiguous() if torch.is_tensor(t) and t.dim() > 0 and t.shape[0] == 1 else t

    for layer in cache.layers:
        for name, v in list(vars(layer).items()):
            if isinstance(v, dict):
                for k in list(v):
                    v[k] = grow(v[k])
            else:
                setattr(layer, name, grow(v))
        if hasattr(layer, "keys") and hasattr(layer, "values") and torch.is_tensor(getattr(layer, "keys", None)):
            layer.values = layer.keys  # K = V share storage, as the cache keeps them
    return cache


def fill(model, cfg, tokens, chunk, dev):
    cache = DynamicCache(config=cfg)
    out = None
    for s in range(0, len(tokens), chunk):
        ids = torch.tensor([tokens[s:s + chunk]], device=dev)
        pos = torch.arange(s, s + ids.shape[1], device=dev).unsqueeze(0)
        out = model(input_ids=ids, position_ids=pos, use_cache=True, past_key_values=cache, logits_to_keep=1)
    return cache, out.logits[0, -1]


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--contexts", default="8192,65536")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=4096)
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    model = DeepseekV4ForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, attn_implementation="eager")
    # transformers keeps norms, sinks and the mHC parameters in f32 even in a bf16 model,
    # and then feeds f32 norm outputs into bf16 projections; casting every parameter to
    # bf16 is what runs (the mHC code upcasts its own inputs explicitly).
    model = model.to(dev, dtype=torch.bfloat16).eval()
    cfg = model.config
    vocab = cfg.vocab_size

    # Warm-up: kernels, allocator, cuBLAS handles.
    model(input_ids=torch.tensor([bench_prompt(512, vocab, 7)], device=dev), use_cache=True,
          past_key_values=DynamicCache(config=cfg), logits_to_keep=1)
    torch.cuda.synchronize()

    prompt = torch.tensor([bench_prompt(args.prefill_tokens, vocab, 1)], device=dev)
    prefill = []
    prefill_error = None
    for _ in range(max(1, args.repeat)):
        try:
            cache = DynamicCache(config=cfg)
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model(input_ids=prompt, use_cache=True, past_key_values=cache, logits_to_keep=1)
            out.logits[0, -1].argmax().item()
            prefill.append(time.perf_counter() - t)
        except torch.cuda.OutOfMemoryError as e:
            prefill_error = f"out of memory: {e}".split("\n")[0]
            break
        finally:
            cache = out = None
            torch.cuda.empty_cache()
    tps = args.prefill_tokens / statistics.median(prefill) if prefill else None
    log(f"prefill {args.prefill_tokens}: {tps} tokens/s {prefill_error or ''}")

    decode = []
    for ctx in [int(c) for c in args.contexts.split(",")]:
        try:
            base, last = fill(model, cfg, bench_prompt(ctx, vocab, 100 + ctx), args.chunk, dev)
        except torch.cuda.OutOfMemoryError as e:
            for b in args.batches.split(","):
                decode.append({"context": ctx, "batch": int(b), "error": f"out of memory filling the context: {e}".split("\n")[0]})
            torch.cuda.empty_cache()
            continue
        for b in [int(x) for x in args.batches.split(",")]:
            row = {"context": ctx, "batch": b}
            try:
                cache = expand_cache(copy.deepcopy(base), b)
                nxt = torch.tensor(bench_prompt(b, vocab, 1000 + b), device=dev).view(b, 1)
                steps = []
                for i in range(args.decode_steps + 1):
                    pos = torch.full((b, 1), ctx + i, device=dev)
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    out = model(input_ids=nxt, position_ids=pos, use_cache=True, past_key_values=cache)
                    nxt = out.logits[:, -1].argmax(-1).view(b, 1)
                    nxt.tolist()
                    if i > 0:
                        steps.append(time.perf_counter() - t)
                ms = statistics.median(steps) * 1e3
                row.update({"ms_per_step": ms, "tokens_per_s": b / (ms / 1e3)})
            except torch.cuda.OutOfMemoryError as e:
                row["error"] = f"out of memory: {e}".split("\n")[0]
            cache = out = None
            torch.cuda.empty_cache()
            log(f"decode ctx {ctx} batch {b}: {row}")
            decode.append(row)
        base = None
        torch.cuda.empty_cache()

    print(json.dumps({
        "engine": "transformers-eager",
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "model": args.model,
        "dtype": "bfloat16",
        "prefill_tokens": args.prefill_tokens,
        "prefill_tokens_per_s": tps,
        "prefill_error": prefill_error,
        "decode": decode,
    }))


if __name__ == "__main__":
    main()
