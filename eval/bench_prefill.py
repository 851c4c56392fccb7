"""Prefilling several sessions' new tokens: one at a time, in chunks, or padded into one batch.

    python eval/bench_prefill.py --sessions 8 --reps 3

The question behind the batching design: should the prefills of turns that join the batch together run as
one forward? Each of `--sessions` sessions has a history already in its cache (`--history` tokens, growing
by `--spread` per session) and a new message to prefill (`--new` tokens, growing by `--spread // 4`): the
shape of a resumed chat turn. Token ids are real ShareGPT text. Variants, once per repetition in an order
drawn afresh each time (from `--seed`; printed: this machine drifts):

- ``one at a time``: each session's new tokens in one forward over its own cache (what the batch runner
  does without a token budget);
- ``chunks of N``: the same in forwards of at most N tokens (what a token budget does to a long prompt);
- ``padded batch``: all sessions in one forward, histories and new tokens left-padded to the longest, with
  an attention mask and per-session positions (what batched prefill of joining turns would be);
- ``equal-length batch``: the bound for batching, all sessions cut to the same lengths (no padding, no mask).

Prints the median seconds per variant and per session-prefill, SmolLM2 fp32 on the default device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from transformers import DynamicCache

from bench_tiers import interleaved, orders_line
from hf_attnstore import load_default_model
from hf_attnstore.lab.data import load_sharegpt
from hf_attnstore.cache.upstream import cache_kwargs


def sharegpt_ids(tokenizer, n: int) -> torch.Tensor:
    """`n` token ids of real ShareGPT text (messages concatenated)."""
    out = []
    for conv in load_sharegpt(limit=400, min_user_turns=1):
        for m in conv.messages:
            out.extend(tokenizer(m["content"], add_special_tokens=False).input_ids)
            if len(out) >= n:
                return torch.tensor([out[:n]])
    raise ValueError(f"ShareGPT has fewer than {n} tokens here")


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--history", type=int, default=600)
    p.add_argument("--new", type=int, default=250)
    p.add_argument("--spread", type=int, default=40)
    p.add_argument("--chunks", default="128,64")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="seed of the variants' order in each repetition")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model()
    device = model.device
    b = args.sessions
    hist = [args.history + args.spread * i for i in range(b)]
    new = [args.new + args.spread // 4 * i for i in range(b)]
    text = sharegpt_ids(tokenizer, sum(h + n for h, n in zip(hist, new))).to(device)
    ids, at = [], 0
    for h, n in zip(hist, new):
        ids.append(text[:, at : at + h + n])
        at += h + n
    past = []  # each session's history KV, computed once
    for i in range(b):
        cache = DynamicCache()
        model(ids[i][:, : hist[i]], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        past.append([(layer.keys, layer.values) for layer in cache.layers])

    def session_cache(kv, rows=None):
        cache = DynamicCache()
        for layer, (k, v) in enumerate(kv):
            cache.update(k.clone() if rows is None else k[:, :, -rows:].clone(),
                         v.clone() if rows is None else v[:, :, -rows:].clone(), layer)
        return cache

    def one_at_a_time(chunk=None):
        for i in range(b):
            cache, x = session_cache(past[i]), ids[i][:, hist[i]:]
            step = chunk or x.shape[1]
            for s in range(0, x.shape[1], step):
                model(x[:, s : s + step], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)

    def padded():
        width, n = max(hist), max(new)
        cache = DynamicCache()
        for layer in range(len(past[0])):
            k0, v0 = past[0][layer]
            keys = k0.new_zeros(b, k0.shape[1], width, k0.shape[3])
            values = v0.new_zeros(b, v0.shape[1], width, v0.shape[3])
            for i in range(b):
                keys[i, :, width - hist[i]:] = past[i][layer][0][0]
                values[i, :, width - hist[i]:] = past[i][layer][1][0]
            cache.update(keys, values, layer)
        tokens = torch.zeros(b, n, dtype=torch.long, device=device)
        mask = torch.zeros(b, width + n, dtype=torch.long, device=device)
        positions = torch.zeros(b, n, dtype=torch.long, device=device)
        for i in range(b):
            tokens[i, n - new[i]:] = ids[i][0, hist[i]:]
            mask[i, width - hist[i] : width] = 1
            mask[i, width + n - new[i]:] = 1
            positions[i, n - new[i]:] = torch.arange(hist[i], hist[i] + new[i], device=device)
        model(tokens, attention_mask=mask, position_ids=positions, **cache_kwargs(cache), use_cache=True,
              logits_to_keep=1)

    def equal_lengths():
        h, n = min(hist), min(new)
        cache = DynamicCache()
        for layer in range(len(past[0])):
            cache.update(torch.cat([past[i][layer][0][:, :, -h:] for i in range(b)]),
                         torch.cat([past[i][layer][1][:, :, -h:] for i in range(b)]), layer)
        tokens = torch.cat([ids[i][:, hist[i] : hist[i] + n] for i in range(b)])
        model(tokens, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)

    variants = {"one at a time": lambda rep: timed(one_at_a_time)}
    for c in (int(c) for c in args.chunks.split(",") if c):
        variants[f"chunks of {c}"] = lambda rep, c=c: timed(lambda: one_at_a_time(c))
    variants["padded batch"] = lambda rep: timed(padded)
    variants["equal-length batch (bound)"] = lambda rep: timed(equal_lengths)
    rows, orders = interleaved(variants, args.reps, args.seed)
    base = statistics.median(rows["one at a time"])
    print(f"{b} sessions, histories {hist[0]}-{hist[-1]}, new tokens {new[0]}-{new[-1]} "
          f"({sum(new)} in all), {args.reps} reps, {device}\n{orders_line(orders, args.seed)}")
    print("| variant | median | new tokens/s | time vs one at a time |")
    print("| --- | --- | --- | --- |")
    for name, seconds in rows.items():
        med = statistics.median(seconds)
        tokens = b * min(new) if name.startswith("equal") else sum(new)  # the bound prefills fewer tokens
        print(f"| {name} | {med:.2f} s | {tokens / med:.0f} | {med / base:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
