"""Replaying a prefix-block trace (Mooncake's format) through the store's eviction policies, with the bounds.

Semantics (they reproduce the reference figures of ``../shared/traces/README.md`` exactly):

* A request hits its longest run of leading blocks present (in host memory, or on disk with a second tier);
  hit tokens count each block's tokens, the last partial block for the tokens it holds (:func:`block_tokens`).
* After the lookup every block of the input is cached (read blocks are touched, first block first, then missing
  ones inserted), then the tier evicts down to its capacity (``host_tokens // 512`` blocks). Output blocks are
  not cached: a later turn carries its predecessor's reply in its own ``hash_ids``.
* With ``disk_tokens``, the tiers are exclusive: a block evicted from host memory moves to disk (same policy
  class, its own instance) and a disk hit moves back; disk evictions drop.
* Look-ahead (``window``): the policies see the block chains of the next `window` requests of the trace, the
  requests that have arrived and wait while this one runs. Nothing else of the future is visible to them.

The bounds: :func:`infinite_hit_rate` (every block ever seen stays) and :func:`belady_hit_rate`, Belady's MIN on
blocks (evict the block whose next use is farthest; a block never used again goes first). Ties on the next use
(a parent and its child read next by the same request) go to the shallower block in the reference convention,
which wastes the child; ``leaf_ties=True`` evicts the deeper one and gives a higher, still offline, figure.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

from ..store.policy import choose_victims
from ..lab.block_policy import make_block_policy
from ..lab.block_policy import BlockKey
from .trace_queue import PrefillCluster
from .traces import BLOCK_TOKENS, TraceRequest, block_tokens

MAX_CAPACITY_TOKENS = 10**13  # beyond any deployment: a typo, not a cache size


@dataclass(frozen=True)
class TraceSimConfig:
    """One simulated prefix cache.

    Args:
        host_tokens: Host-memory capacity in tokens (rounded down to whole blocks).
        policy: A block policy name (:data:`hf_attnstore.store.policy.BLOCK_POLICIES`, e.g. ``"lru"``,
            ``"lru-leaf"``, ``"retention"``, ``"retention:5000"``).
        disk_tokens: A second (SSD) tier's capacity in tokens; 0 for none.
        window: Requests of look-ahead the policies are shown (the waiting queue); 0 for none.
        block: Tokens per block.

    Example:
        >>> TraceSimConfig(host_tokens=10_000, policy="lru-leaf", window=8)
        TraceSimConfig(host_tokens=10000, policy='lru-leaf', disk_tokens=0, window=8, block=512)
        >>> TraceSimConfig(host_tokens=100)
        Traceback (most recent call last):
        ...
        ValueError: `host_tokens`=100 holds no 512-token block
    """

    host_tokens: int
    policy: str = "lru"
    disk_tokens: int = 0
    window: int = 0
    block: int = BLOCK_TOKENS

    def __post_init__(self):
        for name in ("host_tokens", "disk_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or not 0 <= v <= MAX_CAPACITY_TOKENS:
                raise ValueError(f"`{name}`={v!r} must be an integer number of tokens in "
                                 f"[0, {MAX_CAPACITY_TOKENS:.0e}]")
        if self.host_tokens < self.block:
            raise ValueError(f"`host_tokens`={self.host_tokens} holds no {self.block}-token block")
        if not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"`window`={self.window!r} must be a non-negative integer")
        if self.block < 1:
            raise ValueError(f"`block`={self.block!r} must be positive")
        make_block_policy(self.policy)  # validates the name


@dataclass
class TraceResult:
    """What one replay measured, per request in trace order (tokens).

    Example:
        >>> reqs = [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(1, 1000, 1, (1, 3))]
        >>> result = simulate_trace(reqs, TraceSimConfig(host_tokens=1024))
        >>> result.input_tokens, result.host_hits, round(result.token_hit_rate, 3)  # the shared first block
        ([1024, 1000], [0, 512], 0.253)
    """

    config: TraceSimConfig
    input_tokens: list[int] = field(default_factory=list)
    host_hits: list[int] = field(default_factory=list)
    disk_hits: list[int] = field(default_factory=list)

    @property
    def token_hit_rate(self) -> float:
        """Hit tokens (either tier) / input tokens."""
        return (sum(self.host_hits) + sum(self.disk_hits)) / max(1, sum(self.input_tokens))

    @property
    def host_hit_rate(self) -> float:
        """Tokens found in host memory / input tokens."""
        return sum(self.host_hits) / max(1, sum(self.input_tokens))


class _Tier:
    """A set of blocks with a capacity and a policy (the simulator's stand-in for a store tier)."""

    def __init__(self, blocks: int, policy: str):
        self.capacity = blocks
        self.policy = make_block_policy(policy)
        self.keys: dict[int, BlockKey] = {}

    def add(self, key: BlockKey) -> None:
        self.keys[key.block] = key
        self.policy.insert(key)

    def drop(self, block: int) -> BlockKey:
        key = self.keys.pop(block)
        self.policy.remove(key)
        return key

    def overflow(self) -> list[BlockKey]:
        """Evicts down to capacity, one victim at a time (a leaf-first policy exposes the parent next)."""
        out = []
        while len(self.keys) > self.capacity:
            # The store's block pool evicts with the same call (store/block_pool.py): one code, two callers.
            chosen = choose_victims(self.policy.victims(), size=lambda key: 1, movable=lambda key: True, overflow=1)
            assert chosen, "a full tier must have a victim"
            out += [self.drop(victim.block) for victim in chosen]
        return out


def simulate_trace(requests: list[TraceRequest], config: TraceSimConfig,
                   cluster: PrefillCluster | None = None) -> TraceResult:
    """Replays `requests` through one prefix cache and returns the hit tokens of each.

    With a `cluster` (:class:`~hf_attnstore.lab.trace_queue.PrefillCluster`) the look-ahead is the load's: each
    request's policies see the requests that arrived while it waited (at most ``config.window`` of them when that
    is set), and the cluster learns each request's hits, which set its service time and so the next queues.

    Example:
        >>> reqs = [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(1, 1000, 1, (1, 3))]
        >>> simulate_trace(reqs, TraceSimConfig(host_tokens=1024)).host_hits
        [0, 512]
    """
    host = _Tier(config.host_tokens // config.block, config.policy)
    disk = _Tier(config.disk_tokens // config.block, config.policy) if config.disk_tokens >= config.block else None
    result = TraceResult(config)
    for i, r in enumerate(requests):
        window = config.window
        if cluster is not None:
            queued = cluster.start(i)
            window = min(queued, window) if window else queued
        if window or cluster is not None:
            queue = [q.hash_ids for q in requests[i + 1:i + 1 + window]]
            host.policy.set_queue(queue)
            if disk:
                disk.policy.set_queue(queue)
        n_host = n_disk = 0
        for k, b in enumerate(r.hash_ids):
            if b in host.keys:
                n_host += block_tokens(r, k, config.block)
            elif disk and b in disk.keys:
                n_disk += block_tokens(r, k, config.block)
            else:
                break
        parent = None
        for b in r.hash_ids:
            if b in host.keys:
                host.policy.touch(host.keys[b])
            else:
                if disk and b in disk.keys:
                    disk.drop(b)
                host.add(BlockKey(b, parent))
            parent = b
        for key in host.overflow():
            if disk:
                disk.add(key)
        if disk:
            disk.overflow()
        if cluster is not None:
            cluster.finish(i, n_host, n_disk)
        result.input_tokens.append(r.input_length)
        result.host_hits.append(n_host)
        result.disk_hits.append(n_disk)
    return result


def infinite_hit_rate(requests: list[TraceRequest], block: int = BLOCK_TOKENS) -> float:
    """The hit rate of a cache that never evicts (the most any capacity can reach).

    Example:
        >>> infinite_hit_rate([TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(1, 1000, 1, (1, 3))])
        0.2529...
    """
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        for k, b in enumerate(r.hash_ids):
            if b not in seen:
                break
            hit += block_tokens(r, k, block)
        seen.update(r.hash_ids)
        total += r.input_length
    return hit / max(1, total)


def belady_hit_rate(requests: list[TraceRequest], capacity_tokens: int, block: int = BLOCK_TOKENS,
                    leaf_ties: bool = False) -> float:
    """Belady's offline optimum on blocks: after each request, evict the blocks used again farthest ahead.

    Args:
        requests: The trace.
        capacity_tokens: Cache capacity (whole blocks).
        leaf_ties: Of blocks next used by the same request, evict the deepest first (the leaf, which keeps the
            parent useful) instead of the shallowest (the reference figures' convention).

    Example:
        >>> reqs = [TraceRequest(0, 512, 1, (1,)), TraceRequest(1, 512, 1, (2,)), TraceRequest(2, 512, 1, (1,))]
        >>> belady_hit_rate(reqs, 512)  # keeps block 1 (used again), drops block 2 (never)
        0.333...
    """
    hits = belady_hits(requests, capacity_tokens, block, leaf_ties)
    return sum(hits) / max(1, sum(r.input_length for r in requests))


def belady_hits(requests: list[TraceRequest], capacity_tokens: int, block: int = BLOCK_TOKENS,
                leaf_ties: bool = False) -> list[int]:
    """The hit tokens of each request under Belady's MIN (see :func:`belady_hit_rate`).

    Example:
        >>> belady_hits([TraceRequest(0, 512, 1, (1,)), TraceRequest(1, 512, 1, (1,))], 512)
        [0, 512]
    """
    if capacity_tokens < block:
        raise ValueError(f"`capacity_tokens`={capacity_tokens} holds no {block}-token block")
    uses: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        for b in r.hash_ids:
            u = uses.setdefault(b, [])
            if not u or u[-1] != i:
                u.append(i)
    capacity = capacity_tokens // block
    never = len(requests)
    cached: dict[int, int] = {}  # block -> its next use (the heap's entries for other values are stale)
    heap: list[tuple[int, int, int]] = []
    hits = []
    for i, r in enumerate(requests):
        hit = 0
        for k, b in enumerate(r.hash_ids):
            if b not in cached:
                break
            hit += block_tokens(r, k, block)
        hits.append(hit)
        for k, b in enumerate(r.hash_ids):
            u = uses[b]
            j = bisect.bisect_right(u, i)
            nxt = u[j] if j < len(u) else never
            cached[b] = nxt
            heapq.heappush(heap, (-nxt, -k if leaf_ties else k, b))
        while len(cached) > capacity:
            nxt, _, b = heapq.heappop(heap)
            if cached.get(b) == -nxt:
                del cached[b]
    return hits


def reuse_gap_histogram(requests: list[TraceRequest], hits: list[int], block: int = BLOCK_TOKENS) -> dict:
    """Where a cache's hits lie by reuse distance: tokens reused and tokens hit, by requests since the last use.

    Every block a request reads that an earlier request also read is a reuse, at a gap of requests since that
    earlier use; it is a hit when it lies within the request's hit prefix (`hits[i]` tokens). Gaps are grouped in
    powers of two: key ``g`` holds gaps in ``[g, 2g)``.

    Returns:
        ``{g: (reused_tokens, hit_tokens)}`` in increasing `g`.

    Example:
        >>> reqs = [TraceRequest(0, 512, 1, (1,)), TraceRequest(1, 512, 1, (2,)), TraceRequest(2, 512, 1, (1,))]
        >>> reuse_gap_histogram(reqs, [0, 0, 512])
        {2: (512, 512)}
    """
    if len(hits) != len(requests):
        raise ValueError(f"`hits` has {len(hits)} entries for {len(requests)} requests")
    last: dict[int, int] = {}
    out: dict[int, list[int]] = {}
    for i, (r, h) in enumerate(zip(requests, hits)):
        covered = 0
        for k, b in enumerate(r.hash_ids):
            n = block_tokens(r, k, block)
            if b in last:
                cell = out.setdefault(1 << ((i - last[b]).bit_length() - 1), [0, 0])
                cell[0] += n
                if covered + n <= h:  # within the hit prefix
                    cell[1] += n
            covered += n
            last[b] = i
    return {g: tuple(out[g]) for g in sorted(out)}
