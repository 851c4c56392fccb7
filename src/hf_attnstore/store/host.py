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
    """Host memory's share of the store's state (not thread-safe: the store's lock guards it).

    Args:
        limit: Bytes of KV the tier may hold (`host_bytes`).
        policy: Name of the eviction policy (see :mod:`hf_attnstore.store.policy`).
        pin_memory: Whether buffers are allocated in page-locked memory (for asynchronous copies to CUDA).

    Example:
        >>> host = HostTier(limit=1 << 20, policy="lru", pin_memory=False)
        >>> buf = host.new_buffer((2, 4, 8), torch.float16)
        >>> counted, nbytes = host.account(buf, {}, 0)  # an empty buffer holds no segment yet
        >>> nbytes, host.used, host.fits(1 << 20)
        (0, 0, True)
    """

    name = "host"

    def __init__(self, limit: int, policy: str, pin_memory: bool):
        self.limit, self.pin_memory = limit, pin_memory
        self.policy = make_policy(policy)
        self.used = 0
        # Segments are shared between sessions (a prefix another session starts from, `SessionBuffer.selected`):
        # each is counted once, while any session's buffer refers to it. id -> [segment, users].
        self._segments: dict[int, list] = {}

    @staticmethod
    def contains(e: Entry) -> bool:
        return e.host is not None

    def account(self, buf: SessionBuffer | None, counted: dict, accounted: int) -> tuple[dict, int]:
        """Brings the count up to date after a session's buffer grew, shrank or changed (`counted`, `accounted`:
        its segments and bytes at its last accounting): a segment counts when its first user takes it and stops
        counting when its last user lets it go; a state counts per session. Returns the new segments and bytes,
        which the index keeps on the entry (`StoreState.account`)."""
        now = buf.segments() if buf is not None else {}
        state = buf.state.nbytes if buf is not None and buf.state is not None else 0
        old_state = accounted - sum(seg.nbytes for seg in counted.values())
        for sid in counted.keys() - now.keys():
            held = self._segments[sid]
            held[1] -= 1
            if held[1] == 0:
                self.used -= held[0].nbytes
                del self._segments[sid]
        for sid in now.keys() - counted.keys():
            held = self._segments.setdefault(sid, [now[sid], 0])
            held[1] += 1
            if held[1] == 1:
                self.used += held[0].nbytes
        self.used += state - old_state
        return now, sum(seg.nbytes for seg in now.values()) + state

    def freed_by(self, e: Entry) -> int:
        """Bytes that would be freed if the session left host memory: its segments no other session uses, and
        its state."""
        own = sum(seg.nbytes for sid, seg in e.host_segments.items() if self._segments[sid][1] == 1)
        return own + e.host_accounted - sum(seg.nbytes for seg in e.host_segments.values())

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
