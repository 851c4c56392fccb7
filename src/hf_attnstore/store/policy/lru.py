"""Least recently used: every access moves a session to the back of the queue."""

from __future__ import annotations

from collections.abc import Hashable

from .base import EvictionPolicy


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
