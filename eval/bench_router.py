"""Replicas behind the real sglang-router, over HTTP on this machine: which routing policy, measured.

    python eval/bench_router.py --users 16 --turns 4 --policies round_robin,cache_aware,manual,power_of_two

For each policy, a fresh cluster (`hf_attnstore.lab.cluster`: a private redis-server, `--replicas` `attnstore serve`
processes over it, each with its own host and disk tiers, and the router in front) serves `--users` users at once.
Half of them resend their whole chat conversation each turn (no session named: the replica that gets the turn
finds it by its messages), half chain Responses with ``previous_response_id``; each waits a think time drawn from an
exponential of mean `--think` seconds before each turn. ``manual`` routes by the ``x-smg-routing-key`` header
(the user), which the clients send with every policy; the others ignore it. With `--kill`, one more run per policy
in `--kill-policies` SIGKILLs replica 0 once half of all turns are answered (turns in flight on it included).

Per run: turns answered and failed (any non-200: "nothing lost" is 0), the share of each resumed turn's previous
prompt (prompt and reply of the turn before) that was reused (``cached_tokens``), the resumed turns' TTFT as the
replica measured it and their latency as the client saw it, turns/s over the run, and bytes each replica read from
Redis (a turn resumed from the other replica's KV). It checks what every run must do and exits 1 otherwise: every
turn answered, in the runs with a kill too (every chain and conversation goes on).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from hf_attnstore.lab.cluster import POLICIES, Cluster, ClusterConfig

WORDS = ("river stone light garden window paper music summer letter market winter doctor forest planet "
         "engine castle bridge coffee silver animal history question answer morning evening").split()


@dataclass
class Turn:
    user: int
    turn: int
    kind: str
    ok: bool
    prompt: int = 0
    cached: int = 0
    previous: int = 0  # the previous turn's prompt and reply
    ttft_ms: float = 0.0
    latency_ms: float = 0.0


@dataclass
class Run:
    label: str
    turns: list[Turn] = field(default_factory=list)
    seconds: float = 0.0
    remote_read: list[float] = field(default_factory=list)
    killed_at: int | None = None


def message(rng: random.Random, chars: int) -> str:
    words = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words) + "?"


def post(url: str, body: dict, key: str) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                      "x-smg-routing-key": key})
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    except OSError:
        return 0, {}


def user_loop(cluster: Cluster, run: Run, user: int, args, lock: threading.Lock, done: threading.Event,
              answered: list[int], kill_after: int | None) -> None:
    rng = random.Random(1000 * args.seed + user)
    kind = "chat" if user % 2 == 0 else "chain"
    system = "You are a helpful assistant. Answer in a few plain sentences. " * 3
    messages = [{"role": "system", "content": system}]
    previous_id, previous = None, 0
    for turn in range(args.turns):
        time.sleep(rng.expovariate(1.0 / args.think))
        text = message(rng, args.message_chars)
        start = time.perf_counter()
        if kind == "chat":
            messages.append({"role": "user", "content": text})
            status, body = post(cluster.url + "/v1/chat/completions",
                                {"model": cluster.served_name, "messages": messages, "max_tokens": args.max_tokens,
                                 "temperature": 0}, f"user-{user}")
        else:
            request = {"model": cluster.served_name, "input": (system if turn == 0 else "") + text,
                       "max_output_tokens": args.max_tokens, "temperature": 0}
            if previous_id is not None:
                request["previous_response_id"] = previous_id
            status, body = post(cluster.url + "/v1/responses", request, f"user-{user}")
        latency = 1000 * (time.perf_counter() - start)
        record = Turn(user, turn, kind, status == 200, previous=previous, latency_ms=latency)
        if status == 200:
            usage = body["usage"]
            if kind == "chat":
                record.prompt, record.cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
                messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
                previous = usage["prompt_tokens"] + usage["completion_tokens"]
            else:
                record.prompt, record.cached = usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
                previous_id, previous = body["id"], usage["input_tokens"] + usage["output_tokens"]
            record.ttft_ms = body["attnstore"]["ttft_ms"]
        elif kind == "chat":
            messages.pop()  # the client retries this message next turn
        with lock:
            run.turns.append(record)
            answered[0] += 1
            if kill_after is not None and answered[0] == kill_after:
                run.killed_at = answered[0]
                done.set()


def metric(url: str, name: str) -> float:
    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    except OSError:
        return float("nan")
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.split()[-1])
    return float("nan")


def run_policy(policy: str, args, folder: Path, kill: bool) -> Run:
    config = ClusterConfig(folder, args.model, args.replicas, policy,
                           ("--max-tokens", str(args.max_tokens), "--host-bytes", args.host_bytes), not args.no_disk)
    run = Run(f"{policy}{', replica 0 killed' if kill else ''}")
    with Cluster(config) as cluster:
        lock, kill_now, answered = threading.Lock(), threading.Event(), [0]
        kill_after = (args.users * args.turns) // 2 if kill else None
        threads = [threading.Thread(target=user_loop, args=(cluster, run, u, args, lock, kill_now, answered,
                                                            kill_after), daemon=True) for u in range(args.users)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        if kill:
            kill_now.wait(timeout=3600)
            run.remote_read = [metric(u, 'attnstore_store_bytes_total{direction="read",tier="remote"}')
                               for u in cluster.replica_urls]
            cluster.kill(0)
        for t in threads:
            t.join(timeout=3600)
        run.seconds = time.perf_counter() - start
        if not kill:
            run.remote_read = [metric(u, 'attnstore_store_bytes_total{direction="read",tier="remote"}')
                               for u in cluster.replica_urls]
    return run


def summary(run: Run) -> dict:
    ok = [t for t in run.turns if t.ok]
    resumed = [t for t in ok if t.turn > 0 and t.previous > 0]
    ttft = sorted(t.ttft_ms for t in resumed) or [float("nan")]
    return {
        "label": run.label, "turns": len(ok), "failed": len(run.turns) - len(ok), "resumed": len(resumed),
        "reused": sum(min(t.cached, t.previous) for t in resumed) / max(1, sum(t.previous for t in resumed)),
        "at_90": sum(t.cached >= 0.9 * t.previous for t in resumed), "ttft_mean": statistics.mean(ttft),
        "ttft_p50": ttft[len(ttft) // 2], "ttft_p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "latency_mean": statistics.mean([t.latency_ms for t in resumed] or [float("nan")]),
        "turns_per_s": len(ok) / run.seconds if run.seconds else float("nan"),
        "remote_mb": " / ".join(f"{b / 1e6:.1f}" for b in run.remote_read),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="attnstore serve --model (default: the bundled SmolLM2)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--think", type=float, default=2.0, help="mean think time before each turn, seconds")
    p.add_argument("--message-chars", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--host-bytes", default="2GiB")
    p.add_argument("--no-disk", action="store_true", help="replicas without a disk tier (Redis below host memory)")
    p.add_argument("--policies", default="round_robin,cache_aware,manual,power_of_two")
    p.add_argument("--kill", action="store_true", help="also a run per --kill-policies with replica 0 SIGKILLed")
    p.add_argument("--kill-policies", default="round_robin")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the summaries and every turn to this file")
    args = p.parse_args(argv)
    runs = [(policy, False) for policy in args.policies.split(",") if policy]
    if args.kill:
        runs += [(policy, True) for policy in args.kill_policies.split(",") if policy]
    for policy, _ in runs:
        if policy not in POLICIES:
            p.error(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        for i, (policy, kill) in enumerate(runs):
            run = run_policy(policy, args, Path(tmp) / f"run{i}", kill)
            results.append(run)
            print(f"{run.label}: {json.dumps(summary(run))}", flush=True)
    print(f"\n{args.replicas} replicas x {args.users} users x {args.turns} turns, think {args.think} s, "
          f"{args.max_tokens} tokens a reply, {'no disk' if args.no_disk else 'disk + Redis'}\n")
    print("| routing | turns | failed | resumed | reused share of the previous prompt | resumed >= 90% | TTFT resumed, "
          "mean | p50 | p90 | latency resumed, mean | turns/s | Redis read per replica (MB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ok = True
    for run in results:
        s = summary(run)
        print(f"| {s['label']} | {s['turns']} | {s['failed']} | {s['resumed']} | {100 * s['reused']:.1f}% | "
              f"{s['at_90']}/{s['resumed']} | {s['ttft_mean']:.0f} ms | {s['ttft_p50']:.0f} ms | "
              f"{s['ttft_p90']:.0f} ms | {s['latency_mean']:.0f} ms | {s['turns_per_s']:.2f} | {s['remote_mb']} |")
        if s["failed"]:  # nothing lost, with a replica killed too: the router retries on a live one
            print(f"FAIL: {run.label}: {s['failed']} turns failed", file=sys.stderr)
            ok = False
    if args.json:
        Path(args.json).write_text(json.dumps([{"summary": summary(r), "turns": [t.__dict__ for t in r.turns]}
                                               for r in results]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
