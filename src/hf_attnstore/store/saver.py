"""The save worker: what the store writes to a lower tier and when, the thread that writes it, and refills.

`SavePlanner` decides *what* to save and *when* (write-behind in the quiet gap after a turn, at once for a flush
or a demotion), under the index's lock, and hands the save thread a `SaveJob` with the session pinned. The
`SaveThread` only encodes and writes: each chunk is encoded (serialized, hashed, chained to the history before
it) while the tier writes the previous one (`Tier.put` returns a Future), and the manifest is put only after
every chunk it names is durable. It reports back through `SavePlanner.finish_save`, which takes the lock.

A remote tier that lost what it held (a Redis restarted empty, flushed, or that evicted chunks a manifest names)
is refilled (`Refill`): with a disk tier, each session on disk is copied to it again (a `MirrorJob` on the save
thread); with Redis as the only tier below host memory, a session still in host memory is written whole again,
one that is not is gone (a clean miss). A store without a remote tier never runs it.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .buffer import EncodedSegment, SessionKV
from .config import StoreConfig
from .format import (Manifest, Span, StateRef, chunk_payload_bytes, encode_chunk, encode_kv, manifest_bytes_bound,
    prefix_hasher, tensor_bytes)
from .index import Entry, Eviction, Key, NoDiskRoom, StoreState, Write, blocks
from .loader import LoadPlanner
from .sparse_copies import first_missing, gather, kept_positions
from .states import by_slot
from .tiers.base import CHUNK_SUFFIX, Key, MANIFEST, Tier
from .tiers.redis import MissingChunks, RemoteTier


def _names(manifest: Manifest | None) -> set[str]:
    """The files a manifest references: its stored chunks and its state."""
    if manifest is None:
        return set()
    return {s.chunk for s in manifest.spans} | ({manifest.state.name} if manifest.state is not None else set())


class SavePlanner:
    """The store's save decisions, over the store's state (under `StoreState.lock`): what to write and when, and
    what the state learns when a write ends. The :class:`SaveThread` it starts sees only this object's public
    methods (`next_work`, `run_deletes`, `reserve`, `yield_for_save`, `files_to_keep`,
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
        """Whether a remote tier lost its data, asked now (a flush, on its caller's thread): see saver.py."""
        self.thread.check_lost()

    def run_deletes(self, deletes: list) -> None:
        """Runs deletions taken with the next work (save thread, without the lock)."""
        self.eviction.run_deletes(deletes)

    def reserve(self, e: Entry, nbytes: int, exact: bool = False) -> int:
        """Disk bytes reserved for files of `nbytes` the save thread is about to write (`Eviction.reserve_disk`)."""
        return self.eviction.reserve_disk(e, nbytes, exact)

    def link_refused(self, source: Key, chunk: str, copy: Key) -> None:
        """The file system refused another name for `source`'s shared file `chunk` (its link limit): session
        `copy` writes its own instead, which later sessions link."""
        with self.state.lock:
            self.state.link_refused(source, chunk, copy)

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
                if e is not None and job is None:
                    # Nothing due after all: looked at again soon, not first every time, before the others.
                    self.state.park_dirty(e.key, until=time.monotonic() + self.config.idle_flush_s)
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
        """The dirty session to write now, urgent ones first (lock held), or None. Taken from the state's queue of
        dirty sessions (`StoreState.next_dirty`): each one looked at and not due is parked until what it waits for
        (a time, the model's quiet, a change of its entry), so this looks at the sessions that changed, not at
        every dirty one."""
        now = time.monotonic()
        quiet, idle_s = self.compute_quiet(now), self.config.idle_flush_s
        while (key := self.state.next_dirty(now, quiet)) is not None:
            e = self.state.entries.get(key)
            if e is None or not e.dirty:
                self.state.forget_dirty(key)
                continue
            if e.write is Write.FAILED and now < e.retry_at:
                self.state.park_dirty(key, until=e.retry_at)  # backing off; flush() and demotions retry at once
                continue
            if e.pins or e.loading is not None:
                self.state.park_dirty(key)  # until unpinned or loaded (`StoreState.unpin`, `end_load`)
                continue
            if e.host.missing_head > e.persisted:
                # Tokens without KV in the buffer yet (a head the turn recomputes): never written, whatever the
                # buffer holds there. `AttnStore.fill_head` marks the session again once they are filled.
                self.state.park_dirty(key)
                continue
            idle = now - e.last_write >= idle_s
            if not self.may_write(e, now):
                # Write behind: wait for the gap after the turn (see `compute_quiet`), or for this session's turn to
                # have ended (`save_while_computing`).
                self.state.park_dirty(key, until=e.last_write + idle_s if self.config.save_while_computing else None,
                                      quiet=True)
                continue
            if e.urgent or idle or e.length - e.persisted >= self.config.chunk_tokens:
                return e
            self.state.park_dirty(key, until=e.last_write + idle_s)  # or until appends make a whole chunk
        return None

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
        chunk, best, mirrored, full = self.config.chunk_tokens, (), set(), self.state.full_links
        # More candidates than a turn's lookup takes: the newest are often sessions not on disk yet (while the saves
        # lag behind new sessions, all of them are), so the oldest too, the likeliest to be on disk.
        for key, _ in self.state.prefixes.candidates(e.key[0], ids, exclude=e.key, limit=16, oldest=4):
            other = self.successor(self.state.entries.get(key), full)
            if other is None or other.key == e.key:
                continue
            key, manifest = other.key, other.manifest  # (the links name the session whose files they are)
            if manifest is None or manifest.head or manifest.state is not None or other.layout != e.layout:
                continue  # (another KV layout under one fingerprint: only through the raw store API)
            links, pos = [], 0
            for span in manifest.spans:
                whole = span.start == 0 and span.end == chunk and other.chunks.get(span.chunk, (0, 0))[1] == chunk
                # (An inexact chunk, computed under sparse attention, is not what this session's exact KV is.)
                if not whole or span.rebased or span.chunk not in other.files or pos + chunk > ids.numel() \
                        or pos + chunk > manifest.exact_tokens or other.linked.get(span.chunk) in full \
                        or not torch.equal(manifest.token_ids[pos: pos + chunk], ids[pos: pos + chunk]):
                    break
                links.append((key, span))
                pos += chunk
            if len(links) > len(best):
                best = tuple(links)
                mirrored = other.mirrored & {span.digest for _, span in links}
        return best, mirrored

    def successor(self, other: Entry | None, full: dict) -> Entry | None:
        """`other`, or the session that copied its first shared file when that file was at its link limit (and
        so on: one step per 65,000 sessions; lock held)."""
        seen = set()
        while other is not None and other.manifest is not None and other.manifest.spans:
            inode = other.linked.get(other.manifest.spans[0].chunk)
            copy = full.get(inode)
            if copy is None or copy in seen:
                break
            seen.add(copy)
            successor = self.state.entries.get(copy)
            if successor is None or successor.manifest is None:
                if successor is None:  # the copy is gone: the full file is offered again, and a refusal names a new one
                    self.state.forget_full_link(inode)
                return None if successor is not None else other
            other = successor
        return other

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
        """The save thread finished a job (saver.py): the reservation becomes the files that are really
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
            if self.loads.wanted:  # prefetches that waited for room
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


logger = logging.getLogger(__name__)


@dataclass(eq=False)
class MirrorJob:
    """Copy a session's durable disk copy (`manifest`) to the mirror tier: the chunks it lacks, then the manifest.
    The entry is pinned meanwhile (its files stay)."""

    entry: Entry
    manifest: Manifest
    mirrored: frozenset = frozenset()


@dataclass(eq=False)
class MirrorResult:
    mirrored: set = field(default_factory=set)
    nbytes: int = 0
    error: BaseException | None = None


@dataclass(eq=False)
class SaveJob:
    """Tokens ``[start, end)`` of a session, to be written after the durable prefix `base`."""

    entry: Entry
    generation: int  # the session's generation when the job was made: a cut meanwhile voids the commit
    snap: SessionKV
    base: Manifest  # the durable prefix the new chunks extend (a trailing partial chunk is rewritten)
    start: int
    end: int
    first_chunk: int  # the job writes chunks first_chunk, first_chunk + 1, ... (names reserved for it)
    mirrored: frozenset = frozenset()  # digests of the session's chunks already in the mirror tier
    # Whole chunks of another session that begins with the same tokens, to be linked as this session's first
    # spans instead of written again (prefix sharing, `SavePlanner.shared_chunks`): (session, span) in order.
    links: tuple = ()
    sources: tuple = ()  # the entries the links come from, pinned for the job (not evicted under it)


@dataclass(eq=False)
class SaveResult:
    manifest: Manifest | None  # None: the job failed (see error)
    new_chunks: dict[str, tuple[int, int]]  # chunk written -> (bytes, tokens)
    manifest_size: int
    keep: set[str]  # the session's chunk files that stay (the others were collected)
    reserved: int  # tier bytes the store reserved for the job's files
    seconds: float
    error: BaseException | None
    mirrored: set[str] = field(default_factory=set)  # chunk digests now in the mirror tier
    mirror_bytes: int = 0
    mirror_error: BaseException | None = None
    encoded: list = field(default_factory=list)  # (start, part) of the whole lossy chunks written (buffer.py)
    # Chunks linked from another session (`SaveJob.links`): name -> (bytes, tokens, file identity, source, its name)
    linked: dict = field(default_factory=dict)


class SaveThread:
    """Runs the store's save jobs on one thread (see the module docstring)."""

    def __init__(self, planner: SavePlanner, tier: Tier, chunk_tokens: int, timeout_s: float, mirror: Tier | None = None):
        self.planner, self.tier, self.chunk_tokens, self.timeout_s = planner, tier, chunk_tokens, timeout_s
        self.mirror = mirror  # the shared remote tier: a copy of what `tier` holds, written behind it
        self.codec = planner.config.codec  # of every chunk it writes (None: lossless)
        # Whole chunks it encodes are handed back as the session's host copy of them (buffer.py).
        self.keep_encoded = self.codec is not None and planner.config.kv_codec_host
        self.sparse_copies = planner.config.sparse_copies  # whole chunks keep the session's selection (sparse_copies.py)
        self.thread = threading.Thread(target=self._run, name="attnstore-save", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                work = self.planner.next_work()
                if work is None:
                    return
                deletes, job = work
                self.planner.run_deletes(deletes)
                if isinstance(job, MirrorJob):
                    self.planner.refill.finish(job, self._mirror_again(job))
                elif job is not None:
                    self.check_lost()  # what a remote tier holds is what it says now, not what it held
                    self.planner.finish_save(job, self._write(job))
            except Exception as exc:  # a bug must not stop every later write: count it, report it, go on
                logger.exception("the save thread hit an unexpected error (%s); it keeps running", exc)
                self.planner.thread_error(exc)

    def check_lost(self) -> None:
        """Asks the remote tier (mirror or lower) whether it lost its data since it was last asked (saver.py)."""
        for tier in (self.tier, self.mirror):
            if isinstance(tier, RemoteTier) and tier.lost():  # (only a Redis loses what it held: a restart, a flush)
                self.planner.refill.lost()

    def _mirror_again(self, job: MirrorJob) -> MirrorResult:
        """Copies a session's disk copy to the mirror tier that lost it (saver.py)."""
        result = SaveResult(job.manifest, {}, 0, set(), 0, 0.0, None)
        if self.mirror.available():
            self._copy_to_mirror(job, job.manifest, job.manifest.encode(), [], result)
        else:
            result.mirror_error = OSError("the remote tier is down")
        return MirrorResult(result.mirrored, result.mirror_bytes, result.mirror_error)

    def _link(self, job: SaveJob, spans: list, linked: dict) -> int:
        """Links the job's shared chunks (`SaveJob.links`) as the session's first spans; returns the first name
        left for its own chunks. When one cannot be linked (its session deleted it meanwhile, or the tier
        cannot link), none is: the job writes the whole session itself (a copy, never a missing chunk)."""
        next_chunk = job.first_chunk
        try:
            for source, span in job.links:
                name = f"{next_chunk:08d}"
                next_chunk += 1
                made = self.tier.link(source, span.chunk, job.entry.key, name)
                if made is None:
                    raise OSError("the tier cannot link files")
                linked[name] = (made[0], span.length, made[1], source, span.chunk)
                spans.append(Span(name, span.start, span.end, span.digest, False, span.owner or source[1]))
        except OSError as exc:
            if isinstance(exc, FileNotFoundError):  # its session deleted it meanwhile
                logger.debug("prefix sharing: a shared chunk went before it was linked; the session writes its own")
            elif exc.errno == errno.EMLINK:  # the file has as many names as the file system allows
                logger.debug("prefix sharing: a shared chunk is at its link limit; the session writes its own")
                self.planner.link_refused(source, span.chunk, job.entry.key)
            else:  # no hard links here (a file system without them, a file at its link limit)
                self.planner.warn("link", "%s tier: linking a shared prefix's chunk failed (%s); sessions write their "
                                  "own copies", self.tier.name, exc)
            spans[len(job.base.spans):] = []
            linked.clear()
            # From the first reserved name again (the reservation covers the whole session written in chunks):
            # a link made is replaced by the chunk written under its name, atomically.
            return job.first_chunk
        return next_chunk

    def _bound(self, job: SaveJob, start: int, spans: int, header: int) -> int:
        """An upper bound of the disk bytes the job writes from token `start` (its chunks and the manifest), in
        4 KiB blocks: reserved before anything is evicted for it (`_Budget`). `header`: the header bytes of its
        first chunk (the others differ in digits only: 256 bytes of slack)."""
        source, chunk = job.snap.source, self.chunk_tokens
        full, rest = divmod(max(0, job.end - start), chunk)
        per = [blocks(chunk_payload_bytes(source.geometry, source.dtype, n, self.codec) + header + 256)
               for n in (chunk, rest)]
        return full * per[0] + (per[1] if rest else 0) \
            + blocks(manifest_bytes_bound(job.end, spans + full + 1, job.entry.key[1]))

    def _write(self, job: SaveJob) -> SaveResult:
        fp, sid = key = job.entry.key
        spans, pending = list(job.base.spans), []
        new_chunks, manifest, manifest_bytes, manifest_size, error = {}, None, None, 0, None
        budget = _Budget(self.planner, job.entry)
        encoded, linked = [], {}
        mirroring = self.mirror is not None and self.mirror.available()
        copies = []  # (digest, future) of chunks put in the mirror tier
        started = time.perf_counter()
        try:
            next_chunk = self._link(job, spans, linked) if job.links else job.first_chunk
            start = job.start if not job.links or linked else job.base.length
            # Each chunk is chained to its history: the digest of every id before it, and the previous chunk.
            history = prefix_hasher(fp)
            history.update(tensor_bytes(job.snap.token_ids[:start]))
            # Tokens from `exact` on were computed under sparse attention (`kv_budget`): their chunks say so, and so
            # does the manifest (the durable prefix kept from `base` keeps its own label).
            exact = min(job.snap.exact_prefix(job.end), job.end if job.base.exact is None else job.base.exact)
            absent = job.snap.absent(job.end)  # tokens loaded without KV (sparse copies): they stay absent
            a = start
            while a < job.end:
                self.planner.yield_for_save(job.entry)
                b = self._chunk_end(a, job.end, absent)
                ids, keys, values = job.snap.tensors(a, b)
                previous = (spans or job.base.dropped or [Span("", 0, 0)])[-1].digest
                kept = self._kept(job, a, b, absent, keys, values)
                if kept is not None:  # a sparse cold copy: the chunk lacks KV from its first token some head drops
                    keys, values = gather(keys, kept), gather(values, kept)
                    exact = min(exact, a + first_missing(kept))
                blobs = encode_kv(keys, values, self.codec) if self.codec is not None else None
                # Tokens loaded from a lossy copy hold dequantized KV, and the KV computed after them depends on
                # it: a chunk written lossless over such tokens (the codec refused their range) says so, and no
                # store that asks for exact KV serves it.
                inexact = max(0, exact - a) if exact < b else None
                data, digest = encode_chunk(fp, sid, ids, keys, values, history.hexdigest(), previous,
                                            self.codec if blobs is not None else None, blobs,
                                            derived=job.snap.lossy_before(b), inexact_from=inexact, kept=kept)
                if self.keep_encoded and blobs is not None and b - a == self.chunk_tokens and kept is None:
                    encoded.append((a, (self._host_copy(job, ids, blobs, inexact), 0, b - a)))
                name = digest if self.tier.content_addressed else f"{next_chunk:08d}"
                next_chunk += 1
                if a == start and not self.sparse_copies:
                    # All of it is reserved first: a session that cannot fit even once every other copy that may go
                    # has gone is refused (NoDiskRoom) before anything is evicted for it. (Not for sparse cold
                    # copies: a thin chunk's size is known once its selection is, so each reserves its own.)
                    payload = chunk_payload_bytes(job.snap.source.geometry, job.snap.source.dtype, b - a,
                                                  self.codec if blobs is not None else None)
                    budget.prepay(self._bound(job, start, len(spans), max(0, len(data) - payload)))
                budget.take(len(data))
                pending.append((name, b - a, self.tier.put(key, name + CHUNK_SUFFIX, data)))
                if mirroring and digest not in job.mirrored:  # the same bytes, on the mirror's writer thread
                    copies.append((digest, self.mirror.put(key, name + CHUNK_SUFFIX, data)))
                history.update(tensor_bytes(ids))
                spans.append(Span(name, 0, b - a, digest))
                a = b
            state = self._write_state(job, pending, copies if mirroring else None, budget)
            for name, tokens, future in pending:
                new_chunks[name] = (future.result(self.timeout_s), tokens)
            manifest = Manifest(fp, sid, job.snap.token_ids[: job.end].clone(), tuple(spans), next_chunk,
                                job.base.dropped, state, exact if exact < job.end else None)
            manifest_bytes = manifest.encode()
            budget.take(len(manifest_bytes))
            manifest_size = self.tier.put(key, MANIFEST, manifest_bytes).result(self.timeout_s)
        except Exception as exc:  # this session's failure (full disk, I/O error, bad data): reported, not fatal
            error, manifest = exc, None
            for name, tokens, future in pending:  # let every write land before its files are collected
                size = _settle(future, self.timeout_s)
                if size is not None:
                    new_chunks[name] = (size, tokens)
        seconds = time.perf_counter() - started
        result = SaveResult(manifest, new_chunks, manifest_size, set(), budget.reserved, seconds, error,
                            encoded=encoded if manifest is not None else [], linked=linked)
        if mirroring:
            self._copy_to_mirror(job, manifest, manifest_bytes if manifest is not None else None, copies, result)
        # Collect garbage before reporting completion, so that a flush() covers it.
        keep, current = self.planner.files_to_keep(job, manifest)
        try:
            self.tier.remove(key, keep if current else None)
        except OSError as exc:
            self.planner.warn("gc", "%s tier: removing unused files of session %r failed (%s)", self.tier.name,
                                     sid, exc)
        result.keep = keep
        return result

    def _chunk_end(self, a: int, end: int, absent: torch.Tensor | None) -> int:
        """Where the chunk from token `a` ends: `chunk_tokens` later, or further while some slot and head has no KV
        in it at all (tokens of a sparse copy cut into chunks of another size, after a restart with another
        `chunk_tokens`): a thin chunk needs at least one token per slot and head."""
        b = min(a + self.chunk_tokens, end)
        while absent is not None and b < end and bool(absent[:, :, a:b].all(dim=-1).any()):
            b = min(b + self.chunk_tokens, end)
        return b

    def _kept(self, job: SaveJob, a: int, b: int, absent: torch.Tensor | None, keys: list, values: list):
        """The positions a sparse cold copy of tokens ``[a, b)`` keeps (sparse_copies.py), or None: all of them.
        Whole chunks of a session that stored its selection; and any chunk holding tokens loaded without KV."""
        chunk_absent = absent[:, :, a:b] if absent is not None and bool(absent[:, :, a:b].any()) else None
        selection = scores = None
        state = job.snap.state
        if self.sparse_copies and b - a == self.chunk_tokens and state is not None and state.tokens >= b:
            selection, scores = by_slot(state, "S") or None, by_slot(state, "I")
        if (selection is None and chunk_absent is None) or keys[0].shape[1] != values[0].shape[1]:
            return None
        return kept_positions(selection, scores, chunk_absent, a, b, keys[0].shape[1])

    def _host_copy(self, job: SaveJob, ids: torch.Tensor, blobs: tuple[list, list],
                   inexact: int | None) -> EncodedSegment:
        source = job.snap.source
        seg = EncodedSegment(self.codec, source.geometry, ids, *blobs, source.dtype)
        if inexact is not None:
            seg.mark_inexact(inexact)
        return seg.pinned() if source.pin_memory else seg

    def _write_state(self, job: SaveJob, pending: list, copies: list | None, budget: "_Budget") -> StateRef | None:
        """The state the new manifest names (a hybrid model's, states.py): the host copy's if the job's tokens
        cover it (its file is put now, its bytes reserved, unless the durable copy has it already), else the
        durable copy's."""
        state, base = job.snap.state, job.base.state
        if state is None or state.tokens > job.end:
            return base if base is not None and base.tokens <= job.end else None
        ref = state.ref
        if base is not None and base.digest == ref.digest:
            return base
        data = state.encode()
        budget.take(len(data))
        pending.append((ref.name, 0, self.tier.put(job.entry.key, ref.name + CHUNK_SUFFIX, data)))
        if copies is not None and ref.digest not in job.mirrored:
            copies.append((ref.digest, self.mirror.put(job.entry.key, ref.name + CHUNK_SUFFIX, data)))
        return ref

    def _copy_to_mirror(self, job: SaveJob, manifest: Manifest | None, manifest_bytes: bytes | None,
                        copies: list, result: SaveResult) -> None:
        """Completes the mirror's copy of the session: chunks it lacks (read back from `tier`), then the
        manifest once every chunk it names is there. A failure is counted, never the session's failure."""
        key = job.entry.key
        files = {}
        if manifest is not None:
            files = {span.digest: (span.chunk, span.owner) for span in manifest.spans}
            if manifest.state is not None:
                files[manifest.state.digest] = (manifest.state.name, "")

        def copy(digests) -> None:  # chunks read back from `tier`, put in the mirror
            for digest in digests:
                name, owner = files[digest]
                data = self.tier.read_file(key, name + CHUNK_SUFFIX)
                # A shared prefix's chunk lies once in the mirror, under the session that wrote it.
                where = (key[0], owner) if owner else key
                copies.append((digest, self.mirror.put(where, name + CHUNK_SUFFIX, data)))

        def settle() -> None:  # the puts landed: counted and mirrored
            for digest, future in copies:
                result.mirror_bytes += future.result(self.timeout_s)
                result.mirrored.add(digest)

        try:
            # Chunks of earlier saves that the mirror does not have yet (it was down, or is new).
            copy([d for d in files if d not in job.mirrored | {d for d, _ in copies}])
            settle()
            if manifest is not None:
                try:
                    result.mirror_bytes += self.mirror.put(key, MANIFEST, manifest_bytes).result(self.timeout_s)
                except MissingChunks as exc:
                    # The mirror lost chunks it had (a restart, an eviction): copied again, then the manifest.
                    copies.clear()
                    copy([d for d in exc.digests if d in files])
                    settle()
                    result.mirror_bytes += self.mirror.put(key, MANIFEST, manifest_bytes).result(self.timeout_s)
            if manifest is not None and not self.planner.indexed(job.entry):
                # Deleted while its manifest was being put: the deletion's own removal may have run first.
                self.mirror.remove(key)
        except Exception as exc:  # the mirror is a copy: the session stays durable on `tier`
            result.mirror_error = exc
            for digest, future in copies:
                if _settle(future, self.timeout_s) is not None:
                    result.mirrored.add(digest)


class _Budget:
    """The disk bytes a save job reserved (`SavePlanner.reserve`): its bound up front, then each file drawn from
    it as it is written; a file past the bound (a chunk the codec refused, written lossless) reserves more."""

    def __init__(self, planner: SavePlanner, entry: Entry):
        self.planner, self.entry, self.left, self.reserved = planner, entry, 0, 0

    def prepay(self, nbytes: int) -> None:
        self.reserved += self.planner.reserve(self.entry, nbytes, exact=True)
        self.left += nbytes

    def take(self, nbytes: int) -> None:
        size = blocks(nbytes)
        if size <= self.left:
            self.left -= size
        else:
            self.reserved += self.planner.reserve(self.entry, nbytes)


def _settle(future: Future, timeout: float) -> int | None:
    """The size a put wrote, or None when it failed (or did not finish in time).

    Used only after the job already has its error: this settles the other writes of the batch so that
    their files are counted or collected; their own failures add nothing to report."""
    try:
        return future.result(timeout)
    except Exception:  # noqa: BLE001 - see the docstring: the job's first error is the one reported
        return None


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
