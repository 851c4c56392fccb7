"""Eviction policies: which session leaves a tier first. One file per policy."""

from __future__ import annotations

from .base import EvictionPolicy
from .blocks import BlockKey, LeafFirstPolicy, LeafLRUPolicy, RetentionPolicy, SegmentedPolicy
from .density import HitDensityPolicy
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


__all__ = ["BLOCK_POLICIES", "BlockKey", "EvictionPolicy", "FIFOPolicy", "HitDensityPolicy", "LRUPolicy",
           "LeafFirstPolicy", "LeafLRUPolicy", "LookaheadPolicy", "POLICIES", "RetentionPolicy", "SegmentedPolicy",
           "make_block_policy", "make_policy"]
