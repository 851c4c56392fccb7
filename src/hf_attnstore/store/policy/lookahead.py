"""Scheduler-aware eviction (AttentionStore §3.4): the job queue tells which sessions are needed soon."""

from __future__ import annotations

from collections.abc import Hashable, Iterator

from .base import EvictionPolicy


class LookaheadPolicy(EvictionPolicy):
    """Evicts sessions with no queued job first (least recently used first), then sessions whose next
    job is furthest away: the one nearest the tail of the look-ahead window goes first.

    Used for both tiers: when demoting host → disk it keeps the sessions about to run in memory; when
    dropping from disk it drops sessions outside the window first, then the last-arrived job's session.

    The scheduler calls :meth:`set_queue` with the session ids of its waiting jobs, in order (the store
    forwards :meth:`AttnStore.set_schedule`); keys are ``(fingerprint, session_id)``.

    Example:
        >>> policy = LookaheadPolicy()
        >>> for sid in ("a", "b", "c", "d"):
        ...     policy.insert(("model", sid))
        >>> policy.set_queue(["c", "a"])  # c's job runs next, then a's
        >>> [sid for _, sid in policy.victims()]  # idle sessions first, then the job furthest away
        ['b', 'd', 'a', 'c']
    """

    looks_ahead = True

    def __init__(self):
        super().__init__()
        self._next_job: dict[str, int] = {}

    def set_queue(self, session_ids: list[str]) -> None:
        """The session ids of the jobs in the look-ahead window, first to run first."""
        # Built from the back so that a session's first (soonest) job wins; dict(zip) runs in C, and the
        # scheduler calls this at every queue change with windows of thousands of jobs.
        n = len(session_ids)
        self._next_job = dict(zip(reversed(session_ids), range(n - 1, -1, -1)))

    def position(self, key: Hashable) -> int | None:
        """Where the session's next job is in the queue (0 = next), or None if it has none."""
        return self._next_job.get(key[1])

    def touch(self, key: Hashable) -> None:
        if key in self.order:
            self.order.move_to_end(key)

    def victims(self) -> Iterator[Hashable]:
        # Lazy: the idle sessions usually supply the victims, and the queued ones are only sorted if not.
        yield from (k for k in self.order if k[1] not in self._next_job)
        queued = [k for k in self.order if k[1] in self._next_job]
        yield from sorted(queued, key=lambda k: -self._next_job[k[1]])
