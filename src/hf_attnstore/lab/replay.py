"""Replaying real ShareGPT conversations through a ChatPipeline, with and without the store.

`attnstore replay` runs the same trace twice or more: RE (recomputation, a pipeline without a store) and
AS (this library, one run per policy). The trace fixes everything that must not differ between runs:

* the conversations: K multi-turn ShareGPT conversations, user messages and recorded replies clipped to a
  token budget;
* the arrivals: sessions arrive as a Poisson process, and a session's next turn arrives an exponential
  think time after its previous reply ends (both drawn once from a seed);
* the replies: by default each turn reads the recorded reply (``ChatPipeline.submit(reply=...)``: teacher
  forcing), so histories grow as in the real conversation and are the same in every run; or the model
  generates its own (``replies="generate"``).

Time is virtual: one server runs the queued turns in arrival order, and each turn takes as long as it
took on this machine. The driver submits a turn to the pipeline once the virtual clock passes its arrival,
so the pipeline's queue (and its prefetch hints) holds exactly the turns that are waiting. A turn that
arrives while another runs is submitted when that one ends, so prefetching for it cannot overlap the
running turn: the replay understates what prefetching gains.
"""

from __future__ import annotations

import heapq
import random
import statistics
import tempfile
import time
from collections import deque
from dataclasses import dataclass

from ..cache.chat import clip_text
from .costs import CostModel
from .data import load_sharegpt
from ..serving.pipeline import ChatPipeline, PipelineTuning, Reply
from ..store import AttnStore, StoreTuning
from ..store.stats import StoreStats


@dataclass(frozen=True)
class ReplayConfig:
    """What a replay replays and how.

    Args:
        conversations: K, the number of ShareGPT conversations (the first K with at least 2 user turns).
        arrival_rate: Session arrivals per second of virtual time (Poisson).
        think_time_s: Mean user think time between a reply and the next turn (exponential).
        max_turns: User turns per conversation at most (``None``: all).
        max_user_tokens, max_reply_tokens: Each message and recorded reply is clipped to this many tokens.
        replies: ``"trace"`` (read the recorded replies) or ``"generate"`` (the model answers).
        max_new_tokens: Reply length when generating.
        context_window: Tokens the model sees; an overflowing turn drops the oldest half (both RE and AS).
        host_fraction: Host tier capacity as a share of all sessions' final KV (capped at the window).
        disk: Give AS a disk tier for all sessions.
        seed: Seed of arrivals and think times.
        timeout_s: Longest wait for one turn.
        rejoin: Replay whole conversations, joining the parts the packaged (split) ShareGPT cut apart.

    Example:
        >>> ReplayConfig(conversations=10, max_turns=3, context_window=1024).max_user_tokens
        256
        >>> ReplayConfig(max_user_tokens=600, context_window=1024)
        Traceback (most recent call last):
        ...
        ValueError: `max_user_tokens` (600) must be under half the context window (1024) so that a message fits ...
    """

    conversations: int = 40
    arrival_rate: float = 0.1
    think_time_s: float = 30.0
    max_turns: int | None = None
    max_user_tokens: int = 256
    max_reply_tokens: int = 512
    replies: str = "trace"
    max_new_tokens: int = 32
    context_window: int = 2048
    host_fraction: float = 0.25
    disk: bool = True
    seed: int = 0
    timeout_s: float = 600.0
    rejoin: bool = False

    def __post_init__(self):
        for name in ("conversations", "max_user_tokens", "max_reply_tokens", "max_new_tokens", "context_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        if self.max_turns is not None and (not isinstance(self.max_turns, int) or self.max_turns < 1):
            raise ValueError(f"`max_turns` must be a positive integer or None, got {self.max_turns!r}")
        if not self.arrival_rate > 0 or not self.think_time_s >= 0 or not self.timeout_s > 0:
            raise ValueError("`arrival_rate` and `timeout_s` must be positive and `think_time_s` non-negative")
        if self.replies not in ("trace", "generate"):
            raise ValueError(f"`replies` must be 'trace' or 'generate', got {self.replies!r}")
        if not 0 < self.host_fraction:
            raise ValueError(f"`host_fraction` must be positive, got {self.host_fraction!r}")
        if 2 * self.max_user_tokens >= self.context_window:
            raise ValueError(f"`max_user_tokens` ({self.max_user_tokens}) must be under half the context window "
                             f"({self.context_window}) so that a message fits after truncation")


@dataclass(frozen=True)
class Trace:
    """Sessions, their turns (message, recorded reply or None) and when they arrive.

    Example:
        >>> trace = Trace(["s00000", "s00001"], [[("Hi", "Hello"), ("Bye", "Bye!")], [("Hey", None)]], [0.0, 4.2],
        ...               [[30.0, 12.5], [8.0]])
        >>> trace.num_turns
        3
    """

    session_ids: list[str]
    turns: list[list[tuple[str, str | None]]]
    arrivals: list[float]  # first turn of each session, virtual seconds
    think_s: list[list[float]]  # think time after each turn of each session

    @property
    def num_turns(self) -> int:
        return sum(len(t) for t in self.turns)


def build_trace(tokenizer, cfg: ReplayConfig, conversations=None) -> Trace:
    """The trace of `cfg` (ShareGPT unless `conversations`, objects with ``id`` and ``turns``, are given).

    Example:
        >>> from hf_attnstore import load_default_model
        >>> model, tokenizer = load_default_model()  # doctest: +SKIP
        >>> trace = build_trace(tokenizer, ReplayConfig(conversations=4, max_turns=3))  # doctest: +SKIP
        >>> len(trace.session_ids), trace.session_ids[0], trace.num_turns <= 12  # doctest: +SKIP
        (4, 's00000', True)
    """
    convs = conversations if conversations is not None else load_sharegpt(limit=cfg.conversations, min_user_turns=2,
                                                                          rejoin=cfg.rejoin)
    rng = random.Random(cfg.seed)
    ids, turns, arrivals, thinks, t = [], [], [], [], 0.0
    for i, conv in enumerate(convs[: cfg.conversations]):
        pairs = conv.turns[: cfg.max_turns]
        turns.append([(clip_text(tokenizer, u, cfg.max_user_tokens),
                       clip_text(tokenizer, r, cfg.max_reply_tokens) if cfg.replies == "trace" else None)
                      for u, r in pairs])
        ids.append(f"s{i:05d}")  # ShareGPT ids repeat across splits; the index keeps sessions apart
        t += rng.expovariate(cfg.arrival_rate)
        arrivals.append(t)
        thinks.append([rng.expovariate(1 / cfg.think_time_s) if cfg.think_time_s else 0.0 for _ in pairs])
    return Trace(ids, turns, arrivals, thinks)


@dataclass(frozen=True)
class TurnRecord:
    """One replayed turn: when it arrived and started (virtual seconds) and the pipeline's reply.

    Example:
        >>> from types import SimpleNamespace
        >>> reply = SimpleNamespace(ttft_s=0.2)  # the pipeline's Reply: its own TTFT, 0.2 s
        >>> TurnRecord(session=0, turn=1, arrival_s=10.0, start_s=10.5, reply=reply).ttft_queued_s  # 0.5 s queued
        0.7
    """

    session: int
    turn: int
    arrival_s: float
    start_s: float
    reply: Reply
    replica: int = 0  # which server ran it (replicas.py; one server otherwise)

    @property
    def ttft_queued_s(self) -> float:
        """TTFT as the user sees it: waiting in the queue plus the turn's own TTFT."""
        return self.start_s - self.arrival_s + self.reply.ttft_s


@dataclass
class ReplayRun:
    """The outcome of one system on a trace.

    Example:
        >>> from hf_attnstore import load_default_model
        >>> model, tokenizer = load_default_model()  # doctest: +SKIP
        >>> cfg = ReplayConfig(conversations=4, max_turns=3)
        >>> trace = build_trace(tokenizer, cfg)  # doctest: +SKIP
        >>> run = run_store(model, tokenizer, trace, cfg, progress=False)  # doctest: +SKIP
        >>> run.summary()["turns"] == trace.num_turns  # doctest: +SKIP
        True
    """

    label: str
    records: list[TurnRecord]
    makespan_s: float
    wall_s: float
    host_bytes: int = 0  # host tier capacity
    peak_host_bytes: int = 0
    peak_disk_bytes: int = 0
    stats: StoreStats | None = None

    def summary(self, cost_model: CostModel | None = None) -> dict:
        """Means over all turns and over resumed turns (a session's second turn on), hit rates by tier of
        resumed turns, prefill throughput (prompt tokens, history included, per second of prefill),
        compute time and the cost model."""
        cost_model = cost_model or CostModel()
        replies = [r.reply for r in self.records]
        resumed = [r.reply for r in self.records if r.turn > 0]
        queued = [r.ttft_queued_s for r in self.records if r.turn > 0]
        by_tier = {k: sum(r.tier == k for r in resumed) for k in ("host", "disk", "remote", "miss")}
        compute = sum(r.total_s for r in replies)
        # Storage is charged for the capacity provisioned: the host tier's limit, the disk's peak use.
        cost = cost_model.cost(compute, self.host_bytes if self.stats else 0, self.peak_disk_bytes, self.makespan_s)
        n = max(1, len(resumed))
        return {
            "label": self.label,
            "turns": len(replies),
            "resumed": len(resumed),
            "truncated": sum(r.dropped_tokens > 0 for r in replies),
            "ttft_ms": 1000 * statistics.mean(r.ttft_s for r in replies),
            "ttft_resumed_ms": 1000 * statistics.mean(r.ttft_s for r in resumed) if resumed else float("nan"),
            "ttft_resumed_p90_ms": 1000 * _quantile([r.ttft_s for r in resumed], 0.9),
            "ttft_queued_resumed_ms": 1000 * statistics.mean(queued) if queued else float("nan"),
            "prefill_tok_s": sum(r.history_tokens for r in replies) / sum(r.ttft_s for r in replies),
            "prefill_tok_s_resumed": (sum(r.history_tokens for r in resumed) / sum(r.ttft_s for r in resumed)
                                      if resumed else float("nan")),
            "reused_share": sum(r.reused_tokens for r in replies) / sum(r.history_tokens for r in replies),
            "hit_host": by_tier["host"] / n,
            "hit_disk": by_tier["disk"] / n,
            "hit_remote": by_tier["remote"] / n,
            "miss": by_tier["miss"] / n if self.stats else 1.0,
            "compute_s": compute,
            "prefill_s": sum(r.ttft_s for r in replies),
            "makespan_s": self.makespan_s,
            "cost": cost,
            "cost_usd": cost["total"],
        }


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def drive(pipe: ChatPipeline, trace: Trace, *, label: str = "", timeout_s: float = 600.0, progress: bool = True,
          on_turn=None) -> tuple[list[TurnRecord], float]:
    """Runs `trace` through `pipe` in virtual time (see the module docstring).

    Returns:
        The turns in the order they ran, and the virtual time the last one ended.
    """
    from tqdm.auto import tqdm

    pending = [(t, i, 0) for i, t in enumerate(trace.arrivals)]
    heapq.heapify(pending)
    running: deque = deque()
    records: list[TurnRecord] = []
    now = 0.0
    with tqdm(total=trace.num_turns, desc=label, disable=not progress, unit="turn") as bar:
        while pending or running:
            while pending and pending[0][0] <= now:  # arrived before the server is free: in the queue
                t, i, k = heapq.heappop(pending)
                message, reply = trace.turns[i][k]
                running.append((i, k, t, pipe.submit(trace.session_ids[i], message, reply=reply)))
            if not running:
                now = pending[0][0]  # the server idles until the next arrival
                continue
            i, k, t, future = running.popleft()
            reply = future.result(timeout_s)
            start = max(now, t)
            now = start + reply.total_s
            records.append(TurnRecord(i, k, t, start, reply))
            if on_turn is not None:
                on_turn()
            bar.update()
            if k + 1 < len(trace.turns[i]):
                heapq.heappush(pending, (now + trace.think_s[i][k], i, k + 1))
    return records, now


def kv_bytes_per_token(model) -> int:
    """Bytes of KV the store keeps per token of `model` (every layer's keys and values, in the model's dtype).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        >>> kv_bytes_per_token(model)  # 2 layers x (keys + values) x 2 KV heads x head_dim 4 x 4 bytes (fp32)
        128
    """
    from ..cache.fingerprint import kv_geometry
    from ..store.format import bytes_per_token

    return bytes_per_token(kv_geometry(model), next(model.parameters()).element_size())


def host_capacity(model, tokenizer, trace: Trace, cfg: ReplayConfig) -> tuple[int, int]:
    """`cfg.host_fraction` of the sessions' final KV (each capped at the context window), and at least the
    largest session (its capped KV plus a reply), which the store would otherwise refuse to keep.

    Returns:
        The host tier's bytes, and the estimate of all sessions' final KV bytes it is a share of.
    """
    reply_max = cfg.max_reply_tokens if cfg.replies == "trace" else cfg.max_new_tokens
    sizes = []
    for turns in trace.turns:
        tokens = sum(len(tokenizer(u)["input_ids"]) + (len(tokenizer(r)["input_ids"]) if r is not None
                                                        else cfg.max_new_tokens) + 8 for u, r in turns)
        sizes.append(min(tokens, cfg.context_window))
    per_token = kv_bytes_per_token(model)
    largest = max(sizes) + reply_max + 16
    return int(max(cfg.host_fraction * sum(sizes), largest) * per_token), sum(sizes) * per_token


def run_recompute(model, tokenizer, trace: Trace, cfg: ReplayConfig, progress: bool = True) -> ReplayRun:
    """RE: every turn recomputes its whole (token-truncated) history.

    Example:
        >>> from hf_attnstore import load_default_model
        >>> model, tokenizer = load_default_model()  # doctest: +SKIP
        >>> cfg = ReplayConfig(conversations=4, max_turns=3)
        >>> trace = build_trace(tokenizer, cfg)  # doctest: +SKIP
        >>> run = run_recompute(model, tokenizer, trace, cfg, progress=False)  # doctest: +SKIP
        >>> run.label, len(run.records) == trace.num_turns  # every turn recomputes its whole history  # doctest: +SKIP
        ('RE', True)
    """
    started = time.perf_counter()
    with ChatPipeline(model, tokenizer, None, context_window=cfg.context_window,
                      max_new_tokens=cfg.max_new_tokens) as pipe:
        records, end = drive(pipe, trace, label="RE", timeout_s=cfg.timeout_s, progress=progress)
    return ReplayRun("RE", records, end, time.perf_counter() - started)


def run_store(model, tokenizer, trace: Trace, cfg: ReplayConfig, *, policy: str = "lookahead",
              prefetch: bool = True, host_bytes: int | None = None, disk: bool | None = None,
              label: str | None = None, progress: bool = True) -> ReplayRun:
    """AS: the pipeline over a fresh AttnStore (host tier, and a temporary disk tier for all sessions
    unless `disk` or `cfg.disk` says otherwise)."""
    host_bytes = host_bytes or host_capacity(model, tokenizer, trace, cfg)[0]
    disk = cfg.disk if disk is None else disk
    label = label or f"AS {policy}" + (" + prefetch" if prefetch else "")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="attnstore-replay-") as folder:
        store = AttnStore(host_bytes=host_bytes, disk_dir=folder if disk else None, disk_bytes=1 << 50,
                          policy=policy, tuning=StoreTuning(idle_flush_s=0.05))
        peaks = {"host": 0, "disk": 0}

        def sample():
            s = store.stats()
            peaks["host"] = max(peaks["host"], s.host_bytes_used)
            peaks["disk"] = max(peaks["disk"], s.disk_bytes_used)

        try:
            with ChatPipeline(model, tokenizer, store, context_window=cfg.context_window,
                              max_new_tokens=cfg.max_new_tokens,
                              tuning=PipelineTuning(prefetch_window=None if prefetch else 0)) as pipe:
                records, end = drive(pipe, trace, label=label, timeout_s=cfg.timeout_s, progress=progress,
                                     on_turn=sample)
            store.flush(cfg.timeout_s)
            sample()
            stats = store.stats()
        finally:
            store.close()
    return ReplayRun(label, records, end, time.perf_counter() - started, host_bytes=host_bytes,
                     peak_host_bytes=peaks["host"], peak_disk_bytes=peaks["disk"], stats=stats)


def same_outputs(a: ReplayRun, b: ReplayRun) -> tuple[int, int]:
    """(identical, compared): turns whose greedy tokens agree, over the turns of sessions that no
    truncation has touched yet in either run (after one, histories legitimately differ)."""
    index = {(r.session, r.turn): r.reply for r in b.records}
    touched: set[int] = set()
    same = compared = 0
    for r in sorted(a.records, key=lambda r: (r.session, r.turn)):
        other = index.get((r.session, r.turn))
        if other is None or r.session in touched or r.reply.dropped_tokens or other.dropped_tokens:
            touched.add(r.session)
            continue
        compared += 1
        same += r.reply.greedy_ids == other.greedy_ids
    return same, compared


def plot(runs: list[ReplayRun], path: str) -> None:
    """TTFT vs turn index, the CDF of resumed turns' TTFT, and hit rates by tier, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, NullFormatter

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.6))
    for run in runs:
        by_turn: dict[int, list[float]] = {}
        for r in run.records:
            by_turn.setdefault(r.turn + 1, []).append(1000 * r.reply.ttft_s)
        xs = sorted(k for k, v in by_turn.items() if len(v) >= 3)  # indices with too few turns are noise
        a.plot(xs, [statistics.mean(by_turn[k]) for k in xs], marker="o", ms=3, label=run.label)
        ttfts = sorted(1000 * r.reply.ttft_s for r in run.records if r.turn > 0)
        b.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post", label=run.label)
    a.set(xlabel="turn index", ylabel="mean TTFT (ms)", title="TTFT by turn (indices with >= 3 turns)")
    a.xaxis.set_major_locator(MaxNLocator(integer=True))
    b.set(xlabel="TTFT of resumed turns (ms, log)", ylabel="CDF", xscale="log", title="TTFT CDF (turns >= 2)")
    b.xaxis.set_minor_formatter(NullFormatter())
    stores = [run for run in runs if run.stats is not None]
    names = [run.label.removeprefix("AS ") for run in stores]
    summaries = [run.summary() for run in stores]
    bottom = [0.0] * len(stores)
    for key, tier, color in (("hit_host", "host", "tab:green"), ("hit_disk", "disk", "tab:orange"),
                             ("miss", "miss", "tab:red")):
        values = [100 * s[key] for s in summaries]
        c.bar(names, values, bottom=bottom, color=color, label=tier)
        bottom = [x + y for x, y in zip(bottom, values)]
    c.set(ylabel="% of resumed turns", title="where resumed turns found their KV", ylim=(0, 100))
    c.tick_params(axis="x", labelrotation=15)
    for ax in (a, b, c):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(model, tokenizer, cfg: ReplayConfig, policies: list[tuple[str, bool]], *, recompute: bool = True,
           plot_path: str | None = None, json_path: str | None = None, progress: bool = True,
           conversations=None, host_only: bool = False) -> list[ReplayRun]:
    """Runs RE and AS (one run per ``(policy, prefetch)``) on one trace and prints the comparison.

    With `host_only`, one more AS run has a host tier that holds every session and no disk: reuse without
    any tier traffic, the bound the tiered runs approach.

    Example:
        >>> from hf_attnstore import load_default_model
        >>> model, tokenizer = load_default_model()  # doctest: +SKIP
        >>> cfg = ReplayConfig(conversations=4, max_turns=3)
        >>> runs = report(model, tokenizer, cfg, [("lookahead", True)], progress=False)  # doctest: +SKIP
        >>> len(runs), runs[0].label  # recomputation, then one run over the store  # doctest: +SKIP
        (2, 'RE')
    """
    import json

    import torch

    trace = build_trace(tokenizer, cfg, conversations)
    host, all_kv = host_capacity(model, tokenizer, trace, cfg)
    runs = [run_recompute(model, tokenizer, trace, cfg, progress)] if recompute else []
    for policy, prefetch in policies:
        runs.append(run_store(model, tokenizer, trace, cfg, policy=policy, prefetch=prefetch, host_bytes=host,
                              progress=progress))
    if host_only:
        runs.append(run_store(model, tokenizer, trace, cfg, policy="lru", prefetch=False, host_bytes=2 * all_kv + host,
                              disk=False, label="AS host only (all fit)", progress=progress))
    costs = CostModel()
    rows = [run.summary(costs) for run in runs]
    base = rows[0] if recompute else None
    print(f"\n{len(trace.turns)} ShareGPT conversations{' (whole)' if cfg.rejoin else ''}, {trace.num_turns} turns "
          f"({trace.num_turns / len(trace.turns):.2f} per conversation); Poisson {cfg.arrival_rate}/s, think time "
          f"{cfg.think_time_s} s (virtual time); replies: {cfg.replies}; messages <= {cfg.max_user_tokens} tokens, "
          f"replies <= {cfg.max_reply_tokens if cfg.replies == 'trace' else cfg.max_new_tokens}; window "
          f"{cfg.context_window}; host tier {host / 2**20:.1f} MiB ({100 * host / all_kv:.0f}% of all sessions' KV)"
          f"{', disk for all' if cfg.disk else ''}")
    print(f"{type(model).__name__} {next(model.parameters()).dtype} on {model.device}, "
          f"{torch.get_num_threads()} threads\n")
    print("| system | TTFT turns >= 2 | vs RE | p90 | incl. queue | prefill tok/s | vs RE | from host | "
          "from disk | miss | truncated turns | compute | cost | vs RE |")
    print("| --- " * 14 + "|")
    for r in rows:
        rel = lambda key: f"{r[key] / base[key]:.2f}x" if base else ""  # noqa: E731
        print(f"| {r['label']} | {r['ttft_resumed_ms']:.0f} ms | {rel('ttft_resumed_ms')} | "
              f"{r['ttft_resumed_p90_ms']:.0f} ms | {r['ttft_queued_resumed_ms']:.0f} ms | {r['prefill_tok_s']:.0f} | "
              f"{rel('prefill_tok_s')} | {100 * r['hit_host']:.1f}% | {100 * r['hit_disk']:.1f}% | "
              f"{100 * r['miss']:.1f}% | {r['truncated']} | {r['compute_s']:.0f} s | ${r['cost_usd']:.4f} | "
              f"{rel('cost_usd')} |")
    print()
    for run, r in zip(runs, rows):
        if run.stats is None:
            continue
        s = run.stats
        print(f"{run.label}: reused {100 * r['reused_share']:.1f}% of prompt tokens; host peak "
              f"{run.peak_host_bytes / 2**20:.1f} MiB of {run.host_bytes / 2**20:.1f}; disk peak "
              f"{run.peak_disk_bytes / 2**20:.1f} MiB; written {s.bytes_written / 2**20:.0f} MiB, read "
              f"{s.bytes_read / 2**20:.0f} MiB; demotions {s.demotions}, prefetches {s.prefetches}; cost "
              f"GPU ${r['cost']['gpu']:.4f} + DRAM ${r['cost']['dram']:.6f} + SSD ${r['cost']['ssd']:.8f}")
        if recompute:
            same, compared = same_outputs(runs[0], run)
            print(f"  greedy tokens identical to RE on {same}/{compared} turns before any truncation")
    print(f"\nprices: GPU ${costs.gpu_per_hour}/h (this machine's compute time stands in for the GPU's), DRAM "
          f"${costs.dram_per_gb_hour}/GB·h, SSD ${costs.ssd_per_gb_hour}/GB·h over the virtual makespan")
    print("wall time: " + ", ".join(f"{run.label} {run.wall_s:.0f} s" for run in runs))
    if plot_path:
        plot(runs, plot_path)
        print(f"plot: {plot_path}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"config": cfg.__dict__, "summaries": rows,
                       "turns": {run.label: [dict(session=t.session, turn=t.turn, arrival_s=t.arrival_s,
                                                  start_s=t.start_s, ttft_s=t.reply.ttft_s, total_s=t.reply.total_s,
                                                  history=t.reply.history_tokens, reused=t.reply.reused_tokens,
                                                  dropped=t.reply.dropped_tokens, tier=t.reply.tier)
                                             for t in run.records] for run in runs}}, f, indent=1)
    return runs
