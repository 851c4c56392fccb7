"""Eviction policies for prefix blocks (a radix tree of fixed-size KV blocks, as in Mooncake's traces).

A block is reusable only with its whole prefix: a request hits its longest run of leading blocks present.
Evicting a block whose descendants stay therefore wastes the descendants, so every policy here evicts leaves
only (a block with no cached child), as SGLang's radix cache does; a parent becomes a candidate when its last
cached child leaves. Keys are :class:`BlockKey` ``(block, parent)``: the parent tells the policy the tree.

The policies keep a heap of ``(priority, version, key)`` with lazy invalidation: a change of priority pushes
a new entry and bumps the key's version, so stale entries are skipped (and compacted away when they pile up).
Priorities are static between changes, so no re-sorting happens at eviction time.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import NamedTuple
import random

from ..store.policy import EvictionPolicy, LRUPolicy


class BlockKey(NamedTuple):
    """A prefix block: its id (content address) and its parent's id (``None`` for a first block).

    Example:
        >>> first, second = BlockKey(block=101, parent=None), BlockKey(block=102, parent=101)  # a two-block prefix
        >>> second.parent == first.block
        True
    """

    block: Hashable
    parent: Hashable | None


class LeafFirstPolicy(EvictionPolicy):
    """Base of the block policies: leaves only, lowest :meth:`priority` first.

    Subclasses define :meth:`priority`; the base keeps the tree (cached children per block), a logical clock
    (one tick per insert or touch) and the look-ahead queue (:meth:`set_queue`).

    Example:
        >>> p = LeafLRUPolicy()
        >>> for key in (BlockKey(1, None), BlockKey(2, 1), BlockKey(3, None)):
        ...     p.insert(key)
        >>> [k.block for k in p.victims()]  # block 1 has a cached child: only leaves, oldest first
        [2, 3]
    """

    looks_ahead = True

    def __init__(self):
        super().__init__()
        self.clock = 0
        self.last: dict[Hashable, int] = {}  # block -> tick of its last insert/touch
        # Read by subclasses (density.py), written only here.
        self.present: dict[Hashable, BlockKey] = {}  # block -> its key, for blocks present
        self.children: dict[Hashable, int] = {}  # block -> cached children (only counts > 0)
        self._version: dict[Hashable, int] = {}
        self._heap: list[tuple] = []
        self.queued: dict[Hashable, int] = {}  # block -> position of the first queued request reading it

    # The tree and the clock ------------------------------------------------------------------------------------
    def insert(self, key: Hashable) -> None:
        key = _as_key(key)
        if key.block in self.present:
            self.touch(key)
            return
        self.clock += 1
        self.present[key.block] = key
        self.last[key.block] = self.clock
        self.on_insert(key.block)
        if key.parent is not None:
            # Counted even while the parent is absent, so the count is right if the parent comes back.
            self.children[key.parent] = self.children.get(key.parent, 0) + 1
        self._push(key.block)

    def touch(self, key: Hashable) -> None:
        block = _as_key(key).block
        if block not in self.present:
            return
        self.clock += 1
        self.on_touch(block)  # before `last` moves: a policy may measure the age at which the block was reused
        self.last[block] = self.clock
        self._push(block)

    def remove(self, key: Hashable) -> None:
        block = _as_key(key).block
        k = self.present.pop(block, None)
        if k is None:
            return
        self.on_remove(block)
        self._version[block] = self._version.get(block, 0) + 1
        self.last.pop(block, None)
        if k.parent is not None:
            self.children[k.parent] -= 1
            if self.children[k.parent] == 0:
                del self.children[k.parent]
                if k.parent in self.present:
                    self._push(k.parent)  # a new leaf

    def set_queue(self, block_ids: list) -> None:
        """The blocks the waiting requests will read, request by request, first to run first.

        Args:
            block_ids: One list of block ids per queued request (its whole chain), in queue order.
        """
        old = self.queued
        queued: dict[Hashable, int] = {}
        for pos, chain in enumerate(block_ids):
            for b in chain:
                queued.setdefault(b, pos)
        self.queued = queued
        # Only blocks whose queue position changed need a new priority.
        for b in set(old).symmetric_difference(queued) | {b for b in queued if old.get(b) != queued[b]}:
            if b in self.present:
                self._push(b)

    def position(self, key: Hashable) -> int | None:
        return self.queued.get(_as_key(key).block)

    # Subclass hooks ---------------------------------------------------------------------------------------------
    def priority(self, block: Hashable) -> float:
        """The block's eviction priority among unqueued leaves: lowest goes first."""
        raise NotImplementedError

    def on_insert(self, block: Hashable) -> None:
        """A block entered (before its first priority is computed)."""

    def on_touch(self, block: Hashable) -> None:
        """A present block was read."""

    def on_remove(self, block: Hashable) -> None:
        """A block is leaving (its state is still there)."""

    # The heap ---------------------------------------------------------------------------------------------------
    def _push(self, block: Hashable) -> None:
        v = self._version.get(block, 0) + 1
        self._version[block] = v
        pos = self.queued.get(block)
        # Unqueued leaves go first (by priority); queued ones last, the furthest in the queue first.
        rank = (0, self.priority(block)) if pos is None else (1, -pos)
        heapq.heappush(self._heap, (rank, v, block))
        if len(self._heap) > 4 * len(self.present) + 1024:
            self._compact()

    def _valid(self, entry) -> bool:
        _, v, block = entry
        return block in self.present and self._version.get(block) == v and self.children.get(block, 0) == 0

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if e[2] in self.present and self._version.get(e[2]) == e[1]]
        heapq.heapify(self._heap)

    def victims(self) -> Iterator[Hashable]:
        yield from self._walk(self._heap)

    def _walk(self, heap: list) -> Iterator[BlockKey]:
        """The valid entries of `heap` in order, first to evict first."""
        while heap and not self._valid(heap[0]):
            heapq.heappop(heap)  # stale: dropping it changes no order
        # Walk the heap in order without popping (a heap of indices), so that the caller may stop early.
        frontier = [(heap[0], 0)] if heap else []
        while frontier:
            entry, i = heapq.heappop(frontier)
            if self._valid(entry):
                yield self.present[entry[2]]
            for j in (2 * i + 1, 2 * i + 2):
                if j < len(heap):
                    heapq.heappush(frontier, (heap[j], j))

    def __len__(self) -> int:
        return len(self.present)


def _as_key(key: Hashable) -> BlockKey:
    if isinstance(key, BlockKey):
        return key
    if isinstance(key, tuple) and len(key) == 2:
        return BlockKey(*key)
    raise TypeError(f"`key`={key!r} is not a BlockKey(block, parent)")


class LeafLRUPolicy(LeafFirstPolicy):
    """Least recently used leaf first (SGLang's radix-cache eviction), with the queue's blocks kept last.

    Example:
        >>> p = LeafLRUPolicy()
        >>> p.insert(BlockKey("a", None)); p.insert(BlockKey("b", None)); p.touch(BlockKey("a", None))
        >>> [k.block for k in p.victims()]
        ['b', 'a']
    """

    def priority(self, block: Hashable) -> float:
        return self.last[block]


class RetentionPolicy(LeafFirstPolicy):
    """Recency with a retention credit for blocks that have been reused, leaves first, the queue's blocks last.

    A block read by a second request (or inserted again while the ghost of its eviction is remembered: a read
    that missed) is worth keeping longer:
    on prefix traces most blocks are read once (a prompt's unique tail), while a block read twice is a shared
    document, system prompt or conversation head that is likely read again. Such a block's priority is its last
    use plus ``credit`` ticks; ``credit=None`` (default) measures it: the mean age at eviction of the blocks
    that left (the cache's lifetime), so a reused block gets about one more lifetime than a single-use one,
    whatever the cache size or the trace's rate. Ghosts (ids of evicted blocks) are kept for twice as many
    blocks as are present, as ARC keeps its ghost lists.

    Args:
        credit: Extra ticks of retention for a reused block; ``None`` to use the measured lifetime.

    Example:
        >>> p = RetentionPolicy(credit=10)
        >>> p.insert(BlockKey("a", None)); p.touch(BlockKey("a", None)); p.insert(BlockKey("b", None))
        >>> [k.block for k in p.victims()]  # "a" was reused: it outlives the newer "b"
        ['b', 'a']
    """

    def __init__(self, credit: float | None = None):
        if credit is not None and credit < 0:
            raise ValueError(f"`credit`={credit!r} must be >= 0 (or None to measure it)")
        super().__init__()
        self.credit = credit
        self.reused: set[Hashable] = set()
        self._ghosts: OrderedDict[Hashable, None] = OrderedDict()
        self.lifetime = 0.0  # EWMA of the age at eviction, in ticks

    def priority(self, block: Hashable) -> float:
        if block not in self.reused:
            return self.last[block]
        return self.last[block] + (self.lifetime if self.credit is None else self.credit)

    def on_insert(self, block: Hashable) -> None:
        if block in self._ghosts:
            del self._ghosts[block]
            self.reused.add(block)

    def on_touch(self, block: Hashable) -> None:
        self.reused.add(block)

    def on_remove(self, block: Hashable) -> None:
        age = self.clock - self.last[block]
        # The mean over about the last thousand evictions: it follows the trace's phases, not one outlier.
        self.lifetime += (age - self.lifetime) / 1000 if self.lifetime else age
        self.reused.discard(block)
        self._ghosts[block] = None
        while len(self._ghosts) > max(2 * len(self.present), 1):
            self._ghosts.popitem(last=False)


class SegmentedPolicy(RetentionPolicy):
    """Segmented LRU on leaves (SLRU, as in S3-FIFO's small and main queues): reused blocks are protected.

    A block enters on probation; once reused (read by a second request, or back while the ghost of its eviction
    is remembered) it is protected. Victims come from probation, least recently used leaf first, while protected
    blocks fill at most `protected` of the tier; past that share the protected segment gives up its least
    recently used leaves. Unlike a retention credit, the share bounds how much the reused blocks of the past
    (ended conversations, documents no longer asked about) can hold: they age out of their segment by recency.

    Args:
        protected: The largest share of the tier the protected segment keeps from eviction, in [0, 1).

    Example:
        >>> p = SegmentedPolicy(protected=0.5)
        >>> for b in "abc":
        ...     p.insert(BlockKey(b, None))
        >>> p.touch(BlockKey("a", None))  # reused: protected
        >>> [k.block for k in p.victims()]
        ['b', 'c', 'a']
    """

    def __init__(self, protected: float = 0.8):
        if not 0 <= protected < 1:
            raise ValueError(f"`protected`={protected!r} must be in [0, 1)")
        super().__init__(credit=0)
        self.protected = protected
        self._segment_heaps: tuple[list, list] = ([], [])  # probation, protected
        self._n_protected = 0

    def priority(self, block: Hashable) -> float:
        return self.last[block]

    def on_touch(self, block: Hashable) -> None:
        self._protect(block)

    def on_insert(self, block: Hashable) -> None:
        if block in self._ghosts:
            del self._ghosts[block]
            self._protect(block)

    def _protect(self, block: Hashable) -> None:
        if block not in self.reused:
            self.reused.add(block)
            self._n_protected += 1

    def on_remove(self, block: Hashable) -> None:
        if block in self.reused:
            self._n_protected -= 1
        super().on_remove(block)

    def _push(self, block: Hashable) -> None:
        v = self._version.get(block, 0) + 1
        self._version[block] = v
        pos = self.queued.get(block)
        rank = (0, self.priority(block)) if pos is None else (1, -pos)
        heapq.heappush(self._segment_heaps[block in self.reused], (rank, v, block))
        if sum(map(len, self._segment_heaps)) > 4 * len(self.present) + 1024:
            for heap in self._segment_heaps:
                heap[:] = [e for e in heap if e[2] in self.present and self._version.get(e[2]) == e[1]]
                heapq.heapify(heap)

    def victims(self) -> Iterator[Hashable]:
        probation, protected = self._segment_heaps
        over = self._n_protected > self.protected * len(self.present)
        first, second = (protected, probation) if over else (probation, protected)
        queued = []
        for heap in (first, second):
            for key in self._walk(heap):
                # Queued blocks of either segment come last (the furthest in the queue first).
                if key.block in self.queued:
                    queued.append(key)
                else:
                    yield key
        yield from sorted(queued, key=lambda k: -self.queued[k.block])


AGE_BUCKETS = 96  # log-spaced, 4 per doubling: ages up to about 2**24 ticks (older ones share the last)


def _bucket(age: int) -> int:
    """The histogram bucket of an age in ticks (exact below 4, then four per doubling)."""
    if age < 4:
        return age
    e = age.bit_length() - 1  # 2**e <= age < 2**(e+1): four sub-steps per doubling
    return min(AGE_BUCKETS - 1, 4 * e - 4 + ((age >> (e - 2)) & 3))


# The smallest age of each bucket: b below 4, then (4 + sub-step) << (doubling - 2).
_AGE = [b if b < 4 else (4 + b % 4) << (b // 4 - 1) for b in range(AGE_BUCKETS)]


class HitDensityPolicy(LeafFirstPolicy):
    """Evicts the leaf with the lowest expected hits per tick of cache space it will still occupy.

    For each class of block (how many times it was read, 0 to 3+; a block evicted and inserted again while its
    ghost is remembered keeps its count, plus one for the read that brought it back) the policy keeps histograms
    of the ages (ticks since the last access) at which blocks were hit and at which they were evicted, decayed so
    that they follow the trace's phases. From them, a block of class `c` and age `a` has hit density
    ``P(hit after a) / E[remaining lifetime after a]``: blocks whose class usually gets reused soon keep a high
    density while young and lose it as they age past the usual reuse distance; single-use blocks (a prompt's
    unique tail) are learned to be worth little. Nothing is tuned to a trace: the histograms are the trace's own
    reuse distances.

    Eviction samples `samples` leaves at random (seeded) and takes the lowest density, as LHD does; blocks of
    queued requests (:meth:`set_queue`) go last, the furthest in the queue first.

    Args:
        samples: Leaves compared per eviction.
        decay_every: Accesses between two halvings of the histograms (and recomputations of the densities).
        seed: Seed of the sampling.

    Example:
        >>> from hf_attnstore.lab.block_policy import BlockKey
        >>> p = HitDensityPolicy(samples=8)
        >>> p.insert(BlockKey(1, None)); p.insert(BlockKey(2, 1))
        >>> next(p.victims()).block  # the only leaf
        2
    """

    CLASSES = 4
    RECOMPUTE_EVERY = 1000  # accesses between two recomputations of the densities (cheap: 4 x 96 buckets)

    def __init__(self, samples: int = 32, decay_every: int = 20_000, seed: int = 0):
        if samples < 1 or decay_every < 1:
            raise ValueError(f"`samples`={samples} and `decay_every`={decay_every} must be >= 1")
        super().__init__()
        self.samples, self.decay_every = samples, max(decay_every, self.RECOMPUTE_EVERY)
        self._rng = random.Random(seed)
        self.reads: dict[Hashable, int] = {}  # block -> reads since it entered (ghosts included)
        self._ghosts: OrderedDict[Hashable, int] = OrderedDict()
        self._hits = [[0.0] * AGE_BUCKETS for _ in range(self.CLASSES)]
        self._evictions = [[0.0] * AGE_BUCKETS for _ in range(self.CLASSES)]
        self._density = [[1.0] * AGE_BUCKETS for _ in range(self.CLASSES)]
        self._leaves: list[Hashable] = []
        self._leaf_at: dict[Hashable, int] = {}
        self._since = 0

    def _class(self, block: Hashable) -> int:
        return min(self.reads[block], self.CLASSES - 1)

    # Hooks of the base -------------------------------------------------------------------------------------------
    def on_insert(self, block: Hashable) -> None:
        # A block that comes back while its ghost is remembered was read again after it left: that read counts.
        ghost = self._ghosts.pop(block, None)
        self.reads[block] = 0 if ghost is None else ghost + 1
        self._tick()

    def on_touch(self, block: Hashable) -> None:
        # Recorded before the base moves `last`: the hit's age is since the previous access.
        self._hits[self._class(block)][_bucket(self.clock - 1 - self.last[block])] += 1
        self.reads[block] += 1
        self._tick()

    def on_remove(self, block: Hashable) -> None:
        self._evictions[self._class(block)][_bucket(self.clock - self.last[block])] += 1
        self._ghosts[block] = self.reads.pop(block)
        while len(self._ghosts) > max(2 * len(self.present), 1):
            self._ghosts.popitem(last=False)
        self._drop_leaf(block)

    def _push(self, block: Hashable) -> None:
        # No heap: the block is (again) a leaf candidate; sampling checks it still is one.
        if block not in self._leaf_at:
            self._leaf_at[block] = len(self._leaves)
            self._leaves.append(block)

    def _drop_leaf(self, block: Hashable) -> None:
        i = self._leaf_at.pop(block, None)
        if i is None:
            return
        last = self._leaves.pop()
        if last != block:
            self._leaves[i] = last
            self._leaf_at[last] = i

    # The densities -----------------------------------------------------------------------------------------------
    def _tick(self) -> None:
        self._since += 1
        if self._since % self.RECOMPUTE_EVERY == 0:
            self._recompute(halve=self._since >= self.decay_every)
            if self._since >= self.decay_every:
                self._since = 0

    def _recompute(self, halve: bool) -> None:
        for c in range(self.CLASSES):
            hits, evs, dens = self._hits[c], self._evictions[c], self._density[c]
            # Suffix sums from the oldest age down: hits still to come after age a, and the ticks of lifetime
            # still to spend (an event at age x spends x - a more ticks: sum n_x * x - a * sum n_x).
            future_hits = events = weighted = 0.0
            for a in range(AGE_BUCKETS - 1, -1, -1):
                future_hits += hits[a]
                events += hits[a] + evs[a]
                weighted += (hits[a] + evs[a]) * _AGE[a]
                lifetime = weighted - _AGE[a] * events + events  # +1 tick per event: no zero lifetimes
                dens[a] = future_hits / lifetime if lifetime else 0.0
                if halve:
                    hits[a] /= 2
                    evs[a] /= 2

    def density(self, block: Hashable) -> float:
        """Expected hits per unit of remaining lifetime of a present block (higher = keep)."""
        return self._density[self._class(block)][_bucket(self.clock - self.last[block])]

    def priority(self, block: Hashable) -> float:
        return self.density(block)

    def victims(self) -> Iterator[Hashable]:
        leaves = [b for b in self._sample() if self.children.get(b, 0) == 0]
        # Unqueued leaves by density; queued ones last, the furthest in the queue first.
        leaves.sort(key=lambda b: (0, self.density(b)) if b not in self.queued else (1, -self.queued[b]))
        yield from (self.present[b] for b in leaves)
        seen = set(leaves)
        yield from (self.present[b] for b in list(self._leaves) if b not in seen and self.children.get(b, 0) == 0)

    def _sample(self) -> list[Hashable]:
        if len(self._leaves) <= self.samples:  # few leaves: compare them all
            for b in [b for b in self._leaves if b not in self.present or self.children.get(b, 0)]:
                self._drop_leaf(b)
            return list(self._leaves)
        out: list[Hashable] = []
        tries = 0
        while self._leaves and len(out) < self.samples and tries < 4 * self.samples:
            tries += 1
            b = self._leaves[self._rng.randrange(len(self._leaves))]
            if b not in self.present or self.children.get(b, 0):
                self._drop_leaf(b)  # gained a child since: not a leaf any more
                continue
            if b not in out:
                out.append(b)
        return out


# Policies of prefix blocks (keys are `BlockKey`s; see blocks.py). "lru" is the store's own LRUPolicy applied to
# blocks (plain block LRU: it may evict a parent whose children stay); the others evict leaves only.
BLOCK_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lru-leaf": LeafLRUPolicy,
                                                   "retention": RetentionPolicy, "slru": SegmentedPolicy,
                                                   "density": HitDensityPolicy}


def make_block_policy(name: str) -> EvictionPolicy:
    """Creates a block policy by name; ``"retention:N"`` sets :class:`RetentionPolicy`'s credit to N ticks and
    ``"slru:F"`` :class:`SegmentedPolicy`'s protected share to F.

    Example:
        >>> policy = make_block_policy("lru-leaf")
        >>> policy.insert(BlockKey(1, None)); policy.insert(BlockKey(2, 1))
        >>> [key.block for key in policy.victims()]  # the leaf, not its parent
        [2]
    """
    base, _, arg = name.partition(":")
    if base not in BLOCK_POLICIES:
        raise ValueError(f"`policy`={name!r} is unknown; choose one of {', '.join(BLOCK_POLICIES)}")
    if not arg:
        return BLOCK_POLICIES[base]()
    if base not in ("retention", "slru"):
        raise ValueError(f"`policy`={name!r}: only retention:CREDIT and slru:SHARE take a parameter")
    try:
        value = float(arg)
    except ValueError:
        raise ValueError(f"`policy`={name!r}: the parameter {arg!r} is not a number") from None
    return RetentionPolicy(credit=value) if base == "retention" else SegmentedPolicy(protected=value)
