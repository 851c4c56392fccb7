"""Typed settings of an AttnStore: the everyday options, the tuning knobs (`StoreTuning`), the flat
`StoreConfig` the store's modules read, and byte sizes given as numbers or strings ("4GiB"): one parser
for every size the store and the CLI take."""

from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass, fields, replace

import torch

from .codec import KVCodec
from .policy import make_policy

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(value: int | float | str, name: str = "size") -> int:
    """Parses a byte size such as ``4096``, ``"512MiB"`` or ``"2GB"``.

    Args:
        value: An integer number of bytes or a string with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB).
        name: The argument name, used in error messages.

    Returns:
        The size in bytes.

    Example:
        >>> parse_bytes("2GiB")
        2147483648
    """
    if isinstance(value, bool):
        raise TypeError(f"`{name}` must be a byte count or a string like '2GiB', got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite byte count, got {value!r}")
    if isinstance(value, (int, float)):
        size = int(value)
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"`{name}`={value!r} is not a byte size: use a number of bytes or a string like '512MiB' or '2GB'"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise TypeError(f"`{name}` must be a byte count or a string like '2GiB', got {type(value).__name__}")
    if size <= 0:
        raise ValueError(f"`{name}` must be positive, got {value!r}")
    return size


@dataclass(frozen=True)
class StoreConfig:
    """Settings of an :class:`~hf_attnstore.AttnStore`.

    Args:
        host_bytes: Limit of the host (CPU memory) tier: a byte count or a string like ``"8GiB"``. Appends
            and prefetches never exceed it: an append that finds no room (every other session pinned by a
            running turn or a load, or unwritable) is not stored, and what the session already has stays a
            valid prefix. One exception: the disk load a running turn waits for may exceed it by that one
            session while the sessions it displaces are still being written out.
        disk_dir: Folder of the disk tier; ``None`` = no disk tier (sessions evicted from host are dropped).
            One store at a time owns a folder (an exclusive lock on ``disk_dir/LOCK``).
        disk_bytes: Hard limit of the disk tier's files: chunks, manifests, temporary files and chunks not
            yet collected, each rounded up to 4 KiB blocks. Room is made before each file is written, so the
            folder never holds more.
        ttl_s: Sessions not used for this many seconds are deleted; ``None`` = never.
        policy: Eviction policy of both tiers: ``"lru"``, ``"fifo"`` or ``"lookahead"`` (scheduler-aware: fed
            the job queue by :meth:`AttnStore.set_schedule`, e.g. by the ChatPipeline).
        chunk_tokens: Tokens per chunk file. Appending writes new chunks only (and rewrites at most the
            last, partial chunk); truncation rewrites only the manifest.
        read_buffer_layers: How far the disk loader may run ahead of the model (the paper's S_buf): while
            the model computes layer ``i``, layers up to ``i + 1 + read_buffer_layers`` may be loaded
            (before the first layer is asked for, up to ``read_buffer_layers``). ``None`` = no limit. A load
            held back by it lets other loads run meanwhile.
        preload: ``True``: layer-wise pre-loading (compute of layer i waits for layer i only). ``False``:
            a resumed session waits for all its layers before computing (the paper's NO-PL). ``None``
            (default): layer-wise when the model runs on CUDA, where loads are DMA copies; whole-session
            on CPU, where the loader thread competes with the model's threads for the same cores and was
            measured slower (docs/benchmarks.md).
        idle_flush_s: A session whose last write is this old is persisted to disk (its turn has ended).
        save_while_computing: Write a session whose turn has ended (no write for `idle_flush_s`) behind at once,
            even while model forwards run. Default ``False``: such writes wait for a quiet gap, so saving does not
            slow a turn computing on the same cores. Replicas sharing a remote tier want ``True`` (``attnstore
            serve --remote`` sets it with the shared serving state): a conversation's next turn may come to another
            replica, which finds only what was written, and a replica that is never quiet never writes.
        pin_memory: Page-lock host buffers (async GPU copies). ``None`` = when CUDA is available.
        fsync: Make disk writes durable. Only tests and benchmarks of the page cache turn it off.
        io_timeout_s: Longest wait for one layer of a load, and for `flush`.
        reopen_in_background: How a store reopens a `disk_dir` that holds sessions. ``False`` (default): the
            constructor indexes every one before it returns (measured on this project's VM: 1,580-1,850 sessions a
            second from the page cache, 650-800 from a cold disk). ``True``: it returns at once and a thread
            indexes them while the store serves; a call that names a session with its model (`find`, `lookup`,
            `open_turn`, ...) indexes that one first, so a resumed session is never missed, but a shared prefix
            held only by sessions not indexed yet is (recomputed), and `sessions`, `stats` and the disk limit
            count what is indexed so far (`reopening`, `wait_reopened`). ``attnstore serve`` sets it: with
            100,000 sessions held its first turn was planned 11 ms after start-up (docs/benchmarks.md, "Scale").
        remote: URL of the shared remote tier (Redis or Valkey): ``redis://[[user]:password@]host:port/db``,
            ``rediss://`` (TLS) or ``unix:///path.sock?db=0``. Sessions are copied there after the disk tier
            (write-behind), or saved there directly when there is no `disk_dir`, and a session missing here, or
            longer there (another server extended it), is loaded from it layer by layer. ``None`` = no
            remote tier.
        remote_required: Whether the store fails to open when the remote tier cannot be reached
            (``RemoteUnavailableError``: fail fast). ``False`` (default): it opens with the tier marked down
            (`stats().remote_down` 1, every remote lookup a miss, nothing copied there; without `disk_dir`,
            `flush` raises `StoreIOError`) and connects in the background, every few seconds, until it is up.
            A cache is an accelerator: a server starts while its cache is down. Refused credentials and a
            malformed URL raise either way (a configuration error, not an outage).
        remote_ttl_s: Expiry of everything written to the remote tier; ``None`` = until Redis evicts it.
        remote_timeout_s: Socket timeout of each remote call. After a failure the remote tier is skipped
            (a miss) for a few seconds, so a dead server never slows every turn.
        kv_codec: How the copies of a session between turns store keys and values: ``None`` (default,
            lossless: reuse is exact or a miss), ``"int8"`` or ``"int4"`` (asymmetric integers; keys per channel
            before RoPE, values per token; see :mod:`hf_attnstore.store.codec`). The disk and remote copies are
            encoded, and the host copy of every whole chunk written (see `kv_codec_host`); the running turn
            and a session's trailing partial chunk stay at the model's precision. A lossy codec needs a disk
            or remote tier (the save thread encodes). Each chunk records its codec: a store serves stored KV
            only when it is lossless or at least as accurate as its own codec (others are a miss), so a
            lossless store never serves lossy KV. Measured fidelity: docs/evaluation.md.
        kv_codec_group: Values per scale and zero point of a lossy codec (tokens per key group, channels per
            value group); even, at most 4096.
        kv_codec_host: With a lossy `kv_codec`, whether host memory keeps a session's written chunks
            encoded too (default ``True``: the blobs the save thread wrote replace the full-precision tokens
            once the turn has ended, and are dequantized on the device that computes with them, see
            :mod:`hf_attnstore.store.buffer`). ``False``: host copies stay at the model's precision, and a
            session resumed from host memory is exact; only a load from disk or the remote tier is lossy.
        sparse_copies: Sparse cold copies (ALISA): the disk and remote copies of a session kept sparse by its
            caches (``kv_budget``, a policy that ranks by importance) hold, of each whole chunk, only the tokens the
            session's next turn would keep, per layer and KV head (the selection its turn stored with it), padded
            to one count per chunk with each head's next most important tokens. Lossy, like a codec, and
            combinable with one: each chunk records what it keeps, only a store with this option serves such a
            chunk (any other: a miss), and only to a sparse cache; a dense cache reuses the tokens before its
            first missing one (the chunk is labelled inexact from there) and recomputes the rest. A sparse turn
            resumed from it that extends the stored session keeps what it would keep from the whole copy (a
            regenerated or edited turn may differ). ``False`` (default): every token.
        partial_eviction: When the disk tier is full, cold sessions lose their leading chunks first, the
            rest staying (Pensieve): chunks go in order of retention value, recompute cost ÷ time since the
            session's last use (:func:`~hf_attnstore.store.policy.choose_head_drops`), so an idle
            session's head goes before a busy session's, and a session is gone only when its last chunk is.
            A turn resuming such a session recomputes the dropped head, exactly, while the rest loads.
            Sessions the scheduler queued (``policy="lookahead"``) are not shrunk. ``False`` (default):
            whole sessions leave, in the policy's order.
        recompute_by_cost: Load or recompute, by measured cost (ALISA's third phase, Pensieve's partial hits).
            When a turn resumes a session from the disk or remote tier, the store estimates how long loading
            its chunks takes (the tier's measured read rate) and how long recomputing leading chunks takes
            (the model's measured prefill rate), and the turn recomputes the leading chunks that are cheaper
            to recompute, in one forward while the rest loads: exact, as a partially evicted head is (with a
            lossy `kv_codec`, more accurate than the dequantized chunks it replaces). At least
            the last chunk is loaded, and loading everything is the choice until both rates have been measured
            (after one load from the tier and one prefill of 32 tokens or more) or when recomputing is not
            estimated 5% faster. The decisions and their inputs are in `stats()` (``resume_*``). ``False``
            (default): a stored session is always loaded, which keeps which path a turn takes independent of
            timings; turn it on where prefill is fast next to the tier (a GPU, a remote or cold tier).
        share_prefixes: Whether a turn may start from another session's stored KV when that session's ids
            begin with the same tokens as the prompt (a shared system prompt, a regenerated or edited turn, a
            branch), as vLLM's automatic prefix caching does (default ``True``). Exact: the ids are compared
            before anything is reused, within one model fingerprint, `namespace` and ``cache_salt``. In host
            memory the sessions refer to the same segments, counted once against `host_bytes`.
        block_pool: A pool of prefix blocks shared by every session (:class:`~hf_attnstore.lab.block_pool.BlockPoolConfig`:
            capacity in blocks, block size, block policy): each turn's prompt, cut into blocks keyed by chained
            hashes, is kept once whoever computed it, and a turn reuses its prompt's longest run of leading blocks
            present when that is longer than what its own session or `share_prefixes` offer. Evicted block by
            block through a block policy, as ``attnstore simulate --trace`` simulates (issue 48). Its blocks are
            copies, counted in blocks, not against `host_bytes`. ``None`` (default): no pool.
        namespace: A salt mixed into every model fingerprint (see
            :func:`~hf_attnstore.cache.fingerprint.model_fingerprint`): entries stored under one namespace are
            never served under another. Use it for what weights cannot show (a tenant, a policy).

    Example:
        >>> config = StoreConfig(host_bytes="4GiB", disk_dir="/var/cache/kv", disk_bytes="200GiB", kv_codec="int8")
        >>> config.host_bytes, config.codec.name
        (4294967296, 'int8')
        >>> StoreConfig(host_bytes="lots")
        Traceback (most recent call last):
        ...
        ValueError: ...
    """

    host_bytes: int | str = "2GiB"
    disk_dir: str | None = None
    disk_bytes: int | str = "100GiB"
    ttl_s: float | None = None
    policy: str = "lru"
    chunk_tokens: int = 256
    read_buffer_layers: int | None = None
    preload: bool | None = None
    idle_flush_s: float = 0.5
    save_while_computing: bool = False
    pin_memory: bool | None = None
    fsync: bool = True
    io_timeout_s: float = 60.0
    reopen_in_background: bool = False
    namespace: str | None = None
    kv_codec: str | None = None
    kv_codec_group: int = 32
    kv_codec_host: bool = True
    sparse_copies: bool = False
    partial_eviction: bool = False
    recompute_by_cost: bool = False
    share_prefixes: bool = True
    block_pool: object | None = None  # a lab.block_pool.BlockPoolConfig: anything with build(pin_memory)
    remote: str | None = None
    remote_ttl_s: float | None = None
    remote_timeout_s: float = 2.0
    remote_required: bool = False

    def __post_init__(self):
        if self.disk_dir is not None:
            if not isinstance(self.disk_dir, (str, os.PathLike)) or isinstance(self.disk_dir, bytes):
                raise TypeError(f"`disk_dir` must be a folder path (str or os.PathLike) or None, got "
                                f"{type(self.disk_dir).__name__}")
            if not os.fspath(self.disk_dir).strip():
                raise ValueError("`disk_dir` is empty: pass a folder path, or None for no disk tier")
            object.__setattr__(self, "disk_dir", os.fspath(self.disk_dir))
        if self.namespace is not None and not isinstance(self.namespace, str):
            raise TypeError(f"`namespace` must be a str or None, got {type(self.namespace).__name__}")
        if self.remote is not None:
            if not isinstance(self.remote, str) or not self.remote.startswith(("redis://", "rediss://", "unix://")):
                raise ValueError("`remote` must be a redis://, rediss:// or unix:// URL (see StoreConfig), got "
                                 f"{type(self.remote).__name__}")
        if not isinstance(self.remote_required, bool):
            raise TypeError(f"`remote_required` must be True or False, got {self.remote_required!r}")
        for name in ("ttl_s", "idle_flush_s", "io_timeout_s", "remote_ttl_s", "remote_timeout_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise ValueError(f"`{name}` must be a finite number of seconds, got {value!r}")
        object.__setattr__(self, "host_bytes", parse_bytes(self.host_bytes, "host_bytes"))
        object.__setattr__(self, "disk_bytes", parse_bytes(self.disk_bytes, "disk_bytes"))
        make_policy(self.policy)  # validates the name
        if not isinstance(self.partial_eviction, bool):
            raise TypeError(f"`partial_eviction` must be True or False, got {self.partial_eviction!r}")
        if not isinstance(self.recompute_by_cost, bool):
            raise TypeError(f"`recompute_by_cost` must be True or False, got {self.recompute_by_cost!r}")
        if not isinstance(self.share_prefixes, bool):
            raise TypeError(f"`share_prefixes` must be True or False, got {self.share_prefixes!r}")
        if self.block_pool is not None and not callable(getattr(self.block_pool, "build", None)):
            raise TypeError("`block_pool` must be a hf_attnstore.lab.block_pool.BlockPoolConfig (capacity in blocks, "
                            f"block size, policy) or None, got {type(self.block_pool).__name__}")
        self.codec  # validates `kv_codec` and `kv_codec_group`
        if not isinstance(self.kv_codec_host, bool):
            raise TypeError(f"`kv_codec_host` must be True or False, got {self.kv_codec_host!r}")
        if not isinstance(self.sparse_copies, bool):
            raise TypeError(f"`sparse_copies` must be True or False, got {self.sparse_copies!r}")
        if self.sparse_copies and self.disk_dir is None and self.remote is None:
            raise ValueError("`sparse_copies` thins the copies the store writes to a disk or remote tier, and this "
                             "store has neither: set `disk_dir` or `remote`, or leave `sparse_copies` False")
        if self.kv_codec is not None and self.disk_dir is None and self.remote is None:
            raise ValueError(f"`kv_codec={self.kv_codec!r}` encodes the copies the store writes to a disk or remote "
                             "tier, and this store has neither: set `disk_dir` or `remote`, or leave `kv_codec` None")
        if self.ttl_s is not None and not self.ttl_s > 0:
            raise ValueError(f"`ttl_s` must be positive or None, got {self.ttl_s!r}")
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise ValueError(f"`chunk_tokens` must be a positive integer, got {self.chunk_tokens!r}")
        if self.read_buffer_layers is not None and (
            not isinstance(self.read_buffer_layers, int) or self.read_buffer_layers < 0
        ):
            raise ValueError(f"`read_buffer_layers` must be a non-negative integer or None, got {self.read_buffer_layers!r}")
        if not self.idle_flush_s > 0 or not self.io_timeout_s > 0 or not self.remote_timeout_s > 0:
            raise ValueError("`idle_flush_s`, `io_timeout_s` and `remote_timeout_s` must be positive")
        if self.remote_ttl_s is not None and not self.remote_ttl_s >= 1:
            raise ValueError(f"`remote_ttl_s` must be at least 1 second or None, got {self.remote_ttl_s!r}")
        if self.pin_memory is None:
            object.__setattr__(self, "pin_memory", torch.cuda.is_available())
        elif self.pin_memory and not torch.cuda.is_available():
            raise ValueError("`pin_memory=True` needs CUDA; leave it as None to decide automatically")

    @property
    def codec(self) -> KVCodec | None:
        """The codec of the cold copies (None: lossless).

        Example:
            >>> StoreConfig(disk_dir="/var/cache/kv", kv_codec="int4", kv_codec_group=64).codec  # of the disk copies
            KVCodec(name='int4', group=64)
            >>> StoreConfig().codec is None  # lossless
            True
        """
        if self.kv_codec is None:
            return None
        if not isinstance(self.kv_codec, str):
            raise ValueError(f"`kv_codec` must be None, 'int8' or 'int4', got {self.kv_codec!r}")
        return KVCodec(self.kv_codec, self.kv_codec_group)

    @property
    def tuning(self) -> StoreTuning:
        """The tuning knobs of this config, as a :class:`StoreTuning` (the rest are the everyday options).

        Example:
            >>> StoreConfig(chunk_tokens=64).tuning.chunk_tokens
            64
        """
        return StoreTuning(**{name: getattr(self, name) for name in TUNING})

    def layerwise_on(self, device: torch.device) -> bool:
        """Whether a session loading from disk is consumed layer by layer on `device` (see `preload`).

        Example:
            >>> cpu = torch.device("cpu")
            >>> StoreConfig().layerwise_on(cpu), StoreConfig(preload=True).layerwise_on(cpu)  # default: on CUDA only
            (False, True)
        """
        return self.preload if self.preload is not None else device.type == "cuda"


# The options a user sets, as `AttnStore(...)` keywords; every other StoreConfig field is a StoreTuning field.
EVERYDAY = ("host_bytes", "disk_dir", "disk_bytes", "remote", "remote_required", "policy", "ttl_s", "namespace",
            "kv_codec", "share_prefixes", "partial_eviction", "recompute_by_cost")


@dataclass(frozen=True)
class StoreTuning:
    """The tuning and research knobs of an :class:`~hf_attnstore.AttnStore`, in one place.

    Each field means what the :class:`StoreConfig` field of the same name means (see there); the defaults are
    StoreConfig's, and they are validated when the store's config is built. Most users set none of them.

    Args:
        chunk_tokens: Tokens per chunk file (256).
        read_buffer_layers: How far the disk loader may run ahead of the model, in layers (None: no limit).
        preload: Layer-wise loading (True), whole-session (False), or by device (None: layer-wise on CUDA).
        idle_flush_s: A session whose last write is this old is persisted (0.5 s).
        save_while_computing: Write ended turns behind at once, even while forwards run (False).
        pin_memory: Page-locked host buffers (None: when CUDA is available).
        fsync: Make disk writes durable (True; only tests and page-cache benchmarks turn it off).
        io_timeout_s: Longest wait for one layer of a load, and for `flush` (60 s).
        reopen_in_background: Index the sessions of a reopened `disk_dir` on a thread while the store serves
            (False: before the constructor returns).
        kv_codec_group: Values per scale of a lossy `kv_codec` (32).
        kv_codec_host: With a lossy codec, keep the host copy encoded too (True).
        sparse_copies: Disk and remote copies keep only the tokens a sparse session's next turn keeps (False).
        block_pool: A pool of prefix blocks shared by every session (None).
        remote_ttl_s: Expiry of what is written to the remote tier (None: until Redis evicts it).
        remote_timeout_s: Socket timeout of each remote call (2 s).

    Example:
        >>> from hf_attnstore import AttnStore, StoreTuning
        >>> store = AttnStore(host_bytes="64MiB", tuning=StoreTuning(chunk_tokens=64))
        >>> store.config.chunk_tokens, store.config.tuning.chunk_tokens
        (64, 64)
        >>> store.close()
    """

    chunk_tokens: int = 256
    read_buffer_layers: int | None = None
    preload: bool | None = None
    idle_flush_s: float = 0.5
    save_while_computing: bool = False
    pin_memory: bool | None = None
    fsync: bool = True
    io_timeout_s: float = 60.0
    reopen_in_background: bool = False
    kv_codec_group: int = 32
    kv_codec_host: bool = True
    sparse_copies: bool = False
    block_pool: object | None = None  # a lab.block_pool.BlockPoolConfig
    remote_ttl_s: float | None = None
    remote_timeout_s: float = 2.0


TUNING = tuple(f.name for f in fields(StoreTuning))
assert set(EVERYDAY) | set(TUNING) == {f.name for f in fields(StoreConfig)} and not set(EVERYDAY) & set(TUNING), \
    "every StoreConfig field is either an everyday option or a StoreTuning field"
# StoreTuning repeats StoreConfig's defaults (each is a frozen dataclass users read): they must not drift apart, or
# `tuning=StoreTuning()` would change a store that passes nothing.
assert all(f.default == StoreConfig.__dataclass_fields__[f.name].default for f in fields(StoreTuning)), \
    "StoreTuning's defaults are StoreConfig's"


def build_config(config: StoreConfig | None, tuning: StoreTuning | None, legacy: dict, **everyday) -> StoreConfig:
    """The StoreConfig of ``AttnStore(...)``: its everyday keywords, `tuning`, or a whole `config`.

    A tuning knob passed as a keyword of its own (`legacy`, the pre-StoreTuning way) still works for one release,
    with a ``FutureWarning`` that says where it goes now; it overrides the same field of `tuning`.

    Raises:
        TypeError: An unknown keyword, or `config` together with other options.

    Example:
        >>> build_config(None, StoreTuning(fsync=False), {}, host_bytes="1MiB").fsync
        False
    """
    unknown = sorted(set(legacy) - set(TUNING))
    if unknown:
        raise TypeError(f"unknown AttnStore option(s) {', '.join(f'`{n}`' for n in unknown)}: the everyday ones are "
                        f"{', '.join(EVERYDAY)}; the tuning knobs go in `tuning=StoreTuning(...)`")
    if tuning is not None and not isinstance(tuning, StoreTuning):
        raise TypeError(f"`tuning` must be a StoreTuning, got {type(tuning).__name__}")
    if config is not None:
        defaults = StoreConfig.__dataclass_fields__
        if legacy or tuning is not None or any(value != defaults[name].default for name, value in everyday.items()):
            raise TypeError("pass either `config` or separate options, not both")
        return config
    if legacy:
        warnings.warn(f"passing {', '.join(f'`{n}`' for n in sorted(legacy))} to AttnStore directly is deprecated "
                      f"and will be removed in the next release: use `tuning=StoreTuning({', '.join(f'{n}=...' for n in sorted(legacy))})`",
                      FutureWarning, stacklevel=3)
        tuning = replace(tuning or StoreTuning(), **legacy)
    tuning = tuning or StoreTuning()
    return StoreConfig(**everyday, **{name: getattr(tuning, name) for name in TUNING})
