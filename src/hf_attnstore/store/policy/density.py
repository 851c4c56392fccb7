"""Hit density (LHD, Beckmann et al., NSDI'18) on prefix blocks, leaves first: a learned reuse-distance policy."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable, Iterator

from .blocks import LeafFirstPolicy

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
        >>> from hf_attnstore.store.policy.blocks import BlockKey
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
