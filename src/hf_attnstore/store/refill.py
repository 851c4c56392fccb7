"""Refilling a remote tier that lost what it held: a Redis restarted empty (a cache Redis usually keeps no
snapshot), flushed, or that evicted chunks a manifest names.

The store remembers which chunks it put in the remote tier (`Entry.mirrored`) so as not to copy them again at
every save. That memory is only true while the server keeps its data, so it is checked against the server
itself: the remote tier notices a restart or a flush by a marker key (`RemoteTier.lost`, asked before every save
and by every `flush()`), and it refuses to write a manifest that names chunks it no longer holds
(`MissingChunks`). Then:

- with a disk tier (Redis mirrors it): every session's chunks are forgotten as mirrored, and each session on
  disk is copied again from its files (a :class:`MirrorJob` on the save thread), so other replicas resume it;
- with Redis as the only tier below host memory: each session's copy there is forgotten, and a session still
  in host memory is written whole again; one that is not is gone (nothing else holds it), a clean miss.

The save thread runs the copies; the decisions are made here, under the state's lock.
"""

from __future__ import annotations

import logging

from .entry import Entry, Write
from .save_thread import MirrorJob, MirrorResult
from .store_state import StoreState

logger = logging.getLogger(__name__)


class Refill:
    """What the store does when its remote tier lost data (see the module docstring).

    Example:
        >>> from hf_attnstore.store.config import StoreConfig
        >>> state = StoreState(StoreConfig(host_bytes="1MiB"), has_disk=True, has_lower=True)
        >>> refill = Refill(state, mirror=True)
        >>> refill.lost()  # nothing indexed: nothing to copy again
        >>> with state.lock:
        ...     refill.next_job() is None
        True
    """

    def __init__(self, state: StoreState, mirror: bool):
        self.state = state
        self.mirror = mirror  # the remote tier mirrors a disk tier (else it is the tier below host memory)

    def lost(self) -> None:
        """The remote tier lost what it held (lock taken here)."""
        with self.state.cond:
            self.state.count(remote_restarts=1)
            self.state.once.warning("remote_lost", "remote tier: the server lost its data (a restart or a flush); "
                                    "the store writes its sessions there again")
            self.state.lost_mirror()
            for e in list(self.state.entries.values()):
                if self.mirror:
                    if e.manifest is not None:
                        self.state.queue_remirror(e.key)
                elif e.manifest is not None:
                    self.forget(e)
            self.state.cond.notify_all()

    def forget(self, e: Entry) -> None:
        """The session's copy in the remote tier (the tier below host memory) is gone or incomplete (lock held):
        a host copy holding the whole session is written whole again (a save in flight for the old copy does
        not commit: a new generation); otherwise the session is gone."""
        if e.host is not None and e.host.length and not e.host.missing_head:
            self.state.new_history(e)
            self.state.set_manifest(e, None, {})
            self.state.mark_dirty(e, Write.BEHIND if e.write is Write.FAILED or e.write is Write.NEVER else None)
        elif e.pins == 0 and not e.writers:
            self.state.drop(e)
        self.state.cond.notify_all()

    def next_job(self) -> MirrorJob | None:
        """A session to copy again to the mirror tier, pinned (lock held); None when there is none to start now.
        Sessions being loaded or written wait (the next save copies them anyway); gone ones are dropped."""
        for key in list(self.state.remirror):
            e = self.state.entries.get(key)
            if e is None or e.manifest is None:
                self.state.unqueue_remirror(key)
                continue
            if e.pins == 0:
                self.state.pin(e)
                return MirrorJob(e, e.manifest, frozenset(e.mirrored))
        return None

    def finish(self, job: MirrorJob, result: MirrorResult) -> None:
        """A copy ended (lock taken here): the chunks it put are mirrored; failed or not, the session leaves the
        queue (a failure is counted; the session's next save copies it again)."""
        e = job.entry
        with self.state.cond:
            self.state.unpin(e)
            self.state.add_mirrored(e, result.mirrored)
            self.state.count(remote_bytes_written=result.nbytes)
            if result.error is not None:
                self.state.count(remote_errors=1)
                self.state.once.warning("refill", "remote tier: copying session %r again failed (%s); its next save "
                                        "copies it", e.key[1], result.error)
            self.state.unqueue_remirror(e.key)
            self.state.cond.notify_all()
