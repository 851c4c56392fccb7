"""Continuous batching inside the pipeline, without HTTP: the same turns one at a time and batched.

    python eval/bench_batch.py --sessions 8 --turns 3 --batch 1,8
    python eval/bench_batch.py --batch 8,8:256,8:128      # batch:max_batch_tokens (chunked prefill)

`--sessions` ShareGPT conversations (user messages of up to `--message-chars` characters), `--turns` rounds:
each round submits one turn of every session at once, `--max-new-tokens` per reply (no end-of-turn stop, so
every reply has the same length), greedy, SmolLM2 fp32, a fresh store per run. Prints the wall time per
batch size, and for the batched runs where the worker's time went (prefills, decoding steps, members leaving:
their decoded KV handed to the store, rebuilding the batch cache). `8:256` is batch 8 with
`max_batch_tokens=256`. Latency columns: TTFT (median over turns, queueing included) and the gaps between
consecutive streamed tokens of a reply (p99 and max over all replies): a prefill that runs between two
decoding steps shows up as a gap in every running reply. A run in which a reply has not `--max-new-tokens` tokens
fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from hf_attnstore import AttnStore, ChatPipeline, load_default_model
from hf_attnstore.lab.data import load_sharegpt


class Clock:
    """A streamer that notes when each generated token arrives (the first put is the prompt)."""

    def __init__(self):
        self.times, self._prompt = [], True

    def put(self, value):
        if self._prompt:
            self._prompt = False
        else:
            self.times.append(time.perf_counter())

    def end(self):
        pass


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
    p.add_argument("--batch", default="1,8", help="batch sizes, each optionally `:max_batch_tokens`")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--message-chars", type=int, default=1200)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model()
    convs = conversations(args.sessions, args.turns, args.message_chars)
    print("| batch | wall | turns/s | vs first | TTFT p50 | token gap p99 | max | prefills | decoding steps | "
          "members leaving | batch cache rebuilds |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = None
    for spec in args.batch.split(","):
        batch, _, budget = spec.partition(":")
        batch, budget = int(batch), int(budget) if budget else None
        gaps, ttfts = [], []
        with AttnStore(host_bytes="8GiB") as store, \
                ChatPipeline(model, tokenizer, store, max_new_tokens=args.max_new_tokens, max_batch_size=batch,
                             max_batch_tokens=budget, eos_token_id=None) as pipe:
            started = time.perf_counter()
            for k in range(args.turns):
                clocks = [Clock() for _ in convs]
                futures = [pipe.submit(f"s{i}", c[k], clock) for (i, c), clock in zip(enumerate(convs), clocks)]
                replies = [f.result(1200) for f in futures]
                short = [r.generated_tokens for r in replies if r.generated_tokens != args.max_new_tokens]
                assert not short, f"replies of {short} tokens, not {args.max_new_tokens}"
                ttfts += [r.ttft_s + r.queued_s for r in replies]
                gaps += [b - a for clock in clocks for a, b in zip(clock.times, clock.times[1:])]
            wall = time.perf_counter() - started
            runner = getattr(pipe, "batch_runner", None)
        base = base or wall
        split = ("–", "–", "–", "–") if runner is None else (
            f"{runner.seconds['prefill']:.1f} s ({runner.prefill_chunks})",
            f"{runner.seconds['step']:.1f} s ({runner.steps})",
            f"{runner.seconds['leave']:.1f} s", f"{runner.seconds['rebuild']:.1f} s")
        turns = args.sessions * args.turns
        gaps.sort()
        print(f"| {spec} | {wall:.1f} s | {turns / wall:.2f} | {base / wall:.2f}x | "
              f"{1000 * statistics.median(ttfts):.0f} ms | {1000 * gaps[int(0.99 * (len(gaps) - 1))]:.0f} ms | "
              f"{1000 * gaps[-1]:.0f} ms | {split[0]} | {split[1]} | {split[2]} | {split[3]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
