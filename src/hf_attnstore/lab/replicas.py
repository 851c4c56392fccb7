"""Replaying ShareGPT over several replicas behind a load balancer, with and without the shared remote tier.

Each replica is a :class:`ChatPipeline` over its own :class:`AttnStore` (a host tier and a disk tier). The
replicas share the conversations (one `histories` mapping: the conversation database, or clients that send
the whole conversation) and, in the shared runs, one Redis as the remote tier. The load balancer sends each
turn to a replica:

* ``"random"``: no session affinity. A session's next turn lands on another replica with probability
  ``1 - 1/N``; without a shared tier that replica has at best an older copy of the session.
* ``"sticky"``: every turn of a session goes to one replica (session affinity), the upper bound that a
  shared tier tries to reach without making the balancer stateful.

The choice is drawn per (session, turn) from the seed, so every run with the same balancer sends each turn
to the same replica. Time is virtual, as in replay.py: turns arrive at the trace's times; each replica runs
its turns in arrival order, one at a time, each lasting what it took on this machine (one turn runs on the
machine at a time). After each turn the replica's store is flushed outside the measured time: in a
deployment, write-behind completes during the user's think time (mean 30 s); in the replay's compressed
real time it would not, and the next replica would find the shared tier a turn behind.
"""

from __future__ import annotations

import heapq
import random
import tempfile
import time
from dataclasses import fields
from pathlib import Path

from ..serving.pipeline import ChatPipeline, PipelineTuning
from .replay import ReplayConfig, ReplayRun, Trace, TurnRecord, host_capacity
from ..store import AttnStore, StoreTuning
from ..store.stats import StoreStats

BALANCERS = ("random", "sticky")


def choose_replica(balancer: str, replicas: int, seed: int, session: int, turn: int) -> int:
    """The replica the load balancer sends turn `turn` of session `session` to (deterministic per seed).

    Example:
        >>> [choose_replica("sticky", 4, seed=0, session=7, turn=t) for t in range(3)]  # one replica per session
        [3, 3, 3]
        >>> [choose_replica("random", 4, seed=0, session=7, turn=t) for t in range(3)]  # any replica, each turn
        [1, 1, 3]
    """
    if balancer not in BALANCERS:
        raise ValueError(f"`balancer` must be one of {BALANCERS}, got {balancer!r}")
    draw = f"{seed}:{session}" if balancer == "sticky" else f"{seed}:{session}:{turn}"
    return random.Random(draw).randrange(replicas)


def drive_replicas(pipes: list[ChatPipeline], stores: list[AttnStore], trace: Trace, balancer: str, seed: int, *,
                   label: str = "", timeout_s: float = 600.0, progress: bool = True) -> tuple[list[TurnRecord], float]:
    """Runs `trace` over the replicas in virtual time (see the module docstring).

    Returns:
        The turns in the order they ran, and the virtual time the last one ended.
    """
    from tqdm.auto import tqdm

    pending = [(t, i, 0) for i, t in enumerate(trace.arrivals)]
    heapq.heapify(pending)
    free_at = [0.0] * len(pipes)
    records: list[TurnRecord] = []
    with tqdm(total=trace.num_turns, desc=label, disable=not progress, unit="turn") as bar:
        while pending:
            t, i, k = heapq.heappop(pending)
            r = choose_replica(balancer, len(pipes), seed, i, k)
            message, recorded = trace.turns[i][k]
            reply = pipes[r].submit(trace.session_ids[i], message, reply=recorded).result(timeout_s)
            stores[r].flush(timeout_s)  # write-behind done within the think time (not measured: see above)
            start = max(t, free_at[r])
            free_at[r] = start + reply.total_s
            records.append(TurnRecord(i, k, t, start, reply, replica=r))
            bar.update()
            if k + 1 < len(trace.turns[i]):
                heapq.heappush(pending, (free_at[r] + trace.think_s[i][k], i, k + 1))
    return records, max(free_at)


def sum_stats(stats: list[StoreStats]) -> StoreStats:
    """The replicas' counters added up (limits and usage too: the fleet's).

    Example:
        >>> total = sum_stats([StoreStats(lookups=3, hits_host=2), StoreStats(lookups=5, hits_host=1)])
        >>> total.lookups, total.hits_host
        (8, 3)
    """
    total = StoreStats()
    for f in fields(StoreStats):
        setattr(total, f.name, sum(getattr(s, f.name) for s in stats))
    return total


def run_replicas(model, tokenizer, trace: Trace, cfg: ReplayConfig, *, replicas: int = 2, balancer: str = "random",
                 remote: str | None = None, disk: bool = True, host_bytes: int | None = None,
                 label: str | None = None, progress: bool = True) -> ReplayRun:
    """`replicas` pipelines, each over a fresh store with its own host tier (`host_bytes` each, by default
    `host_capacity` of the trace) and temporary disk tier (unless not `disk`); with `remote`, all share that
    Redis.

    The model is shared (one process, one turn at a time): what differs between replicas is only their stores.
    """
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"`replicas` must be a positive integer, got {replicas!r}")
    host_bytes = host_bytes or host_capacity(model, tokenizer, trace, cfg)[0]
    label = label or f"{replicas} replicas, {balancer}" + (", shared Redis tier" if remote else ", no shared tier")
    started = time.perf_counter()
    histories: dict = {}
    with tempfile.TemporaryDirectory(prefix="attnstore-replicas-") as folder:
        stores = []
        try:
            for r in range(replicas):
                disk_dir = Path(folder) / f"replica{r}" if disk else None
                stores.append(AttnStore(host_bytes=host_bytes, disk_dir=disk_dir, disk_bytes=1 << 50, policy="lru",
                                        tuning=StoreTuning(idle_flush_s=0.05), remote=remote))
            # No prefetching: the driver submits one turn at a time, so a prefetch could overlap nothing and
            # would only relabel a load from disk or Redis as a host hit.
            pipes = [ChatPipeline(model, tokenizer, store, context_window=cfg.context_window,
                                  max_new_tokens=cfg.max_new_tokens,
                                  tuning=PipelineTuning(histories=histories, prefetch_window=0))
                     for store in stores]
            try:
                records, end = drive_replicas(pipes, stores, trace, balancer, cfg.seed, label=label,
                                              timeout_s=cfg.timeout_s, progress=progress)
            finally:
                for pipe in pipes:
                    pipe.close()
            stats = sum_stats([store.stats() for store in stores])
        finally:
            for store in stores:
                store.close()
    return ReplayRun(label, records, end, time.perf_counter() - started, host_bytes=host_bytes * replicas,
                     stats=stats)
