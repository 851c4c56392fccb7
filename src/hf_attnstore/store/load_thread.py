"""The load thread: reads sessions from a lower tier into host buffers, layer by layer.

The store decides to load (`LoadPlanner`, load_planner.py, under the state's lock) when a turn finds a session
only below host memory, or a prefetch asks for one; this thread reads it into host buffers.

One thread serves a priority queue. A load that a turn waits for (a *demand* load, from `lookup`) goes
before prefetches, and a queued prefetch is promoted when a turn asks for its session. A load whose
consumer is slow (the read buffer, `read_buffer_layers`, says it may not run further ahead) is parked
and the next job runs, so one slow turn never holds back every other session's load.

The thread only moves bytes: which session is loaded, and where it goes, is the store's decision; the
store learns of the end of a job through the `done` callback (which takes its lock).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .buffer import SessionBuffer
from .codec import KVCodec, serves
from .encoded import EncodedSegment
from .format import FormatError, Manifest, check_chain, layer_names, prefix_digest
from .load_handle import LoadHandle
from .sparse_copies import first_missing
from .state import SessionState
from .tier import ChunkReader, Tier

logger = logging.getLogger(__name__)
DEMAND, PREFETCH = 0, 1
_PARK_S = 0.02  # how long a gated load waits before letting another job run


@dataclass(eq=False)
class LoadJob:
    """One session being read: where from, where to, and how far it got."""

    key: tuple[str, str]
    handle: LoadHandle
    manifest: Manifest  # what is read: `origin`, less the leading chunks a turn recomputes (`recompute_by_cost`)
    buf: SessionBuffer
    priority: int
    tier: Tier | None = None  # where the session is read from
    codec: KVCodec | None = None  # the store's codec: chunks it does not serve are refused (codec.serves)
    keep_encoded: bool = False  # hand lossy chunks' blobs back as the host copy of them (encoded.py)
    sparse_copies: bool = False  # the store serves sparse cold copies (StoreConfig.sparse_copies); else refused
    kept: dict[str, torch.Tensor] = field(default_factory=dict)  # sparse chunk -> its kept positions, verified
    blobs: dict[str, dict] = field(default_factory=dict)  # lossy chunk -> tensor name -> blob, as read
    encoded: list = field(default_factory=list)  # (start, part) built from `blobs` once every layer is read
    entry: object = None  # the session's entry in the store's state (opaque here)
    opened: dict[str, ChunkReader] = field(default_factory=dict)  # chunk name -> open chunk, verified
    verified: bool = False
    layer: int = 0  # next layer to read
    nbytes: int = 0
    seconds: float = 0.0
    read_seconds: float = 0.0  # opening, reading and verifying only (not waiting for the consumer): the tier's rate
    gated_since: float | None = None
    state: str = "queued"  # queued -> running -> (queued ->) done
    origin: Manifest | None = None  # the entry's manifest (None: `manifest` itself)


class LoadThread:
    """Runs load jobs in priority order on one thread (see the module docstring)."""

    def __init__(self, done: Callable[[LoadJob, BaseException | None], None], timeout_s: float):
        self.done, self.timeout_s = done, timeout_s
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="attnstore-load", daemon=True)
        self.thread.start()

    def submit(self, job: LoadJob) -> None:
        self._queue.put((job.priority, next(self._seq), job))

    def promote(self, job: LoadJob) -> None:
        """A turn waits for this load now: it goes before every prefetch (a no-op once it has started)."""
        with self._lock:
            if job.priority == DEMAND or job.state != "queued":
                return
            job.priority = DEMAND
        self._queue.put((DEMAND, next(self._seq), job))  # the old entry is skipped when it comes up

    def stop(self) -> None:
        self._queue.put((PREFETCH + 1, next(self._seq), None))

    def _run(self) -> None:
        while True:
            priority, _, job = self._queue.get()
            if job is None:
                return
            with self._lock:
                if job.state != "queued" or priority != job.priority:
                    continue  # a stale entry of a promoted or finished job
                job.state = "running"
            error, finished = None, True
            started = time.perf_counter()
            try:
                finished = self._step(job)
            except Exception as exc:  # every failure reaches the consumer through the handle (below)
                error = exc
            job.seconds += time.perf_counter() - started
            if not finished:
                with self._lock:
                    job.state = "queued"
                self.submit(job)
                continue
            for chunk in job.opened.values():
                chunk.close()
            job.opened.clear()
            with self._lock:
                job.state = "done"
            try:
                # The store first (it drops a session that failed to load), then the consumer: a turn that sees
                # the failure and looks the session up again finds a clean miss, never the failed entry.
                self.done(job, error)
            except Exception as exc:  # never let the loader die: later loads would hang until their timeout
                logger.exception("finishing a load failed (%s); the load thread keeps running", exc)
            finally:
                if error is not None:
                    job.handle.fail(error)

    def _step(self, job: LoadJob) -> bool:
        """Reads layers until the job is done (True) or its consumer's read buffer is full (False: parked)."""
        if not job.verified:
            started = time.perf_counter()
            self._open_and_verify(job)
            job.read_seconds += time.perf_counter() - started
        seg, manifest = job.buf.parts[0][0], job.manifest
        for layer in range(job.layer, job.buf.geometry[0]):
            # Wait for the consumer in short slices, so that a job submitted meanwhile is noticed; after the
            # timeout the load goes on regardless (its consumer may be gone).
            while not job.handle.gate(layer, _PARK_S):
                if job.gated_since is None:
                    job.gated_since = time.monotonic()
                if time.monotonic() - job.gated_since >= self.timeout_s:
                    break
                if not self._queue.empty():
                    return False  # let other loads run; come back to this one
            job.gated_since = None
            started = time.perf_counter()
            pos = manifest.head  # a partially evicted head is left for the turn to recompute
            for span in manifest.spans:
                chunk = job.opened[span.chunk]
                keys_out = seg.keys[layer][:, :, pos : pos + span.length]
                values_out = seg.values[layer][:, :, pos : pos + span.length]
                if chunk.meta.kept is not None:
                    job.nbytes += _read_sparse(chunk, job.kept[span.chunk][layer], layer, span, keys_out, values_out)
                else:
                    keep = job.blobs.setdefault(span.chunk, {}) if job.keep_encoded and chunk.meta.codec else None
                    job.nbytes += chunk.read_layer_into(layer, span.start, span.end, keys_out, values_out, keep)
                pos += span.length
            job.read_seconds += time.perf_counter() - started
            job.handle.layer_ready(layer)
            job.layer = layer + 1
        if job.keep_encoded:
            job.encoded = self._encoded_parts(job)
        return True

    @staticmethod
    def _open_sparse(job: LoadJob, span, chunk: ChunkReader, pos: int) -> None:
        """Checks a sparse cold copy (`StoreConfig.sparse_copies`) before any KV is read, and records which of the
        span's tokens have no KV (Segment.absent): only a store that asked for such copies serves them."""
        if not job.sparse_copies:
            raise FormatError(f"chunk {span.chunk} is a sparse cold copy (it keeps {chunk.meta.kept} of "
                              f"{chunk.meta.n_tokens} tokens), and this store does not serve them (`sparse_copies`)")
        if span.chunk not in job.kept:
            job.kept[span.chunk] = chunk.kept()
        kept = job.kept[span.chunk]
        if first_missing(kept) < chunk.meta.inexact_from:  # the chunk says it is exact where it lacks KV
            raise FormatError(f"chunk {span.chunk} lacks KV where it says it is exact")
        job.buf.parts[0][0].mark_absent(pos, _span_absent(kept, span.start, span.end))

    @staticmethod
    def _encoded_parts(job: LoadJob) -> list:
        """The lossy chunks just read, as encoded parts of the host copy (see `LoadJob.encoded`)."""
        out, pos, buf, made = [], job.manifest.head, job.buf, {}
        for span in job.manifest.spans:
            blobs, chunk = job.blobs.get(span.chunk), job.opened[span.chunk]
            if blobs is not None:
                if span.chunk not in made:
                    names = [layer_names(i) for i in range(buf.geometry[0])]
                    seg = EncodedSegment(chunk.meta.codec, buf.geometry, chunk.ids(), [blobs[k] for k, _ in names],
                                         [blobs[v] for _, v in names], buf.dtype)
                    if chunk.meta.inexact_from is not None:
                        seg.mark_inexact(chunk.meta.inexact_from)
                    made[span.chunk] = seg.pinned() if buf.pin_memory else seg
                out.append((pos, (made[span.chunk], span.start, span.end)))
            pos += span.length
        job.blobs.clear()
        return out

    def _open_and_verify(self, job: LoadJob) -> None:
        """Opens every chunk once and checks ids, shapes and the chain before any KV is read."""
        manifest, buf, pos = job.manifest, job.buf, job.manifest.head
        for span in manifest.spans:
            if span.chunk not in job.opened:
                job.opened[span.chunk] = job.tier.get(job.key, span.chunk, span.owner)
            chunk = job.opened[span.chunk]
            if (chunk.meta.geometry, chunk.meta.dtype) != (buf.geometry, buf.dtype):
                raise FormatError("chunk shapes changed since the session was indexed")
            if not serves(job.codec, chunk.meta.accuracy):
                raise FormatError(f"chunk {span.chunk} is stored with codec {chunk.meta.accuracy.name}/"
                                  f"{chunk.meta.accuracy.group}, less accurate than this store's "
                                  f"{job.codec.name + '/' + str(job.codec.group) if job.codec else 'lossless'}")
            ids = chunk.ids()[span.start : span.end]
            if not torch.equal(ids, manifest.token_ids[pos : pos + span.length]):
                raise FormatError("chunk ids disagree with the manifest")
            inexact = chunk.meta.inexact_from
            if inexact is not None and inexact < span.end and pos + max(0, inexact - span.start) < manifest.exact_tokens:
                # The manifest would let a dense cache reuse KV computed under sparse attention: doubt, so a miss.
                raise FormatError(f"chunk {span.chunk} holds KV computed under sparse attention where the manifest "
                                  "says exact")
            if chunk.meta.kept is not None:
                self._open_sparse(job, span, chunk, pos)
            pos += span.length
            # The load dequantizes lossy chunks into the buffer: a later write of these tokens is labelled so.
            buf.parts[0][0].mark_lossy(chunk.meta.accuracy, pos)
        check_chain(manifest, [job.opened[span.chunk].meta for span in manifest.spans])
        if manifest.state is not None:
            # Read whole and verified before any KV: a turn of a hybrid model needs it to reuse anything.
            ref = manifest.state
            state = SessionState.decode(job.tier.read_state(job.key, ref), job.key, ref)
            if state.prefix != prefix_digest(job.key[0], manifest.token_ids[: ref.tokens]):
                raise FormatError("the state was computed after another history")
            buf.state = state
        job.verified = True


def _read_sparse(chunk: ChunkReader, kept: torch.Tensor, layer: int, span, keys_out: torch.Tensor,
                 values_out: torch.Tensor) -> int:
    """Reads one layer of a sparse chunk into a span's dense destination: its kept tokens where they belong,
    zeros where a token has no KV (recorded as absent, never read by a dense cache)."""
    heads, m = kept.shape
    k, v = keys_out.new_empty(1, heads, m, keys_out.shape[-1]), values_out.new_empty(1, heads, m, values_out.shape[-1])
    nbytes = chunk.read_layer_into(layer, 0, m, k, v)
    # Only the span is written (the chunk may hold many more tokens than the span uses): a kept token outside it
    # goes to one spare column past its end, which is dropped.
    n = span.end - span.start
    inside = (kept >= span.start) & (kept < span.end)
    index = torch.where(inside, kept - span.start, n)[None, :, :, None]
    for src, out in ((k, keys_out), (v, values_out)):
        full = out.new_zeros(1, heads, n + 1, out.shape[-1])
        full.scatter_(2, index.expand_as(src), src)
        out.copy_(full[:, :, :n])
    return nbytes


def _span_absent(kept: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """``[layers, heads, end - start]``: True where a token of the span has no KV in a sparse chunk."""
    n = end - start
    absent = torch.ones(*kept.shape[:2], n + 1, dtype=torch.bool)
    absent.scatter_(2, torch.where((kept >= start) & (kept < end), kept - start, n), False)
    return absent[:, :, :n]
