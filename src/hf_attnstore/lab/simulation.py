"""A discrete-event simulation of AttentionStore at paper scale, driven by the store's own placement code.

No model runs: a cost model gives each turn's prefill and decode time and KV size. What the simulation
shares with the store is what decides hit rates: the eviction policies (`hf_attnstore.store.policy`), the victim
choice and look-ahead windows (`store.placement`), the in-order prefetch that never evicts a session needed
sooner, and the truncation rule (`truncation.tokens_to_drop`). Tiers are inclusive as in the store: every
saved session is written to disk, so demoting a session from host memory costs nothing unless its disk
copy was dropped.

Serving model (stated in docs/benchmarks.md): sessions arrive as a Poisson process; a session's next turn
arrives an exponential think time after its previous reply; jobs wait in one FIFO queue for one of
`batch` slots of a continuously batching engine. A job takes ``stall + prefill_tokens * t_prefill +
reply_tokens * t_decode``; a disk hit that was not prefetched stalls for its read (one SSD queue).

Shared system prompts (prefix sharing, the store's `share_prefixes`): with a trace from
:func:`with_system_prompts`, each conversation opens with one of a few system prompts. With
``SimConfig.share_prefixes``, a prompt's KV is held once per tier while any session that begins with it is there
(the store's segment refcounts and hard links), and a session's first turn (or a miss) reuses the prompt when
another session holding it is in host memory (or on disk: read first). A session shares its prompt until a
truncation cuts into its history.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass, field
from itertools import islice

from ..cache.config import TruncationConfig
from ..store.policy import make_policy
from ..store.policy import (choose_head_drops, choose_recompute, choose_victims, head_drop_candidates,
                               lookahead_windows)
from ..cache.truncation import tokens_to_drop


@dataclass(frozen=True)
class ModelProfile:
    """Per-token costs of a served model (A100-class GPUs, fp16).

    Example:
        >>> profile = PROFILES["llama-13b"]
        >>> profile.name, profile.kv_bytes_per_token, profile.context_window, profile.gpus
        ('LLaMA-13B', 780000.0, 2048, 1)
        >>> tiny = ModelProfile("tiny", kv_bytes_per_token=1e4, prefill_s_per_token=1e-5, decode_s_per_step=0.01,
        ...                     context_window=512)
        >>> tiny.prefill_s_per_token * 1000  # seconds to prefill 1,000 tokens
        0.01
    """

    name: str
    kv_bytes_per_token: float
    prefill_s_per_token: float
    decode_s_per_step: float
    context_window: int
    gpus: int = 1  # A100s the model is served on (the prefill and decode times are those of the group)


# KV bytes per token from the paper. Prefill: 2 * params FLOP per token at 50% of 312 TFLOP/s per A100,
# across the GPUs the model needs (1 for 13B, 2 for 40B, 4 for 65B/70B). Decode: one step of a batch of
# jobs, bound by reading the weights and the batch's KV (~30-40 ms).
PROFILES = {
    "llama-13b": ModelProfile("LLaMA-13B", 0.78e6, 1.7e-4, 0.030, 2048, gpus=1),
    "llama-65b": ModelProfile("LLaMA-65B", 2.5e6, 2.1e-4, 0.040, 2048, gpus=4),
    "llama-70b": ModelProfile("LLaMA-70B", 0.31e6, 2.2e-4, 0.040, 4096, gpus=4),
    "falcon-40b": ModelProfile("Falcon-40B", 0.12e6, 2.6e-4, 0.035, 2048, gpus=2),
}


@dataclass
class SimConfig:
    """One simulated deployment.

    Args:
        host_bytes, disk_bytes: Tier capacities (0 disables a tier; both 0 is recomputation, RE).
        policy: ``"lookahead"``, ``"lru"`` or ``"fifo"``.
        prefetch: Fetch the sessions of waiting jobs from disk ahead (the scheduler's look-ahead).
        truncation: ``"decoupled"`` (stored KV survives an overflow) or ``"invalidate"`` (an overflow
            makes the stored KV useless, as with KV stored after RoPE).
        arrival_rate: Sessions per second (Poisson).
        think_time_s: Mean user think time between a reply and the next turn (exponential).
        batch: Jobs the engine runs at once.
        ssd_read_bytes_per_s: Disk read bandwidth for loads.
        truncation_ratio, keep_first: The truncation rule at overflow.
        seed: Random seed of arrivals and think times.
        kv_codec: The store's lossy codec of cold copies (``None``, ``"int8"``, ``"int4"``): a session's disk
            copy takes :func:`codec_ratio` of its fp16 bytes, and is read in that many bytes.
        kv_codec_group: The codec's group size.
        codec_tiers: ``"all"`` (default): host copies of sessions between turns are encoded too, as the store
            keeps them (``kv_codec_host=True``, its default; the store keeps a session's trailing partial
            chunk exact, which the simulator does not model); ``"disk"``: only the disk copy is encoded
            (the store's ``kv_codec_host=False``).
        partial_eviction: The disk tier drops cold sessions' leading chunks first (the store's
            ``partial_eviction``, with its victim choice); a resumed session recomputes its dropped head while
            the rest is read.
        chunk_tokens: Tokens per chunk (the unit partial eviction drops).
        recompute_by_cost: A disk hit that a turn waits for has the leading chunks recomputed that the store's
            choice (`placement.choose_recompute`, as the store's ``recompute_by_cost``) says are faster to
            recompute at the profile's prefill rate than to read at the SSD's bandwidth; the rest is read meanwhile.
            The simulator knows the rates exactly, where the store measures them; like the store, it does not count
            the SSD's queue ahead of the read (the store's rate is of its reading alone).
        share_prefixes: Sessions that open with one system prompt (:func:`with_system_prompts`) share its KV in
            each tier and reuse it across sessions (see the module docstring). Partial eviction leaves such
            sessions' heads alone (their first chunks are the shared prompt).

    Example:
        >>> conversations = [[(200, 100), (50, 80), (60, 40)]] * 20  # per turn: (user tokens, reply tokens)
        >>> store = simulate(conversations, PROFILES["llama-13b"], SimConfig(host_bytes=50e9, disk_bytes=0))
        >>> recompute = simulate(conversations, PROFILES["llama-13b"], SimConfig(host_bytes=0, disk_bytes=0))  # RE
        >>> store.prefill_tokens, recompute.prefill_tokens
        (6200, 20800)
    """

    host_bytes: float = 128e9
    disk_bytes: float = 10e12
    policy: str = "lookahead"
    prefetch: bool = True
    truncation: str = "decoupled"
    arrival_rate: float = 1.0
    think_time_s: float = 30.0
    batch: int = 32
    ssd_read_bytes_per_s: float = 5e9
    truncation_ratio: float = 0.5
    keep_first: int = 4
    seed: int = 0
    kv_codec: str | None = None
    kv_codec_group: int = 32
    codec_tiers: str = "all"
    partial_eviction: bool = False
    chunk_tokens: int = 256
    share_prefixes: bool = False
    recompute_by_cost: bool = False


def codec_ratio(kv_codec: str | None, group: int = 32, dtype_bytes: int = 2) -> float:
    """Bytes of a codec's copy per byte of the model's KV (`dtype_bytes` per value; heads of >= `group` channels,
    as LLaMA's 128): the integers plus an fp16 scale and zero point per group (see store/codec.py).

    Example:
        >>> codec_ratio(None), codec_ratio("int8"), codec_ratio("int4")  # of fp16 KV, scales included
        (1.0, 0.5625, 0.3125)
    """
    if kv_codec is None:
        return 1.0
    from ..store.codec import KVCodec

    codec = KVCodec(kv_codec, group)
    return (codec.bits / 8 + 4 / group) / dtype_bytes


@dataclass
class SimResult:
    """Counts over the replayed turns; resumed turns are every turn but a session's first.

    Example:
        >>> conversations = [[(200, 100), (50, 80), (60, 40)]] * 20
        >>> result = simulate(conversations, PROFILES["llama-13b"], SimConfig(host_bytes=50e9, disk_bytes=0))
        >>> result.turns, result.resumed, result.hits_host, result.hit_rate
        (60, 40, 40, 1.0)
    """

    turns: int = 0
    resumed: int = 0
    hits_host: int = 0
    hits_disk: int = 0
    misses_overflow: int = 0  # resumed turns whose KV an overflow invalidated
    prefill_tokens: int = 0
    prefill_tokens_recompute: int = 0
    gpu_busy_s: float = 0.0  # prefill time plus each job's share of the batched decode steps
    stall_s: float = 0.0
    ttft_s: list = field(default_factory=list)  # from the job's arrival: queueing + load stall + prefill
    service_ttft_s: list = field(default_factory=list)  # from the job's start: load stall + prefill
    max_queue: int = 0
    makespan_s: float = 0.0
    demotions: int = 0
    disk_drops: int = 0
    prefetches: int = 0
    head_drops: int = 0  # chunks dropped by partial eviction
    partial_hits: int = 0  # disk hits whose head was recomputed
    recompute_choices: int = 0  # demand loads that left leading chunks to recompute (recompute_by_cost)
    recompute_chosen_tokens: int = 0
    head_recompute_tokens: int = 0
    history_tokens: int = 0  # tokens of resumed turns' histories (kept after truncation)
    reused_tokens: int = 0  # of those, reused from a tier rather than recomputed
    prefix_hits: int = 0  # turns without their own stored KV that reused a shared system prompt
    prefix_reused_tokens: int = 0
    peak_host_bytes: float = 0.0  # the most the tiers held after a turn's KV was saved
    peak_disk_bytes: float = 0.0

    @property
    def hit_rate(self) -> float:
        return (self.hits_host + self.hits_disk) / self.resumed if self.resumed else float("nan")

    def cost(self, profile: ModelProfile, cfg: "SimConfig", prices=None) -> dict[str, float]:
        """Dollars of GPU time (busy time x the model's GPUs) plus the provisioned DRAM and SSD over the run.

        Example:
            >>> config = SimConfig(host_bytes=50e9, disk_bytes=0)
            >>> result = simulate([[(200, 100), (50, 80), (60, 40)]] * 20, PROFILES["llama-13b"], config)
            >>> sorted(result.cost(PROFILES["llama-13b"], config))  # dollars of each
            ['dram', 'gpu', 'ssd', 'total']
        """
        from .costs import CostModel

        return (prices or CostModel()).cost(self.gpu_busy_s * profile.gpus, cfg.host_bytes, cfg.disk_bytes,
                                            self.makespan_s)

    @property
    def token_hit_rate(self) -> float:
        """Share of resumed turns' history tokens reused rather than recomputed (partial hits count their
        stored tail only)."""
        return self.reused_tokens / self.history_tokens if self.history_tokens else float("nan")

    @property
    def host_share(self) -> float:
        """Share of the hits served from host memory (the rest: from disk); NaN without hits.

        Example:
            >>> SimResult(hits_host=3, hits_disk=1).host_share
            0.75
        """
        hits = self.hits_host + self.hits_disk
        return self.hits_host / hits if hits else float("nan")


class _Tiers:
    """Host and disk tiers as byte counts per session, placed by the store's policies and placement code."""

    def __init__(self, cfg: SimConfig, result: SimResult, prefill_s_per_token: float = 0.0):
        self.cfg, self.result = cfg, result
        self.prefill_s_per_token = prefill_s_per_token
        ratio = codec_ratio(cfg.kv_codec, cfg.kv_codec_group)
        if cfg.codec_tiers not in ("disk", "all"):
            raise ValueError(f"`codec_tiers` must be 'disk' or 'all', got {cfg.codec_tiers!r}")
        self.disk_ratio, self.host_ratio = ratio, (ratio if cfg.codec_tiers == "all" else 1.0)
        self.host_policy, self.disk_policy = make_policy(cfg.policy), make_policy(cfg.policy)
        self.host: dict[tuple, float] = {}
        self.disk: dict[tuple, float] = {}
        self.head: dict[tuple, int] = {}  # disk copies' dropped head, in tokens (partial eviction)
        self.tokens: dict[tuple, int] = {}  # disk copies' length in tokens
        self.last_use: dict[tuple, float] = {}
        self.missing: dict[tuple, int] = {}  # host copies loaded without their head (filled by the next turn)
        self.now = 0.0
        self.host_used = self.disk_used = 0.0
        self.ready_at: dict[tuple, float] = {}  # sessions being loaded: when their read completes
        self.ssd_free_at = 0.0
        self.pinned: set[tuple] = set()  # sessions of running jobs
        # Prefix sharing: a session's shared prompt (id, bytes at the model's precision), and per tier and prompt
        # the sessions there that hold it (its bytes are counted once, while any of them is there).
        self.prefix: dict[tuple, tuple[int, float]] = {}
        self.holders: dict[tuple[str, int], set] = {}

    def position(self, key):
        return self.host_policy.position(key)

    def _set(self, tier: dict, policy, key, nbytes: float | None) -> float:
        old = tier.pop(key, None)
        if old is not None and nbytes is None:
            policy.remove(key)
        if nbytes is not None:
            if old is None:
                policy.insert(key)
            tier[key] = nbytes
            policy.touch(key)
        return (nbytes or 0.0) - (old or 0.0)

    def _hold(self, tier: str, key, held: bool) -> float:
        """Counts `key` as holding its shared prompt in `tier` or not; returns the tier's change in bytes."""
        if key not in self.prefix:
            return 0.0
        pid, full = self.prefix[key]
        users = self.holders.setdefault((tier, pid), set())
        before = bool(users)
        (users.add if held else users.discard)(key)
        ratio = self.host_ratio if tier == "host" else self.disk_ratio
        return full * ratio * (bool(users) - before)

    def sole_bytes(self, tier: str, key) -> float:
        """The shared prompt's bytes that leave `tier` with `key` (it is the prompt's last holder there)."""
        if key not in self.prefix:
            return 0.0
        pid, full = self.prefix[key]
        return full * (self.host_ratio if tier == "host" else self.disk_ratio) \
            if self.holders.get((tier, pid)) == {key} else 0.0

    def _prompt_room(self, tier: str, key) -> float:
        """The shared prompt's bytes `key` brings into `tier` (none when a holder has them there already)."""
        if key not in self.prefix or self.prompt_in(tier, self.prefix[key][0]):
            return 0.0
        return self.prefix[key][1] * (self.host_ratio if tier == "host" else self.disk_ratio)

    def prompt_in(self, tier: str, pid: int) -> bool:
        return bool(self.holders.get((tier, pid)))

    def set_host(self, key, nbytes):
        self.host_used += self._set(self.host, self.host_policy, key, nbytes) + self._hold("host", key, nbytes is not None)
        if nbytes is None:
            self.missing.pop(key, None)

    def set_disk(self, key, nbytes):
        self.disk_used += self._set(self.disk, self.disk_policy, key, nbytes) + self._hold("disk", key, nbytes is not None)
        if nbytes is None:
            self.head.pop(key, None)
            self.tokens.pop(key, None)

    def unshare(self, key) -> None:
        """The session no longer begins with its shared prompt (truncated into it): its copies are its own."""
        if key not in self.prefix:
            return
        host, disk = self.host.get(key), self.disk.get(key)
        self.set_host(key, None)
        self.set_disk(key, None)
        _, full = self.prefix.pop(key)
        if host is not None:
            self.set_host(key, host + full * self.host_ratio)
        if disk is not None:
            self.set_disk(key, disk + full * self.disk_ratio)

    def make_host_room(self, extra: float, exclude, keep_sooner_than: int | None = None) -> bool:
        movable = lambda k: k != exclude and k not in self.pinned and k not in self.ready_at  # noqa: E731
        size = lambda k: self.host[k] + self.sole_bytes("host", k)  # noqa: E731
        for key in choose_victims(self.host_policy.victims(), size, movable,
                                  self.host_used + extra - self.cfg.host_bytes, self.position, keep_sooner_than):
            self.set_host(key, None)  # inclusive tiers: its disk copy (if any) remains
            self.result.demotions += 1
        return self.host_used + extra <= self.cfg.host_bytes

    def enforce_disk(self, current) -> None:
        movable = lambda k: k != current and k not in self.ready_at  # noqa: E731
        if self.cfg.partial_eviction and self.disk_used > self.cfg.disk_bytes:
            self._drop_heads(movable)
        size = lambda k: self.disk[k] + self.sole_bytes("disk", k)  # noqa: E731
        for key in choose_victims(self.disk_policy.victims(), size, movable,
                                  self.disk_used - self.cfg.disk_bytes):
            self.set_disk(key, None)
            self.result.disk_drops += 1
        if self.disk_used > self.cfg.disk_bytes and current in self.disk:
            self.set_disk(current, None)

    def _drop_heads(self, movable) -> None:
        """Partial eviction with the store's victim choice: leading chunks of idle, unqueued sessions."""
        chunk = self.cfg.chunk_tokens
        overflow = self.disk_used - self.cfg.disk_bytes

        def describe(key):
            if not movable(key) or key in self.pinned or self.disk_policy.position(key) is not None \
                    or key in self.prefix:  # its first chunks are a shared prompt: dropping them frees nothing
                return None
            head, n = self.head.get(key, 0), self.tokens[key]
            per_token = self.disk[key] / (n - head)
            bounds = list(range(head, n, chunk)) + [n]
            units = [(a, b, (b - a) * per_token) for a, b in zip(bounds, bounds[1:])]
            return self.now - self.last_use.get(key, 0.0), units, self.disk[key]

        candidates = head_drop_candidates(self.disk_policy.victims(), overflow, describe)
        for key in choose_head_drops(candidates, overflow):
            head, n = self.head.get(key, 0), self.tokens[key]
            drop = min(chunk, n - head)
            if head + drop >= n:
                self.set_disk(key, None)
                self.result.disk_drops += 1
                continue
            self.disk_used -= self.disk[key] * drop / (n - head)
            self.disk[key] *= (n - head - drop) / (n - head)
            self.head[key] = head + drop
            self.result.head_drops += 1

    def save(self, key, full: float, tokens: int = 0, head: int = 0) -> None:
        """A turn's KV (`full` bytes at the model's precision, `tokens` tokens): kept in host memory (making
        room) and written to disk, each copy at its codec's size; the disk copy's dropped `head` stays dropped
        (the store never rewrites a head). A shared prompt's bytes are counted once per tier (`_hold`)."""
        full -= self.prefix[key][1] if key in self.prefix else 0.0
        nbytes = full * self.host_ratio
        extra = nbytes - self.host.get(key, 0.0) + self._prompt_room("host", key)
        if nbytes <= self.cfg.host_bytes and self.make_host_room(extra, exclude=key):
            self.set_host(key, nbytes)
        else:
            self.set_host(key, None)
        nbytes = full * self.disk_ratio * ((tokens - head) / tokens if tokens else 1.0)
        if self.cfg.disk_bytes > 0 and nbytes <= self.cfg.disk_bytes:
            self.set_disk(key, nbytes)
            self.tokens[key], self.head[key] = tokens, head
            self.enforce_disk(key)
        else:
            self.set_disk(key, None)
        # After the limits are enforced, as the store's counters stand between decisions.
        self.result.peak_host_bytes = max(self.result.peak_host_bytes, self.host_used)
        self.result.peak_disk_bytes = max(self.result.peak_disk_bytes, self.disk_used)

    def load(self, key, now: float, must_fit: bool) -> bool:
        """Reads a disk-only session into host memory; a prefetch (`must_fit`) never evicts a sooner one."""
        read = self.disk[key]
        n, head = self.tokens.get(key, 1), self.head.get(key, 0)
        shared = key in self.prefix and not self.prompt_in("host", self.prefix[key][0])
        read_all = read + (self.prefix[key][1] * self.disk_ratio if shared else 0.0)  # its prompt too, if not there
        # Dequantized into host memory unless it is encoded too; room for the whole session (the head is
        # recomputed into it).
        nbytes = read / self.disk_ratio * self.host_ratio * n / (n - head)
        if nbytes > self.cfg.host_bytes:
            return False
        keep = self.position(key) if must_fit else None
        room = nbytes + self._prompt_room("host", key)
        if not self.make_host_room(room, exclude=key, keep_sooner_than=keep) and must_fit:
            return False
        self.set_host(key, nbytes)
        if self.cfg.recompute_by_cost and not must_fit and not shared:
            recomputed = self._recompute_head(n, head, read)
            read_all -= read * (recomputed - head) / (n - head)
            head = recomputed
        self.missing[key] = head
        self.ssd_free_at = max(self.ssd_free_at, now) + read_all / self.cfg.ssd_read_bytes_per_s
        self.ready_at[key] = self.ssd_free_at
        return True

    def _recompute_head(self, n: int, head: int, read: float) -> int:
        """The head a demand load leaves to the turn (`recompute_by_cost`): the store's choice with the SSD's
        bandwidth and the profile's linear prefill cost (the queue ahead of the read unknown, as to the store)."""
        bounds = list(range(head, n, self.cfg.chunk_tokens)) + [n]
        per_token = read / (n - head)
        units = [(a, b, (b - a) * per_token) for a, b in zip(bounds, bounds[1:])]
        chunks, _, _ = choose_recompute(units, head, len(units) - 1, 1 / self.cfg.ssd_read_bytes_per_s,
                                        self.prefill_s_per_token, attention_tokens=10**15)
        if not chunks:
            return head
        self.result.recompute_choices += 1
        self.result.recompute_chosen_tokens += units[chunks - 1][1] - head
        return units[chunks - 1][1]

    def forget(self, key) -> None:
        self.set_host(key, None)
        self.set_disk(key, None)


@dataclass
class _Job:
    sid: int
    turn: int
    arrival: float


def simulate(conversations: list[list[tuple[int, int]]], profile: ModelProfile, cfg: SimConfig,
             system: list[tuple[int, int] | None] | None = None) -> SimResult:
    """Replays conversations (per turn: user tokens, reply tokens) through the simulated deployment.

    Args:
        system: Per conversation, the system prompt it opens with, as (prompt id, tokens), or None; its tokens
            are part of the first turn's user tokens (see :func:`with_system_prompts`). Used with
            ``cfg.share_prefixes``.

    Returns:
        A :class:`SimResult`.

    Example:
        >>> conversations = [[(200, 100), (50, 80), (60, 40)]] * 20  # per turn: (user tokens, reply tokens)
        >>> result = simulate(conversations, PROFILES["llama-13b"], SimConfig(host_bytes=50e9, disk_bytes=0))
        >>> result.hit_rate, result.prefill_tokens  # every resumed turn prefills its new message only
        (1.0, 6200)
    """
    if system is not None and len(system) != len(conversations):
        raise ValueError(f"`system` has {len(system)} entries for {len(conversations)} conversations: give one "
                         "(or None) per conversation")
    if cfg.policy not in ("lookahead", "lru", "fifo"):
        raise ValueError(f"unknown policy {cfg.policy!r}: expected lookahead, lru or fifo")
    if cfg.truncation not in ("decoupled", "invalidate"):
        raise ValueError(f"unknown truncation {cfg.truncation!r}: expected decoupled or invalidate")
    rng = random.Random(cfg.seed)
    result = SimResult()
    tiers = _Tiers(cfg, result, profile.prefill_s_per_token)
    window = TruncationConfig(profile.context_window, cfg.truncation_ratio, cfg.keep_first, "recompute")
    history = [0] * len(conversations)
    heads = [0] * len(conversations)  # each session's dropped head after its last turn
    events: list = []
    seq = 0

    def push(t, kind, payload):
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    t = 0.0
    for sid in range(len(conversations)):
        t += rng.expovariate(cfg.arrival_rate)
        push(t, 0, _Job(sid, 0, t))
    waiting: deque[_Job] = deque()
    running: list[_Job] = []

    def hints(now: float) -> None:
        prefetch, evict = lookahead_windows(int(cfg.host_bytes), int(cfg.disk_bytes), int(tiers.host_used),
                                            len(tiers.host), int(tiers.disk_used), len(tiers.disk))
        # Only the windows' head of the queue matters (a saturated engine can have thousands waiting).
        sids = [j.sid for j in islice(waiting, max(prefetch, evict))]
        if tiers.host_policy.looks_ahead:
            # As the pipeline does: running sessions first, then the waiting jobs in the eviction window.
            order = [j.sid for j in running] + sids[:evict]
            tiers.host_policy.set_queue(order)
            tiers.disk_policy.set_queue(order)
        if cfg.prefetch:
            for key in (("sim", sid) for sid in dict.fromkeys(sids[:prefetch])):
                if key not in tiers.host and key in tiers.disk:
                    if not tiers.load(key, now, must_fit=True):
                        break  # in order: a later session must not take the room of an earlier one
                    result.prefetches += 1

    def start(job: _Job, now: float) -> None:
        key = ("sim", job.sid)
        user, reply = conversations[job.sid][job.turn]
        hist = history[job.sid]
        drop = tokens_to_drop(hist + user + reply, window)
        prompt = system[job.sid] if system is not None and cfg.share_prefixes else None
        if job.turn == 0 and prompt is not None and not drop:
            tiers.prefix[key] = (prompt[0], prompt[1] * profile.kv_bytes_per_token)
        elif drop:
            tiers.unshare(key)  # truncated into its prompt: its history no longer begins with it
        kept = hist - min(drop, hist)
        stall = 0.0
        hit = None
        head = tiers.head.get(key, 0) if job.turn > 0 else 0  # the disk copy's dropped head, if any
        if job.turn > 0:
            result.resumed += 1
            if key in tiers.host:
                ready = tiers.ready_at.get(key, now)
                hit = "host" if ready <= now else "disk"
                stall = max(0.0, ready - now)
            elif key in tiers.disk and tiers.load(key, now, must_fit=False):
                hit = "disk"  # (a session larger than the host tier is a miss, as in the store)
                stall = tiers.ready_at[key] - now
            if hit is not None and drop and cfg.truncation == "invalidate":
                result.misses_overflow += 1
                tiers.forget(key)
                hit, stall = None, 0.0
            if hit == "host":
                result.hits_host += 1
            elif hit == "disk":
                result.hits_disk += 1
            for k in [k for k, r in tiers.ready_at.items() if r <= now]:
                del tiers.ready_at[k]
        # A host copy loaded without its head (partial eviction): this turn recomputes the head tokens it keeps
        # (the sinks only, if truncation drops the rest of the head), while the rest is read.
        missing = tiers.missing.pop(key, 0) if hit is not None else 0
        need = missing if not drop or missing > cfg.keep_first + drop else min(missing, cfg.keep_first)
        if hit is None:
            head = 0  # recomputed and stored anew
        elif drop:
            head = min(head, cfg.keep_first) + max(0, head - cfg.keep_first - drop)
        if job.turn > 0:
            result.history_tokens += kept
            result.reused_tokens += kept - need if hit is not None else 0
            result.partial_hits += need > 0
            result.head_recompute_tokens += need
        tiers.last_use[key] = now
        tiers.ready_at.pop(key, None)
        tiers.pinned.add(key)
        prefill = user if hit is not None else kept + user
        if hit is None and key in tiers.prefix and not drop:
            # No stored KV of its own: the shared prompt, if a session holding it is in a tier (read from disk
            # first when only there).
            pid, nbytes = tiers.prefix[key]
            holders = lambda tier: tiers.holders.get((tier, pid), set()) - {key}  # noqa: E731
            if holders("host") or holders("disk"):
                if not holders("host"):
                    tiers.ssd_free_at = max(tiers.ssd_free_at, now) + nbytes * tiers.disk_ratio / cfg.ssd_read_bytes_per_s
                    stall = max(stall, tiers.ssd_free_at - now)
                prefill -= prompt[1]
                result.prefix_hits += 1
                result.prefix_reused_tokens += prompt[1]
        result.turns += 1
        result.prefill_tokens += prefill
        result.prefill_tokens_recompute += kept + user
        prefill_s = prefill * profile.prefill_s_per_token
        head_s = need * profile.prefill_s_per_token
        result.prefill_tokens += need
        # The head is recomputed while the rest of the session is read: the turn waits for the longer of the two.
        wait = max(stall, head_s)
        service = wait + prefill_s + reply * profile.decode_s_per_step
        # A decode step serves the whole batch, so a job's share of the GPU is a 1/batch of each step.
        result.gpu_busy_s += head_s + prefill_s + reply * profile.decode_s_per_step / cfg.batch
        result.stall_s += max(0.0, stall - head_s)
        result.ttft_s.append(now - job.arrival + wait + prefill_s)
        result.service_ttft_s.append(wait + prefill_s)
        history[job.sid] = kept + user + reply
        heads[job.sid] = head
        running.append(job)
        push(now + service, 1, job)

    while events:
        now, _, kind, job = heapq.heappop(events)
        tiers.now = now
        if kind == 0:
            waiting.append(job)
        else:
            running.remove(job)
            key = ("sim", job.sid)
            tiers.pinned.discard(key)
            tiers.last_use[key] = now
            if cfg.host_bytes > 0 or cfg.disk_bytes > 0:
                tiers.save(key, history[job.sid] * profile.kv_bytes_per_token, history[job.sid],
                           heads[job.sid] if key in tiers.disk else 0)
            if job.turn + 1 < len(conversations[job.sid]):
                nxt = now + rng.expovariate(1.0 / cfg.think_time_s) if cfg.think_time_s > 0 else now
                push(nxt, 0, _Job(job.sid, job.turn + 1, nxt))
        result.max_queue = max(result.max_queue, len(waiting))
        while waiting and len(running) < cfg.batch:
            start(waiting.popleft(), now)
        hints(now)
        result.makespan_s = now
    return result


def with_system_prompts(trace: list[list[tuple[int, int]]], sizes: list[int], share: float = 1.0,
                        seed: int = 0) -> tuple[list[list[tuple[int, int]]], list[tuple[int, int] | None]]:
    """The trace with system prompts: a `share` of the conversations (chosen at random) open with one of the
    prompts of `sizes` tokens (chosen uniformly), added to their first turn's user tokens.

    Returns:
        The new trace, and per conversation its prompt as (index into `sizes`, tokens) or None; pass both to
        :func:`simulate`.

    Example:
        >>> trace, system = with_system_prompts([[(10, 5)], [(20, 5), (3, 4)]], [1000], share=1.0)
        >>> trace, system
        ([[(1010, 5)], [(1020, 5), (3, 4)]], [(0, 1000), (0, 1000)])
    """
    if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"`sizes` must be positive token counts, got {sizes!r}")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"`share` must be between 0 and 1, got {share!r}")
    rng = random.Random(seed)
    out, system = [], []
    for conv in trace:
        if conv and rng.random() < share:
            pid = rng.randrange(len(sizes))
            (user, reply), rest = conv[0], conv[1:]
            out.append([(user + sizes[pid], reply), *rest])
            system.append((pid, sizes[pid]))
        else:
            out.append(list(conv))
            system.append(None)
    return out, system


def sharegpt_trace(tokenizer, limit: int | None = None, rejoin: bool = False) -> list[list[tuple[int, int]]]:
    """Every ShareGPT conversation as (user tokens, reply tokens) per turn, counted with `tokenizer`.

    A user message is paired with the assistant message that follows it (0 tokens if none). With `rejoin`,
    the parts of conversations the packaged (split) file cut apart are joined (see `iter_sharegpt`). The counts
    are cached under :func:`hf_attnstore.lab.models.cache_root` (tokenizing 17,671 conversations takes minutes on
    two cores); without that cache, a `limit` tokenizes only the conversations it keeps.

    Example:
        >>> from transformers import AutoTokenizer  # doctest: +SKIP
        >>> tokenizer = AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")  # doctest: +SKIP
        >>> trace = sharegpt_trace(tokenizer, limit=2)  # doctest: +SKIP
        >>> len(trace), type(trace[0][0][0])  # doctest: +SKIP
        (2, <class 'int'>)
    """
    import hashlib
    import json
    import os

    from .data import iter_sharegpt
    from .data.sharegpt import sharegpt_path
    from .models import cache_root

    path = sharegpt_path()
    key = f"{path.stat().st_size}:{tokenizer.name_or_path}:{len(tokenizer)}" + (":rejoin" if rejoin else "")
    tag = hashlib.sha256(key.encode()).hexdigest()[:16]
    cached = cache_root() / "traces" / f"sharegpt-{tag}.json"
    encode = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0  # noqa: E731
    if cached.is_file():
        trace = [[tuple(t) for t in conv] for conv in json.loads(cached.read_text())]
    elif limit is not None:  # the first `limit` conversations with a turn, as the cached trace's first `limit`
        trace = []
        for conv in iter_sharegpt(rejoin=rejoin):
            if len(trace) == limit:
                break
            if conv.turns:
                trace.append([(encode(u), encode(r)) for u, r in conv.turns])
    else:
        trace = [[(encode(u), encode(r)) for u, r in conv.turns] for conv in iter_sharegpt(rejoin=rejoin)]
        trace = [t for t in trace if t]
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(trace))
        os.replace(tmp, cached)
    return trace[:limit] if limit is not None else trace
