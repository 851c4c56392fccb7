"""Sliding-window layers in a resumed turn: the KV the cache holds, TTFT and decoding speed (issue 15).

    python eval/bench_sliding.py --history 2048 --new 128 --decode 64 --reps 3

A Gemma-3-style model at SmolLM2-135M's scale with random weights (timings depend on shapes only): 30 layers,
five sliding-window layers (window 512) to one global layer, 9 query / 3 KV heads of 64, MLP 1536. A session
of `--history` tokens is stored in host memory; then a turn adds `--new` tokens and decodes `--decode` more:

  RE   recomputation through `DynamicCache(config=...)` (transformers' own sliding layers)
  AS   the resumed turn through AttnStoreCache

Reported per system: the KV its cache layers hold at the end of the turn, TTFT (cache built, `--new` tokens
prefilled) and decoding time per token; medians over `--reps`, the two systems in an order drawn afresh for every
repetition (from `--seed`; printed). A resume that did not reuse exactly the stored history, or whose first
logits differ from RE's by more than 1e-3, fails the run (the resumed turns do not save). To compare with the
code before sliding layers were trimmed, run the same command with that commit's `src` on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.cache.upstream import cache_kwargs

sys.path.insert(0, str(Path(__file__).parent))
from bench_tiers import check_resume, interleaved, orders_line  # noqa: E402

_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 5


def build(window: int):
    config = transformers.Gemma3TextConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, num_hidden_layers=30, layer_types=_TYPES, sliding_window=window, max_position_embeddings=8192)
    return transformers.Gemma3ForCausalLM(config).eval()


def kv_bytes(cache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
               for layer in cache.layers)


def decode(model, cache, first: torch.Tensor, steps: int) -> float:
    """Seconds per greedy decoding step through `cache`."""
    token = first
    t = time.perf_counter()
    for _ in range(steps):
        token = model(token, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t) / steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--history", type=int, default=2048)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="seed of the systems' order in each repetition")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    model = build(args.window)
    H, N = args.history, args.new
    ids = torch.randint(100, model.config.vocab_size, (1, H + N), generator=torch.Generator().manual_seed(0))
    with AttnStore(host_bytes="16GiB") as store:
        prefill = AttnStoreCache(model, store, "s", ids[:, :H])
        model(prefill.input_ids, **cache_kwargs(prefill))
        prefill.close()
        model(ids[:, :8])  # warm-up
        rows = {"RE": {"ttft": [], "decode": [], "kv": 0}, "AS": {"ttft": [], "decode": [], "kv": 0}}
        first = {}

        def turn(name: str):
            def run(rep: int) -> None:
                t = time.perf_counter()
                if name == "RE":
                    cache = DynamicCache(config=model.config)
                    logits = model(ids, **cache_kwargs(cache)).logits[:, -1:]
                else:
                    cache = AttnStoreCache(model, store, "s", ids, save=False)
                    logits = model(cache.input_ids[:, H:], **cache_kwargs(cache)).logits[:, -1:]
                rows[name]["ttft"].append(time.perf_counter() - t)
                if name == "AS":
                    check_resume(cache, H, ("host",))
                first[name] = logits
                rows[name]["decode"].append(decode(model, cache, logits.argmax(-1), args.decode))
                rows[name]["kv"] = kv_bytes(cache)
                if name == "AS":
                    cache.close()
            return run

        _, orders = interleaved({name: turn(name) for name in rows}, args.reps, args.seed)
    error = float((first["AS"] - first["RE"]).abs().max())
    assert error <= 1e-3, f"the resumed turn's logits differ from recomputation's by {error:.1e}"
    print(f"Gemma-3-style at SmolLM2-135M scale (random weights, 30 layers, 25 sliding with window {args.window}), fp32 "
          f"on CPU, {torch.get_num_threads()} threads; history {H} + new {N}, {args.decode} decoded, {args.reps} reps "
          f"(medians)\n{orders_line(orders, args.seed)}\n")
    print("| system | KV held after the turn | TTFT | decode per token |\n| --- | --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['kv'] / 1e6:.1f} MB | {1000 * statistics.median(r['ttft']):.0f} ms | "
              f"{1000 * statistics.median(r['decode']):.1f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
