"""A session's entry in the store's state, and the rules for session ids.

The store's state (`StoreState.entries`, store_state.py) owns the entries: they are read only under
`StoreState.lock`, and changed only by `StoreState`'s methods (tests/store/test_ownership.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .buffer import SessionBuffer
from .format import Manifest
from .load_handle import LoadHandle
from .load_thread import LoadJob
from .tier import Key


MAX_SESSION_ID_BYTES = 4096


def validate_session_id(session_id: object) -> str:
    """Session ids are non-empty strings of valid UTF-8 (NUL and any other character included) up to 4 KiB.

    They never become paths (the disk tier hashes them) but they are written into every file of the
    session, so they must encode: a lone surrogate such as ``"\\ud800"`` is refused here rather than
    failing in the background writer.

    Example:
        >>> validate_session_id("chat/1 ../\\0")
        'chat/1 ../\\x00'
        >>> validate_session_id("")
        Traceback (most recent call last):
        ...
        ValueError: `session_id` must be a non-empty string
    """
    if not isinstance(session_id, str):
        raise TypeError(f"`session_id` must be a str, got {type(session_id).__name__}")
    if not session_id:
        raise ValueError("`session_id` must be a non-empty string")
    try:
        size = len(session_id.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"`session_id` must be valid Unicode text (it has a lone surrogate at {exc.start}): "
                         "decode ids from bytes with errors='replace' or use a hash") from None
    if size > MAX_SESSION_ID_BYTES:
        raise ValueError(f"`session_id` is {size} bytes in UTF-8, more than {MAX_SESSION_ID_BYTES}: use a "
                         "shorter id (e.g. a hash of it)")
    return session_id


def remote_signature(manifest: Manifest) -> tuple:
    """What identifies a remote copy of a session: its length and last chunk's digest (digests chain over the
    whole history, so a copy written or extended by anyone since has another signature).

    Example:
        >>> import torch
        >>> from hf_attnstore.store.format import Manifest, Span
        >>> spans = (Span("c0", 0, 4, "a" * 32), Span("c1", 0, 2, "b" * 32))
        >>> manifest = Manifest("model-a", "chat-1", torch.arange(6), spans, next_chunk=2)
        >>> remote_signature(manifest)  # its length and the digest that chains over the whole history
        (6, 'bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb')
    """
    return manifest.length, manifest.spans[-1].digest if manifest.spans else None


BLOCK = 4096


def blocks(nbytes: int) -> int:
    """Bytes a file occupies on disk: its size rounded up to whole 4 KiB blocks (what `du` counts).

    Example:
        >>> blocks(0), blocks(1), blocks(4096), blocks(4097)
        (0, 4096, 4096, 8192)
    """
    return -(-nbytes // BLOCK) * BLOCK


class Write(enum.Enum):
    """What the save thread does with a session's tokens that are not on disk yet.

    Example:
        >>> e = Entry(key=("model-a", "chat-1"))
        >>> e.write, Write("flush")  # a new session is written behind its turn; a flush() asks for FLUSH
        (<Write.BEHIND: 'behind'>, <Write.FLUSH: 'flush'>)
    """

    BEHIND = "behind"  # written in the quiet gap after the turn (write-behind)
    FLUSH = "flush"  # at once: a flush() waits for it
    DEMOTE = "demote"  # at once, then the session leaves host memory (its room is needed)
    FAILED = "failed"  # the last write failed: retried after `retry_at`, at once by flush() or a demotion
    NEVER = "never"  # larger than the disk tier: kept in host memory only, until its next turn


@dataclass(eq=False)
class Entry:
    """One session's record in the store's state: its host copy, durable copy, files, pins and write state.
    Read under `StoreState.lock`; changed only by `StoreState`'s methods (tests/store/test_ownership.py).

    Example:
        >>> e = Entry(key=("model-a", "chat-1"))
        >>> e.length, e.persisted, e.dirty, e.write
        (0, 0, False, <Write.BEHIND: 'behind'>)
    """

    key: Key
    host: SessionBuffer | None = None
    host_accounted: int = 0  # the buffer's bytes at its last accounting (its segments may be shared)
    host_segments: dict = field(default_factory=dict)  # id -> segment it counted (HostTier.account)
    manifest: Manifest | None = None  # the durable prefix of the session (as it is, or will be, on disk)
    chunks: dict[str, tuple[int, int]] = field(default_factory=dict)  # referenced chunk -> (bytes, tokens)
    files: dict[str, int] = field(default_factory=dict)  # every chunk file on disk (referenced or not) -> bytes
    # Those of `files` that other sessions' folders name too (a shared prefix's hard links, `Tier.link`) -> the
    # file's identity: their bytes are counted once, by the index (`StoreState.linked`), not in `disk_bytes`.
    linked: dict = field(default_factory=dict)
    prefix_blocks: int = 0  # whole 64-token blocks offered in the prefix table during the running turn
    manifest_size: int = 0
    remote: Manifest | None = None  # found in the shared remote tier, to be loaded (not local yet)
    # The local durable copy this remote copy is to replace, once loaded (its files, moved to this entry, stay
    # on disk meanwhile): put back in the index if the remote copy fails to load (`RemoteChoice.restore_local`).
    fallback: "Entry | None" = None
    # Another history's durable copy this entry was handed (`StoreState.hand_over`) and keeps on disk until its own copy
    # is durable: what the session is again if the new history's host copy goes first (`StoreState.release_host`).
    predecessor: Manifest | None = None
    successor: "Entry | None" = None  # the entry this one handed its files to (`StoreState.hand_over`)
    refused: tuple | None = None  # a remote copy that failed to verify or load (`remote_signature`): not retried
    mirrored: set = field(default_factory=set)  # digests of chunks this store put in the remote tier
    layout: tuple | None = None  # ((layers, kv_heads, head_dim), dtype) for allocating loads
    owner: int = 0
    generation: int = 0
    pins: int = 0  # loads and writes in flight: the entry's buffers must not change
    writers: set = field(default_factory=set)  # turns running on the session: it stays in host memory
    live: object = None  # weakref to the running turn's TurnWriter, for a hybrid model's states (or None)
    loading: LoadHandle | None = None
    load_job: LoadJob | None = None
    last_access: float = 0.0
    last_write: float = 0.0
    write: Write = Write.BEHIND
    retry_at: float = 0.0
    failures: int = 0
    last_error: BaseException | None = None

    @property
    def length(self) -> int:
        if self.host is not None:
            return self.host.length
        if self.manifest is not None:
            return self.manifest.length
        return self.remote.length if self.remote is not None else 0

    @property
    def persisted(self) -> int:
        return self.manifest.length if self.manifest is not None else 0

    @property
    def state_dirty(self) -> bool:
        """Whether the host copy has a hybrid-model state that the durable copy lacks (state.py)."""
        state = self.host.state if self.host is not None else None
        durable = self.manifest.state if self.manifest is not None else None
        return state is not None and (durable is None or durable.digest != state.digest)

    @property
    def dirty(self) -> bool:
        return self.host is not None and (self.persisted < self.host.length or self.state_dirty) \
            and self.write is not Write.NEVER

    @property
    def urgent(self) -> bool:
        return self.write in (Write.FLUSH, Write.DEMOTE)

    @property
    def disk_bytes(self) -> int:
        """What the session's own files occupy: every chunk file not yet collected and not shared with another
        session (`linked`), and the manifest."""
        return sum(blocks(size) for name, size in self.files.items() if name not in self.linked) \
            + blocks(self.manifest_size)
