"""The interface of a tier below host memory: the disk tier (disk.py) and the shared remote tier (remote.py).

A lower tier keeps a session as immutable chunks plus one manifest, under ``(fingerprint, session id)``,
in the format of format.py (every chunk names its model, session and history, and carries checksums).
A tier only moves and checks bytes. *Which* session lives where, and the pins that keep a session in place
while it is read or written, belong to the store's state (store_state.py, entry.py): `StoreState` is the one
owner of that state, so a tier never needs to know about turns, policies or limits.

The calls a store makes, and on which thread:

- ``put(key, name, data)``: the save thread hands over one encoded file and goes on encoding the next
  chunk while the tier writes (a ``Future``, resolved in submission order; a failure is that future's
  exception, never a dead thread). The manifest is put last, after every chunk it names succeeded.
- ``get(key, chunk)``: the load thread opens one chunk; the returned :class:`ChunkReader` has verified the
  header against the key and reads layers straight into host buffers, checking each checksum.
- ``contains(key)``, ``manifest(key)``: whether, and as what, the tier holds a session.
- ``remove(key, keep=None)``: deletes the session, or only its chunks not in `keep` (garbage collection).
- ``scan()``: the sessions the tier holds, for a store reopening it.
- ``close()``: waits for the writes in flight (bounded) and releases what the tier holds. Idempotent.
"""

from __future__ import annotations

import abc
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar
import torch

from ..format import ChunkMeta, Manifest, StateRef


Key = tuple[str, str]  # (model fingerprint, session id)
T = TypeVar("T")


class ChunkReader(abc.ABC):
    """One chunk opened for reading, its header already checked against the session it was asked for."""

    meta: ChunkMeta

    @abc.abstractmethod
    def ids(self) -> torch.Tensor:
        """The chunk's token ids (checksum verified)."""

    @abc.abstractmethod
    def read_layer_into(self, layer: int, start: int, end: int, keys_out: torch.Tensor,
                        values_out: torch.Tensor, keep: dict | None = None) -> int:
        """Reads tokens ``[start, end)`` of one layer into ``[1, heads, end-start, dim]`` tensors, verifying the
        checksums. Returns the bytes read. A lossy chunk's verified blobs also go into `keep` (by tensor
        name), when given: the host copy may keep them encoded (encoded.py).

        Raises:
            FormatError: The bytes are damaged or truncated.
        """

    @abc.abstractmethod
    def kept(self) -> torch.Tensor:
        """A sparse chunk's kept positions ``[layers, heads, kept]`` (`ChunkMeta.kept`; format.read_kept).

        Raises:
            FormatError: The bytes are damaged, or the positions out of range.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Releases the chunk (a file descriptor, a connection). Idempotent."""

    def __enter__(self) -> "ChunkReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class Found:
    """A session found by :meth:`Tier.scan`.

    Example:
        >>> import tempfile
        >>> from hf_attnstore.store import AttnStore
        >>> from hf_attnstore.store.tiers.disk import DiskTier
        >>> kv = [torch.zeros(1, 2, 3, 4)]
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     with AttnStore(host_bytes="1MiB", disk_dir=folder) as store:
        ...         with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
        ...             _ = turn.append(torch.tensor([5, 6, 7]), kv, kv)
        ...     tier = DiskTier(folder)
        ...     found = list(tier.scan())  # what a reopening store reads
        ...     tier.close()
        >>> [(f.manifest.session_id, f.manifest.length, f.layout) for f in found]
        [('chat-1', 3, ((1, 2, 4), torch.float32))]
    """

    manifest: Manifest
    chunks: dict[str, tuple[int, int]]  # chunk name -> (bytes, tokens)
    layout: tuple  # ((layers, kv_heads, head_dim), dtype)
    mtime: float  # wall-clock time of the last write
    manifest_size: int
    codecs: frozenset = frozenset()  # the codecs of its chunks (None: lossless)
    # Chunk files with other names too (hard links of a shared prefix, `Tier.link`) -> their file's identity.
    inodes: dict = field(default_factory=dict)
    sparse: bool = False  # some chunk is a sparse cold copy (`StoreConfig.sparse_copies`)


# The names of a session's files, as `put`, `read_file` and `delete` take them.
MANIFEST = "manifest.json"
CHUNK_SUFFIX = ".safetensors"


class Tier(abc.ABC):
    """A tier below host memory (see the module docstring for who calls what, and when)."""

    name: str = "tier"
    # Whether chunks are stored under their digest (the name passed to `put` is ignored): then a manifest
    # names its chunks by digest, and a chunk name never changes meaning, whoever writes it.
    content_addressed: bool = False

    @abc.abstractmethod
    def put(self, key: Key, name: str, data: bytes) -> "Future[int]":
        """Writes one file of a session atomically in the background; the future gives its size in bytes.

        Files put by one thread are written in order. Nothing of a failed put becomes visible.
        """

    @abc.abstractmethod
    def get(self, key: Key, chunk: str, owner: str = "") -> ChunkReader:
        """Opens a chunk of a session for reading. `owner`: the session that wrote it, when not `key`'s (a
        shared prefix's chunk, `Span.owner`): its header must name that session.

        Raises:
            FormatError: Missing, damaged, of another format, or not this session's (a clean miss).
        """

    @abc.abstractmethod
    def read_state(self, key: Key, ref: StateRef) -> bytes:
        """The bytes of a session's state file (a hybrid model's, state.py), unverified.

        Raises:
            FormatError: Missing (a clean miss).
        """

    @abc.abstractmethod
    def manifest(self, key: Key) -> Manifest | None:
        """The session's manifest, or ``None`` when the tier does not hold it (or it is damaged)."""

    def link(self, source: Key, name: str, key: Key, new_name: str) -> tuple[int, tuple] | None:
        """Makes chunk `new_name` of session `key` the same file as chunk `name` of session `source` (a
        shared prefix stored once), without copying: returns its size and an identity shared by every name of
        the file, or None where this tier cannot (the caller writes its own copy).

        Raises:
            OSError: The source is gone, or linking failed (the caller writes its own copy).
        """
        return None

    def contains(self, key: Key) -> bool:
        """Whether the tier holds the session (its manifest is there and valid)."""
        return self.manifest(key) is not None

    @abc.abstractmethod
    def write(self, key: Key, name: str, data: bytes) -> int:
        """Writes one file of a session atomically now, on the caller's thread (not behind the writes `put`
        queued); returns its size in bytes.

        Raises:
            OSError: The write failed; nothing of it is visible.
        """

    @abc.abstractmethod
    def read_file(self, key: Key, name: str) -> bytes:
        """A session's whole file as it was put (a chunk copied to another tier keeps its own checksums).

        Raises:
            FormatError: Missing (a clean miss).
            OSError: The tier failed to read it.
        """

    @abc.abstractmethod
    def delete(self, key: Key, names: Sequence[str]) -> None:
        """Deletes these files of the session now, in the order given (the manifest first, so that a crash in
        between never leaves a manifest naming a missing file); files already gone are ignored."""

    def available(self) -> bool:
        """Whether the tier answers now (a remote tier that failed moments ago does not, until it is retried)."""
        return True

    def lost(self) -> bool:
        """Whether the tier lost what it held since it was last asked (a Redis restarted empty, or flushed): the
        store then writes its sessions again. Never for a tier whose files stay (the disk)."""
        return False

    @abc.abstractmethod
    def remove(self, key: Key, keep: set[str] | None = None) -> None:
        """Deletes the session (``keep=None``) or only its chunks whose names are not in `keep`."""

    def scan(self) -> Iterator[Found]:
        """The sessions the tier holds, oldest first; damaged ones are removed. None by default: a tier
        shared with other processes is asked per session (:meth:`manifest`), never indexed as a whole."""
        return iter(())

    @abc.abstractmethod
    def close(self) -> None:
        """Waits (bounded) for writes in flight and releases the tier. Idempotent."""


class SerialWriter:
    """One background thread that runs a tier's writes in submission order, each reported by a Future.

    The thread survives any failure (it becomes that write's future's exception). Writes submitted after
    :meth:`close` fail at once with ``RuntimeError``.

    Example:
        >>> writer = SerialWriter("example-writer")
        >>> futures = [writer.submit(pow, 2, n) for n in range(4)]  # run one at a time, in order
        >>> [f.result() for f in futures], writer.close(timeout=1.0)
        ([1, 2, 4, 8], True)
        >>> writer.submit(pow, 2, 5).exception()
        RuntimeError('this tier is closed')
    """

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args) -> "Future[T]":
        future: Future = Future()
        with self._lock:
            if self._closed:
                future.set_exception(RuntimeError("this tier is closed"))
                return future
            self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - reported through the future, the thread goes on
                future.set_exception(exc)

    def close(self, timeout: float) -> bool:
        """Lets the queued writes finish (up to `timeout` seconds) and stops the thread. Returns whether it
        stopped in time. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()
