"""Resuming a session from the shared remote tier (a local redis-server) vs from disk vs the ideal.

    python eval/bench_remote.py --history 2048 --new 128 --reps 5

One prefill of `--new` tokens after `--history` tokens of SmolLM2: the ideal keeps the history's KV resident
in a DynamicCache; "AS-disk" resumes it from this store's disk tier (the page cache is warm: what a recently
demoted session costs); "AS-remote" resumes it on a second store, with its own empty host and disk tiers,
from Redis, as a replica behind a load balancer does. Variants run once per repetition, in an order drawn afresh
each time (from `--seed`; printed). Every resume has new tokens of its own (a repeated prompt would be served by
prefix sharing from the session that stored it first: a cache hit, not a resume) and fails the run unless it
reused exactly its own session's history from the tier it measures. Load bandwidth comes from the stores'
counters (bytes read over the load thread's time).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hf_attnstore import AttnStore, AttnStoreCache, load_default_model
from hf_attnstore.lab.redis_server import RedisServer

sys.path.insert(0, str(Path(__file__).parent))
from bench_tiers import (  # noqa: E402
    Resumes, check_resume, history_snapshot, ideal_prefill, interleaved, orders_line)
from hf_attnstore.cache.upstream import cache_kwargs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--history", type=int, default=2048)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0, help="seed of the variants' order in each repetition")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, _ = load_default_model()
    H, N = args.history, args.new
    history = torch.randint(100, model.config.vocab_size, (1, H), generator=torch.Generator().manual_seed(0))
    prompts = Resumes(history, N, model.config.vocab_size)
    resident, fp, snapshot = history_snapshot(model, history, H)
    names = (f"s{i}" for i in itertools.count())
    with contextlib.ExitStack() as stack:  # closed in reverse: stores, then the server, then the folder
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="attnstore-remote-"))
        server = stack.enter_context(RedisServer(Path(tmp) / "redis"))
        opts = dict(host_bytes="8GiB", remote=server.url, fsync=False)
        a = stack.enter_context(AttnStore(disk_dir=Path(tmp) / "a", **opts))

        def ideal(_):
            return ideal_prefill(model, resident, prompts.next()[:, H:])

        def stored(rep: int) -> str:
            sid = next(names)
            with a.open_turn(sid, fp, None, torch.arange(0)) as writer:
                writer.append(*snapshot)
            a.flush()
            a.evict(sid)
            return sid

        def resume(store, sid, source):
            prompt = prompts.next()
            t = time.perf_counter()
            with AttnStoreCache(model, store, sid, prompt) as cache:
                model(cache.input_ids[:, H:], **cache_kwargs(cache))
            elapsed = time.perf_counter() - t
            check_resume(cache, H, (source,))
            return elapsed

        def disk(rep):
            return resume(a, stored(rep), "disk")

        def remote(rep):
            sid = stored(rep)
            with AttnStore(disk_dir=Path(tmp) / f"b{rep}", **opts) as b:  # another replica: nothing local
                elapsed = resume(b, sid, "remote")
                remote_stats.append(b.stats())
                b.close(flush=False)
            return elapsed

        remote_stats = []
        ideal(0), disk(-1), remote(-1)
        remote_stats.clear()
        rows, orders = interleaved({"ideal": ideal, "AS-disk": disk, "AS-remote": remote}, args.reps, args.seed)
        base = statistics.median(rows["ideal"])
        print(f"SmolLM2-135M fp32, {torch.get_num_threads()} threads; history {H}, new {N} (drawn afresh for every "
              f"turn), {args.reps} reps (interleaved)\n  {orders_line(orders, args.seed)}")
        for v, xs in rows.items():
            print(f"  {v:<10} median {1000 * statistics.median(xs):7.1f} ms  min {1000 * min(xs):7.1f} ms  "
                  f"{statistics.median(xs) / base:5.2f} x ideal (median)  {min(xs) / min(rows['ideal']):5.2f} x (min)")
        s = a.stats()
        rb = sum(x.remote_bytes_read for x in remote_stats)
        rs = sum(x.remote_read_seconds for x in remote_stats)
        print(f"  load bandwidth: disk {s.read_gbps:.2f} GB/s, remote {rb / rs / 1e9 if rs else 0:.2f} GB/s "
              f"({rb / len(remote_stats) / 1e6:.0f} MB per session)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
