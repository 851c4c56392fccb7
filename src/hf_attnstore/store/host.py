"""The host tier: which sessions have KV in host memory, the bytes they hold, and their eviction order.

The KV itself lives in each entry's :class:`~.buffer.SessionBuffer` (pinned with CUDA, so copies to the
device run asynchronously). This class is the tier's bookkeeping, used by the store under its lock: it
counts allocated bytes against `limit` and keeps the policy's order. Pins are the index's (an entry's
`pins` and `writers`): a pinned session is never chosen to leave.
"""

from __future__ import annotations

import torch

from .policy import make_policy
from .buffer import SessionBuffer, SessionKV
from .entry import Entry


class HostTier:
    """Host memory's share of the index (not thread-safe: the store's lock guards it).

    Args:
        limit: Bytes of KV the tier may hold (`host_bytes`).
        policy: Name of the eviction policy (see :mod:`hf_attnstore.store.policy`).
        pin_memory: Whether buffers are allocated in page-locked memory (for asynchronous copies to CUDA).
    """

    name = "host"

    def __init__(self, limit: int, policy: str, pin_memory: bool):
        self.limit, self.pin_memory = limit, pin_memory
        self.policy = make_policy(policy)
        self.used = 0

    @staticmethod
    def contains(e: Entry) -> bool:
        return e.host is not None

    def put(self, e: Entry, buf: SessionBuffer) -> None:
        """Makes `buf` the session's host copy (replacing any other) and counts its bytes."""
        if e.host is None:
            self.policy.insert(e.key)
        e.host = buf
        self.account(e)

    def remove(self, e: Entry) -> None:
        """Lets the session's host copy go (its bytes are freed when the last snapshot of it is)."""
        if e.host is not None:
            self.policy.remove(e.key)
        e.host = None
        self.account(e)

    def account(self, e: Entry) -> None:
        """Brings the count up to date after the session's buffer grew or shrank."""
        now = e.host.nbytes if e.host is not None else 0
        self.used += now - e.host_accounted
        e.host_accounted = now

    def touch(self, e: Entry) -> None:
        if e.host is not None:
            self.policy.touch(e.key)

    def fits(self, extra: int) -> bool:
        return self.used + extra <= self.limit

    def position(self, key) -> int | None:
        """Where the session's next job is in a look-ahead policy's queue (None: not queued, or no queue)."""
        return self.policy.position(key)

    # -- allocation -----------------------------------------------------------------------------------
    def new_buffer(self, geometry: tuple, dtype: torch.dtype) -> SessionBuffer:
        return SessionBuffer(geometry, dtype, self.pin_memory)

    def selected(self, base: SessionKV, keep: torch.Tensor) -> SessionBuffer:
        """A buffer holding ``base[keep]``: shares `base`'s segments where the kept tokens are contiguous."""
        return SessionBuffer.selected(base, keep, self.pin_memory)

    def for_load(self, geometry: tuple, dtype: torch.dtype, length: int) -> SessionBuffer:
        """An empty buffer of exactly `length` tokens for a load from a lower tier."""
        return SessionBuffer.for_load(geometry, dtype, length, self.pin_memory)
