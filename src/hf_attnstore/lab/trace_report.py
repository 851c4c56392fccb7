"""The table of `attnstore simulate --trace`: policies × capacities beside the bounds, and what hits save.

Cost model (the profiles of :mod:`hf_attnstore.lab.simulation`): the missed tokens are prefilled at the
profile's rate; hit tokens are read from host memory over PCIe and from disk at the SSD's bandwidth, layer by
layer while the missed tokens are computed (AttentionStore's layer-wise pre-loading), so a request's prefill takes
``max(prefill of the misses, reading of the hits)``. Prefill time is linear in tokens, as in the paper's model:
attention's quadratic part is left out, which understates what long hits save. Without `instances` a request's
TTFT is its prefill alone (no queueing); with them it waits for one of that many prefill instances
(:mod:`hf_attnstore.lab.trace_queue`), and the policies look ahead into the queue the load makes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .simulation import PROFILES, ModelProfile
from .trace_queue import PrefillCluster, no_cache_ttft_s, utilization
from .trace_sim import (TraceResult, TraceSimConfig, belady_hit_rate, belady_hits, infinite_hit_rate,
                        reuse_gap_histogram, simulate_trace)
from .traces import TraceRequest

DEFAULT_POLICIES = ("lru", "lru-leaf", "retention", "slru", "density")
DEFAULT_MODELS = ("llama-13b", "llama-70b")


@dataclass(frozen=True)
class Bandwidths:
    """Read bandwidths of the tiers, bytes/s (PCIe 4.0 x16 for host memory; one NVMe SSD for disk).

    Example:
        >>> from hf_attnstore.lab.traces import TraceRequest
        >>> result = simulate_trace([TraceRequest(0, 512, 1, (1,))] * 2, TraceSimConfig(host_tokens=512))
        >>> slow = request_costs(result, PROFILES["llama-13b"], Bandwidths(host=1e9))  # the second request's KV read
        >>> slow["ttft_mean_s"] > request_costs(result, PROFILES["llama-13b"])["ttft_mean_s"]
        True
    """

    host: float = 25e9
    disk: float = 5e9

    def __post_init__(self):
        if not (self.host > 0 and self.disk > 0):
            raise ValueError(f"bandwidths must be positive, got host={self.host!r}, disk={self.disk!r}")


def prefill_seconds(profile: ModelProfile, bw: Bandwidths = Bandwidths()):
    """The service time of one request's prefill under `profile`: ``f(request, host_hits, disk_hits)`` seconds.

    Example:
        >>> from hf_attnstore.lab.traces import TraceRequest
        >>> seconds = prefill_seconds(PROFILES["llama-13b"])
        >>> round(seconds(TraceRequest(0, 1000, 1, (1, 2)), 512, 0), 4)  # 488 missed tokens at 1.7e-4 s
        0.083
    """
    return lambda request, host, disk: _prefill_s(profile, bw, request.input_length, host, disk)


def _prefill_s(profile: ModelProfile, bw: Bandwidths, tokens: int, host: int, disk: int) -> float:
    """A prompt of `tokens` with these hits: the misses prefilled while the hits are read, layer by layer."""
    compute = (tokens - host - disk) * profile.prefill_s_per_token
    return max(compute, profile.kv_bytes_per_token * (host / bw.host + disk / bw.disk))


def request_costs(result: TraceResult, profile: ModelProfile, bw: Bandwidths = Bandwidths(),
                  cluster: PrefillCluster | None = None, no_cache: list[float] | None = None) -> dict[str, float]:
    """Prefill GPU time saved and TTFT statistics of one replay under one model.

    Args:
        cluster: The prefill cluster the replay ran on (its waits count in TTFT); None for no queueing.
        no_cache: With a cluster, every request's TTFT on it with no cache (:func:`no_cache_ttft_s`).

    Returns:
        ``gpu_hours_saved`` (GPU-hours of prefill the hits avoid, all the model's GPUs), ``prefill_saved``
        (the share of recomputation's prefill time), ``ttft_mean_s``, ``ttft_p99_s``, ``ttft_mean_none_s`` and
        ``ttft_p99_none_s`` (with no cache, for comparison); with a cluster also ``wait_mean_s`` and
        ``queued_mean`` (requests queued behind a request when it started: its look-ahead).

    Example:
        >>> from hf_attnstore.lab.traces import TraceRequest
        >>> r = simulate_trace([TraceRequest(0, 512, 1, (1,))] * 2, TraceSimConfig(host_tokens=512))
        >>> request_costs(r, PROFILES["llama-13b"])["prefill_saved"]
        0.5
    """
    ttft, none = [], []
    saved_s = 0.0
    for n, h, d in zip(result.input_tokens, result.host_hits, result.disk_hits):
        ttft.append(_prefill_s(profile, bw, n, h, d))
        none.append(n * profile.prefill_s_per_token)
        saved_s += (h + d) * profile.prefill_s_per_token
    out = {"gpu_hours_saved": saved_s * profile.gpus / 3600, "prefill_saved": saved_s / max(sum(none), 1e-12)}
    if cluster is not None:
        if no_cache is None or len(no_cache) != len(ttft) or len(cluster.waits_s) != len(ttft):
            raise ValueError("a cluster's costs need the cluster the replay ran on and its no-cache TTFTs")
        ttft, none = cluster.ttft_s(), no_cache
        out.update(wait_mean_s=sum(cluster.waits_s) / len(ttft), queued_mean=sum(cluster.queued) / len(ttft))
    return out | {"ttft_mean_s": sum(ttft) / len(ttft), "ttft_p99_s": _p99(ttft),
                  "ttft_mean_none_s": sum(none) / len(none), "ttft_p99_none_s": _p99(none)}


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]


def run_table(requests: list[TraceRequest], host_tokens: list[int], policies: list[str] = list(DEFAULT_POLICIES),
              disk_tokens: int = 0, window: int = 0, models: list[str] = list(DEFAULT_MODELS),
              bw: Bandwidths = Bandwidths(), instances: int = 0) -> dict:
    """Every policy at every capacity, with the bounds and the costs: the JSON object `simulate --json` prints.

    With `instances`, every replay runs on a prefill cluster of that many instances of the one model in `models`
    (the queue, and so the look-ahead, is the load's; ``window`` then caps it), and TTFT includes the waits.

    Example:
        >>> from hf_attnstore.lab.traces import TraceRequest
        >>> reqs = [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(1, 1000, 1, (1, 3))]
        >>> run_table(reqs, [1024], ["lru"], models=[])["results"][0]["token_hit_rate"]
        0.2529...
    """
    unknown = [m for m in models if m not in PROFILES]
    if unknown:
        raise ValueError(f"`models` {unknown} unknown; choose from {', '.join(sorted(PROFILES))}")
    if not host_tokens:
        raise ValueError("`host_tokens` must name at least one capacity")
    cluster_of, load, no_cache = None, None, None
    if instances:
        if len(models) != 1:
            raise ValueError(f"`instances`={instances} simulates one model's prefill cluster: name exactly one model "
                             f"(got {len(models)})")
        service = prefill_seconds(PROFILES[models[0]], bw)
        load = utilization(requests, instances, service)
        no_cache = no_cache_ttft_s(requests, instances, service)
        cluster_of = lambda: PrefillCluster(requests, instances, service)  # noqa: E731
    configs = [TraceSimConfig(h, p, disk_tokens=disk_tokens, window=window) for h in host_tokens for p in policies]
    infinite = infinite_hit_rate(requests)
    bounds = []
    for h in host_tokens:
        b = {"host_tokens": h, "infinite": infinite, "belady": belady_hit_rate(requests, h),
             "belady_leaf": belady_hit_rate(requests, h, leaf_ties=True)}
        if disk_tokens:
            b["belady_host_and_disk"] = belady_hit_rate(requests, h + disk_tokens)
        bounds.append(b)
    # A policy is compared with Belady at the capacity it has: host memory, plus the disk tier when there is one.
    belady = {b["host_tokens"]: b.get("belady_host_and_disk", b["belady"]) for b in bounds}
    results = []
    for cfg in configs:
        cluster = cluster_of() if cluster_of else None
        r = simulate_trace(requests, cfg, cluster)
        row = {"host_tokens": cfg.host_tokens, "policy": cfg.policy, "token_hit_rate": r.token_hit_rate,
               "host_hit_rate": r.host_hit_rate, "of_belady": r.token_hit_rate / belady[cfg.host_tokens]
               if belady[cfg.host_tokens] else None,
               "costs": {m: request_costs(r, PROFILES[m], bw, cluster, no_cache) for m in models}}
        results.append(row)
    return {"requests": len(requests), "input_tokens": sum(r.input_length for r in requests),
            "disk_tokens": disk_tokens, "window": window, "instances": instances, "utilization": load,
            "results": results, "bounds": bounds}


def _tokens(n: int) -> str:
    if n < 1000:
        return str(n)
    return f"{n / 1e6:g}M" if n >= 100_000 else f"{n / 1e3:g}K"


def format_tables(table: dict) -> str:
    """The hit-rate table (capacity × policy, with the bounds) and the cost table, as Markdown.

    Example:
        >>> from hf_attnstore.lab.traces import TraceRequest
        >>> reqs = [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(1, 1000, 1, (1, 3))]
        >>> print(format_tables(run_table(reqs, [1024], ["lru"], models=[])).splitlines()[0])
        2 requests, 2,024 input tokens; look-ahead window 0 requests.
    """
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    policies = list(dict.fromkeys(r["policy"] for r in table["results"]))
    by = {(r["host_tokens"], r["policy"]): r for r in table["results"]}
    disk = table["disk_tokens"]
    instances = table.get("instances") or 0
    if instances:
        model = PROFILES[next(iter(table["results"][0]["costs"]))].name if table["results"] else "?"
        ahead = (f"look-ahead: the queue of a prefill cluster of {instances} {model} instances (offered load "
                 f"{100 * table['utilization']:.0f}% with no cache)"
                 + (f", at most {table['window']} requests" if table["window"] else ""))
    else:
        ahead = f"look-ahead window {table['window']} requests"
    lines = [f"{table['requests']} requests, {table['input_tokens']:,} input tokens; " + ahead
             + (f"; disk tier {_tokens(disk)} tokens" if disk else "") + ".", "",
             "| host tokens | " + " | ".join(policies) + " | Belady | Belady (leaf ties) | infinite |"
             + (" Belady (host + disk) |" if disk else ""),
             "| --- " * (len(policies) + 4) + ("| --- " if disk else "") + "|"]
    for b in table["bounds"]:
        h = b["host_tokens"]
        cells = [f"{pct(by[h, p]['token_hit_rate'])} ({by[h, p]['of_belady']:.2f})" for p in policies]
        extra = f" {pct(b['belady_host_and_disk'])} |" if disk else ""
        lines.append(f"| {_tokens(h)} | " + " | ".join(cells)
                     + f" | {pct(b['belady'])} | {pct(b['belady_leaf'])} | {pct(b['infinite'])} |" + extra)
    of = " at host + disk capacity)." if disk else ")."
    lines += ["", "Cells: token hit rate (its fraction of Belady's" + of, ""]
    models = list(table["results"][0]["costs"]) if table["results"] else []
    if models and instances:
        lines += ["| model | host tokens | policy | prefill saved | queue seen (mean) | mean wait | mean TTFT "
                  "| p99 TTFT | mean / p99 TTFT, no cache |", "| --- " * 9 + "|"]
        for r in table["results"]:
            for m, c in r["costs"].items():
                lines.append(f"| {PROFILES[m].name} | {_tokens(r['host_tokens'])} | {r['policy']} | "
                             f"{pct(c['prefill_saved'])} | {c['queued_mean']:.1f} | {c['wait_mean_s']:.2f} s | "
                             f"{c['ttft_mean_s']:.2f} s | {c['ttft_p99_s']:.2f} s | "
                             f"{c['ttft_mean_none_s']:.2f} / {c['ttft_p99_none_s']:.2f} s |")
    elif models:
        lines += ["| model | host tokens | policy | prefill saved | GPU-hours saved | mean TTFT | p99 TTFT "
                  "| p99 TTFT, no cache |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for m in models:
            for r in table["results"]:
                c = r["costs"][m]
                lines.append(f"| {PROFILES[m].name} | {_tokens(r['host_tokens'])} | {r['policy']} | "
                             f"{pct(c['prefill_saved'])} | {c['gpu_hours_saved']:.2f} | {c['ttft_mean_s']:.2f} s | "
                             f"{c['ttft_p99_s']:.2f} s | {c['ttft_p99_none_s']:.2f} s |")
    return "\n".join(lines)


def gap_table(requests: list[TraceRequest], host_tokens: int, policies: list[str], window: int = 0) -> str:
    """Markdown: by reuse distance (requests since a block's last use), the tokens reused and the share of them
    each policy and Belady hit at one capacity: where a policy loses to the optimum.

    Example:
        >>> from hf_attnstore.lab.traces import TraceRequest
        >>> reqs = [TraceRequest(0, 512, 1, (1,)), TraceRequest(1, 512, 1, (2,)), TraceRequest(2, 512, 1, (1,))]
        >>> print(gap_table(reqs, 512, ["lru"]))  # doctest: +NORMALIZE_WHITESPACE
        Reuses by distance at 512 tokens of host memory (share of the reused tokens each one hits):
        <BLANKLINE>
        | gap (requests) | reused tokens | lru | Belady |
        | --- | --- | --- | --- |
        | 2-3 | 512 | 0% | 100% |
    """
    columns = {p: simulate_trace(requests, TraceSimConfig(host_tokens, p, window=window)).host_hits for p in policies}
    columns["Belady"] = belady_hits(requests, host_tokens)
    hists = {name: reuse_gap_histogram(requests, hits) for name, hits in columns.items()}
    gaps = hists["Belady"]
    lines = [f"Reuses by distance at {_tokens(host_tokens)} tokens of host memory (share of the reused tokens each "
             "one hits):", "", "| gap (requests) | reused tokens | " + " | ".join(columns) + " |",
             "| --- " * (len(columns) + 2) + "|"]
    for g, (reused, _) in gaps.items():
        cells = [f"{100 * hists[name][g][1] / reused:.0f}%" for name in columns]
        lines.append(f"| {g}-{2 * g - 1} | {reused:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
