"""Lossy codecs of the cold copies: the KV a store writes to its disk and remote tiers.

``int8`` and ``int4`` are asymmetric min-max integers with one fp16 scale and one fp16 zero point per group:

- **keys per channel**: a group is `group` consecutive tokens of one channel of one head. Our keys are stored
  *before* RoPE, where each channel keeps its own stable range (KVQuant's outlier channels); after RoPE a
  channel pair rotates with the position and the range is smeared. `eval/quant_ablation.py` measures it.
- **values per token**: a group is `group` consecutive channels of one token (KIVI's split).

One tensor ``[1, kv_heads, n, head_dim]`` is encoded into one ``uint8`` blob: the integers (two per byte for
int4, low nibble first) in the grouped axis order, then the scales, then the zero points (fp16,
little-endian). Its size follows from the shape and the codec, so the chunk format validates it like any
other tensor; its checksum covers the scales and zero points too.

A chunk whose KV cannot be represented (a value beyond fp16's range, a NaN) is written lossless instead:
the codec is recorded per chunk, never assumed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
import torch



CODECS = {"int8": 8, "int4": 4}
MAX_GROUP = 4096


class CodecRangeError(ValueError):
    """The KV has values a codec cannot represent (non-finite, or beyond fp16's range for the scales).

    Example:
        >>> import torch
        >>> try:
        ...     KVCodec("int8").encode(torch.tensor([[[[1.0, float("inf")]]]]), keys=False)
        ... except CodecRangeError:  # the store then writes that chunk lossless
        ...     print("not representable")
        not representable
    """


@dataclass(frozen=True)
class KVCodec:
    """A lossy codec of stored keys and values (see the module docstring).

    Args:
        name: ``"int8"`` or ``"int4"``.
        group: Tokens per key group (one channel) and channels per value group (one token; at most the head
            dimension). Smaller groups: more accurate, more bytes for the scales.

    Example:
        >>> import torch
        >>> codec = KVCodec("int8", group=32)
        >>> keys = torch.randn(1, 2, 64, 16)
        >>> blob = codec.encode(keys, keys=True)
        >>> blob.numel() < keys.numel() * keys.element_size() / 3  # about a quarter of fp32, with scales
        True
        >>> out = torch.empty_like(keys)
        >>> codec.decode_into(blob, 64, out, keys=True)
        >>> bool((out - keys).abs().max() < 0.05 * keys.abs().max())
        True
    """

    name: str
    group: int = 32

    def __post_init__(self):
        if self.name not in CODECS:
            raise ValueError(f"unknown KV codec {self.name!r}: use one of {sorted(CODECS)} (or None for lossless)")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or not 2 <= self.group <= MAX_GROUP \
                or self.group % 2:
            raise ValueError(f"`kv_codec_group` must be an even integer in [2, {MAX_GROUP}], got {self.group!r}")

    @property
    def bits(self) -> int:
        return CODECS[self.name]

    # -- what a chunk records ---------------------------------------------------------------------------
    def describe(self) -> str:
        return json.dumps({"name": self.name, "group": self.group}, sort_keys=True)

    @classmethod
    def parse(cls, text: str) -> "KVCodec":
        """The codec a chunk's metadata names. Raises ValueError when it is malformed or unknown."""
        fields = json.loads(text)
        if not isinstance(fields, dict) or set(fields) != {"name", "group"}:
            raise ValueError("malformed codec field")
        return cls(fields["name"], fields["group"])

    # -- sizes ------------------------------------------------------------------------------------------
    def _value_group(self, dim: int) -> int:
        return min(self.group, dim)

    def nbytes(self, heads: int, n: int, dim: int, keys: bool) -> int:
        """Bytes of the blob of one ``[1, heads, n, dim]`` tensor."""
        length, group = (n, self.group) if keys else (dim, self._value_group(dim))
        rows = heads * (dim if keys else n)  # the groups run along `length` within each row
        groups = rows * -(-length // group)
        return _even(-(-rows * length * self.bits // 8)) + 4 * groups

    def bytes_per_token(self, layers: int, heads: int, dim: int) -> float:
        """Stored bytes per token of keys and values in whole chunks of `group` tokens (no ids)."""
        n = self.group
        return layers * (self.nbytes(heads, n, dim, True) + self.nbytes(heads, n, dim, False)) / n

    # -- encoding ---------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, keys: bool) -> torch.Tensor:
        """The ``uint8`` blob of ``x`` ``[1, heads, n, dim]`` (keys: per channel; values: per token).

        Raises:
            CodecRangeError: Non-finite values, or a range fp16 scales cannot hold.
        """
        _, heads, n, dim = x.shape
        rows = x[0].detach().to("cpu", torch.float32)
        rows = rows.transpose(1, 2) if keys else rows  # [heads, dim, n] or [heads, n, dim]: groups on the last axis
        length = rows.shape[-1]
        group = self.group if keys else self._value_group(dim)
        pad = (-length) % group
        if pad:  # repeat the last value: the padding never widens a group's range
            rows = torch.cat([rows, rows[..., -1:].expand(*rows.shape[:-1], pad)], dim=-1)
        g = rows.reshape(*rows.shape[:-1], -1, group)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        levels = (1 << self.bits) - 1
        zero = lo.to(torch.float16)
        scale = ((hi - zero.float()) / levels).to(torch.float16)
        if not (torch.isfinite(zero).all() and torch.isfinite(scale).all()):
            raise CodecRangeError("KV values are non-finite or beyond fp16's range")
        s = scale.float()
        q = torch.where(s > 0, (g - zero.float()) / torch.where(s > 0, s, 1.0), 0.0)
        q = q.round_().clamp_(0, levels).to(torch.uint8).reshape(*rows.shape)[..., :length].reshape(-1)
        if self.bits == 4:
            q = torch.cat([q, q.new_zeros(q.numel() % 2)])
            q = q[0::2] | (q[1::2] << 4)
        q = torch.cat([q, q.new_zeros(q.numel() % 2)])  # the fp16 scales that follow start 2-byte aligned
        blob = torch.cat([q, scale.reshape(-1).view(torch.uint8), zero.reshape(-1).view(torch.uint8)])
        assert blob.numel() == self.nbytes(heads, n, dim, keys), "codec size mismatch"
        return blob

    def decode_into(self, blob: torch.Tensor, n: int, out: torch.Tensor, keys: bool, start: int = 0) -> None:
        """Dequantizes `blob`, the encoding of a ``[1, heads, n, dim]`` tensor, and writes its tokens
        ``[start, start + m)`` into `out` ``[1, heads, m, dim]`` (any float dtype)."""
        _, heads, m, dim = out.shape
        assert blob.numel() == self.nbytes(heads, n, dim, keys) and start + m <= n, "blob and shape disagree"
        length, group = (n, self.group) if keys else (dim, self._value_group(dim))
        rows = heads * (dim if keys else n)
        count = rows * length
        packed = _even(-(-count * self.bits // 8))
        groups = rows * -(-length // group)
        q = blob[:packed]
        if self.bits == 4:
            q = torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(-1)
        q = q[:count]
        scale = blob[packed : packed + 2 * groups].view(torch.float16).float().view(rows, -1, 1)
        zero = blob[packed + 2 * groups :].view(torch.float16).float().view(rows, -1, 1)
        q = q.view(rows, length).float()
        pad = (-length) % group
        if pad:
            q = torch.nn.functional.pad(q, (0, pad))
        x = q.view(rows, -1, group).mul_(scale).add_(zero).view(rows, -1)[:, :length]  # in place: q is a new tensor
        if keys:
            x = x.view(heads, dim, n)[:, :, start : start + m].transpose(1, 2)
        else:
            x = x.view(heads, n, dim)[:, start : start + m]
        out[0].copy_(x)


def serves(codec: KVCodec | None, stored: KVCodec | None) -> bool:
    """Whether a store using `codec` may serve KV stored with `stored`.

    Lossless KV is served by every store. A lossless store (`codec` None) serves nothing else: its reuse is
    exact or a miss. A lossy store serves lossy KV at least as accurate as its own: more bits, or the same
    bits in groups no larger. Anything else is a miss (recomputed), never a silent loss of accuracy.

    Example:
        >>> int8, int4 = KVCodec("int8", group=32), KVCodec("int4", group=32)
        >>> serves(int4, int8), serves(int8, int4), serves(None, int8), serves(None, None)
        (True, False, False, True)
    """
    if stored is None:
        return True
    if codec is None:
        return False
    return stored.bits > codec.bits or (stored.bits == codec.bits and stored.group <= codec.group)


def least_accurate(a: KVCodec | None, b: KVCodec | None) -> KVCodec | None:
    """The less accurate of two codecs (None: exact): the label of KV that mixes both.

    Example:
        >>> least_accurate(None, KVCodec("int8")).name
        'int8'
    """
    if a is None or b is None:
        return a if b is None else b
    return a if serves(a, b) else b


def _even(n: int) -> int:
    return n + n % 2
