"""The eviction policy interface."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator


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
