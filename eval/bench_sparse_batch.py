"""Sparse sessions in a batch: the batch cache's memory per member, the batch size at equal memory, decoding speed.

    python eval/bench_sparse_batch.py --sessions 8 --history 1536 --new-tokens 64 --batch 2 --budget 0.2

`--sessions` sessions, each a real ShareGPT conversation replayed (its replies given, `ChatPipeline.submit(...,
reply=)`) until its history reaches `--history` tokens, in a pipeline of its own per variant (a sparse session's
history is computed sparsely). Then one measured turn of every session at once (a short question), batched,
`--new-tokens` each (no end-of-turn stop: every reply has that length), greedy, SmolLM2 fp32:

  * dense @ B:       ``max_batch_size=B``, every member's row holds its whole history;
  * sparse @ B:      the same with ``kv_budget`` (ALISA): a row holds the budget of its history and the turn;
  * sparse @ equal memory: the batch size whose rows fit the memory the dense batch of B took (B times the
                     ratio of a dense row to a sparse one, measured above), at most `--sessions`;
  * dense @ that size: what the same batch costs dense.

Reported per variant: the batch cache's live KV at its largest (bytes, rows, per row), decode tokens/s (tokens
of the batched decoding steps over their seconds), the measured turn's wall time and median TTFT (queueing
included). The store keeps every token in every variant; the batch cache is what a GPU's memory would bound.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from hf_attnstore import AttnStore, ChatPipeline, SparseConfig, load_default_model
from hf_attnstore.lab.data import load_sharegpt

QUESTION = "Summarize what we discussed so far in three sentences."


def build(pipe: ChatPipeline, sessions: int, history: int, convs) -> list[int]:
    """Replays conversations (user and given assistant turns) into each session until it holds `history` tokens."""
    lengths, source = [], iter(convs)
    for i in range(sessions):
        length = 0
        while length < history:
            conv = next(source)
            msgs = conv.messages
            for user, assistant in zip(msgs, msgs[1:]):
                if user["role"] != "user" or assistant["role"] != "assistant" or length >= history:
                    continue
                reply = pipe.submit(f"s{i}", user["content"][:2000], reply=assistant["content"][:2000]).result(1200)
                length = reply.history_tokens + reply.generated_tokens
        lengths.append(length)
    return lengths


def measure(model, tokenizer, args, batch: int, sparse: SparseConfig | None, convs) -> dict:
    with AttnStore(host_bytes="16GiB") as store, \
            ChatPipeline(model, tokenizer, store, max_new_tokens=args.new_tokens, max_batch_size=batch,
                         eos_token_id=None, kv_budget=sparse) as pipe:
        lengths = build(pipe, args.sessions, args.history, convs)  # given replies run alone: the batch is unused
        runner = pipe.batch_runner
        started = time.perf_counter()
        futures = [pipe.submit(f"s{i}", QUESTION) for i in range(args.sessions)]
        replies = [f.result(1200) for f in futures]
        wall = time.perf_counter() - started
        peak, steps, step_s = dict(runner.peak), runner.steps, runner.seconds["step"]
    decoded = sum(r.generated_tokens - 1 for r in replies)  # the first token of each reply comes from its prefill
    return {"lengths": lengths, "peak": peak, "per_row": peak["live"] / max(peak["rows"], 1),
            "tok_s": decoded / step_s if step_s else 0.0, "steps": steps, "wall": wall,
            "ttft": statistics.median(r.ttft_s + r.queued_s for r in replies)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--history", type=int, default=1536, help="tokens of history per session (at least)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="the dense batch size whose memory the sparse batch gets")
    p.add_argument("--budget", type=float, default=0.2, help="kv_budget of the sparse variants (0.2: 80%% sparsity)")
    p.add_argument("--policy", default="alisa")
    args = p.parse_args(argv)
    if args.batch < 2:
        p.error("--batch must be at least 2 (a batch)")
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model()
    convs = [c for c in load_sharegpt(limit=40 * args.sessions, min_user_turns=2)]
    sparse = SparseConfig(args.budget, policy=args.policy)
    rows = []
    dense = measure(model, tokenizer, args, args.batch, None, convs)
    rows.append((f"dense @ {args.batch}", args.batch, dense))
    same = measure(model, tokenizer, args, args.batch, sparse, convs)
    rows.append((f"{args.policy} {args.budget:g} @ {args.batch}", args.batch, same))
    fits = min(args.sessions, int(args.batch * dense["per_row"] // same["per_row"]))
    if fits > args.batch:
        equal = measure(model, tokenizer, args, fits, sparse, convs)
        rows.append((f"{args.policy} {args.budget:g} @ {fits} (equal memory)", fits, equal))
        rows.append((f"dense @ {fits}", fits, measure(model, tokenizer, args, fits, None, convs)))
    print(f"histories (tokens): {dense['lengths']}")
    print("| variant | batch | batch KV at its largest | rows then | per row | decode tok/s | decoding steps | "
          "turn wall | TTFT p50 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, batch, r in rows:
        print(f"| {name} | {batch} | {r['peak']['live'] / 2**20:.1f} MiB | {r['peak']['rows']} | "
              f"{r['per_row'] / 2**20:.1f} MiB | {r['tok_s']:.1f} | {r['steps']} | {r['wall']:.1f} s | "
              f"{1000 * r['ttft']:,.0f} ms |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
