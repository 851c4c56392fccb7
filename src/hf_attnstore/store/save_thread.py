"""The save thread: encodes a session's new chunks and writes them to a lower tier, and copies sessions to a
mirror tier that lost them.

The store decides *what* to save and *when* (`SavePlanner`, saver.py, under the state's lock) and hands this
thread a :class:`SaveJob` with the session pinned. The thread only encodes and writes: each chunk is encoded
(serialized, hashed, chained to the history before it) while the tier writes the previous one (`Tier.put`
returns a Future), and the manifest is put only after every chunk it names is durable. It talks to its planner
alone (`Planner`: never the store's state) and reports back through `Planner.finish_save`, which takes the lock.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .buffer import SessionKV
from .config import StoreConfig
from .encoded import EncodedSegment
from .entry import Entry, Key, blocks
from .format import (Manifest, Span, StateRef, chunk_payload_bytes, encode_chunk, encode_kv, manifest_bytes_bound,
                     prefix_hasher, tensor_bytes)
from .remote import MissingChunks
from .sparse_copies import first_missing, gather, kept_positions
from .state import by_slot
from .tier import CHUNK_SUFFIX, MANIFEST, Tier

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


class Refilling(Protocol):
    """What the thread tells of a remote tier that lost its data (`refill.Refill`)."""

    def lost(self) -> None: ...

    def finish(self, job: MirrorJob, result: MirrorResult) -> None: ...


class Planner(Protocol):
    """The save thread's planner (`saver.SavePlanner`): the only object of the store it talks to."""

    config: StoreConfig
    refill: Refilling

    def next_work(self) -> tuple[list[tuple[Key, int, tuple | None]], "SaveJob | MirrorJob | None"] | None: ...

    def run_deletes(self, deletes: list) -> None: ...

    def reserve(self, e: Entry, nbytes: int, exact: bool = False) -> int: ...

    def yield_for_save(self, e: Entry) -> None: ...

    def files_to_keep(self, job: "SaveJob", manifest: Manifest | None) -> tuple[set[str], bool]: ...

    def indexed(self, e: Entry) -> bool: ...

    def finish_save(self, job: "SaveJob", result: "SaveResult") -> None: ...

    def thread_error(self, exc: BaseException) -> None: ...

    def warn(self, kind: str, message: str, *args) -> None: ...


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
    encoded: list = field(default_factory=list)  # (start, part) of the whole lossy chunks written (encoded.py)
    # Chunks linked from another session (`SaveJob.links`): name -> (bytes, tokens, file identity, source, its name)
    linked: dict = field(default_factory=dict)


class SaveThread:
    """Runs the store's save jobs on one thread (see the module docstring)."""

    def __init__(self, planner: Planner, tier: Tier, chunk_tokens: int, timeout_s: float, mirror: Tier | None = None):
        self.planner, self.tier, self.chunk_tokens, self.timeout_s = planner, tier, chunk_tokens, timeout_s
        self.mirror = mirror  # the shared remote tier: a copy of what `tier` holds, written behind it
        self.codec = planner.config.codec  # of every chunk it writes (None: lossless)
        # Whole chunks it encodes are handed back as the session's host copy of them (encoded.py).
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
        """Asks the remote tier (mirror or lower) whether it lost its data since it was last asked (refill.py)."""
        for tier in (self.tier, self.mirror):
            if tier is not None and tier.lost():
                self.planner.refill.lost()

    def _mirror_again(self, job: MirrorJob) -> MirrorResult:
        """Copies a session's disk copy to the mirror tier that lost it (refill.py)."""
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
        """The state the new manifest names (a hybrid model's, state.py): the host copy's if the job's tokens
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
    """The disk bytes a save job reserved (`Planner.reserve`): its bound up front, then each file drawn from
    it as it is written; a file past the bound (a chunk the codec refused, written lossless) reserves more."""

    def __init__(self, planner: Planner, entry: Entry):
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
