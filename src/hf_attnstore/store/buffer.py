"""Progress of a session being loaded from disk into host memory, layer by layer.

The load thread marks each layer ready as soon as its bytes are verified; the consumer (a cache's layer
about to compute) waits only for its own layer. The read buffer bounds how far the loader may run ahead
of the consumer (the paper's S_buf, in layers).
"""

from __future__ import annotations

import threading
import dataclasses
from dataclasses import dataclass
import torch

from .codec import KVCodec, least_accurate
from .format import Geometry, bytes_per_token, make_geometry, shapes
from .states import SessionState


class LoadError(RuntimeError):
    """A stored session could not be loaded (damaged or vanished files, I/O error).

    Example:
        >>> handle = LoadHandle(num_layers=1, read_buffer_layers=None, timeout_s=1.0)
        >>> handle.fail(OSError("EIO"))
        >>> try:
        ...     handle.wait_layer(0)
        ... except LoadError as exc:
        ...     print(exc)
        loading the session failed: EIO
    """


class LoadHandle:
    """Shared between the load thread (producer) and the cache layers (consumer).

    Args:
        num_layers: Layers to load.
        read_buffer_layers: How many layers the loader may load beyond the next one the consumer needs;
            ``None`` = no limit. Only applies while a consumer is attached.
        timeout_s: Longest wait for one layer before giving up (the load is then treated as failed).

    Example:
        >>> handle = LoadHandle(num_layers=2, read_buffer_layers=1, timeout_s=1.0)
        >>> handle.layer_ready(0)  # the load thread verified layer 0
        >>> handle.wait_layer(0)  # the layer computing next needs only its own
        >>> handle.ready_layers, handle.done
        (1, False)
    """

    def __init__(self, num_layers: int, read_buffer_layers: int | None, timeout_s: float):
        self.num_layers = num_layers
        self.read_buffer_layers = read_buffer_layers
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._ready = 0  # layers [0, _ready) are loaded
        self._needed = -1  # highest layer the consumer has asked for
        self._attached = False
        self._error: BaseException | None = None
        self._gate_waiting = False

    # -- consumer side ------------------------------------------------------------------------------
    def attach(self) -> None:
        """A cache will consume this load: from now on the read buffer limits run-ahead.

        Example:
            >>> handle = LoadHandle(num_layers=4, read_buffer_layers=1, timeout_s=1.0)
            >>> handle.attach()
            >>> handle.gate(2, timeout=0.01)  # the consumer needs no layer yet: at most layers 0 and 1 run ahead
            False
        """
        with self._cond:
            self._attached = True

    def release(self) -> None:
        """The consumer is gone (done or abandoned): the loader may finish at full speed.

        Example:
            >>> handle = LoadHandle(num_layers=4, read_buffer_layers=1, timeout_s=1.0)
            >>> handle.attach(); handle.release()
            >>> handle.gate(3)  # no consumer: no limit
            True
        """
        with self._cond:
            self._attached = False
            self._cond.notify_all()

    def wait_layer(self, layer: int) -> None:
        """Blocks until `layer` is loaded. Raises LoadError if the load failed or timed out.

        Example:
            >>> handle = LoadHandle(num_layers=2, read_buffer_layers=None, timeout_s=0.05)
            >>> handle.layer_ready(0)
            >>> handle.wait_layer(0)  # returns at once
            >>> handle.wait_layer(1)
            Traceback (most recent call last):
            ...
            hf_attnstore.store.buffer.LoadError: layer 1 was not loaded within 0.05 s
        """
        with self._cond:
            if layer > self._needed:
                self._needed = layer
                self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._ready > layer or self._error is not None, self.timeout_s):
                raise LoadError(f"layer {layer} was not loaded within {self.timeout_s} s")
            if self._error is not None and self._ready <= layer:
                raise LoadError(f"loading the session failed: {self._error}") from self._error

    def wait_all(self) -> None:
        """Blocks until every layer is loaded. Raises LoadError if the load failed or timed out.

        Example:
            >>> handle = LoadHandle(num_layers=2, read_buffer_layers=None, timeout_s=1.0)
            >>> handle.layer_ready(0); handle.layer_ready(1)
            >>> handle.wait_all(); handle.done
            True
        """
        self.wait_layer(self.num_layers - 1)

    @property
    def ready_layers(self) -> int:
        """How many leading layers are loaded (never waits)."""
        with self._cond:
            return self._ready

    @property
    def done(self) -> bool:
        with self._cond:
            return self._ready == self.num_layers

    # -- producer side ------------------------------------------------------------------------------
    def gate(self, layer: int, timeout: float | None = None) -> bool:
        """Called by the loader before reading `layer`: waits while it is too far ahead of the consumer.

        Returns whether the layer may be read now; False after `timeout` seconds (default: the handle's
        timeout, after which a load always proceeds rather than wait for a consumer that may be gone).

        Example:
            >>> handle = LoadHandle(num_layers=4, read_buffer_layers=1, timeout_s=1.0)
            >>> handle.attach()
            >>> handle.gate(1), handle.gate(2, timeout=0.01)  # the consumer is before layer 0: one layer of run-ahead
            (True, False)
        """
        if self.read_buffer_layers is None:
            return True
        with self._cond:
            self._gate_waiting = True  # observable by tests: the producer is held back here
            try:
                return self._cond.wait_for(
                    lambda: not self._attached or layer <= self._needed + 1 + self.read_buffer_layers,
                    self.timeout_s if timeout is None else timeout,
                )
            finally:
                self._gate_waiting = False

    def layer_ready(self, layer: int) -> None:
        """The load thread verified `layer` (layers are loaded in order): its consumer may go on.

        Example:
            >>> handle = LoadHandle(num_layers=2, read_buffer_layers=None, timeout_s=1.0)
            >>> handle.layer_ready(0)
            >>> handle.ready_layers, handle.done
            (1, False)
        """
        with self._cond:
            assert layer == self._ready, "layers are loaded in order"
            self._ready = layer + 1
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The load failed with `error`: waits for layers not loaded yet raise LoadError (loaded ones stay readable).

        Example:
            >>> handle = LoadHandle(num_layers=2, read_buffer_layers=None, timeout_s=1.0)
            >>> handle.layer_ready(0)
            >>> handle.fail(OSError("EIO"))
            >>> handle.wait_layer(0)  # loaded before the failure: still readable
            >>> handle.wait_layer(1)
            Traceback (most recent call last):
            ...
            hf_attnstore.store.buffer.LoadError: loading the session failed: EIO
        """
        with self._cond:
            self._error = error
            self._cond.notify_all()


NOT_INEXACT = 1 << 62  # `inexact_from` of a segment whose tokens are all exact (buffer.Segment.inexact_from)


@dataclass(frozen=True)
class EncodedSlice:
    """Tokens ``[start, start + length)`` of one layer's encoded keys or values, ``[1, heads, length, dim]``
    once decoded. Duck-types the tensor operations the readers of host parts use (`shape`, `narrow`, `to`,
    `record_stream`).

    Example:
        >>> codec, keys = KVCodec("int8", group=32), torch.randn(1, 2, 32, 8)
        >>> blob = codec.encode(keys, keys=True)
        >>> part = EncodedSlice(codec, blob, n=32, start=0, length=32, heads=2, dim=8, keys=True)
        >>> tail = part.narrow(2, 16, 16)  # tokens 16..31, still encoded
        >>> tail.shape, bool((tail.decode(torch.float32) - keys[:, :, 16:]).abs().max() < 0.05 * keys.abs().max())
        ((1, 2, 16, 8), True)
    """

    codec: KVCodec
    blob: torch.Tensor  # uint8: the codec's encoding of the whole chunk's tensor
    n: int  # tokens the blob encodes
    start: int
    length: int
    heads: int
    dim: int
    keys: bool

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (1, self.heads, self.length, self.dim)

    @property
    def device(self) -> torch.device:
        return self.blob.device

    def narrow(self, dim: int, start: int, length: int) -> "EncodedSlice":
        assert dim == 2 and 0 <= start and start + length <= self.length, "encoded slices narrow along tokens"
        return dataclasses.replace(self, start=self.start + start, length=length)

    def to(self, device, non_blocking: bool = False) -> "EncodedSlice":
        """The same slice with its blob on `device` (the codec's bytes are what is copied)."""
        if self.blob.device == torch.device(device):
            return self  # the per-layer load path calls this for every part: no new object when nothing moves
        return dataclasses.replace(self, blob=self.blob.to(device, non_blocking=non_blocking))

    def record_stream(self, stream) -> None:
        self.blob.record_stream(stream)

    def decode_into(self, out: torch.Tensor) -> None:
        """Dequantizes the slice into `out` ``[1, heads, length, dim]`` (on the blob's device)."""
        self.codec.decode_into(self.blob, self.n, out, self.keys, self.start)

    def decode(self, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=dtype, device=self.blob.device)
        self.decode_into(out)
        return out


def dense(x, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A host part's keys or values as a tensor on `device`: an encoded slice is moved there first, then
    dequantized (so a GPU receives the codec's bytes, not the full-precision ones).

    Example:
        >>> dense(torch.ones(1, 2, 3, 4, dtype=torch.float16), torch.device("cpu"), torch.float32).dtype  # a plain part
        torch.float32
    """
    if isinstance(x, EncodedSlice):
        return x.to(device, non_blocking=True).decode(dtype)
    return x.to(device=device, dtype=dtype)


def copy_into(out: torch.Tensor, x) -> None:
    """``out.copy_(x)`` for a host part's keys or values, dequantizing an encoded slice on `out`'s device.

    Example:
        >>> codec, keys = KVCodec("int8", group=32), torch.randn(1, 2, 32, 8)
        >>> blob = codec.encode(keys, keys=True)
        >>> part = EncodedSlice(codec, blob, n=32, start=0, length=32, heads=2, dim=8, keys=True)
        >>> out = torch.empty(1, 2, 32, 8)
        >>> copy_into(out, part)  # dequantized into `out`
        >>> bool((out - keys).abs().max() < 0.05 * keys.abs().max())
        True
    """
    if isinstance(x, EncodedSlice):
        x.to(out.device, non_blocking=True).decode_into(out)
    else:
        out.copy_(x)


class EncodedSegment:
    """One durable chunk of a session in host memory, as the codec's blobs (see the module docstring).

    Args:
        codec: The codec the blobs are in.
        geometry: The session's KV geometry (geometry.py).
        token_ids: The chunk's ids ``[n]``.
        keys: Per layer, the blob of the keys ``[1, key_heads, n, key_dim]``.
        values: Per layer, the blob of the values.
        dtype: The session's full precision (what readers that need dense tensors get).

    Example:
        >>> codec, kv = KVCodec("int8", group=32), torch.randn(1, 2, 32, 8)  # one layer of 32 tokens
        >>> seg = EncodedSegment(codec, (1, 2, 8), torch.arange(32), [codec.encode(kv, keys=True)],
        ...                      [codec.encode(kv, keys=False)], torch.float32)
        >>> keys, values = seg.layer(0, 0, 4)
        >>> keys.shape, seg.lossy_between(0, 4).name, seg.nbytes < 32 * (2 * 2 * 8 * 4 + 8)  # smaller than fp32
        ((1, 2, 4, 8), 'int8', True)
    """

    def __init__(self, codec: KVCodec, geometry: Geometry, token_ids: torch.Tensor, keys: list[torch.Tensor],
                 values: list[torch.Tensor], dtype: torch.dtype):
        layers, (kh, kd), (vh, vd) = shapes(geometry)
        n = int(token_ids.numel())
        assert len(keys) == len(values) == layers, "one blob per layer"
        assert all(b.numel() == codec.nbytes(kh, n, kd, True) for b in keys), "key blob size mismatch"
        assert all(b.numel() == codec.nbytes(vh, n, vd, False) for b in values), "value blob size mismatch"
        self.codec, self.dtype = codec, dtype
        self.capacity = self.filled = n  # full: never appended to
        self.inexact_from = NOT_INEXACT  # see buffer.Segment.inexact_from
        self.absent = None  # every token has KV (sparse cold copies are never kept encoded)
        self.event = None  # written on the host by the save thread: no device copy to wait for
        self.token_ids, self.keys, self.values = token_ids, list(keys), list(values)
        self._key_shape, self._value_shape = (kh, kd), (vh, vd)
        self.nbytes = sum(int(b.numel()) for b in self.keys + self.values) + 8 * n

    def layer(self, idx: int, a: int, b: int) -> tuple[EncodedSlice, EncodedSlice]:
        """Layer `idx`'s tokens ``[a, b)``, encoded."""
        n = self.filled
        return (EncodedSlice(self.codec, self.keys[idx], n, a, b - a, *self._key_shape, True),
                EncodedSlice(self.codec, self.values[idx], n, a, b - a, *self._value_shape, False))

    def lossy_between(self, a: int, b: int) -> KVCodec:
        """Every token of an encoded segment is lossy (see buffer.Segment.lossy_between)."""
        return self.codec

    def mark_inexact(self, start: int) -> None:
        """Records that tokens ``[start, ...)`` were computed under sparse attention (buffer.Segment.inexact_from)."""
        self.inexact_from = min(self.inexact_from, start)

    def pinned(self) -> "EncodedSegment":
        """This segment with its blobs in page-locked memory (for asynchronous copies to CUDA)."""
        seg = EncodedSegment.__new__(EncodedSegment)
        seg.__dict__.update(self.__dict__)
        seg.keys = [b.pin_memory() for b in self.keys]
        seg.values = [b.pin_memory() for b in self.values]
        seg.token_ids = self.token_ids.pin_memory()
        return seg



_ROUND_TOKENS = 16


def _round(n: int) -> int:
    return -(-n // _ROUND_TOKENS) * _ROUND_TOKENS


class Segment:
    """Host memory for `capacity` tokens of every layer (pinned when asked: async GPU copies).

    Example:
        >>> seg = Segment((2, 1, 4), torch.float32, capacity=16, pin_memory=False)  # 2 layers, 1 KV head, head_dim 4
        >>> seg.capacity, seg.filled, tuple(seg.keys[1].shape)
        (16, 0, (1, 1, 16, 4))
    """

    # Tokens [0, lossy_upto) hold KV dequantized from the codec `lossy` (loaded from lossy chunks): written
    # again, they must be labelled lossy (format.encode_chunk's `derived`). Appended tokens are exact.
    lossy: KVCodec | None = None
    lossy_upto: int = 0
    # Tokens [inexact_from, ...) hold KV computed under sparse attention (a `kv_budget` forward that attended to a
    # selection of the history), or after such KV: not what the model computes over the whole history, so a
    # dense cache never reuses them (see SessionKV.exact_prefix). NOT_INEXACT: every token is exact.
    inexact_from: int = NOT_INEXACT
    # Loaded from sparse cold copies (`StoreConfig.sparse_copies`): True where a token has no KV in a layer and KV
    # head, ``[layers, heads, capacity]`` (its memory holds zeros). Such tokens are inexact too: only a sparse
    # cache reads them, and it never attends to an absent one (SessionKV.absent). None: every token has KV.
    absent: torch.Tensor | None = None

    def __init__(self, geometry: Geometry, dtype: torch.dtype, capacity: int, pin_memory: bool):
        layers, (kh, kd), (vh, vd) = shapes(geometry)
        self.capacity = capacity
        self.filled = 0  # tokens [0, filled) are written and may be visible: never overwritten
        # CUDA event recorded after the last asynchronous device-to-host copy into this segment. It lives on
        # the segment, not on a session: segments are shared (truncated copies, snapshots), and each reader
        # must wait for the copies into the memory it reads. Never cleared: a reader that syncs an old
        # event only ever reads tokens whose copies that event covers (appends and snapshots are ordered by
        # the store's lock), and synchronizing a completed event costs nothing.
        self.event = None
        self.token_ids = torch.empty(capacity, dtype=torch.long, pin_memory=pin_memory)
        # One allocation per segment for all layers' keys, one for values (per-layer views): a decoding step
        # appends every layer in one copy, and pinned memory comes in two blocks rather than 2 x layers
        # (the caching host allocator rounds each block up to a power of two).
        self.keys_all = torch.empty(layers, 1, kh, capacity, kd, dtype=dtype, pin_memory=pin_memory)
        self.values_all = torch.empty(layers, 1, vh, capacity, vd, dtype=dtype, pin_memory=pin_memory)
        self.keys, self.values = list(self.keys_all.unbind(0)), list(self.values_all.unbind(0))
        self.nbytes = capacity * (bytes_per_token(geometry, torch.tensor([], dtype=dtype).element_size()) + 8)

    @classmethod
    def adopt(cls, token_ids: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> "Segment":
        """A full segment made of the given CPU tensors, without copying them (they must not change).

        Example:
            >>> seg = Segment.adopt(torch.tensor([5, 6]), [torch.zeros(1, 1, 2, 4)], [torch.zeros(1, 1, 2, 4)])
            >>> seg.capacity, seg.filled  # full: appends go to a new segment
            (2, 2)
        """
        seg = cls.__new__(cls)
        n = int(token_ids.numel())
        seg.capacity = seg.filled = n
        seg.event = None
        seg.keys_all = seg.values_all = None  # full: never appended to
        seg.token_ids, seg.keys, seg.values = token_ids.clone(), list(keys), list(values)
        seg.nbytes = n * (bytes_per_token(_geometry_of(seg), keys[0].element_size()) + 8)
        return seg

    def layer(self, idx: int, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of layer `idx`'s keys and values, tokens ``[a, b)``.

        Example:
            >>> keys = [torch.arange(3.0).view(1, 1, 3, 1)]
            >>> seg = Segment.adopt(torch.tensor([5, 6, 7]), keys, [torch.zeros(1, 1, 3, 1)])
            >>> k, v = seg.layer(0, 1, 3)
            >>> k.flatten().tolist()
            [1.0, 2.0]
        """
        return self.keys[idx][:, :, a:b], self.values[idx][:, :, a:b]

    def mark_lossy(self, codec: KVCodec | None, upto: int) -> None:
        """Records that tokens ``[0, upto)`` hold KV dequantized from `codec` (None: nothing to record).

        Example:
            >>> from hf_attnstore.store.codec import KVCodec
            >>> seg = Segment.adopt(torch.arange(4), [torch.zeros(1, 1, 4, 2)], [torch.zeros(1, 1, 4, 2)])
            >>> seg.mark_lossy(KVCodec("int8"), 2)  # tokens 0 and 1 were loaded from int8 chunks
            >>> seg.lossy_upto, seg.lossy_between(2, 4) is None
            (2, True)
        """
        if codec is not None and upto > 0:
            self.lossy = least_accurate(self.lossy, codec)
            self.lossy_upto = max(self.lossy_upto, upto)

    def lossy_between(self, a: int, b: int) -> KVCodec | None:
        """The codec some of tokens ``[a, b)`` were dequantized from, or None if all of them are exact.

        Example:
            >>> seg = Segment.adopt(torch.arange(4), [torch.zeros(1, 1, 4, 2)], [torch.zeros(1, 1, 4, 2)])
            >>> seg.lossy_between(0, 4) is None  # adopted from exact tensors
            True
        """
        return self.lossy if a < self.lossy_upto and a < b else None

    def mark_inexact(self, start: int) -> None:
        """Records that tokens ``[start, ...)`` hold KV computed under sparse attention, or after such KV.

        Example:
            >>> seg = Segment.adopt(torch.arange(4), [torch.zeros(1, 1, 4, 2)], [torch.zeros(1, 1, 4, 2)])
            >>> seg.mark_inexact(3); seg.mark_inexact(5)  # the earliest start wins
            >>> seg.inexact_from
            3
        """
        self.inexact_from = min(self.inexact_from, start)

    def mark_absent(self, start: int, absent: torch.Tensor) -> None:
        """Records that tokens ``[start, start + n)`` lack KV where `absent` ``[layers, heads, n]`` is True.

        Example:
            >>> seg = Segment.adopt(torch.arange(3), [torch.zeros(1, 1, 3, 2)], [torch.zeros(1, 1, 3, 2)])
            >>> seg.mark_absent(1, torch.tensor([[[False, True]]]))  # layer 0, head 0: token 2 has no KV
            >>> seg.absent[0, 0].tolist(), seg.inexact_from
            ([False, False, True], 2)
        """
        if self.absent is None:
            self.absent = torch.zeros(absent.shape[0], absent.shape[1], self.capacity, dtype=torch.bool)
        self.absent[:, :, start : start + absent.shape[2]] |= absent
        first = torch.nonzero(absent.any(dim=(0, 1)))
        if first.numel():
            self.mark_inexact(start + int(first[0]))


def _geometry_of(seg: Segment) -> Geometry:
    k, v = seg.keys[0], seg.values[0]
    return make_geometry(len(seg.keys), (k.shape[1], k.shape[3]), (v.shape[1], v.shape[3]))


Part = tuple[Segment, int, int]
_ADOPT_MIN_TOKENS = 64  # below this, appending copies into the tail segment (decoding: one token at a time)


@dataclass(frozen=True)
class SessionKV:
    """A read-only view of a session's stored KV.

    Attributes:
        token_ids: The ids the KV covers, ``[seq]`` (int64, CPU).
        parts: The segments holding it, in order (read them through :meth:`layer_parts`).
        source: The buffer the snapshot was taken from.
        loader: Set while the session is still being loaded from disk: layers are waited for.
        tier: Where the KV came from: ``"host"`` or ``"disk"``.
        key: The ``(fingerprint, session_id)`` it was taken from, set by `AttnStore.lookup`: a turn that
            continues the same session may reuse its buffer in place; a base from another session (a shared
            prefix) is always copied by reference into a new history.
        generation: The session's generation when the snapshot was taken (it changes when the session's
            history is cut or truncated): tells a later turn whether positions still mean the same tokens.
        head: Leading tokens whose KV is not there (a partially evicted session, see `StoreConfig.
            partial_eviction`): their ids are known, their memory holds nothing yet. The turn that reuses the
            snapshot recomputes them (`AttnStore.fill_head`); no reader may read them before.
        state: A hybrid model's recurrent and convolution states after the first ``state.tokens`` tokens
            (state.py), or None. Set once the session is loaded (a snapshot of a session still loading has
            none: read the buffer's, ``source.state``, after waiting for the load).

    Example:
        >>> buf = SessionBuffer((1, 2, 4), torch.float32, pin_memory=False)  # 1 layer, 2 KV heads, head_dim 4
        >>> kv = [torch.zeros(1, 2, 3, 4)]
        >>> buf.append(torch.tensor([5, 6, 7]), kv, kv)
        >>> snap = buf.snapshot()
        >>> snap.token_ids.tolist(), snap.length, snap.tier, snap.head
        ([5, 6, 7], 3, 'host', 0)
    """

    token_ids: torch.Tensor
    parts: tuple[Part, ...]
    source: "SessionBuffer"
    loader: LoadHandle | None = None
    tier: str = "host"
    generation: int = 0
    head: int = 0
    state: SessionState | None = None
    key: tuple | None = None  # the session it was taken from (None: a buffer's own view)

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())

    def layer_parts(self, idx: int, length: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views ``(keys, values)`` of layer `idx` covering the first `length` tokens, one per part (a part
        kept encoded gives :class:`~.encoded.EncodedSlice` pairs: read them with ``encoded.dense``).

        Waits for the layer if the session is still loading.

        Raises:
            LoadError: The load failed (damaged file, I/O error) or timed out.

        Example:
            >>> buf = SessionBuffer((1, 2, 4), torch.float32, pin_memory=False)
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> buf.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> [tuple(k.shape) for k, v in buf.snapshot().layer_parts(0, length=2)]
            [(1, 2, 2, 4)]
        """
        if self.loader is not None:
            self.loader.wait_layer(idx)
        _sync(self.parts)
        remaining = self.length if length is None else length
        out = []
        for seg, a, b in self.parts:
            if remaining <= 0:
                break
            b = min(b, a + remaining)
            out.append(seg.layer(idx, a, b))
            remaining -= b - a
        return out

    def with_head(self, seg: "Segment") -> "SessionKV":
        """This snapshot with its first ``seg.filled`` tokens read from `seg` instead (a recomputed head); the
        tokens after them, up to the missing head's end, are never read (not kept by the turn).

        Example:
            >>> buf = SessionBuffer((1, 2, 4), torch.float32, pin_memory=False)
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> buf.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> head = Segment.adopt(torch.tensor([5]), [torch.ones(1, 2, 1, 4)], [torch.ones(1, 2, 1, 4)])
            >>> snap = buf.snapshot().with_head(head)  # token 0 now read from `head`
            >>> [(s is head, a, b) for s, a, b in snap.parts]
            [(True, 0, 1), (False, 1, 3)]
        """
        n, parts, pos = seg.filled, [(seg, 0, seg.filled)], 0
        for s, a, b in self.parts:
            x = max(a, a + n - pos)
            if x < b:
                parts.append((s, x, b))
            pos += b - a
        return dataclasses.replace(self, parts=tuple(parts), head=0)

    def tensors(self, start: int, end: int) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Contiguous copies of tokens ``[start, end)``: ids and per-layer keys and values (for the writer).

        Example:
            >>> buf = SessionBuffer((1, 2, 4), torch.float32, pin_memory=False)
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> buf.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> ids, keys, values = buf.snapshot().tensors(1, 3)
            >>> ids.tolist(), tuple(keys[0].shape)
            ([6, 7], (1, 2, 2, 4))
        """
        _sync(self.parts)
        pieces, pos = [], 0
        for seg, a, b in self.parts:
            x, y = max(start, pos), min(end, pos + b - a)
            if x < y:
                pieces.append((seg, a + x - pos, a + y - pos))
            pos += b - a
        ids = torch.cat([seg.token_ids[a:b] for seg, a, b in pieces])
        layers, cpu, dtype = len(pieces[0][0].keys), torch.device("cpu"), self.source.dtype
        keys, values = [], []
        for i in range(layers):
            # Encoded parts (a truncated copy of a session kept encoded) are dequantized: written again, they
            # are quantized again, in the new chunk's groups.
            kv = [[dense(x, cpu, dtype) for x in seg.layer(i, a, b)] for seg, a, b in pieces]
            keys.append(torch.cat([k for k, _ in kv], dim=2))
            values.append(torch.cat([v for _, v in kv], dim=2))
        return ids, keys, values

    def lossy_before(self, end: int) -> KVCodec | None:
        """The least accurate codec that the KV of the first `end` tokens depends on (None: all exact).

        Under causal attention a token's KV is computed from every token before it: once a dequantized token is
        reused, the KV computed after it is no longer what the model computes on the exact history, so it
        counts as lossy too, even if its own values were never quantized.

        Example:
            >>> buf = SessionBuffer((1, 2, 4), torch.float32, pin_memory=False)
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> buf.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> snap = buf.snapshot()
            >>> snap.lossy_before(3) is None  # appended KV is exact
            True
        """
        worst, pos = None, 0
        for seg, a, b in self.parts:
            y = min(end, pos + b - a)
            lossy = seg.lossy_between(a, a + y - pos) if pos < y else None
            if lossy is not None:  # (a lossless store's segments never are: no codec runs)
                worst = least_accurate(worst, lossy)
            pos += b - a
        return worst

    def exact_prefix(self, end: int | None = None) -> int:
        """How many leading tokens (of the first `end`) hold KV the model computes over the whole history: all
        but those from the first token computed under sparse attention (``kv_budget``) on. Under causal attention
        every token after an inexact one is inexact too, whatever its segment says.

        Example:
            >>> buf = SessionBuffer((1, 2, 4), torch.float32, pin_memory=False)
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> buf.append(torch.tensor([5, 6, 7]), kv, kv, inexact_at=2)  # token 7 under sparse attention
            >>> buf.snapshot().exact_prefix(), buf.snapshot().exact_prefix(1)
            (2, 1)
        """
        return exact_prefix(self.parts, self.length if end is None else end)

    def absent(self, end: int | None = None) -> torch.Tensor | None:
        """Where the first `end` tokens lack KV, ``[layers, heads, end]`` (loaded from sparse cold copies), or None
        when every one of them has KV.

        Example:
            >>> buf = SessionBuffer((1, 2, 4), torch.float32, pin_memory=False)
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> buf.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> buf.snapshot().absent() is None  # every token has KV
            True
        """
        end = self.length if end is None else end
        shape = next((seg.absent.shape[:2] for seg, _, _ in self.parts if seg.absent is not None), None)
        if shape is None:
            return None
        pieces, pos = [], 0
        for seg, a, b in self.parts:
            if pos >= end:
                break
            b = min(b, a + end - pos)
            pieces.append(seg.absent[:, :, a:b] if seg.absent is not None else torch.zeros(*shape, b - a, dtype=torch.bool))
            pos += b - a
        return torch.cat(pieces, dim=2) if pieces else torch.zeros(*shape, 0, dtype=torch.bool)

    def select(self, keep: torch.Tensor) -> list[Part]:
        """The parts holding tokens `keep` (sorted indices), in order; no data is copied.

        Example:
            >>> buf = SessionBuffer((1, 2, 4), torch.float32, pin_memory=False)
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> buf.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> [(a, b) for _, a, b in buf.snapshot().select(torch.tensor([0, 2]))]
            [(0, 1), (2, 3)]
        """
        bounds, pos = [], 0
        for seg, a, b in self.parts:
            bounds.append((pos, pos + b - a, seg, a))
            pos += b - a
        out: list[Part] = []
        for lo, hi in ranges(keep):
            for start, end, seg, a in bounds:
                x, y = max(lo, start), min(hi, end)
                if x < y:
                    out.append((seg, a + x - start, a + y - start))
        return out


def exact_prefix(parts, end: int) -> int:
    """The leading tokens of `parts` (of the first `end`) before the first inexact one (SessionKV.exact_prefix).

    Example:
        >>> seg = Segment.adopt(torch.arange(4), [torch.zeros(1, 1, 4, 2)], [torch.zeros(1, 1, 4, 2)])
        >>> seg.mark_inexact(3)  # token 3 was computed under sparse attention
        >>> exact_prefix([(seg, 0, 4)], 4), exact_prefix([(seg, 0, 4)], 2)
        (3, 2)
    """
    pos = 0
    for seg, a, b in parts:
        if pos >= end:
            break
        if seg.inexact_from < b:
            return min(end, pos + max(0, seg.inexact_from - a))
        pos += b - a
    return end


def _sync(parts) -> None:
    """Waits for asynchronous GPU-to-host copies into these parts' segments to land."""
    for event in {id(seg.event): seg.event for seg, _, _ in parts if seg.event is not None}.values():
        event.synchronize()


def ranges(indices: torch.Tensor) -> list[tuple[int, int]]:
    """Sorted indices as maximal ``[a, b)`` ranges.

    Example:
        >>> ranges(torch.tensor([0, 1, 2, 5, 6, 9]))
        [(0, 3), (5, 7), (9, 10)]
    """
    out: list[tuple[int, int]] = []
    for i in indices.tolist():
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


class SessionBuffer:
    """A session's KV in host memory: the parts it is made of, its length, and where to append.

    Example:
        >>> buf = SessionBuffer((1, 2, 4), torch.float32, pin_memory=False)  # 1 layer, 2 KV heads, head_dim 4
        >>> kv = [torch.zeros(1, 2, 3, 4)]  # per layer: [1, kv_heads, tokens, head_dim]
        >>> buf.append(torch.tensor([5, 6, 7]), kv, kv)
        >>> snap = buf.snapshot()
        >>> buf.truncate(2)  # the snapshot still sees all three tokens
        >>> buf.length, snap.token_ids.tolist()
        (2, [5, 6, 7])
    """

    def __init__(self, geometry: Geometry, dtype: torch.dtype, pin_memory: bool, parts: list[Part] | None = None):
        self.geometry = tuple(geometry)
        self.dtype = dtype
        self.pin_memory = pin_memory
        self.parts: list[Part] = list(parts or [])
        self.length = sum(b - a for _, a, b in self.parts)
        # Partial eviction: the first `missing_head` tokens were loaded without KV (their chunks were dropped);
        # one turn fills them in (`head_claimed`) and sets it to 0. Nothing reads them before.
        self.missing_head = 0
        self.head_claimed = False
        # A hybrid model's states after the first `state.tokens` tokens (state.py); they stay valid while
        # those tokens are kept, and count in the buffer's bytes.
        self.state: SessionState | None = None
        # Encoded copies of some of its tokens, waiting for the session's turn to end (see `stash`).
        self.pending: list[tuple[int, Part]] = []
        # Leading tokens held in segments selected from a snapshot (`selected`), maybe another session's (a shared
        # prefix): they do not count towards the size of this buffer's own new segments (`_grow_capacity`).
        self.selected_tokens = 0

    def segments(self) -> dict[int, "Segment"]:
        """The segments this session uses, by id (whole segments: that is what occupies memory).

        Example:
            >>> buf = SessionBuffer((1, 2, 4), torch.float32, pin_memory=False)
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> buf.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> [seg.capacity for seg in buf.segments().values()]  # rounded up to 16 tokens
            [16]
        """
        segments = {id(seg): seg for seg, _, _ in self.parts}
        segments.update({id(seg): seg for _, (seg, _, _) in self.pending})
        return segments

    @property
    def nbytes(self) -> int:
        """Bytes of the segments this session uses, and of its state.

        Example:
            >>> buf = SessionBuffer((1, 2, 4), torch.float32, pin_memory=False)
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> buf.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> buf.nbytes  # 16 tokens of room x (64 bytes of KV + 8 of token id)
            1152
        """
        kv = sum(seg.nbytes for seg in self.segments().values())
        return kv + (self.state.nbytes if self.state is not None else 0)

    def new_segment(self, capacity: int) -> Segment:
        """A new, empty segment of this buffer's geometry and dtype for `capacity` tokens (rounded up to 16).

        Example:
            >>> buf = SessionBuffer((1, 2, 4), torch.float32, pin_memory=False)
            >>> buf.new_segment(20).capacity  # rounded up to a multiple of 16 tokens
            32
        """
        return Segment(self.geometry, self.dtype, _round(capacity), self.pin_memory)

    def snapshot(self, loader: LoadHandle | None = None, tier: str = "host", generation: int = 0,
                 key: tuple | None = None) -> SessionKV:
        """A read-only view of the buffer as it is now (:class:`SessionKV`): later appends and truncations leave
        it as is.

        Example:
            >>> buf = SessionBuffer((1, 2, 4), torch.float32, pin_memory=False)
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> buf.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> snap = buf.snapshot(tier="disk", generation=2)
            >>> snap.token_ids.tolist(), snap.tier, snap.generation, snap.source is buf
            ([5, 6, 7], 'disk', 2, True)
        """
        ids = [seg.token_ids[a:b] for seg, a, b in self.parts]
        if not ids:  # an empty buffer (a turn that stored nothing yet): torch.cat refuses an empty list
            token_ids = torch.empty(0, dtype=torch.long)
        else:
            token_ids = torch.cat(ids) if len(ids) != 1 else ids[0]
        return SessionKV(token_ids=token_ids, parts=tuple(self.parts), source=self, loader=loader, tier=tier,
                         generation=generation, head=self.missing_head, state=self.state, key=key)

    def _tail_room(self) -> int:
        """Tokens that can be appended in place (0 if the last part does not end at its segment's fill mark)."""
        if not self.parts:
            return 0
        seg, _, b = self.parts[-1]
        return seg.capacity - b if b == seg.filled else 0

    def bytes_after_append(self, tokens: int) -> int:
        """Bytes the buffer would hold after appending `tokens` tokens.

        Example:
            >>> buf = SessionBuffer((1, 2, 4), torch.float32, pin_memory=False)
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> buf.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> buf.bytes_after_append(10) == buf.nbytes, buf.bytes_after_append(20) > buf.nbytes  # 13 fit in 16
            (True, True)
        """
        if tokens <= self._tail_room():
            return self.nbytes
        per_token = bytes_per_token(self.geometry, torch.tensor([], dtype=self.dtype).element_size()) + 8
        return self.nbytes + self._grow_capacity(tokens) * per_token

    def _grow_capacity(self, tokens: int) -> int:
        # A new segment holds at least a quarter of the history, so a session made of many turns and decoded
        # tokens needs few segments. Not of a shared prefix: seven sessions over one 1,200-token system prompt
        # would each reserve 300 tokens for a 30-token question.
        return _round(max(tokens, (self.length - self.selected_tokens) // 4))

    def append(self, token_ids: torch.Tensor, keys, values, inexact_at: int | None = None) -> None:
        """Appends ``len(token_ids)`` tokens (device tensors are copied to host).

        `keys` and `values` are per-layer lists of ``[1, kv_heads, n, head_dim]`` tensors or stacked
        ``[layers, 1, kv_heads, n, head_dim]`` tensors (copied in one operation). `inexact_at`: the appended
        tokens from this one on were computed under sparse attention (Segment.inexact_from); tokens appended
        after inexact ones are inexact whatever it says.

        Example:
            >>> buf = SessionBuffer((2, 2, 4), torch.float32, pin_memory=False)  # 2 layers
            >>> kv = [torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4)]
            >>> buf.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> buf.append(torch.tensor([8]), torch.ones(2, 1, 2, 1, 4), torch.ones(2, 1, 2, 1, 4))  # stacked layers
            >>> buf.length, buf.snapshot().token_ids.tolist()
            (4, [5, 6, 7, 8])
        """
        n = int(token_ids.numel())
        if exact_prefix(self.parts, self.length) < self.length:
            inexact_at = 0
        layers, (kh, kd), (vh, vd) = shapes(self.geometry)
        assert len(keys) == len(values) == layers, "one key/value tensor per layer is required"
        on_gpu = keys[0].is_cuda
        if not self.pin_memory and n >= _ADOPT_MIN_TOKENS and n > self._tail_room() and not on_gpu:
            # A prefill's KV is freshly computed and never modified afterwards: keep it as a segment instead
            # of copying it (this copy was most of the time saving adds to a turn).
            keys, values = list(keys), list(values)  # a stacked tensor's per-layer views share its storage
            assert all(t.shape == (1, kh, n, kd) for t in keys) and all(t.shape == (1, vh, n, vd) for t in values), \
                "KV shape mismatch"
            seg = Segment.adopt(token_ids.view(-1), keys, values)
            if inexact_at is not None:
                seg.mark_inexact(inexact_at)
            self.parts.append((seg, 0, n))
            self.length += n
            return
        if n <= self._tail_room():
            seg, a, b = self.parts[-1]
            self.parts[-1] = (seg, a, b + n)
        else:
            seg, b = self.new_segment(self._grow_capacity(n)), 0
            self.parts.append((seg, 0, n))
        seg.token_ids[b : b + n].copy_(token_ids.view(-1))
        from_gpu = self.pin_memory and on_gpu
        # Into pinned memory the copy is asynchronous: it is ordered on the current stream, and readers
        # of the segment (the disk writer, a later turn) wait for its event first (see Segment.event).
        for dst_all, dst, src, (heads, dim) in ((seg.keys_all, seg.keys, keys, (kh, kd)),
                                                (seg.values_all, seg.values, values, (vh, vd))):
            if isinstance(src, torch.Tensor):
                assert src.shape == (layers, 1, heads, n, dim), f"expected {(layers, 1, heads, n, dim)}"
                dst_all[:, :, :, b : b + n].copy_(src, non_blocking=from_gpu)
            else:
                for d, t in zip(dst, src):
                    assert t.shape == (1, heads, n, dim), f"expected {(1, heads, n, dim)}, got {tuple(t.shape)}"
                    d[:, :, b : b + n].copy_(t, non_blocking=from_gpu)
        seg.filled = b + n
        if inexact_at is not None:
            seg.mark_inexact(b + inexact_at)
        if from_gpu:
            event = torch.cuda.Event()
            event.record()
            seg.event = event
        self.length += n

    def truncate(self, length: int) -> None:
        """Keeps the first `length` tokens. The data stays (snapshots may see it); the next append starts a
        new segment instead of overwriting it.

        Example:
            >>> buf = SessionBuffer((1, 2, 4), torch.float32, pin_memory=False)
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> buf.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> buf.truncate(1)
            >>> buf.snapshot().token_ids.tolist()
            [5]
        """
        assert 0 <= length <= self.length, f"cannot truncate {self.length} tokens to {length}"
        parts, pos = [], 0
        for seg, a, b in self.parts:
            if pos >= length:
                break
            take = min(b - a, length - pos)
            parts.append((seg, a, a + take))
            pos += take
        self.parts, self.length = parts, length
        self.pending = [(x, (seg, a, b)) for x, (seg, a, b) in self.pending if x + b - a <= length]
        self.missing_head = min(self.missing_head, length)
        if self.state is not None and self.state.tokens > length:
            self.state = None  # it summarizes tokens that are gone

    def stash(self, chunks: list[tuple[int, Part]]) -> None:
        """Keeps encoded copies of some of the buffer's tokens for a later :meth:`compact` (a turn is running
        on the session now). Each is ``(start, (seg, a, b))``: tokens ``[start, start + b - a)`` are
        ``seg[a:b]`` of an :class:`~.encoded.EncodedSegment`. They count in :attr:`nbytes` meanwhile."""
        self.pending.extend(chunks)

    def compact(self, chunks: list[tuple[int, Part]] | None = None) -> int:
        """Holds the buffer's tokens given by `chunks` (as for :meth:`stash`; default: the stashed ones) as
        those encoded parts instead of at full precision, and forgets the stash.

        A chunk is taken only where the buffer still holds its tokens at full precision (same ids, nothing
        missing). The full-precision tokens left in a segment that gave up some (the trailing partial chunk,
        typically) are copied into a segment of their own, so that the old segment is freed once no snapshot
        or other session reads it. Returns the tokens now held encoded.
        """
        if self.missing_head:
            return 0  # a head still to recompute (partial eviction): the stash waits for the turn that fills it
        if chunks is None:
            chunks, self.pending = self.pending, []
        if not chunks:
            return 0
        ids = self.snapshot().token_ids
        spans, pos = [], 0  # (start, end, part) of every part
        for seg, a, b in self.parts:
            spans.append((pos, pos + b - a, (seg, a, b)))
            pos += b - a
        take = []
        for start, (enc, a, b) in sorted(chunks, key=lambda c: c[0]):
            end = start + b - a
            over = [p for s, e, p in spans if s < end and e > start]
            if end <= self.length and over and all(not isinstance(p[0], EncodedSegment) for p in over) \
                    and (not take or take[-1][1] <= start) and torch.equal(ids[start:end], enc.token_ids[a:b]):
                take.append((start, end, (enc, a, b)))
        if not take:
            return 0
        pieces: list[tuple[int, Part]] = [(x, part) for x, _, part in take]
        touched: set[int] = set()
        for s, e, (seg, a, b) in spans:
            pos = s
            for x, y, _ in take:  # keep what lies outside the encoded chunks
                if x < e and y > s:
                    touched.add(id(seg))
                    if x > pos:
                        pieces.append((pos, (seg, a + pos - s, a + x - s)))
                    pos = max(pos, y)
            if pos < e:
                pieces.append((pos, (seg, a + pos - s, b)))
        pieces.sort(key=lambda p: p[0])
        # Full-precision runs of the segments that gave up tokens are copied out, so their memory can go.
        out: list[Part] = []
        run: list[Part] = []
        for _, part in pieces + [(self.length, None)]:
            if part is not None and id(part[0]) in touched and not isinstance(part[0], EncodedSegment):
                run.append(part)
                continue
            if run:
                out.append(self._copied(run))
                run = []
            if part is not None:
                out.append(part)
        self.parts = out
        return sum(y - x for x, y, _ in take)

    def _copied(self, run: list[Part]) -> Part:
        """Consecutive parts copied into one new segment (with room to append after them)."""
        _sync(run)
        n = sum(b - a for _, a, b in run)
        copy, pos = self.new_segment(n), 0
        for seg, a, b in run:
            copy.mark_lossy(seg.lossy_between(a, b), pos + b - a)  # the copy is as exact as what it copies
            if seg.inexact_from < b:
                copy.mark_inexact(pos + max(0, seg.inexact_from - a))
            if seg.absent is not None:
                copy.mark_absent(pos, seg.absent[:, :, a:b])
            copy.token_ids[pos : pos + b - a].copy_(seg.token_ids[a:b])
            for dst, src in ((copy.keys, seg.keys), (copy.values, seg.values)):
                for d, t in zip(dst, src):
                    d[:, :, pos : pos + b - a].copy_(t[:, :, a:b])
            pos += b - a
        copy.filled = n
        return (copy, 0, n)

    @classmethod
    def selected(cls, base: SessionKV, keep: torch.Tensor, pin_memory: bool) -> "SessionBuffer":
        """A buffer of `base`'s tokens at sorted indices `keep`, sharing its segments (no copy).

        Example:
            >>> buf = SessionBuffer((1, 2, 4), torch.float32, pin_memory=False)
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> buf.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> picked = SessionBuffer.selected(buf.snapshot(), torch.tensor([0, 2]), pin_memory=False)
            >>> picked.snapshot().token_ids.tolist(), picked.segments().keys() == buf.segments().keys()  # no copy
            ([5, 7], True)
        """
        assert base.loader is None or base.loader.done, "select only fully loaded snapshots"
        keep = keep.to(torch.long)
        buf = cls(base.source.geometry, base.source.dtype, pin_memory, parts=base.select(keep))
        buf.selected_tokens = buf.length
        if base.head:
            # Tokens without KV may only lead (a head is recomputed from position 0).
            missing = int((keep < base.head).sum())
            if not torch.equal(keep[:missing], torch.arange(missing)):
                raise ValueError("a selection keeps tokens of a missing head after a gap: recompute the head first")
            buf.missing_head = missing
        n = int(keep.numel())
        if base.state is not None and base.state.tokens <= n and torch.equal(keep, torch.arange(n)):
            buf.state = base.state  # its tokens are kept in place: still the state after them
        return buf

    @classmethod
    def for_load(cls, geometry, dtype, length: int, pin_memory: bool) -> "SessionBuffer":
        """A buffer with one segment for `length` tokens, to be filled by the disk loader.

        Example:
            >>> buf = SessionBuffer.for_load((1, 2, 4), torch.float32, 40, pin_memory=False)
            >>> buf.length, [(a, b) for _, a, b in buf.parts]
            (40, [(0, 40)])
        """
        buf = cls(geometry, dtype, pin_memory)
        seg = buf.new_segment(length)
        seg.filled = length
        buf.parts, buf.length = [(seg, 0, length)], length
        return buf
