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

from .base import EvictionPolicy


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
