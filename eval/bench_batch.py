"""Continuous batching inside the pipeline, without HTTP: the same turns one at a time and batched.

    python eval/bench_batch.py --sessions 8 --turns 3 --batch 1,8

`--sessions` ShareGPT conversations (user messages of up to `--message-chars` characters), `--turns` rounds:
each round submits one turn of every session at once, `--max-new-tokens` per reply (no end-of-turn stop, so
every reply has the same length), greedy, SmolLM2 fp32, a fresh store per run. Prints the wall time per
batch size, and for the batched runs where the worker's time went (prefills, decoding steps, members leaving:
their decoded KV handed to the store, rebuilding the batch cache).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from hf_attnstore import AttnStore, ChatPipeline, load_default_model
from hf_attnstore.data import load_sharegpt


def conversations(n: int, turns: int, chars: int) -> list[list[str]]:
    out = []
    for conv in load_sharegpt(limit=8 * n, min_user_turns=1):
        users = [m["content"][:chars] for m in conv.messages if m["role"] == "user" and len(m["content"]) >= 200]
        if users:
            out.append((users * turns)[:turns])
        if len(out) == n:
            return out
    raise ValueError(f"not enough ShareGPT conversations for {n} sessions")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--message-chars", type=int, default=1200)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model()
    convs = conversations(args.sessions, args.turns, args.message_chars)
    print("| batch | wall | turns/s | vs batch 1 | prefills | decoding steps | members leaving | batch cache rebuilds |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    base = None
    for batch in [int(b) for b in args.batch.split(",")]:
        with AttnStore(host_bytes="8GiB") as store, \
                ChatPipeline(model, tokenizer, store, max_new_tokens=args.max_new_tokens, max_batch_size=batch,
                             eos_token_id=None) as pipe:
            started = time.perf_counter()
            for k in range(args.turns):
                futures = [pipe.submit(f"s{i}", c[k]) for i, c in enumerate(convs)]
                for f in futures:
                    f.result(1200)
            wall = time.perf_counter() - started
            runner = getattr(pipe, "batch_runner", None)
        base = base or wall
        split = ("–", "–", "–", "–") if runner is None else (
            f"{runner.seconds['prefill']:.1f} s", f"{runner.seconds['step']:.1f} s ({runner.steps} steps)",
            f"{runner.seconds['leave']:.1f} s", f"{runner.seconds['rebuild']:.1f} s")
        turns = args.sessions * args.turns
        print(f"| {batch} | {wall:.1f} s | {turns / wall:.2f} | {base / wall:.2f}x | {split[0]} | {split[1]} | "
              f"{split[2]} | {split[3]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
