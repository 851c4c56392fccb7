"""R replicas sharing one remote tier of bandwidth B, on paper: where the shared tier becomes the bottleneck, and
what session affinity buys (the `replicas` section of ``eval/simulate.py``).

The serving model, deliberately small (the single-replica simulator, `lab/simulation.py`, models the tiers inside a
replica; here only what R of them share matters):

* Conversations arrive as a Poisson process (`rate_per_replica` x R sessions per second); each turn follows the
  previous reply after an exponential think time (`think_s`). A turn's history is what the conversation holds
  before it (cut to the model's window); its new tokens, the user message; then the reply.
* Routing: ``affinity`` sends every turn of a session to one replica (the router's ``manual`` policy keyed by the
  session, or ``cache_aware`` when it works); ``round_robin`` sends turns in arrival order to replicas 0, 1, ..,
  R-1, 0, ... so a session's turn lands where its previous turn ran with probability about 1/R.
* Each replica holds its own sessions in host memory (no capacity limit: the point is the shared tier). A turn on
  the replica that ran the session's previous turn loads its history at `host_gbps`; on another replica, from the
  shared tier, whose link (one FIFO of `remote_gbps`) also carries every turn's new KV written behind it (what
  makes failover and round robin possible at all). A turn's time to first token: waiting for the link, the load,
  the prefill of its new tokens (GPU queueing is left out: prefill keeps the GPUs a few percent busy at these
  rates, and decoding is batched). "Recompute" is the alternative to a remote load: prefilling the whole history.

Example:
    >>> from hf_attnstore.lab.simulation import PROFILES
    >>> r = simulate_replicas([[(100, 50), (20, 40)]] * 50, PROFILES["llama-13b"], ReplicaSimConfig(replicas=2))
    >>> r.turns, round(r.moved, 2) <= 1.0
    (100, True)
"""

from __future__ import annotations

import heapq
import random
import statistics
from dataclasses import dataclass, field

from .simulation import ModelProfile


@dataclass(frozen=True)
class ReplicaSimConfig:
    """One configuration of the replicas' model (see the module's docstring).

    Example:
        >>> ReplicaSimConfig(replicas=8, remote_gbps=12.5, routing="affinity").routing
        'affinity'
    """

    replicas: int = 2
    remote_gbps: float = 12.5  # the shared tier's aggregate bandwidth (a 100 GbE Redis cluster)
    host_gbps: float = 25.0  # a replica's host memory -> GPU
    routing: str = "round_robin"
    rate_per_replica: float = 0.05  # new conversations per second per replica
    think_s: float = 30.0
    seed: int = 0

    def __post_init__(self):
        if self.routing not in ("round_robin", "affinity"):
            raise ValueError(f"`routing` must be 'round_robin' or 'affinity', got {self.routing!r}")
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"`replicas` must be a positive integer, got {self.replicas!r}")
        for name in ("remote_gbps", "host_gbps", "rate_per_replica", "think_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}` must be positive, got {getattr(self, name)!r}")


@dataclass
class ReplicaSimResult:
    """What a run measured: resumed turns' TTFT (and recomputation's), the link's utilization and waits."""

    turns: int = 0
    resumed_ttft_s: list[float] = field(default_factory=list)
    recompute_ttft_s: list[float] = field(default_factory=list)  # the same turns had they recomputed the history
    link_wait_s: list[float] = field(default_factory=list)
    moved: float = 0.0  # share of resumed turns that ran on another replica than the previous turn
    link_utilization: float = 0.0
    gpu_utilization: float = 0.0  # prefill only

    def mean_ttft(self) -> float:
        return statistics.mean(self.resumed_ttft_s) if self.resumed_ttft_s else float("nan")


def simulate_replicas(conversations: list[list[tuple[int, int]]], profile: ModelProfile,
                      cfg: ReplicaSimConfig) -> ReplicaSimResult:
    """Runs the conversations (each a list of (new tokens, reply tokens) turns) through `cfg`'s replicas.

    Example:
        >>> from hf_attnstore.lab.simulation import PROFILES
        >>> simulate_replicas([[(10, 10)]], PROFILES["llama-13b"], ReplicaSimConfig()).turns
        1
    """
    rng = random.Random(cfg.seed)
    result = ReplicaSimResult()
    events: list[tuple[float, int, int, int]] = []  # (time, sequence, conversation, turn)
    now = 0.0
    for c in range(len(conversations)):
        now += rng.expovariate(cfg.rate_per_replica * cfg.replicas)
        heapq.heappush(events, (now, c, c, 0))
    seq = len(conversations)
    gpu_busy = 0.0
    link_free, link_busy = 0.0, 0.0
    history = [0] * len(conversations)
    last = [-1] * len(conversations)
    counter = moved = resumed = 0
    bpt, window = profile.kv_bytes_per_token, profile.context_window
    end = 0.0
    while events:
        t, _, c, k = heapq.heappop(events)
        new, reply = conversations[c][k]
        replica = c % cfg.replicas if cfg.routing == "affinity" else counter % cfg.replicas
        counter += 1
        hist = min(history[c], max(0, window - new - reply))
        load, wait = 0.0, 0.0
        if k > 0 and hist:
            resumed += 1
            if replica == last[c]:
                load = hist * bpt / (cfg.host_gbps * 1e9)
            else:
                moved += 1
                start = max(t, link_free)
                wait = start - t
                load = hist * bpt / (cfg.remote_gbps * 1e9)
                link_free = start + load
                link_busy += load
        prefill = new * profile.prefill_s_per_token
        gpu_busy += prefill
        ttft = wait + load + prefill  # GPUs stay a few % busy at these rates: their queueing is left out
        if k > 0 and hist:
            result.resumed_ttft_s.append(ttft)
            result.link_wait_s.append(wait)
            result.recompute_ttft_s.append((hist + new) * profile.prefill_s_per_token)
        # The turn's new KV is written behind it over the link (the other replicas' only way to resume it). Queued
        # in turn order (at its arrival rather than after its reply: the events stay in time order, one FIFO).
        written = (new + reply) * bpt / (cfg.remote_gbps * 1e9)
        done = t + ttft + reply * profile.decode_s_per_step
        link_free = max(link_free, t) + written
        link_busy += written
        history[c], last[c] = hist + new + reply, replica
        result.turns += 1
        end = max(end, done, link_free)
        if k + 1 < len(conversations[c]):
            seq += 1
            heapq.heappush(events, (done + rng.expovariate(1.0 / cfg.think_s), seq, c, k + 1))
    result.moved = moved / resumed if resumed else 0.0
    result.link_utilization = link_busy / end if end else 0.0
    result.gpu_utilization = gpu_busy / (end * cfg.replicas) if end else 0.0
    return result
