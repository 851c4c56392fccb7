"""Eviction policies: which session leaves a tier first. One file per policy."""

from __future__ import annotations

from .base import EvictionPolicy
from .fifo import FIFOPolicy
from .lookahead import LookaheadPolicy
from .lru import LRUPolicy

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


__all__ = ["EvictionPolicy", "FIFOPolicy", "LRUPolicy", "LookaheadPolicy", "POLICIES", "make_policy"]
