"""First in, first out: accesses do not change the order."""

from __future__ import annotations

from .base import EvictionPolicy


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
