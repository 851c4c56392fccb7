"""Host copies kept encoded: a session's durable chunks held in host memory by a lossy codec (codec.py).

With ``kv_codec`` set, the save thread encodes each whole chunk it writes to the disk or remote tier. By
default (``kv_codec_host``) the store then keeps those same blobs as the session's host copy of the chunk,
in place of the full-precision tokens (:meth:`~.buffer.SessionBuffer.compact`): a session between turns holds
``codec.bytes_per_token`` per token instead of the model's precision, for no extra encoding work. The
trailing partial chunk and the running turn's KV stay at full precision (the partial chunk is rewritten by
the next save, and encoding it twice would quantize twice).

An :class:`EncodedSegment` is a part of a session like a :class:`~.buffer.Segment`, full and immutable. Its
layers are read as :class:`EncodedSlice` pairs: the blob itself, not dequantized values. Whoever computes
with them dequantizes where the computation runs: on a GPU, the blob crosses PCIe at the codec's size and is
dequantized on the device, in the same per-layer load step that re-rotates the keys (cache.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .codec import KVCodec
from .geometry import Geometry, shapes

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
