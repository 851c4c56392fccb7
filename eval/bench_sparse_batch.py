"""Sparse sessions in a batch: the batch cache's memory per member, the batch size at equal memory, decoding speed.

    python eval/bench_sparse_batch.py --sessions 8 --history 1536 --new-tokens 64 --batch-kv 256MiB --budget 0.2

`--sessions` sessions, each a real ShareGPT conversation replayed (its replies given, `ChatPipeline.submit(...,
reply=)`) until its history reaches `--history` tokens, in a pipeline of its own per variant (a sparse session's
history is computed sparsely). Then one measured turn of every session at once (a short question), batched,
`--new-tokens` each (no end-of-turn stop: every reply has that length), greedy, SmolLM2 fp32:

  * dense, bounded:  ``max_batch_kv_bytes=--batch-kv``, ``max_batch_size=--sessions``: the batch admits the turns
                     whose rows (each its whole history) fit, the others wait for members to leave;
  * sparse, bounded: the same with ``kv_budget`` (ALISA): a row holds the budget of its history and the turn;
  * dense at the batch size the sparse variant reached, unbounded: what that batch costs dense.

Reported per variant: the batch size reached and the batch cache at its largest (live KV after a join, slabs as
allocated), decode tokens/s (tokens of the batched decoding steps over their seconds), the measured turn's wall
time and median TTFT (queueing included). The store keeps every token in every variant; the batch cache is what a
GPU's memory would bound. A run in which a measured reply has not `--new-tokens` tokens fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from hf_attnstore import AttnStore, ChatPipeline, SparseConfig, load_default_model
from hf_attnstore.lab.data import load_sharegpt
from hf_attnstore.store.config import parse_bytes

QUESTION = "Summarize what we discussed so far in three sentences."


def build(pipe: ChatPipeline, sessions: int, history: int, convs, chars: int) -> list[int]:
    """Replays conversations (user and given assistant turns, each clipped to `chars` characters) into each session
    until it holds `history` tokens."""
    lengths, source = [], iter(convs)
    for i in range(sessions):
        length = 0
        while length < history:
            conv = next(source)
            msgs = conv.messages
            for user, assistant in zip(msgs, msgs[1:]):
                if user["role"] != "user" or assistant["role"] != "assistant" or length >= history:
                    continue
                reply = pipe.submit(f"s{i}", user["content"][:chars], reply=assistant["content"][:chars]).result(1200)
                length = reply.history_tokens + reply.generated_tokens
        lengths.append(length)
    return lengths


def measure(model, tokenizer, args, batch: int, sparse: SparseConfig | None, convs, bound: int | None) -> dict:
    with AttnStore(host_bytes="16GiB") as store, \
            ChatPipeline(model, tokenizer, store, max_new_tokens=args.new_tokens, max_batch_size=batch,
                         max_batch_kv_bytes=bound, eos_token_id=None, kv_budget=sparse) as pipe:
        # Given replies run alone: the batch is unused.
        lengths = build(pipe, args.sessions, args.history, convs, args.message_chars)
        runner = pipe.batch_runner
        started = time.perf_counter()
        futures = [pipe.submit(f"s{i}", QUESTION) for i in range(args.sessions)]
        replies = [f.result(1200) for f in futures]
        wall = time.perf_counter() - started
        short = [r.generated_tokens for r in replies if r.generated_tokens != args.new_tokens]
        assert not short, f"replies of {short} tokens, not {args.new_tokens}"
        peak, steps, step_s, waits = dict(runner.peak), runner.steps, runner.seconds["step"], runner.memory_waits
    decoded = sum(r.generated_tokens - 1 for r in replies)  # the first token of each reply comes from its prefill
    return {"lengths": lengths, "peak": peak, "tok_s": decoded / step_s if step_s else 0.0, "steps": steps,
            "wall": wall, "waits": waits, "ttft": statistics.median(r.ttft_s + r.queued_s for r in replies)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--history", type=int, default=1536, help="tokens of history per session (at least)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch-kv", default="256MiB", help="max_batch_kv_bytes of the bounded variants")
    p.add_argument("--budget", type=float, default=0.2, help="kv_budget of the sparse variant (0.2: 80%% sparsity)")
    p.add_argument("--policy", default="alisa")
    p.add_argument("--message-chars", type=int, default=2000, help="replayed messages and replies clipped to this")
    args = p.parse_args(argv)
    bound = parse_bytes(args.batch_kv, "--batch-kv")
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model()
    convs = [c for c in load_sharegpt(limit=40 * args.sessions, min_user_turns=2)]
    sparse = SparseConfig(args.budget, policy=args.policy)
    rows = [(f"dense, bounded by {args.batch_kv}", measure(model, tokenizer, args, args.sessions, None, convs, bound)),
            (f"{args.policy} {args.budget:g}, bounded by {args.batch_kv}",
             measure(model, tokenizer, args, args.sessions, sparse, convs, bound))]
    reached = rows[1][1]["peak"]["rows"]
    rows.append((f"dense @ {reached}, unbounded", measure(model, tokenizer, args, max(reached, 2), None, convs, None)))
    print(f"histories (tokens): {rows[0][1]['lengths']}")
    print("| variant | batch reached | batch KV at its largest: live | allocated | per row | decode tok/s | "
          "decoding steps | turn wall | TTFT p50 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in rows:
        peak = r["peak"]
        print(f"| {name} | {peak['rows']} | {peak['live'] / 2**20:.1f} MiB | {peak['allocated'] / 2**20:.1f} MiB | "
              f"{peak['live'] / max(peak['rows'], 1) / 2**20:.1f} MiB | {r['tok_s']:.1f} | {r['steps']} | "
              f"{r['wall']:.1f} s | {1000 * r['ttft']:,.0f} ms |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
