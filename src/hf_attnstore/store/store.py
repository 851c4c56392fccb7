"""AttnStore: where the KV of every chat session lives between turns."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from ..config import parse_bytes
from ..policy import make_policy
from .buffer import SessionBuffer, SessionKV

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (model fingerprint, session id)


def validate_session_id(session_id: object) -> str:
    """Session ids are arbitrary non-empty strings; they are never used as paths."""
    if not isinstance(session_id, str):
        raise TypeError(f"`session_id` must be a str, got {type(session_id).__name__}")
    if not session_id:
        raise ValueError("`session_id` must be a non-empty string")
    return session_id


@dataclass(frozen=True)
class StoreConfig:
    """Settings of an :class:`AttnStore`.

    Args:
        host_bytes: Hard limit of the host (CPU memory) tier, in bytes or as a string like ``"2GiB"``.
        policy: Eviction policy of the host tier: ``"lru"`` or ``"fifo"``.
        pin_memory: Page-lock host buffers so copies to and from a GPU are asynchronous. Defaults to whether
            CUDA is available (pinning is meaningless, and fails, without it).
    """

    host_bytes: int | str = "2GiB"
    policy: str = "lru"
    pin_memory: bool | None = None

    def __post_init__(self):
        object.__setattr__(self, "host_bytes", parse_bytes(self.host_bytes, "host_bytes"))
        make_policy(self.policy)  # validates the name
        if self.pin_memory is None:
            object.__setattr__(self, "pin_memory", torch.cuda.is_available())
        elif self.pin_memory and not torch.cuda.is_available():
            raise ValueError("`pin_memory=True` needs CUDA; leave it as None to decide automatically")


@dataclass
class _Entry:
    buffer: SessionBuffer
    owner: int  # id of the turn allowed to write; a newer turn of the session takes over


@dataclass
class StoreStats:
    """Counters of an :class:`AttnStore` (a copy is returned by :meth:`AttnStore.stats`)."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    appended_tokens: int = 0
    evictions: int = 0
    rejected_too_large: int = 0
    stale_writes: int = 0
    sessions: int = 0
    host_bytes_used: int = 0
    host_bytes_limit: int = 0
    extra: dict = field(default_factory=dict)


class AttnStore:
    """A bounded store of pre-RoPE KV caches, one per (model, session).

    The store is the single owner of its index: every read and write of the index happens under one lock,
    and the tensors handed out are immutable snapshots. This version keeps KV in host memory; the caller
    never sees a failure of the store as an exception during generation, only as a miss.

    Args:
        host_bytes: Capacity of the host tier (``"2GiB"``, or a byte count).
        policy: ``"lru"`` (default) or ``"fifo"``.
        pin_memory: See :class:`StoreConfig`.

    Example:
        >>> store = AttnStore(host_bytes="512MiB")
        >>> store.stats().host_bytes_limit
        536870912
    """

    def __init__(self, host_bytes: int | str = "2GiB", policy: str = "lru", pin_memory: bool | None = None):
        self.config = StoreConfig(host_bytes=host_bytes, policy=policy, pin_memory=pin_memory)
        self._lock = threading.Lock()
        self._entries: dict[Key, _Entry] = {}
        self._policy = make_policy(self.config.policy)
        self._stats = StoreStats(host_bytes_limit=self.config.host_bytes)
        self._next_turn = 0
        self._warned: set[str] = set()

    # -- reading --------------------------------------------------------------------------------------
    def lookup(self, session_id: str, fingerprint: str) -> SessionKV | None:
        """Returns a snapshot of the session's KV for this model, or ``None`` (a miss)."""
        key = (fingerprint, validate_session_id(session_id))
        with self._lock:
            self._stats.lookups += 1
            entry = self._entries.get(key)
            if entry is None or entry.buffer.length == 0:
                self._stats.misses += 1
                return None
            self._stats.hits += 1
            self._policy.touch(key)
            return entry.buffer.snapshot()

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            return any(sid == session_id for _, sid in self._entries)

    def sessions(self) -> list[str]:
        """Session ids with stored KV (for any model)."""
        with self._lock:
            return sorted({sid for _, sid in self._entries})

    def stats(self) -> StoreStats:
        """A snapshot of the counters."""
        with self._lock:
            s = StoreStats(**{k: getattr(self._stats, k) for k in StoreStats.__dataclass_fields__})
            s.sessions = len(self._entries)
            s.host_bytes_used = self._used_bytes()
            return s

    # -- writing --------------------------------------------------------------------------------------
    def open_turn(
        self, session_id: str, fingerprint: str, base: SessionKV | None, keep: torch.Tensor
    ) -> "TurnWriter":
        """Starts a turn: its writes will make the session ``base[keep]`` followed by what it appends.

        Nothing changes in the store until the first append, so a turn that never runs loses nothing. The
        newest turn of a session owns it; appends of older turns are dropped (and counted as stale).
        """
        key = (fingerprint, validate_session_id(session_id))
        with self._lock:
            self._next_turn += 1
            return TurnWriter(self, key, self._next_turn, base, keep)

    def delete(self, session_id: str) -> bool:
        """Removes the session's KV for every model. Returns whether anything was removed."""
        with self._lock:
            keys = [k for k in self._entries if k[1] == session_id]
            for key in keys:
                self._remove(key)
            return bool(keys)

    evict = delete  # with a single tier, evicting a session drops it

    def close(self) -> None:
        """Releases all stored KV."""
        with self._lock:
            for key in list(self._entries):
                self._remove(key)

    # -- internals (called with the lock held) ------------------------------------------------------
    def _used_bytes(self) -> int:
        return sum(e.buffer.nbytes for e in self._entries.values())

    def _remove(self, key: Key) -> None:
        self._entries.pop(key, None)
        self._policy.remove(key)

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message)

    def _append(self, writer: "TurnWriter", token_ids, keys, values) -> bool:
        with self._lock:
            entry = self._entries.get(writer.key)
            if not writer.started:
                entry = self._start_turn(writer, entry)
            elif entry is None or entry.owner != writer.turn:
                self._stats.stale_writes += 1
                self._warn_once("stale", f"session {writer.key[1]!r} was taken over by a newer turn; "
                                         "writes of the older turn are dropped")
                return False
            buf = entry.buffer
            needed = buf.bytes_after_append(int(token_ids.numel()))
            if not self._make_room(writer.key, needed - buf.nbytes, needed):
                self._remove(writer.key)
                self._stats.rejected_too_large += 1
                self._warn_once("too_large", (
                    f"session {writer.key[1]!r} needs {needed} bytes, more than the host tier's "
                    f"{self.config.host_bytes}: it is not stored (raise `host_bytes` to keep it)"))
                writer.dead = True
                return False
            buf.append(token_ids, keys, values)
            self._policy.touch(writer.key)
            self._stats.appended_tokens += int(token_ids.numel())
            return True

    def _start_turn(self, writer: "TurnWriter", entry: _Entry | None) -> _Entry:
        writer.started = True
        base, keep = writer.base, writer.keep
        n = int(keep.numel())
        in_place = (
            entry is not None and base is not None and base.source is entry.buffer
            and n <= entry.buffer.length and torch.equal(keep, torch.arange(n))
        )
        if in_place:
            entry.buffer.truncate(n)
            entry.owner = writer.turn
        else:
            if base is not None and n:
                buf = SessionBuffer.gathered(base, keep, self.config.pin_memory)
            else:
                buf = SessionBuffer(*writer.geometry, writer.dtype, self.config.pin_memory)
            entry = _Entry(buffer=buf, owner=writer.turn)
            if writer.key in self._entries:
                self._policy.remove(writer.key)
            self._entries[writer.key] = entry
            self._policy.insert(writer.key)
        writer.base = None  # the snapshot is no longer needed: let its memory go
        return entry

    def _make_room(self, key: Key, extra: int, total_for_key: int) -> bool:
        """Evicts other sessions until `extra` more bytes fit. False if the session alone is too large."""
        limit = self.config.host_bytes
        if total_for_key > limit:
            return False
        for victim in self._policy.victims():
            if self._used_bytes() + extra <= limit:
                break
            if victim != key:
                self._remove(victim)
                self._stats.evictions += 1
        return self._used_bytes() + extra <= limit


class TurnWriter:
    """Appends one turn's KV to a session. Created by :meth:`AttnStore.open_turn`."""

    def __init__(self, store: AttnStore, key: Key, turn: int, base: SessionKV | None, keep: torch.Tensor):
        self.store, self.key, self.turn = store, key, turn
        self.base, self.keep = base, keep.to(torch.long).cpu()
        self.started = False
        self.dead = False
        self.geometry: tuple[int, int, int] | None = None
        self.dtype: torch.dtype | None = None

    def append(self, token_ids: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
        """Appends tokens with their per-layer pre-RoPE keys and values ``[1, kv_heads, n, head_dim]``.

        Returns whether the data was stored (False when the session was too large or taken over).
        """
        if self.dead:
            return False
        if self.geometry is None:
            self.geometry = (len(keys), keys[0].shape[1], keys[0].shape[3])
            self.dtype = keys[0].dtype
        return self.store._append(self, token_ids.detach().to("cpu", torch.long).view(-1), keys, values)

    def truncate(self, length: int) -> None:
        """Cuts the session back to `length` tokens (e.g. after assisted decoding rejected tokens)."""
        with self.store._lock:
            entry = self.store._entries.get(self.key)
            if self.started and entry is not None and entry.owner == self.turn and length < entry.buffer.length:
                entry.buffer.truncate(length)
