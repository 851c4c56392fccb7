"""Eviction policies (which session leaves a tier first) and the placement decisions shared with the simulator.

The policies: `LRUPolicy` (every access moves a session to the back), `FIFOPolicy` (accesses change nothing) and
`LookaheadPolicy` (scheduler-aware, AttentionStore §3.4: the job queue tells which sessions are needed soon),
behind `EvictionPolicy`, made by name (`make_policy`).

The decisions (`choose_victims`, `head_drop_candidates`, `choose_head_drops`, `lookahead_windows`,
`choose_recompute`): the store calls them under its index lock with its real sessions; the simulator
(`eval/simulate.py`) calls them with simulated sessions, so the hit rates it reports come from the code that runs
in production.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator


def choose_victims(victims: Iterable[Hashable], size: Callable[[Hashable], int], movable: Callable[[Hashable], bool],
                   overflow: int, position: Callable[[Hashable], int | None] | None = None,
                   keep_sooner_than: int | None = None) -> list[Hashable]:
    """The sessions to move out of a tier, in the eviction policy's order, until `overflow` bytes are freed.

    Args:
        victims: Keys in eviction order (``policy.victims()``).
        size: Bytes a key frees when it leaves.
        movable: Whether a key may leave now (not pinned by a load, a write or the running turn).
        overflow: Bytes over the limit; nothing is chosen when it is 0 or less.
        position: The queue position of a key's next job (``LookaheadPolicy.position``), if known.
        keep_sooner_than: Room is made for the job at this queue position (a prefetch): sessions needed
            at or before it are never chosen, and neither is anything after them in the victim order.

    Returns:
        The keys to evict, in order. They may free less than `overflow` if too few can move.

    Example:
        >>> sizes = {"a": 100, "b": 300, "c": 200}
        >>> choose_victims(["a", "b", "c"], sizes.get, lambda key: key != "a", overflow=250)  # "a" is pinned
        ['b']
    """
    chosen = []
    for key in victims:
        if overflow <= 0:
            break
        if keep_sooner_than is not None and position is not None:
            pos = position(key)
            if pos is not None and pos <= keep_sooner_than:
                break  # the rest of the victim order is needed even sooner
        if movable(key):
            chosen.append(key)
            overflow -= size(key)
    return chosen


def lookahead_windows(host_limit: int, disk_limit: int, host_used: int, host_sessions: int, disk_used: int,
                      disk_sessions: int, prefetch_window: int | None = None,
                      eviction_window: int | None = None) -> tuple[int, int]:
    """The scheduler's look-ahead windows (AttentionStore §3.3-3.4), in jobs.

    With S_kv the mean session size stored so far, the eviction window is ``(C_host + C_disk) / S_kv``; the
    prefetch window is an upper bound of ``2 C_host / S_kv``: the store fetches the sessions in queue order
    only while they fit, never evicting one needed sooner, so it adapts to the sessions' actual sizes.
    Explicit windows override the computed ones.

    Example:
        >>> # 10 sessions of 1 MB each so far; 20 MB of host memory and 80 MB of disk: (prefetch, eviction) windows
        >>> lookahead_windows(20_000_000, 80_000_000, host_used=10_000_000, host_sessions=10, disk_used=0,
        ...                   disk_sessions=0)
        (40, 100)
    """
    if host_sessions:
        mean = max(1, host_used // host_sessions)
    elif disk_sessions:
        mean = max(1, disk_used // disk_sessions)
    else:
        mean = max(1, host_limit)  # nothing stored yet: nothing to fetch either
    prefetch = prefetch_window if prefetch_window is not None else max(1, 2 * (host_limit // mean))
    eviction = eviction_window if eviction_window is not None else max(1, (host_limit + disk_limit) // mean)
    return prefetch, eviction


# The history length at which one token's attention costs as much as its linear layers (per token: ~2P FLOPs
# for the weights, ~4·layers·hidden·position for attention; equal near P / (2·layers·hidden): ~32K tokens for
# LLaMA-13B, ~26K for 7B, ~4K for SmolLM2-135M). Only the ratio between chunks matters for the victim order.
ATTENTION_TOKENS = 16384


# Callers offer `choose_head_drops` the sessions first in their eviction policy's order (least recently used
# first) until these hold this many times the bytes to free: with idle time dominating the value, a younger
# session's chunk is chosen only when an older one's cost is far higher, and scanning every session of a
# large tier at each write would cost more than it could gain.
HEAD_SEARCH = 4


def head_drop_candidates(victims: Iterable[Hashable], overflow: float, describe) -> list:
    """The sessions offered to :func:`choose_head_drops`, the same scan for the store and the simulator: in the
    eviction policy's order (`victims`), those `describe` accepts, until they hold `HEAD_SEARCH` times the bytes
    to free.

    Args:
        victims: Keys in eviction order (the policy's `victims()`).
        overflow: Bytes to free.
        describe: ``key -> (idle_seconds, units, bytes held)`` for a session that may shrink (`units` as
            :func:`choose_head_drops` takes them), or None for one that may not (in use, queued, ...).

    Example:
        >>> head_drop_candidates(["a", "b"], 10, lambda k: (1.0, [(0, 4, 8)], 8) if k == "b" else None)
        [('b', 1.0, [(0, 4, 8)])]
    """
    candidates, offered = [], 0.0
    for key in victims:
        if offered >= HEAD_SEARCH * overflow:
            break
        found = describe(key)
        if found is not None:
            idle, units, nbytes = found
            candidates.append((key, idle, units))
            offered += nbytes
    return candidates


def recompute_cost(start: int, end: int, attention_tokens: int = ATTENTION_TOKENS) -> float:
    """Relative prefill cost of recomputing tokens ``[start, end)`` after the tokens before them: their linear
    layers, plus attention over every earlier position (so later chunks cost more).

    Example:
        >>> recompute_cost(0, 256) < recompute_cost(256, 512)  # the same tokens cost more later in the history
        True
    """
    n = end - start
    return n * (1.0 + (start + end - 1) / 2 / attention_tokens)


def choose_head_drops(candidates: Iterable[tuple[Hashable, float, list[tuple[int, int, int]]]], overflow: int,
                      attention_tokens: int = ATTENTION_TOKENS) -> list[Hashable]:
    """Partial eviction (Pensieve §4.3): the leading chunks to drop, across sessions, until `overflow` bytes are
    freed, cheapest to lose first.

    A chunk's retention value is its recompute cost divided by the time since its session was last used: a
    session idle for long, and the head of any session (its first tokens are the cheapest to recompute, and
    only a head can be recomputed before the rest is loaded), go first. A session only ever loses its
    current first chunk; losing its last one is losing the session.

    Args:
        candidates: ``(key, idle_seconds, units)`` per session that may shrink, where `units` are its stored
            chunks in order as ``(start, end, bytes freed)`` (token positions in the session).
        overflow: Bytes to free; nothing is chosen when it is 0 or less.

    Returns:
        One key per chunk to drop, in order (a key repeats when a session loses several chunks). They may
        free less than `overflow` if the candidates hold too little.

    Example:
        >>> candidates = [("old", 600.0, [(0, 256, 1000), (256, 512, 1000)]),  # idle for 10 minutes
        ...               ("new", 5.0, [(0, 256, 1000), (256, 512, 1000)])]
        >>> choose_head_drops(candidates, overflow=1500)  # the long-idle session loses its two chunks first
        ['old', 'old']
    """
    heap, chosen = [], []
    for order, (key, idle, units) in enumerate(candidates):
        if units:
            heap.append((recompute_cost(*units[0][:2], attention_tokens) / max(idle, 1e-3), order, 0, key, idle, units))
    heapq.heapify(heap)
    while heap and overflow > 0:
        _, order, i, key, idle, units = heapq.heappop(heap)
        chosen.append(key)
        overflow -= units[i][2]
        if i + 1 < len(units):
            value = recompute_cost(*units[i + 1][:2], attention_tokens) / max(idle, 1e-3)
            heapq.heappush(heap, (value, order, i + 1, key, idle, units))
    return chosen


# A head is recomputed only when that is estimated this much faster than loading it: near a tie the measured
# rates' noise would flip the choice from turn to turn for no gain.
RECOMPUTE_MARGIN = 0.05


def choose_recompute(units: list[tuple[int, int, int]], head: int, eligible: int, seconds_per_byte: float,
                     seconds_per_unit: float, attention_tokens: int = ATTENTION_TOKENS) -> tuple[int, float, float]:
    """Load or recompute (ALISA's third phase, Pensieve's partial hits): how many leading stored chunks of a
    session a turn should recompute instead of loading.

    The turn recomputes its head (a partially evicted one, plus the chunks chosen here) in one forward from
    position 0 while the load thread reads the rest (the loader is not held back by the read buffer until the
    turn's first layer asks for its KV, after the recompute), so resuming takes about ``max(recompute, load)``. Loading
    everything is the choice unless recomputing is estimated `RECOMPUTE_MARGIN` faster.

    Args:
        units: The stored chunks after the head, in order, as ``(start, end, bytes)`` (token positions).
        head: Tokens before them without stored KV (recomputed whatever is chosen).
        eligible: How many of the first `units` may be recomputed (a rebased span may not: its stored KV was
            computed after another history, and recomputing it would change what the session holds).
        seconds_per_byte: The tier's measured load time per byte.
        seconds_per_unit: The model's measured prefill time per :func:`recompute_cost` unit.
        attention_tokens: See :func:`recompute_cost` (the simulator, whose prefill cost is linear, passes a
            larger one).

    Returns:
        ``(chunks, chosen_s, load_s)``: the chunks to recompute, the estimated time of that choice and of
        loading every stored chunk.

    Example:
        >>> units = [(0, 256, 1000), (256, 512, 1000), (512, 768, 1000)]
        >>> choose_recompute(units, 0, 2, seconds_per_byte=1e-6, seconds_per_unit=1e-3)[0]  # a fast tier
        0
        >>> choose_recompute(units, 0, 2, seconds_per_byte=1e-3, seconds_per_unit=1e-3)[0]  # a slow one
        2
    """
    remaining = sum(b for _, _, b in units)

    def estimate(end: int, left: int) -> float:
        recompute = recompute_cost(0, end, attention_tokens) * seconds_per_unit if end else 0.0
        return max(recompute, left * seconds_per_byte)

    load_s = estimate(head, remaining)
    best, best_s = 0, load_s
    for k, (_, end, nbytes) in enumerate(units[: min(eligible, len(units))], start=1):
        remaining -= nbytes
        t = estimate(end, remaining)
        if t < best_s:
            best, best_s = k, t
    if best and best_s > load_s * (1 - RECOMPUTE_MARGIN):
        return 0, load_s, load_s
    return best, best_s, load_s


class EvictionPolicy:
    """Orders the keys of one tier for eviction.

    The store that owns the tier calls these methods under its index lock, so a policy needs no locking.
    The base class keeps keys in insertion order; subclasses decide what an access does.

    Example:
        >>> policy = EvictionPolicy()  # insertion order: first in, first out
        >>> for key in ("a", "b", "c"):
        ...     policy.insert(key)
        >>> policy.touch("a"); policy.remove("b")
        >>> list(policy.victims()), len(policy)
        (['a', 'c'], 2)
    """

    looks_ahead = False  # whether `set_queue` changes the order (a scheduler may skip building the queue)

    def __init__(self):
        # The keys in eviction order (first = evict first); subclasses reorder it on access.
        self.order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        """A key entered the tier."""
        self.order[key] = None
        self.order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        """A key was read or written."""

    def remove(self, key: Hashable) -> None:
        """A key left the tier."""
        self.order.pop(key, None)

    def set_queue(self, session_ids: list[str]) -> None:
        """The session ids of the jobs waiting to run, first to run first (a scheduler's look-ahead window).
        Ignored here; a scheduler-aware policy (lookahead.py) evicts the sessions of no waiting job first."""

    def position(self, key: Hashable) -> int | None:
        """Where the key's session's next job waits in the scheduler's queue (0 = next), or None if it has none
        (or this policy does not look ahead)."""
        return None

    def victims(self) -> Iterator[Hashable]:
        """Keys in the order they should be evicted (first = evict first).

        Lazy, so that finding the first few victims of a large tier is cheap: the caller must not change
        the tier while iterating (`placement.choose_victims` chooses first, then evicts).
        """
        yield from self.order

    def __len__(self) -> int:
        return len(self.order)


class LRUPolicy(EvictionPolicy):
    """Evicts the session whose last read or write is oldest.

    Example:
        >>> policy = LRUPolicy()
        >>> for key in ("a", "b", "c"):
        ...     policy.insert(key)
        >>> policy.touch("a")
        >>> list(policy.victims())
        ['b', 'c', 'a']
    """

    def touch(self, key: Hashable) -> None:
        if key in self.order:
            self.order.move_to_end(key)


class FIFOPolicy(EvictionPolicy):
    """Evicts the session that entered the tier first, however recently it was used.

    Example:
        >>> policy = FIFOPolicy()
        >>> for key in ("a", "b", "c"):
        ...     policy.insert(key)
        >>> policy.touch("a")
        >>> list(policy.victims())
        ['a', 'b', 'c']
    """


class LookaheadPolicy(EvictionPolicy):
    """Evicts sessions with no queued job first (least recently used first), then sessions whose next
    job is furthest away: the one nearest the tail of the look-ahead window goes first.

    Used for both tiers: when demoting host → disk it keeps the sessions about to run in memory; when
    dropping from disk it drops sessions outside the window first, then the last-arrived job's session.

    The scheduler calls :meth:`set_queue` with the session ids of its waiting jobs, in order (the store
    forwards :meth:`AttnStore.set_schedule`); keys are ``(fingerprint, session_id)``.

    Example:
        >>> policy = LookaheadPolicy()
        >>> for sid in ("a", "b", "c", "d"):
        ...     policy.insert(("model", sid))
        >>> policy.set_queue(["c", "a"])  # c's job runs next, then a's
        >>> [sid for _, sid in policy.victims()]  # idle sessions first, then the job furthest away
        ['b', 'd', 'a', 'c']
    """

    looks_ahead = True

    def __init__(self):
        super().__init__()
        self._next_job: dict[str, int] = {}
        # Each session id's keys (one per fingerprint), in `order`'s order: the queued sessions are found from the
        # queue (a few thousand jobs at most), not by walking every key the tier holds.
        self._by_sid: dict[str, dict[Hashable, None]] = {}

    def insert(self, key: Hashable) -> None:
        super().insert(key)
        keys = self._by_sid.setdefault(key[1], {})
        keys.pop(key, None)
        keys[key] = None

    def remove(self, key: Hashable) -> None:
        super().remove(key)
        keys = self._by_sid.get(key[1])
        if keys is not None:
            keys.pop(key, None)
            if not keys:
                del self._by_sid[key[1]]

    def set_queue(self, session_ids: list[str]) -> None:
        """The session ids of the jobs in the look-ahead window, first to run first."""
        # Built from the back so that a session's first (soonest) job wins; dict(zip) runs in C, and the
        # scheduler calls this at every queue change with windows of thousands of jobs.
        n = len(session_ids)
        self._next_job = dict(zip(reversed(session_ids), range(n - 1, -1, -1)))

    def position(self, key: Hashable) -> int | None:
        """Where the session's next job is in the queue (0 = next), or None if it has none."""
        return self._next_job.get(key[1])

    def touch(self, key: Hashable) -> None:
        if key in self.order:
            self.order.move_to_end(key)
            keys = self._by_sid[key[1]]
            del keys[key]
            keys[key] = None

    def victims(self) -> Iterator[Hashable]:
        # Lazy: the idle sessions usually supply the victims, and the queued ones are only sorted if not.
        yield from (k for k in self.order if k[1] not in self._next_job)
        # Furthest job first; a session id's keys (several models) keep `order`'s order, as a stable sort of
        # `order` would give them.
        for sid in sorted((sid for sid in self._next_job if sid in self._by_sid), key=lambda sid: -self._next_job[sid]):
            yield from list(self._by_sid[sid])


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "fifo": FIFOPolicy, "lookahead": LookaheadPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """Creates a policy by name (``"lru"``, ``"fifo"`` or ``"lookahead"``).

    Example:
        >>> policy = make_policy("lru")
        >>> for key in ("a", "b", "c"):
        ...     policy.insert(key)
        >>> policy.touch("a")
        >>> list(policy.victims())  # least recently used first
        ['b', 'c', 'a']
    """
    if name not in POLICIES:
        raise ValueError(f"`policy`={name!r} is unknown; choose one of {', '.join(sorted(POLICIES))}")
    return POLICIES[name]()


__all__ = ["ATTENTION_TOKENS", "EvictionPolicy", "FIFOPolicy", "HEAD_SEARCH", "LRUPolicy", "LookaheadPolicy", "POLICIES",
           "RECOMPUTE_MARGIN", "choose_head_drops", "choose_recompute", "choose_victims", "head_drop_candidates",
           "lookahead_windows", "make_policy", "recompute_cost"]


def __getattr__(name: str):
    """The block policies moved to the lab (`hf_attnstore.lab.block_policy`); their old names here keep working
    for one release, with a `FutureWarning`."""
    if name in ("BLOCK_POLICIES", "BlockKey", "HitDensityPolicy", "LeafFirstPolicy", "LeafLRUPolicy",
                "RetentionPolicy", "SegmentedPolicy", "make_block_policy"):
        import importlib
        import warnings

        warnings.warn(f"`hf_attnstore.store.policy.{name}` moved to `hf_attnstore.lab.block_policy.{name}`; the old "
                      "path is removed in the next release", FutureWarning, stacklevel=2)
        return getattr(importlib.import_module("hf_attnstore.lab.block_policy"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
