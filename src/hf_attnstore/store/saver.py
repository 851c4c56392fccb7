"""Save decisions: what the store writes to a lower tier and when, and what its state learns when a write ends.

:class:`SavePlanner` decides *what* to save and *when* (write-behind in the quiet gap after a turn, at once for a
flush or a demotion), under the state's lock, and hands the save thread (save_thread.py) a :class:`SaveJob` with
the session pinned; the thread reports back through `SavePlanner.finish_save`, which takes the lock.
"""

from __future__ import annotations

import time

import torch

from .config import StoreConfig
from .entry import Entry, Write
from .eviction import Eviction, NoDiskRoom
from .format import Manifest
from .load_planner import LoadPlanner
from .refill import Refill
from .remote import MissingChunks
from .save_thread import SaveJob, SaveResult, SaveThread
from .store_state import StoreState
from .tier import Key, Tier


def _names(manifest: Manifest | None) -> set[str]:
    """The files a manifest references: its stored chunks and its state."""
    if manifest is None:
        return set()
    return {s.chunk for s in manifest.spans} | ({manifest.state.name} if manifest.state is not None else set())


class SavePlanner:
    """The store's save decisions, over the store's state (under `StoreState.lock`): what to write and when, and
    what the state learns when a write ends. The :class:`SaveThread` it starts sees only this object's public
    methods (`save_thread.Planner`: `next_work`, `run_deletes`, `reserve`, `yield_for_save`, `files_to_keep`,
    `indexed`, `finish_save`, `thread_error`, `warn`), never the state.

    Example (through the store: a flush writes what the turn appended, through the save thread)::

        >>> import tempfile, torch
        >>> from hf_attnstore import AttnStore
        >>> kv = [torch.zeros(1, 2, 3, 4) for _ in range(2)]
        >>> with AttnStore(host_bytes="1MiB", disk_dir=tempfile.mkdtemp()) as store:
        ...     with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
        ...         _ = turn.append(torch.tensor([5, 6, 7]), kv, kv)
        ...     store.flush()
        ...     store.stats().bytes_written > 0
        True
    """

    def __init__(self, state: StoreState, eviction: Eviction, loads: LoadPlanner, config: StoreConfig, lower: Tier,
                 disk: Tier | None, mirror: Tier | None):
        self.state, self.eviction, self.loads, self.config = state, eviction, loads, config
        self.lower, self.disk = lower, disk
        self.refill = Refill(state, mirror=mirror is not None)
        self.thread = SaveThread(self, lower, config.chunk_tokens, config.io_timeout_s, mirror=mirror)

    def indexed(self, e: Entry) -> bool:
        """Whether the entry is still the session's, or handed its files to the one that is (not deleted)."""
        with self.state.lock:
            return self.state.entries.get(e.key) is e or self.state.heir(e) is not None

    def check_lost(self) -> None:
        """Whether a remote tier lost its data, asked now (a flush, on its caller's thread): see refill.py."""
        self.thread.check_lost()

    def run_deletes(self, deletes: list) -> None:
        """Runs deletions taken with the next work (save thread, without the lock)."""
        self.eviction.run_deletes(deletes)

    def reserve(self, e: Entry, nbytes: int, exact: bool = False) -> int:
        """Disk bytes reserved for files of `nbytes` the save thread is about to write (`Eviction.reserve_disk`)."""
        return self.eviction.reserve_disk(e, nbytes, exact)

    def warn(self, kind: str, message: str, *args) -> None:
        """Logs a warning of this kind once per store."""
        self.state.once.warning(kind, message, *args)

    def next_work(self) -> tuple[list[tuple[Key, int]], SaveJob | None] | None:
        """The save thread's next unit of work: folders to delete and/or a session to write, with the session
        pinned and its chunk names reserved. Waits until there is some; ``None`` tells the thread to stop."""
        with self.state.cond:
            while True:
                self.state.apply_ended_turns()  # end-of-turn states to write
                deletes = self.state.take_deletes()
                e = self.next_save()
                job = self.save_job(e) if e is not None else None
                if self.state.closed:
                    self.state.unqueue_remirror()  # closing: copies for other replicas are not waited for
                elif job is None:
                    job = self.refill.next_job()  # sessions to copy again to a mirror that lost them
                if deletes or job is not None:
                    return deletes, job
                if self.state.closed and (not self.state.dirty or e is None):
                    return None  # closed, with nothing (or only failed writes, close(flush=False)) left
                self.state.cond.wait(timeout=self.config.idle_flush_s / 2)
                self.state.expire()

    def compute_quiet(self, now: float) -> bool:
        """Whether no forward runs or ran in the last `idle_flush_s`. Saving costs CPU (serializing,
        hashing, writing): where the model computes on the same cores, writing during a turn slows it, so
        non-urgent writes wait for the gap after it (the paper's write buffer). Flushes and demotions
        needed to make room do not wait."""
        return self.state.forwards_active == 0 and now - self.state.last_forward >= self.config.idle_flush_s

    def may_write(self, e: Entry, now: float) -> bool:
        """Whether a save of `e` may run now: it is urgent, the model is quiet (`compute_quiet`), or, with
        `save_while_computing`, `e`'s turn has ended (no write for `idle_flush_s`)."""
        return e.urgent or self.compute_quiet(now) or (
            self.config.save_while_computing and now - e.last_write >= self.config.idle_flush_s)

    def next_save(self) -> Entry | None:
        now = time.monotonic()
        best = None
        for key in list(self.state.dirty):
            e = self.state.entries.get(key)
            if e is None or not e.dirty:
                self.state.forget_dirty(key)
                continue
            if e.write is Write.FAILED and now < e.retry_at:
                continue  # backing off after a failure; flush() and demotions retry at once
            if e.pins or e.loading is not None:
                continue
            if e.host.missing_head > e.persisted:
                # Tokens without KV in the buffer yet (a head the turn recomputes): never written, whatever the
                # buffer holds there. `AttnStore.fill_head` marks the session again once they are filled.
                continue
            idle = now - e.last_write >= self.config.idle_flush_s
            if not self.may_write(e, now):
                continue  # write behind: wait for the gap after the turn (see `compute_quiet`)
            if e.urgent or idle or e.length - e.persisted >= self.config.chunk_tokens:
                if best is None or (e.urgent and not best.urgent):
                    best = e
        return best

    def save_job(self, e: Entry) -> SaveJob | None:
        """What `next_save` chose to write now (lock held), or None when nothing is due after all."""
        chunk = self.config.chunk_tokens
        fp, sid = e.key
        buf = e.host
        base = e.manifest or Manifest(fp, sid, torch.empty(0, dtype=torch.long), (), 0)
        start, end = base.length, buf.length
        if base.spans:
            last = base.spans[-1]
            tokens = e.chunks[last.chunk][1]
            if last.start == 0 and last.end == tokens < chunk:
                # Rewrite the trailing partial chunk together with the new tokens, so a session keeps at
                # most one partial chunk (older chunks are never rewritten).
                base = base.select([(0, start - tokens)])
                start -= tokens
        if not (e.urgent or time.monotonic() - e.last_write >= self.config.idle_flush_s):
            end = start + (end - start) // chunk * chunk  # during a turn, write whole chunks only
        if end < start or (end == start and not (e.state_dirty and buf.state.tokens <= end)):
            return None  # (a job of no tokens writes a new state and the manifest naming it)
        snap = buf.snapshot()
        links = ()
        if start == 0 and not base.dropped:
            links, mirrored = self.shared_chunks(e, snap.token_ids[:end])
            # The shared chunks the mirror has (under their owner): never copied again.
            self.state.add_mirrored(e, mirrored)
        # The sessions linked from are pinned until the job ends: an eviction that makes room for this job's own
        # chunks must not take them (their files would stay, held by the links, but counted as freed).
        sources = tuple({id(s): s for s in (self.state.entries[key] for key, _ in links)}.values())
        for source in sources:
            self.state.pin(source)
        self.state.pin(e)
        # Reserve the names this job writes. Names are never reused for a session, even by a later entry
        # replacing this one, so a chunk file never changes once a manifest may reference it. (A job whose links
        # fail writes every token itself: as many names at most, each link covering one whole chunk.)
        shared = sum(span.length for _, span in links)
        first = self.state.take_chunk_numbers(e.key, len(links) + -(-(end - start - shared) // chunk))
        return SaveJob(e, e.generation, snap, base, start + shared, end, first, frozenset(e.mirrored), links, sources)

    def shared_chunks(self, e: Entry, ids: torch.Tensor) -> tuple[tuple, set]:
        """The whole chunks of another session's disk copy that hold this session's first tokens, to be linked
        rather than written again (prefix sharing on disk; lock held), and the digests of those the mirror tier
        has already (under their owner).

        Candidates come from the prefix table; each chunk's ids are compared with the session's, and only
        unshifted whole chunks (not rebased, from the first token) are linked: their KV was computed for
        exactly these tokens, by this model under this salt (the key's fingerprint), so it is what this
        session would write. Only with a disk tier and `share_prefixes`."""
        if self.disk is None or self.lower is not self.disk or not self.config.share_prefixes:
            return (), set()
        chunk, best, mirrored = self.config.chunk_tokens, (), set()
        # More candidates than a turn's lookup takes: the newest are often sessions not on disk yet.
        for key, _ in self.state.prefixes.candidates(e.key[0], ids, exclude=e.key, limit=16):
            other = self.state.entries.get(key)
            manifest = other.manifest if other is not None else None
            if manifest is None or manifest.head or manifest.state is not None or other.layout != e.layout:
                continue  # (another KV layout under one fingerprint: only through the raw store API)
            links, pos = [], 0
            for span in manifest.spans:
                whole = span.start == 0 and span.end == chunk and other.chunks.get(span.chunk, (0, 0))[1] == chunk
                # (An inexact chunk, computed under sparse attention, is not what this session's exact KV is.)
                if not whole or span.rebased or span.chunk not in other.files or pos + chunk > ids.numel() \
                        or pos + chunk > manifest.exact_tokens \
                        or not torch.equal(manifest.token_ids[pos: pos + chunk], ids[pos: pos + chunk]):
                    break
                links.append((key, span))
                pos += chunk
            if len(links) > len(best):
                best = tuple(links)
                mirrored = other.mirrored & {span.digest for _, span in links}
        return best, mirrored

    def files_to_keep(self, job: SaveJob, manifest: Manifest | None) -> tuple[set[str], bool]:
        """The session's files that must stay after a save, and whether any may be kept at all (False: the session
        was removed, and its folder goes entirely).

        The durable copy stays until its successor is durable: a failed save keeps the copy it was to replace; a
        session cut or truncated meanwhile keeps the chunks its in-memory manifest (a selection of the old one)
        uses; a session replaced meanwhile by another history (`StoreState.hand_over`) keeps every file its new entry
        was handed, which this save's manifest (if it landed) now names too (`finish_save`)."""
        with self.state.lock:
            e = job.entry
            keep = _names(manifest)
            if manifest is None or e.generation != job.generation:
                # The manifest on disk is still the one before this job (or names files the cut entry's selection
                # no longer does): every file the entry holds stays, collected by its next save that lands.
                keep |= set(e.chunks) | _names(e.manifest) | set(e.files)
            if self.state.entries.get(e.key) is e:
                return keep, True
            heir = self.state.heir(e)
            if heir is not None:
                keep |= set(heir.files) | set(heir.chunks)
            return keep, heir is not None

    def thread_error(self, exc: BaseException) -> None:
        with self.state.cond:
            self.state.count(write_errors=1)
            self.state.cond.notify_all()

    def finish_save(self, job: SaveJob, result: SaveResult) -> None:
        """The save thread finished a job (save_thread.py): the reservation becomes the files that are really
        there now, and the index learns the new durable prefix (or the failure)."""
        e = job.entry
        with self.state.cond:
            for source in job.sources:
                self.state.unpin(source)
            self.state.release_disk(result.reserved)
            if self.state.entries.get(e.key) is e:
                if self.disk is not None:  # the files `disk_bytes` counts (a remote tier's bytes are Redis's)
                    for name, (size, _, inode, source, source_name) in result.linked.items():
                        if name in result.keep:  # counted once, with the file's other names
                            self.state.add_link(e, name, inode, size, source, source_name)
                    made = {**result.new_chunks, **{n: link[:2] for n, link in result.linked.items()}}
                    files = {name: size for name, size in {**e.files, **{n: c[0] for n, c in made.items()}}
                             .items() if name in result.keep}
                    self.state.set_files(e, files,
                                         result.manifest_size if result.manifest is not None else e.manifest_size)
                    if result.linked and self.state.disk_used - self.state.deleting > self.config.disk_bytes:
                        # A shared file whose other names were deleted meanwhile (`delete`) is counted now: room.
                        self.eviction.enforce_disk(e)
                self.state.add_mirrored(e, result.mirrored)
            elif self.disk is not None and self.state.heir(e) is not None:
                # Replaced by another history while this save ran: what it made durable is the older copy the new
                # entry keeps until its own is durable (a crash meanwhile leaves this one).
                made = {**result.new_chunks, **{n: link[:2] for n, link in result.linked.items()}}
                self.state.inherit(self.state.heir(e), result.manifest, made, result.manifest_size, result.keep,
                                   result.linked)
            self.state.count(remote_bytes_written=result.mirror_bytes)
            if result.mirror_error is not None:
                self.state.count(remote_errors=1)
                self.state.once.warning("mirror", "remote tier: copying session %r failed (%s); it stays on disk and is "
                                   "copied again with its next save", e.key[1], result.mirror_error)
        self.finish_persist(e, job.generation, result.manifest, result.new_chunks, result.seconds, result.error,
                            result.encoded, {n: link[:2] for n, link in result.linked.items()})

    def finish_persist(self, e, generation, manifest, new_chunks, seconds, error, encoded=(), linked=None) -> None:
        """The index learns how a write ended (lock taken here): `new_chunks` written, `linked` (name ->
        (bytes, tokens)) shared with another session rather than written."""
        with self.state.cond:
            self.state.unpin(e)
            current = self.state.entries.get(e.key) is e
            if isinstance(error, NoDiskRoom):
                # Larger than the disk tier can hold next to what cannot leave it: refused before anything was
                # evicted for it. The rest stays in host memory only (flush() says so); its durable copy stays.
                self.state.count(rejected_too_large=1)
                self.state.once.warning("disk_too_large", "session %r is larger than the disk tier: what is not durable "
                                        "is kept in memory only", e.key[1])
                demoting = e.write is Write.DEMOTE
                if current:
                    # (Not a newer entry's dirty mark: it is another history, to be written.)
                    self.state.never_write(e, error)  # not retried until its next turn
                    if demoting and e.pins == 0 and not e.writers:
                        self.state.count(host_drops=1)
                        self.state.release_host(e)
            elif isinstance(error, MissingChunks) and e.failures < 2:
                # The remote tier (below host memory) lost chunks of the session's copy: it is written whole again
                # at once, not backed off (twice at most in a row: a server evicting as fast as we write fails).
                self.state.count(remote_errors=1)
                self.state.save_failed(e)
                if current:
                    self.refill.forget(e)
            elif error is not None:
                self.state.count(write_errors=1)
                self.state.once.warning("write", "%s tier: writing session %r failed (%s); it stays in host memory, its "
                                "previous durable state is kept, and the write is retried", self.lower.name, e.key[1],
                                error)
                demoting = e.write is Write.DEMOTE
                self.state.save_failed(e, error, time.monotonic() + min(60.0, 2.0 ** min(e.failures, 6)))
                if demoting:
                    # A demotion that failed: the session cannot go down, so it must not stay "being written"
                    # (appends would wait for room that never comes). Fall back to its durable prefix, if any.
                    if current and e.pins == 0 and not e.writers:
                        self.state.count(host_drops=1)
                        self.state.release_host(e)
            else:
                if self.disk is not None:
                    self.state.count(bytes_written=sum(size for size, _ in new_chunks.values()), write_seconds=seconds)
                else:  # no disk tier: sessions are saved to the remote tier directly
                    self.state.count(remote_bytes_written=sum(size for size, _ in new_chunks.values()))
                self.state.save_ok(e)
                if current and e.generation == generation:
                    # Its own copy is durable: the one it was handed is collected.
                    self.state.saved(e, manifest, {**e.chunks, **new_chunks, **(linked or {})})
                    if not e.dirty:
                        demoting = e.write is Write.DEMOTE
                        self.state.mark_clean(e, Write.BEHIND)
                        if demoting and e.pins == 0 and e.manifest is not None:
                            self.state.set_host(e, None)
                            self.state.count(demotions=1)
                    self.state.keep_encoded(e, encoded)
                # else: the session was cut or truncated meanwhile (what we wrote is an older, consistent
                # state; the next persist writes the new one), or removed (its folder is gone).
            self.eviction.make_host_room(0, exclude=None)
            self.loads.retry_prefetch()
            self.state.cond.notify_all()

    def yield_for_save(self, e: Entry) -> None:
        """Between chunks: loads go first; a non-urgent save also waits for the model to be idle, unless an
        append is blocked on host room. Then the model cannot go idle until writes free memory: waiting
        for it would stall both threads for `io_timeout_s` (the session being written is pinned, and the
        urgent victims queue behind it)."""
        with self.state.cond:
            self.state.cond.wait_for(
                lambda: self.state.closed or (self.state.loads_active == 0 and (
                    self.state.room_waiters > 0 or self.may_write(e, time.monotonic()))),
                self.config.io_timeout_s,
            )
