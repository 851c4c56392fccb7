"""Two replicas behind a load balancer: hit rate and resumed-turn TTFT with and without the shared tier.

    python eval/replay_replicas.py --conversations 24 --replicas 2

The ShareGPT trace of `attnstore replay` (Poisson arrivals, think time, recorded replies read by teacher
forcing), served by `--replicas` ChatPipelines, each over its own store (host tier as in the replay, disk for
all), on one trace and one model. Runs (see `hf_attnstore.lab.replicas` for the protocol):

* sticky balancer, no shared tier: every turn of a session on one replica (the affinity bound);
* random balancer, no shared tier: a turn on another replica finds at best an older copy of its session;
* random balancer, shared Redis tier (a local redis-server): the replicas resume each other's sessions;
* random balancer, shared Redis tier and no disk tiers (stateless replicas), with `--no-disk-run`.

Every run reads the same replies, so the greedy tokens of each turn must be identical across runs: a run whose
tokens differ from the sticky run's fails (exit 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from hf_attnstore import load_default_model
from hf_attnstore.lab.replay import ReplayConfig, build_trace, host_capacity, same_outputs
from hf_attnstore.lab.replicas import run_replicas
from hf_attnstore.lab.redis_server import RedisServer


def resumed_summary(run) -> dict:
    resumed = [r.reply for r in run.records if r.turn > 0]
    ttft = sorted(1000 * r.ttft_s for r in resumed)
    by_tier = {k: sum(r.tier == k for r in resumed) / len(resumed) for k in ("host", "disk", "remote", "miss")}
    moved = [r for r in run.records if r.turn > 0]
    return {
        "label": run.label,
        "resumed": len(resumed),
        "ttft_mean_ms": statistics.mean(ttft),
        "ttft_p50_ms": ttft[len(ttft) // 2],
        "ttft_p90_ms": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "reused_share": sum(r.reused_tokens for r in resumed) / sum(r.history_tokens for r in resumed),
        "prefilled_mean": statistics.mean(r.prefilled_tokens for r in resumed),
        **{f"from_{k}": v for k, v in by_tier.items()},
        "replicas_used": sorted({r.replica for r in moved}),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--max-turns", type=int, default=None)
    p.add_argument("--max-user-tokens", type=int, default=256, help="user messages are clipped to this")
    p.add_argument("--max-reply-tokens", type=int, default=512, help="recorded replies are clipped to this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-disk-run", action="store_true", help="also run stateless replicas (Redis, no disk)")
    p.add_argument("--json", help="write the summaries here")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model()
    cfg = ReplayConfig(conversations=args.conversations, max_turns=args.max_turns, seed=args.seed,
                       max_user_tokens=args.max_user_tokens, max_reply_tokens=args.max_reply_tokens)
    trace = build_trace(tokenizer, cfg)
    host, all_kv = host_capacity(model, tokenizer, trace, cfg)
    n = args.replicas
    runs = [run_replicas(model, tokenizer, trace, cfg, replicas=n, balancer="sticky", host_bytes=host),
            run_replicas(model, tokenizer, trace, cfg, replicas=n, balancer="random", host_bytes=host)]
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        runs.append(run_replicas(model, tokenizer, trace, cfg, replicas=n, balancer="random", remote=server.url,
                                 host_bytes=host))
    if args.no_disk_run:
        with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
            runs.append(run_replicas(model, tokenizer, trace, cfg, replicas=n, balancer="random", remote=server.url,
                                     host_bytes=host, disk=False, label=f"{n} replicas, random, Redis, no disk"))
    rows = [resumed_summary(run) for run in runs]
    print(f"\n{len(trace.turns)} ShareGPT conversations, {trace.num_turns} turns; {n} replicas, each with a host "
          f"tier of {host / 2**20:.1f} MiB ({100 * host / all_kv:.0f}% of all sessions' KV) and a disk tier; "
          f"{type(model).__name__} {next(model.parameters()).dtype}, {torch.get_num_threads()} threads\n")
    print("| run | TTFT resumed, mean | p50 | p90 | reused share | prefilled / turn | host | disk | remote | "
          "miss | greedy = sticky |")
    print("| --- " * 11 + "|")
    differ = []
    for run, r in zip(runs, rows):
        same, compared = same_outputs(runs[0], run)
        if same != compared:
            differ.append(f"{run.label}: {compared - same} of {compared} turns")
        print(f"| {r['label']} | {r['ttft_mean_ms']:.0f} ms | {r['ttft_p50_ms']:.0f} ms | {r['ttft_p90_ms']:.0f} ms | "
              f"{100 * r['reused_share']:.1f}% | {r['prefilled_mean']:.0f} | {100 * r['from_host']:.1f}% | "
              f"{100 * r['from_disk']:.1f}% | {100 * r['from_remote']:.1f}% | {100 * r['from_miss']:.1f}% | "
              f"{same}/{compared} |")
    print()
    for run in runs:
        s = run.stats
        print(f"{run.label}: remote read {s.remote_bytes_read / 2**20:.0f} MiB in {s.remote_read_seconds:.1f} s, "
              f"written {s.remote_bytes_written / 2**20:.0f} MiB, remote errors {s.remote_errors}; disk read "
              f"{s.bytes_read / 2**20:.0f} MiB; wall {run.wall_s:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if differ:
        print("greedy tokens differ from the sticky run's: " + "; ".join(differ), file=sys.stderr)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
