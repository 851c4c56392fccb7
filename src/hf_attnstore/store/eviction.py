"""Making room: which sessions leave host memory (demoted to the tier below, or dropped) and which disk copies, or
their leading chunks (partial eviction), leave the disk tier when it is over `disk_bytes`.

The choices themselves are `placement.py`'s (shared with the simulator); this module applies them to the index,
under its lock, and runs the disk deletions they queue (on the save thread, without the lock).
"""

from __future__ import annotations

import time

from .config import StoreConfig
from .disk import DiskTier
from .entry import Entry, Key, Write, blocks
from .placement import choose_head_drops, choose_victims, head_drop_candidates
from .store_state import StoreState
from .tier import CHUNK_SUFFIX, MANIFEST, Tier


class NoDiskRoom(Exception):
    """A write would take the disk tier over `disk_bytes` even after evicting every other session."""


class DiskBusy(OSError):
    """A write does not fit now because the sessions that would make room are being read or written: a failed
    write, retried (with back-off, and at once by a flush), not a refusal."""


class Eviction:
    """Host demotion and the disk limit, over the store's state (see the module docstring).

    Example:
        >>> from hf_attnstore.store.config import StoreConfig
        >>> config = StoreConfig(host_bytes="1MiB")
        >>> state = StoreState(config, has_disk=False, has_lower=False)
        >>> eviction = Eviction(state, config, disk=None, lower=None)
        >>> with state.lock:
        ...     eviction.make_host_room(1024, exclude=None)  # an empty host tier has room
        True
    """

    def __init__(self, state: StoreState, config: StoreConfig, disk: DiskTier | None, lower: Tier | None):
        self.state, self.config, self.disk, self.lower = state, config, disk, lower

    def make_host_room(self, extra: int, exclude: Entry | None, keep_sooner_than: int | None = None) -> bool:
        """Demotes (or drops) host sessions until `extra` more bytes fit. Pinned ones stay; dirty ones are
        persisted first and demoted when that completes. With `keep_sooner_than` (a prefetch for the job at
        that queue position), sessions whose next job comes sooner are never evicted for it."""
        limit = self.state.host.limit
        if self.state.host.fits(extra):
            return True  # the common case, once per appended token: no scan of the index
        self.state.apply_ended_turns()
        host = self.state.host
        freeing = sum(host.freed_by(e) for e in self.state.entries.values() if e.write is Write.DEMOTE)
        entries = self.state.entries

        def movable(key) -> bool:  # already being written out counts in `freeing`; pinned ones stay
            e = entries[key]
            return e is not exclude and e.write is not Write.DEMOTE and e.pins == 0 and not e.writers

        for key in choose_victims(self.state.host.policy.victims(), lambda key: host.freed_by(entries[key]), movable,
                                  self.state.host.used - freeing + extra - limit,
                                  self.state.host.position, keep_sooner_than):
            self.evict_from_host(entries[key])
        return self.state.host.fits(extra)

    def evict_from_host(self, e: Entry) -> None:
        """Demotes a session to disk, or drops it when it cannot be kept there. Sessions being loaded or
        written, or whose turn is running, are pinned and stay; unwritten ones are written first (then demoted
        by _finish_persist)."""
        self.state.apply_ended_turns()
        if e.pins or e.writers:
            return
        # A host copy still missing a head its turn did not recompute, and not durable that far (a remote copy
        # loaded without its head, `recompute_by_cost`), cannot be written: dropped (the remote copy stays).
        unwritable = e.host is not None and e.host.missing_head > e.persisted
        if self.lower is None or e.write is Write.NEVER or e.length == 0 or unwritable:
            if e.manifest is None:  # its only copy
                self.state.dropped(e)
            self.state.release_host(e)  # its durable copy, if any, stays
            self.state.count(host_drops=1)
        elif e.dirty:
            self.state.mark_dirty(e, Write.DEMOTE)
            self.state.cond.notify_all()
        else:
            assert e.manifest is not None and e.persisted == e.length, "a clean session is entirely below host"
            self.state.set_host(e, None)
            self.state.count(demotions=1)

    def enforce_disk(self, current: Entry | None) -> bool:
        """Drops other sessions' disk copies (or, with `partial_eviction`, their leading chunks first) while
        the disk tier is over its limit. Returns whether it fits once the queued deletions have run (the caller
        runs them before writing)."""
        limit = self.config.disk_bytes
        entries = self.state.entries
        if self.state.disk_used - self.state.deleting > limit:
            self.drop_replaced_copies(current, self.state.disk_used - self.state.deleting - limit)
        while self.config.partial_eviction and self.state.disk_used - self.state.deleting > limit:
            # (Again while it frees something: the room a head drop's new manifest takes counts only once chosen.)
            queued = len(self.state.deletes)
            self.drop_disk_heads(current, self.state.disk_used - self.state.deleting - limit)
            if len(self.state.deletes) == queued:
                break
        for key in choose_victims(self.state.disk_policy.victims(), lambda key: entries[key].disk_bytes,
                                  lambda key: entries[key] is not current and entries[key].pins == 0,
                                  self.state.disk_used - self.state.deleting - limit):
            self.state.count(disk_drops=1)
            self.state.dropped(entries[key])
            self.drop_disk_copy(entries[key])
        return self.state.disk_used - self.state.deleting <= limit

    def replaced_copies(self, current: Entry | None, loading: bool = False):
        """Other sessions' older copies that a new history keeps until its own copy is durable (`StoreState.hand_over`)
        and that may go for room now (`loading`: or once their loads end). The session being written keeps its
        own: a durable copy is never dropped for its own successor."""
        for e in self.state.entries.values():
            if e is not current and e.manifest is None and e.predecessor is not None and e.files \
                    and (e.pins == 0 or loading and e.loading is not None):
                yield e

    def drop_replaced_copies(self, current: Entry | None, overflow: int) -> None:
        """Room from other sessions' replaced histories first (a capacity eviction, counted in `disk_drops`): they
        are the least likely to be resumed. The session's new history stays in host memory, to be written."""
        for e in list(self.replaced_copies(current)):
            if overflow <= 0:
                return
            overflow -= e.disk_bytes
            self.state.count(disk_drops=1)
            self.state.forget_replaced(e)

    def drop_disk_heads(self, current: Entry | None, overflow: int) -> None:
        """Partial eviction: drops leading chunks of idle sessions' disk copies, lowest retention value first
        (`placement.choose_head_drops`). Sessions loading, being written, running a turn or queued by the
        scheduler are left whole."""
        now, policy = time.monotonic(), self.state.disk_policy

        def describe(key):
            e = self.state.entries[key]
            # A hybrid model's session (with a state) stays whole: its head could not be recomputed without
            # recomputing the states, i.e. the whole session.
            if e is current or e.pins or e.writers or e.manifest is None or not e.manifest.spans \
                    or e.manifest.state is not None or policy.position(key) is not None:
                return None
            return now - e.last_access, self.head_units(e), e.disk_bytes

        candidates = head_drop_candidates(policy.victims(), overflow, describe)
        for key in choose_head_drops(candidates, overflow):
            e = self.state.entries.get(key)
            if e is None or e.manifest is None:
                continue
            if len(e.manifest.spans) == 1:  # its last chunk: the session leaves the disk tier
                self.state.count(disk_drops=1)
                self.state.dropped(e)
                self.drop_disk_copy(e)
            else:
                self.drop_disk_head(e)

    def head_units(self, e: Entry) -> list[tuple[int, int, int]]:
        """The session's stored chunks in order as (start, end, bytes freed when dropped); the last frees
        everything left (the manifest, chunks not yet collected)."""
        spans, units, pos = e.manifest.spans, [], e.manifest.head
        for i, span in enumerate(spans):
            if any(s.chunk == span.chunk for s in spans[i + 1 :]):
                freed = 0  # a later span reads the chunk too
            elif span.chunk in e.linked:  # a shared prefix's file: freed only with its last name
                freed = self.state.shared_bytes(e.key, span.chunk, e.linked[span.chunk])
            else:
                freed = blocks(e.files.get(span.chunk, 0))
            units.append((pos, pos + span.length, freed))
            pos += span.length
        a, b, _ = units[-1]
        units[-1] = (a, b, e.disk_bytes - sum(u[2] for u in units[:-1]))
        return units

    def drop_disk_head(self, e: Entry) -> None:
        """Drops the first stored chunk of a session's disk copy: the index at once, the files on the save
        thread (the new manifest first, then the chunk, so a crash in between leaves an orphan chunk)."""
        old = e.manifest
        manifest = old.drop_head_span()
        chunk = old.spans[0].chunk
        gone = chunk if all(s.chunk != chunk for s in manifest.spans) else None
        self.state.set_manifest(e, manifest, e.chunks)
        files = dict(e.files)
        size = files.pop(gone) if gone in files else None
        # A shared file frees its bytes only with its last name (`StoreState.set_files` says how many).
        nbytes = blocks(size) if size is not None and gone not in e.linked else 0
        nbytes += self.state.set_files(e, files, e.manifest_size)
        # The new manifest is written beside the old one (a temporary file, then a rename) before the chunk goes:
        # room for the largest such temporary is counted until the queued deletions have run (`run_deletes`; they
        # run one at a time), so `disk_bytes` holds while they do.
        room = blocks(len(manifest.encode()))
        self.state.reserve_manifest_room(room)
        self.state.queue_delete(e.key, nbytes, (manifest, gone))
        self.state.count(head_drops=1, head_dropped_tokens=old.spans[0].length)

    def reserve_disk(self, e: Entry, nbytes: int, exact: bool = False) -> int:
        """Makes room for `nbytes` before they are written (save thread), so the files on disk never exceed
        `disk_bytes`: other sessions' copies are dropped first and their folders deleted now. A file is counted
        in 4 KiB blocks; `exact`: `nbytes` is already a sum of such blocks (a job's bound, `SaveThread`).

        Whether the bytes can fit at all is asked first: when not even dropping every other session's copy that
        may go would make room, nothing is dropped (a refusal loses nothing else). The session's own durable
        copy is never dropped for it either: it stays until its successor is durable (`StoreState.hand_over`).

        Raises:
            NoDiskRoom: The session alone would not fit.
        """
        if self.disk is None:
            return 0  # saved to the remote tier: its memory is Redis's to limit (maxmemory), not `disk_bytes`
        size = nbytes if exact else blocks(nbytes)
        busy = False
        with self.state.cond:
            over = self.state.disk_used - self.state.deleting + size - self.config.disk_bytes
            fits = over <= 0 or over <= self.evictable_bytes(e)  # (the common case asks no session)
            busy = not fits and over <= self.evictable_bytes(e, pinned=True)
            if fits:
                self.state.reserve_disk(size)
                fits = self.enforce_disk(e)
                if not fits:  # (sessions pinned meanwhile: what was dropped went in good faith)
                    self.state.release_disk(size)
            deletes = self.state.take_deletes()
        self.run_deletes(deletes)
        if busy:
            raise DiskBusy(f"session {e.key[1]!r} does not fit in the disk tier while the sessions that would make "
                           "room for it are being read or written; retried")
        if not fits:
            raise NoDiskRoom(f"session {e.key[1]!r} is larger than the disk tier (`disk_bytes` "
                             f"{self.config.disk_bytes}) next to the sessions that cannot leave it")
        return size

    def evictable_bytes(self, current: Entry, pinned: bool = False) -> int:
        """The disk bytes dropping every other session's copy that may go now would free (lock held): copies that
        are not pinned (`pinned`: those being loaded too, once their loads end; the other pins are the running
        save's own, its links' sources), and shared files all of whose names are in them."""
        entries, gone = self.state.entries, set()
        total = 0
        for key in self.state.disk_policy.victims():
            e = entries.get(key)
            if e is not None and e is not current and (e.pins == 0 or pinned and e.loading is not None):
                total += e.disk_bytes
                gone.add(key)
        for e in self.replaced_copies(current, pinned):
            total += e.disk_bytes
            gone.add(e.key)
        for nbytes, names in self.state.linked.values():
            if names and all(key in gone for key, _ in names):
                total += nbytes
        return total

    def run_deletes(self, deletes: list[tuple[Key, int, tuple | None]]) -> None:
        """Runs queued deletions (save thread, without the lock; see `StoreState.deletes`). A deletion that fails
        (EACCES, EIO) is logged and the others go on; the bytes are released from the count either way (what is left
        is collected when the folder is next scanned)."""
        try:
            for key, nbytes, head in deletes:
                try:
                    self.run_delete(key, nbytes, head)
                except OSError as exc:
                    self.state.once.warning("delete", "disk tier: deleting files of session %r failed (%s)", key[1], exc)
        finally:
            if deletes:
                with self.state.cond:
                    self.state.deletes_done(deletes)
                    self.state.cond.notify_all()  # a flush() may be waiting for them

    def run_delete(self, key: Key, nbytes: int, head: tuple | None) -> None:
        if head is None:
            self.disk.remove(key)
            return
        manifest, chunk = head
        try:
            # Now, on this thread: behind the tier's write queue it would wait for every chunk queued before
            # it (a timeout there would drop a copy whose manifest still lands later).
            size = self.disk.write(key, MANIFEST, manifest.encode())
        except OSError as exc:
            # The index says the chunk is dropped, the disk still has the old manifest: make them agree by
            # letting the whole disk copy go (a clean miss later; the chunk is deleted with the folder).
            self.state.once.warning("head_drop", "disk tier: writing the manifest of partially evicted session %r "
                               "failed (%s); its disk copy is dropped", key[1], exc)
            with self.state.cond:
                e = self.state.entries.get(key)
                if e is not None and e.manifest is manifest:
                    # The chunk is still there: count it with the folder, whose deletion removes it.
                    self.state.set_files(e, {**e.files, chunk: nbytes} if chunk else e.files, e.manifest_size)
                    self.drop_disk_copy(e)
            return
        if chunk is not None:
            self.disk.delete(key, [chunk + CHUNK_SUFFIX])
        with self.state.cond:
            e = self.state.entries.get(key)
            if e is not None and e.manifest is manifest:
                self.state.set_files(e, e.files, size)

    def drop_disk_copy(self, e: Entry) -> None:
        """Removes a session from the disk tier; with no copy in host memory either, it is gone."""
        self.state.drop_disk_copy(e)
