"""The save thread: writes sessions from host memory to a lower tier as chained chunks, then a manifest.

The store decides *what* to save and *when* (write-behind in the quiet gap after a turn, at once for a
flush or a demotion) and hands over a :class:`SaveJob` with the session pinned. This thread only encodes
and writes: each chunk is encoded (serialized, hashed, chained to the history before it) while the tier
writes the previous one (`Tier.put` returns a Future), and the manifest is put only after every chunk it
names is durable. It reports back to the store through `_finish_save`, which takes the store's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .buffer import SessionKV
from .disk import CHUNK_SUFFIX, MANIFEST
from .entry import Entry
from .format import Manifest, Span, encode_chunk, prefix_hasher, tensor_bytes
from .tier import Tier

if TYPE_CHECKING:
    from .store import AttnStore

logger = logging.getLogger(__name__)


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


@dataclass(eq=False)
class SaveResult:
    manifest: Manifest | None  # None: the job failed (see error)
    new_chunks: dict[str, tuple[int, int]]  # chunk written -> (bytes, tokens)
    manifest_size: int
    keep: set[str]  # the session's chunk files that stay (the others were collected)
    reserved: int  # tier bytes the store reserved for the job's files
    seconds: float
    error: BaseException | None


class SaveThread:
    """Runs the store's save jobs on one thread (see the module docstring)."""

    def __init__(self, store: AttnStore, tier: Tier, chunk_tokens: int, timeout_s: float):
        self.store, self.tier, self.chunk_tokens, self.timeout_s = store, tier, chunk_tokens, timeout_s
        self.thread = threading.Thread(target=self._run, name="attnstore-save", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                work = self.store._next_save_work()
                if work is None:
                    return
                deletes, job = work
                self.store._run_deletes(deletes)
                if job is not None:
                    self.store._finish_save(job, self._write(job))
            except Exception as exc:  # a bug must not stop every later write: count it, report it, go on
                logger.exception("disk tier: the save thread hit an unexpected error (%s); it keeps running", exc)
                self.store._save_thread_error(exc)

    def _write(self, job: SaveJob) -> SaveResult:
        fp, sid = key = job.entry.key
        spans, pending = list(job.base.spans), []
        new_chunks, reserved, manifest, manifest_size, error = {}, 0, None, 0, None
        started = time.perf_counter()
        try:
            # Each chunk is chained to its history: the digest of every id before it, and the previous chunk.
            history = prefix_hasher(fp)
            history.update(tensor_bytes(job.snap.token_ids[: job.start]))
            next_chunk = job.first_chunk
            for a in range(job.start, job.end, self.chunk_tokens):
                self.store._yield_for_save(job.entry)
                b, name = min(a + self.chunk_tokens, job.end), f"{next_chunk:08d}"
                next_chunk += 1
                ids, keys, values = job.snap.tensors(a, b)
                data, digest = encode_chunk(fp, sid, ids, keys, values, history.hexdigest(),
                                            spans[-1].digest if spans else "")
                reserved += self.store._reserve_disk(job.entry, len(data))
                pending.append((name, b - a, self.tier.put(key, name + CHUNK_SUFFIX, data)))
                history.update(tensor_bytes(ids))
                spans.append(Span(name, 0, b - a, digest))
            for name, tokens, future in pending:
                new_chunks[name] = (future.result(self.timeout_s), tokens)
            manifest = Manifest(fp, sid, job.snap.token_ids[: job.end].clone(), tuple(spans), next_chunk)
            data = manifest.encode()
            reserved += self.store._reserve_disk(job.entry, len(data))
            manifest_size = self.tier.put(key, MANIFEST, data).result(self.timeout_s)
        except Exception as exc:  # this session's failure (full disk, I/O error, bad data): reported, not fatal
            error, manifest = exc, None
            for name, tokens, future in pending:  # let every write land before its files are collected
                size = _settle(future, self.timeout_s)
                if size is not None:
                    new_chunks[name] = (size, tokens)
        seconds = time.perf_counter() - started
        # Collect garbage before reporting completion, so that a flush() covers it.
        keep, current = self.store._files_to_keep(job, manifest)
        try:
            self.tier.remove(key, keep if current else None)
        except OSError as exc:
            self.store._once.warning("gc", "disk tier: removing unused files of session %r failed (%s)", sid, exc)
        return SaveResult(manifest, new_chunks, manifest_size, keep, reserved, seconds, error)


def _settle(future: Future, timeout: float) -> int | None:
    """The size a put wrote, or None when it failed (or did not finish in time)."""
    try:
        return future.result(timeout)
    except Exception:
        return None
