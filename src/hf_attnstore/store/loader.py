"""The loader: which sessions to load from a lower tier and into which buffers, the thread that reads them layer by
layer, and the measured costs of resuming.

`LoadPlanner` decides, under the index's lock, when a turn finds a session only below host memory or a prefetch
asks for one, and, with `recompute_by_cost`, which leading chunks the turn recomputes rather than loads
(`ResumeDecision`, by the rates `ResumeCosts` measures: each lower tier's load rate, each model's prefill rate;
ALISA's third phase, Pensieve's partial hits). The `LoadThread` reads: one thread over a priority queue, loads a
turn waits for (*demand* loads) before prefetches, a queued prefetch promoted when a turn asks for it, and a load
whose consumer is slow (the read buffer, `read_buffer_layers`) parked so that one slow turn never holds back
every other session's load. It only moves bytes and reports each end through the `done` callback (which takes
the lock).
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

from .buffer import EncodedSegment, LoadHandle, SessionBuffer
from .codec import KVCodec, serves
from .config import StoreConfig
from .format import FormatError, Manifest, bytes_per_token, check_chain, layer_names, prefix_digest
from .index import Entry, Eviction, StoreState
from .policy import choose_recompute, recompute_cost
from .sparse_copies import first_missing
from .states import SessionState
from .tiers.base import ChunkReader, Tier


@dataclass(frozen=True)
class ResumeDecision:
    """A load-or-recompute decision (`LoadPlanner.choose`), for the stats (``resume_*``) and the metrics.

    Example:
        >>> d = ResumeDecision(chunks=2, tokens=512, load_gbps=1.5, prefill_tokens_per_s=8000.0, load_s=0.30,
        ...                    chosen_s=0.22)
        >>> round(d.load_s - d.chosen_s, 2)  # seconds the turn saves by recomputing its first 512 tokens
        0.08
    """

    chunks: int  # leading chunks recomputed instead of loaded
    tokens: int  # their tokens
    load_gbps: float  # the tier's measured rate, GB/s of KV at the model's precision
    prefill_tokens_per_s: float  # the model's measured prefill rate
    load_s: float  # the estimate of loading every chunk
    chosen_s: float  # the estimate of the choice made



class LoadPlanner:
    """The store's load decisions, over the store's state (under `StoreState.lock`): which sessions to load and into which
    buffers; the :class:`LoadThread` it owns only reads them and reports each end through `done`.

    Example (through the store: a session demoted to disk is loaded back by a lookup)::

        >>> import tempfile, torch
        >>> from hf_attnstore import AttnStore
        >>> kv = [torch.zeros(1, 2, 3, 4) for _ in range(2)]
        >>> with AttnStore(host_bytes="1MiB", disk_dir=tempfile.mkdtemp()) as store:
        ...     with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
        ...         _ = turn.append(torch.tensor([5, 6, 7]), kv, kv)
        ...     store.evict("chat-1")  # written to disk first, then out of host memory
        ...     store.flush()
        ...     snapshot = store.lookup("chat-1", "model-a")  # starts the load; layers arrive one by one
        ...     snapshot.tier, snapshot.token_ids.tolist()
        ('disk', [5, 6, 7])
    """

    def __init__(self, state: StoreState, eviction: Eviction, config: StoreConfig, lower: Tier, remote: Tier | None,
                 done: Callable[[LoadJob, BaseException | None], None], costs: ResumeCosts | None = None):
        self.state, self.eviction, self.config, self.lower, self.remote = state, eviction, config, lower, remote
        self.costs = costs if costs is not None else ResumeCosts()
        self.wanted: list[tuple[str | None, str]] = []  # the last prefetch request, in order
        self.wanted_key: str | None = None  # its `prefill_key`: the first session's load is decided by cost
        self.loader = LoadThread(done, config.io_timeout_s)

    def retry_prefetch(self) -> int:
        """Starts the wanted loads that fit now, in order (called by `prefetch`, and when a write-out frees room)."""
        started = 0
        first = self.wanted[0][1] if self.wanted else None  # the session whose turn runs next, when keyed
        for fingerprint, sid in self.wanted:
            for e in [self.state.entries[k] for k in self.state.keys_of(sid) if fingerprint is None or k[0] == fingerprint]:
                if e.host is None and (e.manifest or e.remote) is not None:
                    if not self.start(e, must_fit=True, prefill_key=self.wanted_key if sid == first else None):
                        return started  # in order: a later session must not take the room of an earlier one
                    started += 1
                    self.state.count(prefetches=1)
        return started

    def start(self, e: Entry, must_fit: bool = False, prefill_key: str | None = None) -> bool:
        """Starts loading a session found only below host memory (on disk, else in the remote tier). A
        prefetch (`must_fit`) is skipped rather than overshooting the host limit; a load a turn waits for may
        overshoot by this one session. With `prefill_key` (a turn about to run can recompute a head, and its
        model's prefill rate is measured under that key) and `recompute_by_cost`, the leading chunks that are
        cheaper to recompute are not read (:meth:`choose`)."""
        assert e.host is None and (e.manifest or e.remote) is not None, "only sessions below host are loaded"
        origin, tier = (e.manifest, self.lower) if e.manifest is not None else (e.remote, self.remote)
        if tier is self.remote and not tier.available():
            return False  # the remote tier failed moments ago: a miss now rather than a wait on a dead server
        geometry, dtype = e.layout
        length = origin.length
        # Exactly the session's size: the next turn appends in a new segment, without copying this one.
        buf = self.state.host.for_load(geometry, dtype, length)
        if buf.nbytes > self.config.host_bytes:
            self.state.once.warning("load_too_large", "session %r does not fit the host tier: served as a miss", e.key[1])
            return False
        manifest, decision = origin, None
        if prefill_key is not None and self.config.recompute_by_cost:
            manifest, decision = self.choose(origin, tier.name, prefill_key, bytes_per_token(geometry, dtype.itemsize))
        position = self.state.host.position(e.key) if must_fit else None
        if not self.eviction.make_host_room(buf.nbytes, exclude=e, keep_sooner_than=position) and must_fit:
            return False
        buf.parts[0][0].token_ids[:length].copy_(manifest.token_ids)
        buf.missing_head = manifest.head  # a partially evicted head: left for the turn to recompute
        if manifest.exact is not None:  # KV computed under sparse attention from there on (Segment.inexact_from)
            buf.parts[0][0].mark_inexact(manifest.exact)
        handle = LoadHandle(geometry[0], self.config.read_buffer_layers, self.config.io_timeout_s)
        job = LoadJob(e.key, handle, manifest, buf, PREFETCH if must_fit else DEMAND, tier=tier, entry=e,
                      codec=self.config.codec, keep_encoded=self.config.kv_codec_host, origin=origin,
                      sparse_copies=self.config.sparse_copies)
        self.state.start_load(e, buf, job)
        self.loader.submit(job)
        if decision is not None:  # counted once the load has started (a refused prefetch decided nothing)
            self.state.count(resume_decisions=1, resume_recomputes=decision.chunks > 0,
                             resume_recomputed_tokens=decision.tokens)
            self.state.record(resume_load_gbps=decision.load_gbps,
                              resume_prefill_tokens_per_s=decision.prefill_tokens_per_s,
                              resume_load_estimate_s=decision.load_s, resume_chosen_estimate_s=decision.chosen_s)
        return True

    def choose(self, manifest: Manifest, tier: str, prefill_key: str,
               token_bytes: int) -> tuple[Manifest, ResumeDecision | None]:
        """The manifest to read (lock held): `manifest`, or it less the leading chunks that the turn recomputes
        faster than the tier delivers them (:func:`~hf_attnstore.store.policy.choose_recompute`, by the
        measured rates of `ResumeCosts`; nothing is chosen before both are measured). Only chunks computed in
        this history may be recomputed (not rebased ones), and at least the last chunk is read. With it, the
        decision for the stats (``resume_*``, counted once the load starts), or None when nothing was decided.

        `token_bytes` is one token's KV at the model's precision: the rate is measured in those bytes whatever
        the chunks' codec, so a tier that stores fewer bytes per token is measured faster.
        """
        load, prefill = self.costs.load_bytes_per_s(tier), self.costs.prefill_units_per_s(prefill_key)
        if load is None or prefill is None or not manifest.spans or manifest.state is not None:
            return manifest, None
        units, pos = [], manifest.head
        for span in manifest.spans:
            units.append((pos, pos + span.length, span.length * token_bytes))
            pos += span.length
        eligible = 0
        while eligible < len(manifest.spans) - 1 and not manifest.spans[eligible].rebased:
            eligible += 1
        if manifest.dropped and any(span.rebased for span in manifest.dropped):
            eligible = 0  # a recomputed head must be this history's own KV from position 0
        chunks, chosen_s, load_s = choose_recompute(units, manifest.head, eligible, 1 / load, 1 / prefill)
        for _ in range(chunks):
            manifest = manifest.drop_head_span()
        tokens = units[chunks - 1][1] - units[0][0] if chunks else 0
        return manifest, ResumeDecision(chunks, tokens, load / 1e9, prefill, load_s, chosen_s)

    def finish(self, job: LoadJob, error: BaseException | None) -> None:
        """The load thread finished a job (loader.py)."""
        if error is None:
            geometry, dtype = job.buf.geometry, job.buf.dtype
            tokens = job.manifest.length - job.manifest.head
            self.costs.observe_load(job.tier.name, tokens * bytes_per_token(geometry, dtype.itemsize),
                                    job.read_seconds)
        with self.state.cond:
            e = job.entry
            self.state.end_load(e, job.handle)
            remote = job.tier is self.remote
            if remote:
                self.state.count(remote_bytes_read=job.nbytes, remote_read_seconds=job.seconds)
            else:
                self.state.count(bytes_read=job.nbytes, read_seconds=job.seconds)
            if e.host is job.buf:
                self.state.account(e)  # a state read with the KV counts now
                if error is None:
                    self.state.keep_encoded(e, job.encoded)  # applied now, or when the turn reading it ends
            if error is not None:
                self.state.count(load_errors=1, remote_errors=remote)
                self.state.once.warning("load", "%s tier: session %r could not be loaded (%s); it is removed and will "
                                   "be recomputed", job.tier.name, e.key[1], error)
                if self.state.entries.get(e.key) is e:
                    if e.manifest is None and e.predecessor is not None:
                        self.state.give_up_remote(e)  # adopted over an unsaved new history: the older copy stays
                    else:
                        self.state.drop(e)
            elif (job.origin or job.manifest) is e.remote and self.state.entries.get(e.key) is e:
                # Found remotely, local now: written to disk behind the turn, like a session the turn computed.
                # Not while leading chunks left to the turn are missing from the buffer: `AttnStore.fill_head`
                # marks it for writing once they are there (writing it now would store whatever the buffer held).
                self.state.loaded_remote(e, dirty=not job.buf.missing_head)
            self.state.cond.notify_all()


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
    keep_encoded: bool = False  # hand lossy chunks' blobs back as the host copy of them (buffer.py)
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


# Samples after which an old one weighs half as much: recent enough to follow a tier that slows down, long
# enough that one slow turn (a page fault storm, another job on the cores) does not flip the decision.
HALF_LIFE = 8
_DECAY = 0.5 ** (1 / HALF_LIFE)
# Forwards shorter than this are not prefill samples: a decoding step's time is its fixed overhead (launches,
# Python), not its tokens', and would make recomputing look slower than it is.
MIN_PREFILL_TOKENS = 32


@dataclass
class _Rate:
    """A decayed ratio: sum of amounts / sum of seconds."""

    amount: float = 0.0
    seconds: float = 0.0
    samples: int = 0

    def add(self, amount: float, seconds: float) -> None:
        self.amount = self.amount * _DECAY + amount
        self.seconds = self.seconds * _DECAY + seconds
        self.samples += 1

    @property
    def per_second(self) -> float | None:
        return self.amount / self.seconds if self.samples and self.seconds > 0 else None


class ResumeCosts:
    """The measured rates (thread-safe: loads report from the load thread, prefills from the turn's thread);
    `AttnStore.costs`. Observations may also come from outside (a calibration run, a test).

    Example:
        >>> costs = ResumeCosts()
        >>> costs.observe_load("disk", 2_000_000_000, 1.0)
        >>> costs.observe_prefill("model-a", 0, 1000, 1.0)
        >>> round(costs.load_bytes_per_s("disk") / 1e9, 1), round(costs.prefill_units_per_s("model-a"))
        (2.0, 1030)
        >>> costs.prefill_units_per_s("model-b") is None  # never measured: nothing is assumed
        True
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._loads: dict[str, _Rate] = {}
        self._prefills: dict[str, _Rate] = {}

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """A load read `nbytes` of KV from `tier` in `seconds` (opening, reading and verifying chunks)."""
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self._loads.setdefault(tier, _Rate()).add(nbytes, seconds)

    def observe_prefill(self, model: str, start: int, end: int, seconds: float) -> None:
        """`model` computed tokens ``[start, end)`` of a sequence, after the tokens before them, in `seconds`."""
        if end - start >= MIN_PREFILL_TOKENS and seconds > 0:
            with self._lock:
                self._prefills.setdefault(model, _Rate()).add(recompute_cost(start, end), seconds)

    def load_bytes_per_s(self, tier: str) -> float | None:
        """The tier's measured load rate, or None before its first load."""
        with self._lock:
            rate = self._loads.get(tier)
            return rate.per_second if rate else None

    def prefill_units_per_s(self, model: str) -> float | None:
        """The model's measured prefill rate in :func:`~hf_attnstore.store.policy.recompute_cost` units per
        second (tokens per second at the start of a sequence), or None before its first measured prefill."""
        with self._lock:
            rate = self._prefills.get(model)
            return rate.per_second if rate else None
