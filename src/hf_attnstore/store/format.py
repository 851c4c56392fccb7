"""The shape of a session's KV: how many layers (KV slots), and the heads and head dim of keys and of values.

Most models cache keys and values of one shape, ``[1, kv_heads, n, head_dim]``: their geometry is the triple
``(layers, kv_heads, head_dim)``, as chunk files have always recorded it. Multi-head latent attention
(deepseek_v2/v3 and their kin) caches two tensors of different widths, a compressed latent and the rotary part
of the key: its geometry is ``(layers, key_heads, key_dim, value_heads, value_dim)``. The short form is kept
wherever the shapes agree, so files and fingerprints of the other models do not change.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
import numpy as np
import torch
import xxhash
from safetensors.torch import save as safetensors_save

from .codec import CodecRangeError, KVCodec


Geometry = tuple  # (layers, heads, dim) or (layers, key_heads, key_dim, value_heads, value_dim)


def make_geometry(layers: int, key_shape: tuple[int, int], value_shape: tuple[int, int]) -> Geometry:
    """The canonical geometry of `layers` slots with keys ``(heads, dim)`` `key_shape` and values `value_shape`.

    Example:
        >>> make_geometry(2, (4, 64), (4, 64)), make_geometry(2, (1, 576), (1, 512))
        ((2, 4, 64), (2, 1, 576, 1, 512))
    """
    key_shape, value_shape = tuple(int(x) for x in key_shape), tuple(int(x) for x in value_shape)
    if key_shape == value_shape:
        return (int(layers), *key_shape)
    return (int(layers), *key_shape, *value_shape)


def parse_geometry(values) -> Geometry:
    """A geometry from its recorded list (3 or 5 positive ints), canonical; ValueError otherwise.

    Example:
        >>> parse_geometry([2, 4, 64, 4, 64])
        (2, 4, 64)
    """
    g = tuple(int(x) for x in values)
    if len(g) not in (3, 5) or any(x <= 0 for x in g):
        raise ValueError(f"a KV geometry is 3 or 5 positive ints, got {list(values)!r}")
    return make_geometry(g[0], g[1:3], g[3:] if len(g) == 5 else g[1:3])


def shapes(geometry: Geometry) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """``(layers, (key_heads, key_dim), (value_heads, value_dim))`` of a geometry.

    Example:
        >>> shapes((2, 4, 64))
        (2, (4, 64), (4, 64))
    """
    layers, key_shape = geometry[0], tuple(geometry[1:3])
    return layers, key_shape, (tuple(geometry[3:5]) if len(geometry) == 5 else key_shape)


def shape_of(geometry: Geometry, keys: bool) -> tuple[int, int]:
    """``(heads, dim)`` of the keys (`keys`) or of the values.

    Example:
        >>> shape_of((2, 1, 576, 1, 512), keys=False)
        (1, 512)
    """
    _, key_shape, value_shape = shapes(geometry)
    return key_shape if keys else value_shape


def bytes_per_token(geometry: Geometry, itemsize: int) -> int:
    """Bytes of one token's keys and values over every layer, at `itemsize` bytes per element.

    Example:
        >>> bytes_per_token((2, 4, 64), itemsize=2)  # 2 layers x (keys + values) x 4 heads x 64 x 2 bytes
        2048
    """
    layers, (kh, kd), (vh, vd) = shapes(geometry)
    return layers * (kh * kd + vh * vd) * itemsize


FORMAT = "hf_attnstore/2"
MAX_HEADER_BYTES = 16 * 1024 * 1024
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "U8": torch.uint8}
KV_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)  # what keys and values may be
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class FormatError(ValueError):
    """A stored file is damaged, truncated, of another format, model or session.

    Example:
        >>> try:
        ...     Manifest.decode(b"not a manifest")
        ... except FormatError as error:  # damaged or foreign data: the store treats it as a miss
        ...     print(type(error).__name__, isinstance(error, ValueError))
        FormatError True
    """


def session_dirname(fingerprint: str, session_id: str) -> str:
    """The folder of a session: a hash, so hostile ids ('../x', NUL, 10 kB) never reach a path.

    Example:
        >>> name = session_dirname("model-a", "../../etc/passwd")
        >>> len(name), name.isalnum(), name == session_dirname("model-b", "../../etc/passwd")
        (40, True, False)
    """
    return hashlib.sha256(f"{fingerprint}\0{session_id}".encode("utf-8", "surrogatepass")).hexdigest()[:40]


def checksum(data) -> str:
    """The xxh64 hex digest of `data` (bytes or a memoryview): the checksum of every stored tensor and manifest.

    Example:
        >>> checksum(b"hello")
        '26c7827d889f6da3'
    """
    return xxhash.xxh64(data).hexdigest()


def prefix_hasher(fingerprint: str):
    """A running digest of a session's token ids, seeded with the model fingerprint (see `prefix_digest`).

    Example:
        >>> hasher = prefix_hasher("model-a")
        >>> hasher.update(tensor_bytes(torch.tensor([5, 6, 7])))
        >>> hasher.hexdigest() == prefix_digest("model-a", torch.tensor([5, 6, 7]))
        True
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(fingerprint.encode())
    return digest


def prefix_digest(fingerprint: str, token_ids: torch.Tensor) -> str:
    """The digest of the history ``token_ids`` (every id before a chunk) for this model.

    Example:
        >>> a = prefix_digest("model-a", torch.tensor([5, 6, 7]))
        >>> other_model = prefix_digest("model-b", torch.tensor([5, 6, 7]))
        >>> shorter = prefix_digest("model-a", torch.tensor([5, 6]))
        >>> len(a), a == other_model, a == shorter
        (32, False, False)
    """
    digest = prefix_hasher(fingerprint)
    digest.update(tensor_bytes(token_ids.to(torch.int64)))
    return digest.hexdigest()


def metadata_digest(meta: dict) -> str:
    """A chunk's digest: a hash of its whole metadata, which holds the checksum of every tensor.

    Example:
        >>> metadata_digest({"a": "1", "b": "2"}) == metadata_digest({"b": "2", "a": "1"})  # key order does not matter
        True
    """
    return hashlib.blake2b(json.dumps(meta, sort_keys=True).encode(), digest_size=16).hexdigest()


def layer_names(layer: int) -> tuple[str, str]:
    """The names of layer `layer`'s keys and values tensors in a chunk file.

    Example:
        >>> layer_names(3)
        ('L0003.k', 'L0003.v')
    """
    return f"L{layer:04d}.k", f"L{layer:04d}.v"


def chunk_payload_bytes(geometry, dtype: torch.dtype, n: int, codec: KVCodec | None) -> int:
    """The bytes of the tensors of a chunk of `n` tokens (:func:`encode_chunk`: ids, keys and values, encoded with
    `codec` if given), without its header. A save adds the header size it measured on its first chunk (the
    headers of one session's chunks differ only in digits) to bound what it writes before it writes it.

    Example:
        >>> chunk_payload_bytes((2, 4, 64), torch.float16, 16, None)  # 16 x 8 bytes of ids + 2 x (4 x 64) x 2 x 16 x 2
        32896
    """
    layers, (kh, kd), (vh, vd) = shapes(geometry)
    if codec is None:
        kv = layers * (kh * kd + vh * vd) * n * torch.tensor([], dtype=dtype).element_size()
    else:
        kv = layers * (codec.nbytes(kh, n, kd, True) + codec.nbytes(vh, n, vd, False))
    return 8 * n + kv


def manifest_bytes_bound(tokens: int, spans: int, session_id: str) -> int:
    """An upper bound of an encoded :class:`Manifest`'s bytes: the ids in base64, the spans, the session id escaped
    (twice: the body is JSON inside JSON).

    Example:
        >>> ids = torch.arange(100)
        >>> manifest = Manifest("model-a", "chat-1", ids, (Span("c0", 0, 100, "d" * 32),), next_chunk=1)
        >>> len(manifest.encode()) <= manifest_bytes_bound(100, 1, "chat-1")
        True
    """
    return 1024 + 4 * -(-8 * tokens // 3) + 192 * spans + 12 * len(session_id.encode("utf-8"))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor (bf16 viewed as int16: numpy lacks bf16).

    Example:
        >>> tensor_bytes(torch.tensor([1, 2], dtype=torch.int16)).hex()  # little-endian
        '01000200'
    """
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


@dataclass(frozen=True)
class ChunkMeta:
    """What a chunk file's header says, validated.

    Example:
        >>> ids, k, v = torch.tensor([5, 6, 7]), [torch.zeros(1, 2, 3, 4)], [torch.ones(1, 2, 3, 4)]
        >>> data, digest = encode_chunk("model-a", "chat-1", ids, k, v, prefix="", previous="")
        >>> meta = read_chunk_meta(lambda size, offset: data[offset : offset + size], len(data), "model-a", "chat-1")
        >>> meta.n_tokens, meta.geometry, meta.dtype, meta.codec, meta.digest == digest
        (3, (1, 2, 4), torch.float32, None, True)
    """

    fingerprint: str
    session_id: str
    n_tokens: int
    geometry: tuple  # (layers, kv_heads, head_dim), or with the values' own (heads, dim): geometry.py
    dtype: torch.dtype
    offsets: dict[str, tuple[int, int]]  # tensor name -> absolute [begin, end) in the file
    checksums: dict[str, str]
    prefix: str = ""  # digest of every token id before the chunk when it was computed
    previous: str = ""  # digest of the chunk before it ("" for the first)
    digest: str = ""  # this chunk's digest (pinned in the manifest)
    codec: KVCodec | None = None  # how keys and values are encoded; None = lossless, in `dtype`
    # Stored lossless (in `dtype`), but holding KV dequantized from this codec: as accurate as it, no more
    # (a lossy store's chunk its codec could not encode, rewritten over tokens it had loaded lossy).
    derived: KVCodec | None = None
    # Its tokens from this one on hold KV computed under sparse attention (`kv_budget`), or after such KV: never
    # reused by a cache that attends to the whole history. None: every token is exact.
    inexact_from: int | None = None
    # A sparse cold copy (`StoreConfig.sparse_copies`): per layer and KV head only `kept` of the chunk's tokens have
    # KV, at the chunk positions its "kept" tensor ``[layers, heads, kept]`` lists (read_kept). None: every token.
    kept: int | None = None

    @property
    def kv_tokens(self) -> int:
        """How many tokens each stored key and value tensor holds."""
        return self.n_tokens if self.kept is None else self.kept

    @property
    def accuracy(self) -> KVCodec | None:
        """The codec whose accuracy the chunk's KV has (None: exact): what `codec.serves` is asked about."""
        return self.codec if self.codec is not None else self.derived

    def decode_into(self, name: str, data: bytes, out: torch.Tensor, start: int, keep: dict | None = None) -> None:
        """Writes tokens ``[start, start + out.shape[2])`` of tensor `name`, whose verified bytes are `data`,
        into `out` ``[1, heads, m, dim]`` (dequantized when the chunk is lossy; then `keep`, if given, gets
        the blob under `name`).

        Example:
            >>> ids, keys = torch.tensor([5, 6, 7]), [torch.arange(24.0).view(1, 2, 3, 4)]
            >>> values = [torch.zeros(1, 2, 3, 4)]
            >>> data, _ = encode_chunk("model-a", "chat-1", ids, keys, values, prefix="", previous="")
            >>> pread = lambda size, offset: data[offset : offset + size]
            >>> meta = read_chunk_meta(pread, len(data), "model-a", "chat-1")
            >>> out = torch.empty(1, 2, 2, 4)
            >>> meta.decode_into("L0000.k", read_range(pread, *meta.offsets["L0000.k"], "L0000.k", meta), out, start=1)
            >>> torch.equal(out, keys[0][:, :, 1:])
            True
        """
        if self.codec is None:
            heads, dim = shape_of(self.geometry, name.endswith(".k"))
            out.copy_(bytes_to_tensor(data, self.dtype, [1, heads, self.kv_tokens, dim])[:, :, start : start + out.shape[2]])
        else:
            blob = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self.codec.decode_into(blob, self.kv_tokens, out, name.endswith(".k"), start)
            if keep is not None:
                keep[name] = blob


def encode_kv(keys: list[torch.Tensor], values: list[torch.Tensor], codec: KVCodec) -> tuple[list, list] | None:
    """The `codec` blobs of every layer's keys and values, or None when the codec cannot represent them
    (non-finite, out of fp16's range).

    Example:
        >>> from hf_attnstore.store.codec import KVCodec
        >>> kv = [torch.randn(1, 2, 32, 4)]
        >>> blobs = encode_kv(kv, kv, KVCodec("int8"))
        >>> [blob.dtype for blob in blobs[0]], encode_kv([torch.full((1, 2, 32, 4), float("nan"))], kv, KVCodec("int8"))
        ([torch.uint8], None)
    """
    try:
        return [codec.encode(k, keys=True) for k in keys], [codec.encode(v, keys=False) for v in values]
    except CodecRangeError:
        return None


def encode_chunk(fingerprint: str, session_id: str, ids: torch.Tensor, keys: list[torch.Tensor],
                 values: list[torch.Tensor], prefix: str, previous: str,
                 codec: KVCodec | None = None, blobs: tuple[list, list] | None = None,
                 derived: KVCodec | None = None, inexact_from: int | None = None,
                 kept: torch.Tensor | None = None) -> tuple[bytes, str]:
    """Serializes one chunk to safetensors bytes; returns them and the chunk's digest.

    With a `codec`, keys and values are quantized (codec.py; `blobs`: their encoding by :func:`encode_kv`, when
    the caller has it already); KV the codec cannot represent (non-finite, out of fp16's range) is written
    lossless instead, and the chunk says which it is. `derived`: some of the KV was dequantized from that
    codec (loaded from a lossy copy): a chunk then written lossless says so, so that no store that asks for
    exact KV ever serves it (a label must be true of every token it covers). `inexact_from`: the chunk's tokens
    from this one on were computed under sparse attention (buffer.Segment.inexact_from). `kept`: a sparse cold copy,
    ``[layers, heads, m]`` ascending chunk positions whose KV `keys` and `values` ``[1, heads, m, dim]`` hold (the
    chunk has ``len(ids)`` tokens; the others have none, so it must be labelled inexact from the first of them).

    Example:
        >>> ids, k, v = torch.tensor([5, 6, 7]), [torch.zeros(1, 2, 3, 4)], [torch.ones(1, 2, 3, 4)]
        >>> data, digest = encode_chunk("model-a", "chat-1", ids, k, v, prefix=prefix_digest("model-a", ids[:0]),
        ...                             previous="")
        >>> chunk_digest(data) == digest, len(digest)
        (True, 32)
    """
    tensors = {"ids": ids.detach().to("cpu", torch.int64).contiguous()}
    if codec is not None and blobs is None:
        blobs = encode_kv(keys, values, codec)
        codec = codec if blobs is not None else None
    for layer, (k, v) in enumerate(zip(keys, values)):
        kn, vn = layer_names(layer)
        if codec is None:
            tensors[kn], tensors[vn] = k.detach().contiguous().cpu(), v.detach().contiguous().cpu()
        else:
            tensors[kn], tensors[vn] = blobs[0][layer], blobs[1][layer]
    n = int(ids.numel())
    if kept is not None:
        tensors["kept"] = kept.detach().to("cpu", torch.int64).contiguous()
    geometry = make_geometry(len(keys), (keys[0].shape[1], keys[0].shape[3]), (values[0].shape[1], values[0].shape[3]))
    meta = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "session_id": session_id,
        "n_tokens": str(n),
        "geometry": json.dumps(list(geometry)),
        "dtype": _DTYPE_NAMES[keys[0].dtype],
        "checksums": json.dumps({name: checksum(tensor_bytes(t)) for name, t in tensors.items()}),
        "prefix": prefix,
        "previous": previous,
    }
    if codec is not None:
        meta["codec"] = codec.describe()
    elif derived is not None:
        meta["derived"] = derived.describe()
    if inexact_from is not None:  # absent otherwise: chunks of dense turns are what they always were
        meta["inexact_from"] = str(inexact_from)
    if kept is not None:
        meta["kept"] = str(kept.shape[-1])
    return safetensors_save(tensors, metadata=meta), metadata_digest(meta)


def file_reader(fd: int) -> Callable[[int, int], bytes]:
    """``pread(size, offset)`` of a file descriptor (what :func:`read_chunk_meta` and :func:`read_range` take).

    Example:
        >>> import os, tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     _ = f.write(b"0123456789"); f.flush()
        ...     file_reader(f.fileno())(4, 3)  # 4 bytes from offset 3
        b'3456'
    """
    return lambda size, offset: os.pread(fd, size, offset)


def read_chunk_meta(pread: Callable[[int, int], bytes], file_size: int, fingerprint: str,
                    session_id: str) -> ChunkMeta:
    """Reads and validates a chunk's header through ``pread(size, offset)`` (a file, a remote value).

    Raises:
        FormatError: On any doubt.

    Example:
        >>> ids, k, v = torch.tensor([5, 6, 7]), [torch.zeros(1, 2, 3, 4)], [torch.ones(1, 2, 3, 4)]
        >>> data, _ = encode_chunk("model-a", "chat-1", ids, k, v, prefix="", previous="")
        >>> pread = lambda size, offset: data[offset : offset + size]
        >>> read_chunk_meta(pread, len(data), "model-a", "chat-1").n_tokens
        3
        >>> read_chunk_meta(pread, len(data), "model-a", "chat-2")  # another session's chunk
        Traceback (most recent call last):
        ...
        hf_attnstore.store.format.FormatError: ...
    """
    if file_size < 8:
        raise FormatError("file too short for a safetensors header")
    raw = pread(8, 0)
    if len(raw) != 8:
        raise FormatError("short read of the header length")
    (header_len,) = struct.unpack("<Q", raw)
    if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
        raise FormatError("header length out of range")
    raw = pread(header_len, 8)
    if len(raw) != header_len:
        raise FormatError("short read of the header")
    try:
        header = json.loads(raw)
        meta = header.pop("__metadata__")
        if meta.get("format") != FORMAT:
            raise FormatError(f"format {meta.get('format')!r} is not {FORMAT!r}")
        if meta.get("fingerprint") != fingerprint:
            raise FormatError("chunk of another model")
        if meta.get("session_id") != session_id:
            raise FormatError("chunk of another session")
        n = int(meta["n_tokens"])
        geometry = parse_geometry(json.loads(meta["geometry"]))
        dtype = _DTYPES[meta["dtype"]]
        if dtype not in KV_DTYPES:
            raise FormatError(f"keys and values of dtype {meta['dtype']!r}")
        codec = KVCodec.parse(meta["codec"]) if "codec" in meta else None
        derived = KVCodec.parse(meta["derived"]) if "derived" in meta else None
        inexact_from = int(meta["inexact_from"]) if "inexact_from" in meta else None
        if inexact_from is not None and not 0 <= inexact_from < n:
            raise FormatError(f"inexact_from {inexact_from} out of range for a chunk of {n} tokens")
        kept = int(meta["kept"]) if "kept" in meta else None
        if kept is not None and not (1 <= kept < n and inexact_from is not None):
            raise FormatError(f"a sparse chunk of {n} tokens keeps {kept} and must be labelled inexact")
        sums = json.loads(meta["checksums"])
        prefix, previous = str(meta["prefix"]), str(meta["previous"])
        digest = metadata_digest(meta)
    except FormatError:
        raise
    except Exception as exc:  # any malformed field: the header is damaged
        raise FormatError(f"unreadable header: {exc}") from exc
    try:
        offsets = _validate_layout(header, sums, n, geometry, dtype, codec, 8 + header_len, file_size, kept)
    except FormatError:
        raise
    except Exception as exc:  # a damaged field of any type
        raise FormatError(f"unreadable header: {exc}") from exc
    return ChunkMeta(fingerprint, session_id, n, geometry, dtype, offsets, sums, prefix, previous, digest, codec,
                     derived, inexact_from, kept)


def _validate_layout(header: dict, sums: dict, n: int, geometry: tuple, dtype: torch.dtype, codec: KVCodec | None,
                     data_start: int, file_size: int, kept: int | None = None) -> dict[str, tuple[int, int]]:
    """Checks names, dtypes, shapes and offsets of every tensor; returns absolute byte ranges."""
    expected = {"ids": ("I64", [n])}
    if kept is not None:
        heads = shape_of(geometry, True)[0]
        if shape_of(geometry, False)[0] != heads:
            raise FormatError("a sparse chunk needs as many value heads as key heads")
        expected["kept"] = ("I64", [geometry[0], heads, kept])
        n = kept  # the tokens each key and value tensor holds
    for layer in range(geometry[0]):
        for name, is_key in zip(layer_names(layer), (True, False)):
            heads, dim = shape_of(geometry, is_key)
            if codec is None:
                expected[name] = (_DTYPE_NAMES[dtype], [1, heads, n, dim])
            else:
                expected[name] = ("U8", [codec.nbytes(heads, n, dim, is_key)])
    if set(header) != set(expected) or set(sums) != set(expected):
        raise FormatError("unexpected tensor names")
    offsets, spans = {}, []
    for name, (dtype_name, shape) in expected.items():
        info = header[name]
        if info.get("dtype") != dtype_name or info.get("shape") != shape:
            raise FormatError(f"tensor {name} has the wrong dtype or shape")
        begin, end = info["data_offsets"]
        size = int(np.prod(shape)) * torch.tensor([], dtype=_DTYPES[dtype_name]).element_size()
        if end - begin != size:
            raise FormatError(f"tensor {name} has the wrong byte size")
        offsets[name] = (data_start + begin, data_start + end)
        spans.append((begin, end))
    spans.sort()
    if spans[0][0] != 0 or any(a[1] != b[0] for a, b in zip(spans, spans[1:])) or data_start + spans[-1][1] != file_size:
        raise FormatError("tensor data is not contiguous or the file is truncated")
    return offsets


def chunk_digest(data: bytes) -> str:
    """The digest of an encoded chunk (what :func:`encode_chunk` returned for it), from its header.

    Raises:
        FormatError: The bytes are not a chunk of this format.

    Example:
        >>> ids, k, v = torch.tensor([5, 6, 7]), [torch.zeros(1, 2, 3, 4)], [torch.ones(1, 2, 3, 4)]
        >>> data, digest = encode_chunk("model-a", "chat-1", ids, k, v, prefix="", previous="")
        >>> chunk_digest(data) == digest
        True
    """
    try:
        (header_len,) = struct.unpack("<Q", data[:8])
        if header_len > MAX_HEADER_BYTES:
            raise FormatError("header length out of range")
        meta = json.loads(bytes(data[8 : 8 + header_len]))["__metadata__"]
        if meta.get("format") != FORMAT:
            raise FormatError(f"format {meta.get('format')!r} is not {FORMAT!r}")
        return metadata_digest(meta)
    except FormatError:
        raise
    except Exception as exc:
        raise FormatError(f"unreadable header: {exc}") from exc


def read_kept(pread: Callable[[int, int], bytes], meta: ChunkMeta) -> torch.Tensor:
    """A sparse chunk's kept positions ``[layers, heads, kept]`` (checksum verified, strictly ascending within the
    chunk). Raises FormatError on any doubt.

    Example:
        >>> # a sparse cold copy: each head keeps 2 of the chunk's 4 tokens
        >>> k, v = [torch.zeros(1, 2, 2, 4)], [torch.ones(1, 2, 2, 4)]
        >>> kept = torch.tensor([[[0, 3], [1, 2]]])  # [layers, heads, kept]
        >>> data, _ = encode_chunk("model-a", "chat-1", torch.arange(4), k, v, prefix="", previous="", inexact_from=1,
        ...                        kept=kept)
        >>> pread = lambda size, offset: data[offset : offset + size]
        >>> read_kept(pread, read_chunk_meta(pread, len(data), "model-a", "chat-1")).tolist()
        [[[0, 3], [1, 2]]]
    """
    begin, end = meta.offsets["kept"]
    shape = [meta.geometry[0], shape_of(meta.geometry, True)[0], meta.kept]
    kept = bytes_to_tensor(read_range(pread, begin, end, "kept", meta), torch.int64, shape)
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= meta.n_tokens
                         or not bool((kept[..., 1:] > kept[..., :-1]).all())):
        raise FormatError("a sparse chunk's kept positions are out of range or not ascending")
    return kept


def read_range(pread: Callable[[int, int], bytes], begin: int, end: int, name: str, meta: ChunkMeta) -> bytes:
    """Reads one tensor's bytes through ``pread(size, offset)`` and verifies its checksum.

    Example:
        >>> ids, k, v = torch.tensor([5, 6, 7]), [torch.zeros(1, 2, 3, 4)], [torch.ones(1, 2, 3, 4)]
        >>> data, _ = encode_chunk("model-a", "chat-1", ids, k, v, prefix="", previous="")
        >>> pread = lambda size, offset: data[offset : offset + size]
        >>> meta = read_chunk_meta(pread, len(data), "model-a", "chat-1")
        >>> bytes_to_tensor(read_range(pread, *meta.offsets["ids"], "ids", meta), torch.int64, [3]).tolist()
        [5, 6, 7]
    """
    return verified(pread(end - begin, begin), name, meta)


def verified(data: bytes, name: str, meta: ChunkMeta) -> bytes:
    """`data` if it is all of tensor `name`'s bytes with the checksum the header records; else FormatError.

    Example:
        >>> ids, k, v = torch.tensor([5, 6, 7]), [torch.zeros(1, 2, 3, 4)], [torch.ones(1, 2, 3, 4)]
        >>> data, _ = encode_chunk("model-a", "chat-1", ids, k, v, prefix="", previous="")
        >>> meta = read_chunk_meta(lambda size, offset: data[offset : offset + size], len(data), "model-a", "chat-1")
        >>> verified(bytes(tensor_bytes(torch.tensor([5, 6, 8]))), "ids", meta)  # one id changed
        Traceback (most recent call last):
        ...
        hf_attnstore.store.format.FormatError: checksum mismatch in ids
    """
    begin, end = meta.offsets[name]
    if len(data) != end - begin:
        raise FormatError(f"short read of {name}: the file or value is truncated")
    if checksum(data) != meta.checksums[name]:
        raise FormatError(f"checksum mismatch in {name}")
    return data


def bytes_to_tensor(data: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A tensor of `dtype` and `shape` over a copy of raw little-endian `data` (the inverse of :func:`tensor_bytes`).

    Example:
        >>> t = torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16)
        >>> torch.equal(bytes_to_tensor(bytes(tensor_bytes(t)), torch.bfloat16, [1, 2]), t)
        True
    """
    if dtype == torch.bfloat16:
        return torch.frombuffer(bytearray(data), dtype=torch.int16).view(torch.bfloat16).view(*shape)
    return torch.frombuffer(bytearray(data), dtype=dtype).view(*shape)


# -- manifest -------------------------------------------------------------------------------------------
STATE_PREFIX = "s-"  # state files (state.py) are named "s-<digest>"; chunk files never start so


@dataclass(frozen=True)
class StateRef:
    """A manifest's hybrid-model state (state.py): file `name` (without its suffix), which summarizes the
    session's first `tokens` tokens and whose metadata digest must be `digest`.

    Example:
        >>> ref = StateRef("s-0a1b", tokens=12, digest="d" * 32)
        >>> StateRef.decode(ref.encode()) == ref
        True
    """

    name: str
    tokens: int
    digest: str

    def encode(self) -> list:
        return [self.name, self.tokens, self.digest]

    @classmethod
    def decode(cls, raw) -> "StateRef":
        name, tokens, digest = raw
        if not isinstance(name, str) or not name.startswith(STATE_PREFIX) or not name[len(STATE_PREFIX):].isalnum():
            raise FormatError("malformed state reference")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
            raise FormatError("malformed state reference")
        return cls(name, tokens, str(digest))


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, end)`` of chunk file ``chunk``, whose digest must be ``digest``.

    ``rebased``: the span was kept by a truncation that dropped tokens before it, so its KV was computed
    after another history than the manifest's (decoupled truncation); its `prefix` is not checked against
    the manifest's ids, only its pinned digest.

    ``owner``: the session that wrote the chunk, when it is not the manifest's own (prefix sharing: the file
    is a hard link to a chunk of another session that begins with the same tokens, so its header names that
    session). Empty: the manifest's session. Readers check the header against it.

    Example:
        >>> span = Span("c3", start=16, end=48, digest="d" * 32)
        >>> span.length, span.rebased, span.owner
        (32, False, '')
    """

    chunk: str
    start: int
    end: int
    digest: str = ""
    rebased: bool = False
    owner: str = ""

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Manifest:
    """A session's durable state: its token ids and where their KV lies, in order.

    ``dropped``: the leading spans whose chunk files partial eviction deleted (their digests are kept for the
    chain). Their tokens, the session's *head*, have ids but no stored KV: a turn that resumes the session
    recomputes them (exactly: under causal attention the first tokens' KV does not depend on later ones) and
    loads ``spans``, which cover the tokens after the head.

    Example:
        >>> spans = (Span("c0", 0, 4, "a" * 32), Span("c1", 0, 2, "b" * 32))
        >>> manifest = Manifest("model-a", "chat-1", torch.arange(6), spans, next_chunk=2)
        >>> again = Manifest.decode(manifest.encode(), fingerprint="model-a")
        >>> again.length, again.token_ids.tolist(), again.spans == spans
        (6, [0, 1, 2, 3, 4, 5], True)
    """

    fingerprint: str
    session_id: str
    token_ids: torch.Tensor  # [length] int64
    spans: tuple[Span, ...]
    next_chunk: int  # chunk names are never reused, even after a restart
    dropped: tuple[Span, ...] = ()
    state: StateRef | None = None  # a hybrid model's states after the first `state.tokens` tokens (state.py)
    # Leading tokens whose KV is exact; the rest was computed under sparse attention (`kv_budget`), or after such
    # KV, and its chunks say so (`ChunkMeta.inexact_from`). None: every token (what manifests always said).
    exact: int | None = None

    @property
    def exact_tokens(self) -> int:
        """How many leading tokens a cache that attends to the whole history may reuse."""
        return self.length if self.exact is None else self.exact

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())

    @property
    def head(self) -> int:
        """Leading tokens without stored KV (partially evicted)."""
        return sum(s.length for s in self.dropped)

    def drop_head_span(self) -> "Manifest":
        """The manifest after partial eviction of its first stored span (its chunk's file can then go).

        Example:
            >>> spans = (Span("c0", 0, 4, "a" * 32), Span("c1", 0, 2, "b" * 32))
            >>> manifest = Manifest("model-a", "chat-1", torch.arange(6), spans, next_chunk=2).drop_head_span()
            >>> manifest.head, manifest.length, [s.chunk for s in manifest.spans]  # tokens 0-3: ids, no KV
            (4, 6, ['c1'])
        """
        assert self.spans, "nothing left to drop"
        return Manifest(self.fingerprint, self.session_id, self.token_ids, self.spans[1:], self.next_chunk,
                        self.dropped + self.spans[:1], self.state, self.exact)

    def select(self, ranges: list[tuple[int, int]]) -> "Manifest":
        """The manifest of the logical token ranges `ranges` (in order), without touching any data.

        Tokens of the dropped head stay dropped; they can only lead (a head is recomputed from the start), so
        a selection that keeps stored tokens and then head tokens again stops before the latter: a shorter
        durable prefix, whose remainder the store writes again from host memory.

        Example:
            >>> spans = (Span("c0", 0, 4, "a" * 32), Span("c1", 0, 2, "b" * 32))
            >>> manifest = Manifest("model-a", "chat-1", torch.arange(6), spans, next_chunk=2)
            >>> kept = manifest.select([(0, 2), (4, 6)])  # drops tokens 2 and 3
            >>> kept.token_ids.tolist(), [(s.chunk, s.start, s.end, s.rebased) for s in kept.spans]
            ([0, 1, 4, 5], [('c0', 0, 2, False), ('c1', 0, 2, True)])
        """
        spans, dropped, ids, pos = [], [], [], 0
        bounds = []
        for span in self.dropped + self.spans:
            bounds.append((pos, pos + span.length, span))
            pos += span.length
        head = self.head
        kept = 0  # tokens kept before the first dropped one: spans after a gap are rebased
        for a, b in ranges:
            if a != kept:
                break
            kept = b
        for a, b in ranges:
            for lo, hi, span in bounds:
                x, y = max(a, lo), min(b, hi)
                if x < y:
                    piece = Span(span.chunk, span.start + x - lo, span.start + y - lo, span.digest,
                                 span.rebased or x > kept, span.owner)
                    if lo < head and spans:
                        break  # head tokens after stored ones: the selection ends here
                    (dropped if lo < head else spans).append(piece)
                    ids.append(self.token_ids[x:y])
            else:
                continue
            break
        token_ids = torch.cat(ids) if ids else torch.empty(0, dtype=torch.long)
        assert sum(s.length for s in spans + dropped) == token_ids.numel(), "spans must cover the selected tokens"
        # A state summarizes exactly its first tokens: it stays only if they are kept, in place.
        state = self.state if self.state is not None and ranges and ranges[0][0] == 0 \
            and ranges[0][1] >= self.state.tokens else None
        # The selected tokens before the first inexact one stay exact; every token after it stays inexact.
        exact = None
        if self.exact is not None:
            exact = min(token_ids.numel(), sum(max(0, min(b, self.exact) - a) for a, b in ranges))
        return Manifest(self.fingerprint, self.session_id, token_ids, tuple(spans), self.next_chunk, tuple(dropped),
                        state, exact if exact is not None and exact < token_ids.numel() else None)

    def encode(self) -> bytes:
        """The manifest as checksummed JSON bytes (what :meth:`decode` reads).

        Example:
            >>> manifest = Manifest("model-a", "chat-1", torch.arange(3), (Span("c0", 0, 3, "a" * 32),), next_chunk=1)
            >>> Manifest.decode(manifest.encode()).token_ids.tolist()
            [0, 1, 2]
        """
        body = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "session_id": self.session_id,
            "token_ids": base64.b64encode(bytes(tensor_bytes(self.token_ids.to(torch.int64)))).decode(),
            "spans": [_span_fields(s) for s in self.spans],
            "next_chunk": self.next_chunk,
        }
        if self.dropped:  # absent otherwise: a store without partial eviction writes what it always wrote
            body["dropped"] = [_span_fields(s) for s in self.dropped]
        if self.state is not None:  # only hybrid models' sessions have one
            body["state"] = self.state.encode()
        if self.exact is not None:  # only sessions kept sparse have inexact tokens
            body["exact"] = self.exact
        text = json.dumps(body, sort_keys=True)
        return json.dumps({"body": text, "xxh64": checksum(text.encode())}).encode()

    @classmethod
    def decode(cls, data: bytes, fingerprint: str | None = None) -> "Manifest":
        """Parses and validates a manifest. Raises FormatError on any doubt.

        Example:
            >>> manifest = Manifest("model-a", "chat-1", torch.arange(3), (Span("c0", 0, 3, "a" * 32),), next_chunk=1)
            >>> Manifest.decode(manifest.encode(), fingerprint="model-b")
            Traceback (most recent call last):
            ...
            hf_attnstore.store.format.FormatError: manifest of another model
        """
        try:
            outer = json.loads(data)
            text = outer["body"]
            if checksum(text.encode()) != outer["xxh64"]:
                raise FormatError("manifest checksum mismatch")
            body = json.loads(text)
            if body["format"] != FORMAT:
                raise FormatError(f"manifest format {body['format']!r} is not {FORMAT!r}")
            raw = base64.b64decode(body["token_ids"], validate=True)
            ids = torch.frombuffer(bytearray(raw), dtype=torch.int64).clone() if raw else torch.empty(0, dtype=torch.long)
            spans, dropped = (tuple(_span(fields) for fields in body.get(k, ())) for k in ("spans", "dropped"))
            state = StateRef.decode(body["state"]) if "state" in body else None
            exact = body.get("exact")
            if exact is not None and (isinstance(exact, bool) or not isinstance(exact, int)):
                raise FormatError(f"manifest field `exact` must be an integer, got {exact!r}")
            manifest = cls(str(body["fingerprint"]), str(body["session_id"]), ids, spans, int(body["next_chunk"]),
                           dropped, state, exact)
        except FormatError:
            raise
        except Exception as exc:
            raise FormatError(f"unreadable manifest: {exc}") from exc
        if fingerprint is not None and manifest.fingerprint != fingerprint:
            raise FormatError("manifest of another model")
        every = spans + dropped
        if any(s.start < 0 or s.end <= s.start for s in every) or sum(s.length for s in every) != manifest.length:
            raise FormatError("manifest spans do not cover its tokens")
        if manifest.state is not None and manifest.state.tokens > manifest.length:
            raise FormatError("the manifest's state covers more tokens than the manifest")
        if manifest.exact is not None and not 0 <= manifest.exact < manifest.length:
            raise FormatError("the manifest's exact prefix is out of range")
        return manifest


def _span_fields(s: Span) -> list:
    # The owner only where there is one: manifests of unshared sessions are what they always were.
    fields = [s.chunk, s.start, s.end, s.digest, s.rebased]
    return fields + [s.owner] if s.owner else fields


def _span(fields: list) -> Span:
    if len(fields) not in (5, 6):
        raise FormatError(f"a span has {len(fields)} fields")
    c, a, b, d, r, *owner = fields
    if owner and not (isinstance(owner[0], str) and owner[0]):
        raise FormatError("a span's owner must be a non-empty session id")
    return Span(str(c), int(a), int(b), str(d), bool(r), owner[0] if owner else "")


def check_chain(manifest: Manifest, metas: list[ChunkMeta]) -> None:
    """Checks that the chunks of the stored spans are exactly the ones the manifest pinned, each in its own
    history (a dropped head is checked through its pinned digests: the first stored chunk must follow it).

    Raises:
        FormatError: A chunk is not the pinned one, or was computed after other tokens than the manifest's.

    Example:
        >>> ids, k, v = torch.tensor([5, 6, 7]), [torch.zeros(1, 2, 3, 4)], [torch.ones(1, 2, 3, 4)]
        >>> data, digest = encode_chunk("model-a", "chat-1", ids, k, v, prefix=prefix_digest("model-a", ids[:0]),
        ...                             previous="")
        >>> meta = read_chunk_meta(lambda size, offset: data[offset : offset + size], len(data), "model-a", "chat-1")
        >>> manifest = Manifest("model-a", "chat-1", ids, (Span("c0", 0, 3, digest),), next_chunk=1)
        >>> check_chain(manifest, [meta])  # the pinned chunk, in its own history: no error
        >>> check_chain(Manifest("model-a", "chat-1", ids, (Span("c0", 0, 3, "0" * 32),), 1), [meta])
        Traceback (most recent call last):
        ...
        hf_attnstore.store.format.FormatError: chunk c0 is not the one the manifest pinned (replaced or rewritten)
    """
    hasher, pos = prefix_hasher(manifest.fingerprint), manifest.head
    hasher.update(tensor_bytes(manifest.token_ids[:pos].to(torch.int64)))
    previous = manifest.dropped[-1].digest if manifest.dropped else ""
    for span, meta in zip(manifest.spans, metas, strict=True):
        if meta.digest != span.digest:
            raise FormatError(f"chunk {span.chunk} is not the one the manifest pinned (replaced or rewritten)")
        if not span.rebased and (meta.prefix != hasher.copy().hexdigest() or meta.previous != previous):
            raise FormatError(f"chunk {span.chunk} was computed after another history")
        hasher.update(tensor_bytes(manifest.token_ids[pos : pos + span.length].to(torch.int64)))
        pos += span.length
        previous = span.digest
