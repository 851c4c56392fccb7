"""AttnStore: the hierarchical KV store (host memory, then lower tiers) behind AttnStoreCache.

Threads. The index (`_entries`, both policies, the byte counters) has one owner: the store, through
methods that hold `_lock`. Two I/O threads only move bytes: the load thread (reader.py) reads chunks
into host buffers it was handed, the save thread (saver.py) writes host buffers to a lower tier; both
report back by calling the store's `_finish_*` methods, which take the lock. Loads have priority: the save
thread waits for running loads between chunks (concurrent reads and writes slowed both by 18-20% in
Pensieve).

This file holds the public API, the index bookkeeping, placement (making room, demoting, the disk limit)
and the turn's writes. Beside it: the decisions to load (reader.py: `LoadPlanning`) and to save
(saver.py: `SavePlanning`), methods of this class kept with their threads; the lower-tier interface
(tier.py) and the disk tier (disk.py, format.py); the host tier's bookkeeping (host.py) and bytes
(buffer.py); the index entry (entry.py), a turn's writer (writer.py) and the counters (stats.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import fields

import torch

from .logs import OnceLogger
from .policy import make_policy
from .buffer import SessionBuffer, SessionKV, ranges
from .host import HostTier
from .config import StoreConfig
from .codec import serves
from .disk import DiskTier
from .tier import CHUNK_SUFFIX, MANIFEST
from .format import FormatError, Manifest, check_chain, prefix_digest
from .entry import Entry, Key, Write, blocks, remote_signature, validate_session_id
from .placement import choose_head_drops, choose_victims, head_drop_candidates
from .reader import LoadPlanning, LoadThread
from .remote import RemoteTier, RemoteUnavailableError
from .saver import NoDiskRoom, SavePlanning, SaveThread
from .state import SessionState
from .stats import StoreStats
from .writer import TurnWriter

logger = logging.getLogger(__name__)


class StoreIOError(RuntimeError):
    """Writing to the disk tier failed; the failed entries never became visible."""


def _io_error(error: BaseException) -> bool:
    """Whether a failed read is the device's (keep the data) rather than the data's: damaged (FormatError) or
    gone (a file or folder missing or replaced), which is deleted."""
    return isinstance(error, OSError) and not isinstance(
        error, (FileNotFoundError, NotADirectoryError, IsADirectoryError))


class AttnStore(LoadPlanning, SavePlanning):
    """A bounded, hierarchical store of pre-RoPE KV caches, one per (model, session).

    Host memory holds the sessions in use; sessions evicted from it are demoted to the disk tier (if
    any), from which a later turn loads them back layer by layer. Everything a turn computes is saved
    asynchronously: `generate` never waits for the disk. A failure of the store is never an exception
    during generation: damaged or missing data is a miss (see :class:`StoreConfig` for the options).

    Example:
        >>> store = AttnStore(host_bytes="8GiB", disk_dir="/tmp/kv", disk_bytes="100GiB")  # doctest: +SKIP
        >>> store.flush()  # doctest: +SKIP
        >>> store.stats().hits_disk  # doctest: +SKIP
    """

    def __init__(self, host_bytes: int | str = "2GiB", disk_dir: str | os.PathLike | None = None, *,
                 config: StoreConfig | None = None, **options):
        """See :class:`StoreConfig` for every option (`disk_bytes`, `ttl_s`, `policy`, `namespace`, ...).

        Raises:
            TypeError: An unknown option, or one of the wrong type.
            DiskLockedError: Another store has `disk_dir` open.
        """
        if config is None:
            config = StoreConfig(host_bytes=host_bytes, disk_dir=disk_dir, **options)
        elif options or disk_dir is not None:
            raise TypeError("pass either `config` or separate options, not both")
        self.config = config
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._entries: dict[Key, Entry] = {}
        self._host = HostTier(self.config.host_bytes, self.config.policy, self.config.pin_memory)
        self._disk_policy = make_policy(self.config.policy)
        self._stats = StoreStats(host_bytes_limit=self.config.host_bytes, disk_bytes_limit=self.config.disk_bytes)
        self._disk_used = 0  # files of indexed sessions, folders queued for deletion, writes in flight
        self._next_turn = 0
        self._dirty: set[Key] = set()
        self._next_chunk: dict[Key, int] = {}  # per session, only ever grows
        # Deletions for the save thread, in order: (key, bytes freed, None) deletes a session's folder;
        # (key, bytes freed, (manifest, chunk)) writes the manifest of a partially evicted session, then
        # deletes `chunk` (if not None); (key, bytes freed, (None, names)) deletes the manifest, then the files
        # `names`, of an older copy handed over to a new entry (`_hand_over`). Their bytes stay counted in
        # `_disk_used` until done (`_deleting`).
        self._deletes: list[tuple[Key, int, tuple | None]] = []
        self._deleting = 0
        # Closed writers and hybrid models' states: (key, turn, state or None, whether the turn ended), applied
        # under the lock.
        self._ended_turns: deque[tuple[Key, int, SessionState | None, bool]] = deque()
        self._loads_active = 0
        self._wanted: list[tuple[str | None, str]] = []  # the last prefetch request
        self._forwards_active = 0  # model forwards running through caches of this store
        self._room_waiters = 0  # appends blocked until demotions free host memory
        self._last_forward = 0.0
        self._once = OnceLogger(logger)  # each kind of warning once per store
        self._closed = False
        self._disk = DiskTier(self.config.disk_dir, fsync=self.config.fsync,
                              timeout_s=self.config.io_timeout_s) if self.config.disk_dir else None
        self._threads: list[threading.Thread] = []
        self._remote: RemoteTier | None = None
        try:
            if self._disk is not None:
                self._reopen()
            if self.config.remote is not None:
                # Unreachable at start: the tier starts down (misses, reconnected in the background), unless
                # `remote_required`. Refused credentials and malformed URLs always raise.
                self._remote = RemoteTier(self.config.remote, self.config.remote_ttl_s, self.config.remote_timeout_s,
                                          required=self.config.remote_required)
                if not self._remote.connected:
                    self._stats.remote_errors += 1
        except BaseException:
            if self._disk is not None:
                self._disk.close()
            raise
        # The tier sessions are saved to and demoted to: the disk, else the remote tier itself. With both, the
        # remote tier holds a copy of what is durable on disk (the save thread's mirror).
        self._lower = self._disk if self._disk is not None else self._remote
        if self._lower is not None:
            self._loader = LoadThread(self._load_done, self.config.io_timeout_s)
            self._saver = SaveThread(self, self._lower, self.config.chunk_tokens, self.config.io_timeout_s,
                                     mirror=self._remote if self._lower is self._disk else None)
            self._threads += [self._loader.thread, self._saver.thread]

    # -- public API -----------------------------------------------------------------------------------
    def lookup(self, session_id: str, fingerprint: str) -> SessionKV | None:
        """A snapshot of the session's KV for this model, or ``None`` (a miss).

        A session found only below host memory starts loading into it at once; the snapshot's
        :meth:`~SessionKV.layer_parts` waits for each layer as needed. With a remote tier, the session is
        also looked up there (one round trip): when it is missing here, or longer there (another server
        extended it), the remote copy is loaded. A remote copy replaces a local one only once its chunk headers
        are verified and it has loaded: any failure is a remote miss, and the local copy is served (now, or
        at the next lookup when the failure shows during the load: this snapshot's layers then raise
        ``LoadError``, and the turn recomputes).
        """
        key = (fingerprint, validate_session_id(session_id))
        self._publish_states([key])  # the previous turn's cache may still be open (and hold the states)
        found = self._remote_lookup(key)  # network I/O: outside the lock
        with self._lock:
            self._check_open()
            self._apply_ended_turns()  # a turn that just ended may have left the state this lookup needs
            self._expire()
            self._stats.lookups += 1
            e = self._adopt_remote(key, found)
            if e is None or e.length == 0:
                self._stats.misses += 1
                return None
            self._touch(e)
            if e.host is not None:
                self._stats.hits_host += 1
                if e.load_job is not None:
                    self._loader.promote(e.load_job)  # a prefetch this turn now waits for
                return e.host.snapshot(loader=e.loading, tier="host", generation=e.generation)
            tier = self._lower.name if e.manifest is not None else "remote"
            started = self._start_load(e)
            if not started and e.fallback is not None and self._restore_local(
                    e, refuse=e.remote if self._remote.available() else None):
                # The remote copy cannot be loaded now (the tier just failed) or ever (it does not fit host
                # memory: refused until it changes): the local copy it was to replace is served instead.
                e = self._entries[key]
                self._touch(e)
                tier = self._lower.name
                started = self._start_load(e)
            if not started:
                self._stats.misses += 1
                return None
            if tier == "disk":
                self._stats.hits_disk += 1
            else:
                self._stats.hits_remote += 1
            return e.host.snapshot(loader=e.loading, tier=tier, generation=e.generation)

    def _remote_lookup(self, key: Key) -> tuple[Manifest, tuple, bool] | None:
        """The remote tier's manifest of the session, its layout and whether it may replace a local copy, or
        None: absent, not longer than the local copy, or not servable here (a remote miss; a failure of the
        tier or of its data is counted). Called without the lock.

        With no local copy, only the first chunk's header is read (for the layout and codec): the load checks
        the rest, and a failure is only a miss. With a local copy, which the remote one would replace, every
        chunk's header is checked first (this session's, this model's, the local layout, a codec this store
        serves, chained as the manifest pins): a copy refused here, or whose load fails later, is remembered
        (`Entry.refused`) and not tried again until the remote copy changes."""
        remote = self._remote
        if remote is None or self._closed or not remote.available():
            return None
        local = None
        try:
            manifest = remote.manifest(key)
            if manifest is None:
                return None
            with self._lock:  # the common case, a local copy at least as long, needs no more round trips
                self._apply_ended_turns()
                local = self._entries.get(key)
                if local is not None and (local.length >= manifest.length or local.refused == remote_signature(manifest)
                                          or local.pins or local.writers or local.loading is not None):
                    return None  # (a local copy in use is not replaced: see `_adopt_remote`)
            if not manifest.spans:
                return None  # nothing stored but a dropped head: nothing to reuse
            if local is None:
                with remote.get(key, manifest.spans[0].chunk) as chunk:
                    if not serves(self.config.codec, chunk.meta.accuracy):
                        return None  # written by a store with a less accurate codec: a miss (the load checks all)
                    return manifest, (chunk.meta.geometry, chunk.meta.dtype), False
            if not self._verify_remote(remote, key, manifest, local.layout):
                self._refuse_remote(local, manifest)
                return None
            return manifest, local.layout, True
        except (RemoteUnavailableError, FormatError) as exc:
            if isinstance(exc, FormatError) and local is not None:
                self._refuse_remote(local, manifest)  # damaged or foreign data: a miss until it changes
            with self._lock:
                self._stats.remote_errors += 1
            self._once.warning("remote_lookup", "remote tier: a lookup failed (%s); served as a miss", exc)
            return None

    def _verify_remote(self, remote: RemoteTier, key: Key, manifest: Manifest, layout: tuple) -> bool:
        """Whether a remote copy may replace the local one: False when it holds chunks of a codec this store does
        not serve. Reads every chunk's header (no KV); the load verifies the ids and checksums again.

        Raises:
            FormatError: A chunk is missing, damaged, of another model or session, of another layout, or not the
                one the manifest pinned (the chain).
            RemoteUnavailableError: The tier failed.
        """
        metas, seen = [], {}
        for span in manifest.spans:
            meta = seen.get(span.chunk)
            if meta is None:
                with remote.get(key, span.chunk) as chunk:  # checks the header against `key`
                    meta = seen[span.chunk] = chunk.meta
            if not serves(self.config.codec, meta.accuracy):  # a derived chunk counts as lossy
                return False
            if (meta.geometry, meta.dtype) != layout:
                raise FormatError("the remote copy's shapes or dtype differ from the local copy's")
            if span.end > meta.n_tokens:
                raise FormatError("span beyond the chunk's tokens")
            metas.append(meta)
        check_chain(manifest, metas)
        return True

    def _refuse_remote(self, local: Entry, manifest: Manifest) -> None:
        with self._lock:
            if self._entries.get(local.key) is local:
                local.refused = remote_signature(manifest)

    def _adopt_remote(self, key: Key, found: tuple[Manifest, tuple, bool] | None) -> Entry | None:
        """The entry a lookup uses (lock held): the local one, unless the remote copy is longer, was verified
        to replace it (`_remote_lookup`), and the local one is idle (nothing reads or writes it). Last writer
        wins, as for the remote tier itself.

        A local durable copy is never deleted here: the remote entry takes over its files (the session's
        folder, whose manifest stays valid until the remote copy, once loaded, is written over it) and keeps
        it as its `fallback`, put back in the index if the remote copy fails to load (`_restore_local`)."""
        e = self._entries.get(key)
        if found is None:
            return e
        manifest, layout, verified = found
        self._apply_ended_turns()
        if e is not None and (e.length >= manifest.length or e.pins or e.writers or e.loading is not None
                              or not verified or e.refused == remote_signature(manifest)):
            return e
        n = Entry(key=key, layout=layout)
        if e is not None:
            if self._disk is None:
                self._drop(e)  # nothing of it is local but a host copy (its durable copy is in the remote tier)
            else:
                self._unindex(e)  # its host copy goes (and the session's dirty tail, if any, with it)
                # A remote copy not loaded yet stands for the local copy it was to replace: that is the fallback.
                n.fallback, e.fallback = (e if e.manifest is not None else e.fallback), None
                self._hand_over(e, n)
        if self._lower is self._remote:
            # No disk tier: the remote copy is the session's durable copy, as a disk copy would be. Its chunks
            # are named by digest; their token counts are the spans' (a later save may rewrite the last one).
            self._set_manifest(n, manifest, {s.chunk: (0, s.end) for s in manifest.spans})
        else:
            n.remote = manifest
            n.mirrored = {span.digest for span in manifest.spans}
        n.last_access = time.monotonic()
        self._entries[key] = n
        return n

    def _restore_local(self, e: Entry, refuse: Manifest | None = None) -> bool:
        """Puts back the local copy that the remote entry `e` was to replace (lock held), if it has one and is
        still indexed: its load failed or cannot start. Returns whether it did. With `refuse`, that remote copy
        is not tried again until it changes."""
        old = e.fallback
        if old is None or self._entries.get(e.key) is not e:
            return False
        e.fallback = None
        self._set_host(e, None)  # a failed load's buffer (the snapshot handed out keeps its own reference)
        old.files, old.manifest_size, e.files, e.manifest_size = e.files, e.manifest_size, {}, 0
        e.chunks = {}
        old.generation = max(old.generation, e.generation) + 1  # no snapshot of the failed load is of its lineage
        self._entries[e.key] = old
        self._disk_policy.insert(e.key)
        if refuse is not None:
            old.refused = remote_signature(refuse)
        self._stats.remote_restores += 1
        return True

    def _load_done(self, job, error: BaseException | None) -> None:
        """The load thread's report: first the store's own part for a remote copy that was to replace a local
        one (put the local copy back if the load failed; forget it once the remote copy has loaded), then the
        bookkeeping of every load (reader.py, `_finish_load`), which no longer finds the failed entry indexed."""
        e = job.entry
        with self._cond:
            if error is None:
                e.fallback = None  # verified and loaded: it replaces the local copy (written over it behind the turn)
            elif self._restore_local(e, refuse=None if isinstance(error, RemoteUnavailableError) else job.manifest):
                self._once.warning("remote_restore", "remote tier: session %r could not be loaded from it (%s); "
                                   "the local copy is kept and served", e.key[1], error)
            elif job.tier is self._disk and _io_error(error) and self._entries.get(e.key) is e and not e.writers:
                # The disk failed to read the copy (EIO, EMFILE, ...), which is not damaged or missing data: a
                # miss now, but the copy stays (indexed afresh), as it may well be readable at the next turn.
                self._reindex(e)
                self._once.warning("disk_read", "disk tier: reading session %r failed (%s); a miss now, its disk "
                                   "copy is kept", e.key[1], error)
        self._finish_load(job, error)

    def _reindex(self, e: Entry) -> None:
        """Replaces an entry whose load failed by a fresh one holding the same durable copy (lock held)."""
        c = Entry(key=e.key, layout=e.layout, generation=e.generation + 1, last_access=e.last_access,
                  mirrored=set(e.mirrored), refused=e.refused)
        self._unindex(e)
        self._entries[c.key] = c
        self._set_manifest(c, e.manifest, e.chunks)
        c.files, c.manifest_size, e.files, e.manifest_size = e.files, e.manifest_size, {}, 0

    def open_turn(self, session_id: str, fingerprint: str, base: SessionKV | None, keep: torch.Tensor) -> "TurnWriter":
        """Starts a turn: its writes make the session ``base[keep]`` followed by what it appends.

        Nothing changes until the first append, so a turn that never runs loses nothing. The newest turn
        of a session owns it; appends of older turns are dropped and counted as stale.
        """
        key = (fingerprint, validate_session_id(session_id))
        with self._lock:
            self._check_open()
            self._next_turn += 1
            writer = TurnWriter(self, key, self._next_turn, base, keep)
        # A writer dropped without close() ends its turn too (deque.append is safe in a finalizer).
        weakref.finalize(writer, self._ended_turns.append, (key, writer.turn, None, True))
        return writer

    def prefetch(self, session_ids, fingerprint: str | Sequence[str] | None = None) -> int:
        """Starts loading these sessions from lower tiers into host memory. Returns how many loads started.

        With `fingerprint` (or several: a model whose KV is keyed per RoPE regime, see
        ``AttnStoreCache.fingerprints_of``) and a remote tier, sessions are also looked up there (one round
        trip each and fingerprint). Without it, a session is prefetched under whichever model stored it.
        """
        wanted = [validate_session_id(s) for s in session_ids]
        fingerprints = [fingerprint] if fingerprint is None or isinstance(fingerprint, str) else list(fingerprint)
        keys = [(fp, sid) for sid in dict.fromkeys(wanted) for fp in fingerprints]
        found = {}
        if self._remote is not None:
            for key in keys:
                if key[0] is not None:
                    found[key] = self._remote_lookup(key)  # network I/O: outside the lock
        with self._lock:
            self._check_open()
            for key, hit in found.items():
                self._adopt_remote(key, hit)
            # Remembered, in order: sessions that do not fit yet are fetched when a write-out frees room.
            self._wanted = keys
            return self._retry_prefetch()

    def _retry_prefetch(self) -> int:
        started = 0
        for fingerprint, sid in self._wanted:
            for e in [e for k, e in self._entries.items() if k[1] == sid and (fingerprint is None or k[0] == fingerprint)]:
                if e.host is None and (e.manifest or e.remote) is not None:
                    if not self._start_load(e, must_fit=True):
                        return started  # in order: a later session must not take the room of an earlier one
                    started += 1
                    self._stats.prefetches += 1
        return started

    def set_schedule(self, session_ids: list[str]) -> None:
        """Tells a scheduler-aware policy (``policy="lookahead"``) the sessions of the waiting jobs, in order.

        Ignored by policies that do not look ahead.
        """
        with self._lock:
            for policy in (self._host.policy, self._disk_policy):
                policy.set_queue(list(session_ids))

    def evict(self, session_id: str) -> None:
        """Moves the session out of host memory: to the tier below (after its pending writes), or drops it."""
        validate_session_id(session_id)
        with self._lock:
            for e in [e for k, e in self._entries.items() if k[1] == session_id and e.host is not None]:
                self._evict_from_host(e)

    def delete(self, session_id: str, fingerprint: str | None = None) -> bool:
        """Removes the session's KV from every tier, for every model (or only that stored under `fingerprint`).
        Returns whether anything was removed."""
        validate_session_id(session_id)
        with self._lock:
            victims = [e for k, e in self._entries.items()
                       if k[1] == session_id and (fingerprint is None or k[0] == fingerprint)]
            for e in victims:
                self._drop(e)
                if self._remote is not None:
                    self._remote.remove(e.key)  # queued behind its pending writes: never resurrected
            return bool(victims)

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every session is durable on disk, or in the remote tier when there is no disk tier
        (a no-op without either).

        Writes that failed earlier (full disk, I/O error) are retried once now.

        Raises:
            StoreIOError: Some sessions are still not durable after the retry; the message names them. They
                keep being served from host memory, stay pending (a later flush retries them), and their
                failed state never became visible on disk.
            TimeoutError: Not durable within `timeout` seconds.
        """
        if self._lower is None:
            return
        timeout = self.config.io_timeout_s if timeout is None else timeout
        self._publish_states(None)
        with self._cond:
            self._apply_ended_turns()  # end-of-turn states are part of what becomes durable
            for key in list(self._dirty):
                e = self._entries.get(key)
                if e is not None and e.write is not Write.DEMOTE:
                    e.write = Write.FLUSH  # a failed write is retried now
            self._cond.notify_all()

            def settled() -> bool:  # every pending write has either completed or failed again
                return self._closed or all(self._entries.get(k) is None or self._entries[k].write is Write.FAILED
                                           for k in self._dirty)

            if not self._cond.wait_for(settled, timeout):
                raise TimeoutError(f"the {self._lower.name} tier did not become durable within {timeout} s")
            failed = [self._entries[k] for k in self._dirty if self._entries.get(k) is not None]
        if failed:
            names = ", ".join(repr(e.key[1]) for e in failed[:5]) + (" ..." if len(failed) > 5 else "")
            raise StoreIOError(f"{len(failed)} session(s) are not durable in the {self._lower.name} tier ({names}): "
                               f"{failed[0].last_error}") from failed[0].last_error

    def stats(self) -> StoreStats:
        """A snapshot of the counters."""
        with self._lock:
            s = StoreStats(**{f.name: getattr(self._stats, f.name) for f in fields(StoreStats)})
            s.sessions = len(self._entries)
            s.host_sessions = sum(e.host is not None for e in self._entries.values())
            s.disk_sessions = sum(e.manifest is not None for e in self._entries.values()) if self._disk else 0
            s.host_bytes_used, s.disk_bytes_used = self._host.used, self._disk_used
            s.loads_in_flight, s.saves_pending = self._loads_active, len(self._dirty)
            s.remote_down = int(self._remote is not None and not self._remote.available())
            return s

    def token_ids(self, session_id: str, fingerprint: str) -> torch.Tensor | None:
        """The ids a session's stored KV covers (without loading anything), or ``None``.

        With a remote tier, a session missing here or longer there is looked up there too (as by `lookup`),
        so a server that never saw a conversation resumes it where another server left it."""
        key = (fingerprint, validate_session_id(session_id))
        found = self._remote_lookup(key)  # network I/O: outside the lock
        with self._lock:
            e = self._adopt_remote(key, found)
            if e is None or e.length == 0:
                return None
            if e.host is not None:
                return e.host.snapshot().token_ids.clone()
            return (e.manifest or e.remote).token_ids.clone()

    def fill_head(self, snapshot: SessionKV, keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
        """Gives a partially evicted session its recomputed head back in host memory (see `SessionKV.head`).

        Called by the turn that recomputed it (AttnStoreCache), with per-layer pre-RoPE ``[1, kv_heads, head,
        head_dim]`` tensors of the snapshot's first ``snapshot.head`` tokens. The first caller fills the buffer;
        a concurrent or later one finds it claimed and changes nothing. Returns whether this call filled it.
        """
        buf, head = snapshot.source, snapshot.head
        with self._lock:
            if head == 0 or buf.head_claimed or buf.missing_head == 0:
                return False
            buf.head_claimed = True
        seg, a, b = snapshot.parts[0]  # the load's one segment: the head is its first tokens
        assert b - a >= head and len(keys) == len(seg.keys), "the head lies in the load's segment"
        try:
            for dst, src in ((seg.keys, keys), (seg.values, values)):
                for d, t in zip(dst, src):
                    d[:, :, a : a + head].copy_(t)
        except BaseException:
            with self._lock:
                buf.head_claimed = False
            raise
        with self._lock:
            buf.missing_head = 0  # a truncation meanwhile only shortened it; the tokens kept are filled
        return True

    def tier_of(self, session_id: str, fingerprint: str) -> str | None:
        """``"host"``, ``"disk"``, ``"remote"`` or ``None``: where the session's KV is now (``"remote"``: only in
        the shared remote tier, as far as this store knows)."""
        validate_session_id(session_id)
        with self._lock:
            e = self._entries.get((fingerprint, session_id))
            if e is None:
                return None
            return "host" if e.host is not None else self._lower.name if e.manifest is not None else "remote"

    def sessions(self) -> list[str]:
        """Session ids with stored KV (for any model)."""
        with self._lock:
            return sorted({sid for _, sid in self._entries})

    def __contains__(self, session_id: str) -> bool:
        validate_session_id(session_id)
        with self._lock:
            return any(sid == session_id for _, sid in self._entries)

    def close(self, flush: bool = True) -> None:
        """Persists pending writes (unless `flush=False`) and stops the I/O threads. Idempotent."""
        if self._closed:
            return
        try:
            if flush:
                self.flush()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            if self._threads:
                self._loader.stop()
            for thread in self._threads:
                thread.join(timeout=self.config.io_timeout_s)
            if self._disk is not None:
                self._disk.close()
            if self._remote is not None:
                self._remote.close()

    def __enter__(self) -> "AttnStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- index bookkeeping (lock held) ----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this AttnStore is closed")

    def _touch(self, e: Entry) -> None:
        e.last_access = time.monotonic()
        self._host.touch(e)
        if e.manifest is not None:
            self._disk_policy.touch(e.key)

    def _set_host(self, e: Entry, buf: SessionBuffer | None) -> None:
        if buf is not None:
            self._host.put(e, buf)
            return
        if e.host is not None:
            self._dirty.discard(e.key)  # what is not written by now is given up with the buffer
        self._host.remove(e)

    def _set_manifest(self, e: Entry, manifest: Manifest | None, chunks: dict[str, tuple[int, int]]) -> None:
        if manifest is None and e.manifest is not None:
            self._disk_policy.remove(e.key)
        elif manifest is not None and e.manifest is None:
            self._disk_policy.insert(e.key)
        e.manifest = manifest
        e.chunks = {c: chunks[c] for c in {s.chunk for s in manifest.spans}} if manifest else {}
        # The files stay counted (in `files`) until they are deleted: collected after the next write, or with
        # the session's folder.

    def _set_files(self, e: Entry, files: dict[str, int], manifest_size: int) -> None:
        self._disk_used -= e.disk_bytes
        e.files, e.manifest_size = files, manifest_size
        self._disk_used += e.disk_bytes

    def _delete_folder(self, e: Entry) -> None:
        """Queues the deletion of the session's folder; its bytes stay counted until it is gone."""
        nbytes = e.disk_bytes
        self._set_files(e, {}, 0)
        self._queue_delete(e.key, nbytes, None)

    def _queue_delete(self, key: Key, nbytes: int, head: tuple | None) -> None:
        self._disk_used += nbytes
        self._deleting += nbytes
        self._deletes.append((key, nbytes, head))
        self._cond.notify_all()

    def _drop(self, e: Entry) -> None:
        """Removes a session from the index and (asynchronously) from disk."""
        if self._entries.get(e.key) is e:
            del self._entries[e.key]
        self._set_host(e, None)
        self._set_manifest(e, None, {})
        if self._disk is not None:
            self._delete_folder(e)

    def _unindex(self, e: Entry) -> None:
        """Takes an entry out of the index, host memory and the disk policy, leaving its files (lock held)."""
        if self._entries.get(e.key) is e:
            del self._entries[e.key]
        self._set_host(e, None)
        if e.manifest is not None:
            self._disk_policy.remove(e.key)

    def _hand_over(self, e: Entry, n: Entry) -> None:
        """Gives the session's new entry `n` the disk files of its old entry `e` (out of the index), deleting
        none (lock held). The folder's manifest stays `e`'s, a valid older copy of the session (what a crash
        leaves), until `n`'s first save writes its own over it and collects `e`'s files; a failed save of `n`
        keeps them (`n.chunks` names them, see saver.py `_files_to_keep`). Only when the disk tier has no other
        room for `n`'s save do they go first (`_reserve_disk`)."""
        if e.manifest is not None:
            names = {s.chunk for s in e.manifest.spans} | ({e.manifest.state.name} if e.manifest.state else set())
            n.chunks = {name: e.chunks.get(name, (e.files.get(name, 0), 0)) for name in names}
        else:
            n.chunks = dict(e.chunks)  # an entry that was handed an older copy itself, and never saved
        n.files, n.manifest_size, e.files, e.manifest_size = e.files, e.manifest_size, {}, 0

    def _expire(self) -> None:
        ttl = self.config.ttl_s
        if ttl is None:
            return
        now = time.monotonic()
        self._apply_ended_turns()
        for e in [e for e in self._entries.values() if now - e.last_access > ttl and e.pins == 0 and not e.writers]:
            self._drop(e)
            self._stats.ttl_expired += 1

    def _cut(self, e: Entry, length: int) -> None:
        """Shortens a session. A new generation: a save in flight may hold tokens past the cut, and must not
        commit them (it would describe a history that no longer exists)."""
        e.host.truncate(length)
        self._host.account(e)  # a state of the cut tokens went with them
        e.generation += 1
        if e.persisted > length:
            self._set_manifest(e, e.manifest.select([(0, length)]), e.chunks)

    def _apply_ended_turns(self) -> None:
        """Unpins the sessions of turns that ended (see TurnWriter.close), keeping their end-of-turn states."""
        while self._ended_turns:
            key, turn, state, ended = self._ended_turns.popleft()
            e = self._entries.get(key)
            if e is None:
                continue
            if state is not None:
                self._keep_state(e, turn, state)
            if ended:
                e.writers.discard(turn)
                live = e.live() if e.live is not None else None
                if live is None or live.turn == turn:
                    e.live = None
                self._keep_encoded(e)  # encoded copies that waited for the turn to end (encoded.py)

    def _publish_states(self, keys) -> None:
        """Asks the open turns of these sessions for their hybrid models' states, where the session's stored
        state is not the one after all its tokens (a next turn's lookup, a flush, while the previous turn's
        cache is still referenced). Called without the lock: the states are copied meanwhile."""
        writers = []
        with self._lock:
            for key in list(self._entries) if keys is None else keys:
                e = self._entries.get(key)
                writer = e.live() if e is not None and e.live is not None else None
                buf = e.host if e is not None else None
                if writer is not None and writer.turn == e.owner and not writer.dead and buf is not None \
                        and (buf.state is None or buf.state.tokens != buf.length):
                    writers.append(writer)
        for writer in writers:
            writer.publish_state()

    def _keep_state(self, e: Entry, turn: int, state: SessionState) -> None:
        """Keeps a hybrid model's end-of-turn state with the session, if it is the state after exactly the KV
        stored: the turn still owns the session, and every token it computed was stored (no refused append,
        no cut). It is sealed with the digest of those ids, which a later turn's prompt must extend."""
        buf = e.host
        if e.owner != turn or buf is None or buf.length != state.tokens or buf.missing_head or state.tokens == 0:
            self._stats.states_refused += 1
            return
        ids = buf.snapshot().token_ids
        buf.state = state.sealed(e.key, prefix_digest(e.key[0], ids))
        self._host.account(e)
        self._stats.states_kept += 1
        if self._lower is not None and e.dirty:
            self._dirty.add(e.key)
            self._cond.notify_all()

    def _make_host_room(self, extra: int, exclude: Entry | None, keep_sooner_than: int | None = None) -> bool:
        """Demotes (or drops) host sessions until `extra` more bytes fit. Pinned ones stay; dirty ones are
        persisted first and demoted when that completes. With `keep_sooner_than` (a prefetch for the job at
        that queue position), sessions whose next job comes sooner are never evicted for it."""
        limit = self._host.limit
        if self._host.fits(extra):
            return True  # the common case, once per appended token: no scan of the index
        self._apply_ended_turns()
        freeing = sum(e.host_accounted for e in self._entries.values() if e.write is Write.DEMOTE)
        entries = self._entries

        def movable(key) -> bool:  # already being written out counts in `freeing`; pinned ones stay
            e = entries[key]
            return e is not exclude and e.write is not Write.DEMOTE and e.pins == 0 and not e.writers

        for key in choose_victims(self._host.policy.victims(), lambda key: entries[key].host_accounted, movable,
                                  self._host.used - freeing + extra - limit,
                                  self._host.position, keep_sooner_than):
            self._evict_from_host(entries[key])
        return self._host.fits(extra)

    def _evict_from_host(self, e: Entry) -> None:
        """Demotes a session to disk, or drops it when it cannot be kept there. Sessions being loaded or
        written, or whose turn is running, are pinned and stay; unwritten ones are written first (then demoted
        by _finish_persist)."""
        self._apply_ended_turns()
        if e.pins or e.writers:
            return
        if self._lower is None or e.write is Write.NEVER or e.length == 0:
            self._drop(e)
            self._stats.host_drops += 1
        elif e.dirty:
            e.write = Write.DEMOTE
            self._dirty.add(e.key)
            self._cond.notify_all()
        else:
            assert e.manifest is not None and e.persisted == e.length, "a clean session is entirely below host"
            self._set_host(e, None)
            self._stats.demotions += 1

    def _enforce_disk(self, current: Entry | None) -> bool:
        """Drops other sessions' disk copies (or, with `partial_eviction`, their leading chunks first) while
        the disk tier is over its limit. Returns whether it fits once the queued deletions have run (the caller
        runs them before writing)."""
        limit = self.config.disk_bytes
        entries = self._entries
        if self.config.partial_eviction and self._disk_used - self._deleting > limit:
            self._drop_disk_heads(current, self._disk_used - self._deleting - limit)
        for key in choose_victims(self._disk_policy.victims(), lambda key: entries[key].disk_bytes,
                                  lambda key: entries[key] is not current and entries[key].pins == 0,
                                  self._disk_used - self._deleting - limit):
            self._stats.disk_drops += 1
            self._drop_disk_copy(entries[key])
        return self._disk_used - self._deleting <= limit

    def _drop_disk_heads(self, current: Entry | None, overflow: int) -> None:
        """Partial eviction: drops leading chunks of idle sessions' disk copies, lowest retention value first
        (`placement.choose_head_drops`). Sessions loading, being written, running a turn or queued by the
        scheduler are left whole."""
        now, policy = time.monotonic(), self._disk_policy

        def describe(key):
            e = self._entries[key]
            # A hybrid model's session (with a state) stays whole: its head could not be recomputed without
            # recomputing the states, i.e. the whole session.
            if e is current or e.pins or e.writers or e.manifest is None or not e.manifest.spans \
                    or e.manifest.state is not None or policy.position(key) is not None:
                return None
            return now - e.last_access, self._head_units(e), e.disk_bytes

        candidates = head_drop_candidates(policy.victims(), overflow, describe)
        for key in choose_head_drops(candidates, overflow):
            e = self._entries.get(key)
            if e is None or e.manifest is None:
                continue
            if len(e.manifest.spans) == 1:  # its last chunk: the session leaves the disk tier
                self._stats.disk_drops += 1
                self._drop_disk_copy(e)
            else:
                self._drop_disk_head(e)

    @staticmethod
    def _head_units(e: Entry) -> list[tuple[int, int, int]]:
        """The session's stored chunks in order as (start, end, bytes freed when dropped); the last frees
        everything left (the manifest, chunks not yet collected)."""
        spans, units, pos = e.manifest.spans, [], e.manifest.head
        for i, span in enumerate(spans):
            shared = any(s.chunk == span.chunk for s in spans[i + 1 :])
            units.append((pos, pos + span.length, 0 if shared else blocks(e.files.get(span.chunk, 0))))
            pos += span.length
        a, b, _ = units[-1]
        units[-1] = (a, b, e.disk_bytes - sum(u[2] for u in units[:-1]))
        return units

    def _drop_disk_head(self, e: Entry) -> None:
        """Drops the first stored chunk of a session's disk copy: the index at once, the files on the save
        thread (the new manifest first, then the chunk, so a crash in between leaves an orphan chunk)."""
        old = e.manifest
        manifest = old.drop_head_span()
        chunk = old.spans[0].chunk
        gone = chunk if all(s.chunk != chunk for s in manifest.spans) else None
        self._set_manifest(e, manifest, e.chunks)
        files = dict(e.files)
        nbytes = blocks(files.pop(gone)) if gone in files else 0
        self._set_files(e, files, e.manifest_size)
        self._queue_delete(e.key, nbytes, (manifest, gone))
        self._stats.head_drops += 1
        self._stats.head_dropped_tokens += old.spans[0].length

    def _reserve_disk(self, e: Entry, nbytes: int) -> int:
        """Makes room for a file of `nbytes` before it is written (save thread), so the files on disk never
        exceed `disk_bytes`: other sessions' copies are dropped first and their folders deleted now.

        Raises:
            NoDiskRoom: The session alone would not fit.
        """
        if self._disk is None:
            return 0  # saved to the remote tier: its memory is Redis's to limit (maxmemory), not `disk_bytes`
        size = blocks(nbytes)
        with self._cond:
            self._disk_used += size
            fits = self._enforce_disk(e)
            if not fits and e.manifest is None and e.files and self._entries.get(e.key) is e:
                # The older copy this first save replaces (`_hand_over`) goes now, as the last room there is.
                self._drop_handed_over(e)
                fits = self._enforce_disk(e)
            if not fits:
                self._disk_used -= size
            deletes, self._deletes = self._deletes, []
        self._run_deletes(deletes)
        if not fits:
            raise NoDiskRoom(f"session {e.key[1]!r} is larger than the disk tier")
        return size

    def _drop_handed_over(self, e: Entry) -> None:
        """Queues the deletion of the older copy's files an entry was handed (`_hand_over`): its manifest first,
        then its chunk and state files, leaving the files the entry's own save is writing (lock held)."""
        nbytes, names = e.disk_bytes, tuple(e.files)
        self._set_files(e, {}, 0)
        e.chunks = {}
        self._queue_delete(e.key, nbytes, (None, names))

    def _run_deletes(self, deletes: list[tuple[Key, int, tuple | None]]) -> None:
        """Runs queued deletions (save thread, without the lock; see `_deletes`). A deletion that fails (EACCES,
        EIO) is logged and the others go on; the bytes are released from the count either way (what is left
        is collected when the folder is next scanned)."""
        try:
            for key, nbytes, head in deletes:
                try:
                    self._run_delete(key, nbytes, head)
                except OSError as exc:
                    self._once.warning("delete", "disk tier: deleting files of session %r failed (%s)", key[1], exc)
        finally:
            if deletes:
                with self._cond:
                    nbytes = sum(item[1] for item in deletes)
                    self._disk_used -= nbytes
                    self._deleting -= nbytes

    def _run_delete(self, key: Key, nbytes: int, head: tuple | None) -> None:
        if head is None:
            self._disk.remove(key)
            return
        manifest, chunk = head
        if manifest is None:  # an older copy's files (`_drop_handed_over`): the manifest first
            self._disk.delete(key, [MANIFEST, *(name + CHUNK_SUFFIX for name in chunk)])
            return
        try:
            # Now, on this thread: behind the tier's write queue it would wait for every chunk queued before
            # it (a timeout there would drop a copy whose manifest still lands later).
            size = self._disk.write(key, MANIFEST, manifest.encode())
        except OSError as exc:
            # The index says the chunk is dropped, the disk still has the old manifest: make them agree by
            # letting the whole disk copy go (a clean miss later; the chunk is deleted with the folder).
            self._once.warning("head_drop", "disk tier: writing the manifest of partially evicted session %r "
                               "failed (%s); its disk copy is dropped", key[1], exc)
            with self._cond:
                e = self._entries.get(key)
                if e is not None and e.manifest is manifest:
                    # The chunk is still there: count it with the folder, whose deletion removes it.
                    self._set_files(e, {**e.files, chunk: nbytes} if chunk else e.files, e.manifest_size)
                    self._drop_disk_copy(e)
            return
        if chunk is not None:
            self._disk.delete(key, [chunk + CHUNK_SUFFIX])
        with self._cond:
            e = self._entries.get(key)
            if e is not None and e.manifest is manifest:
                self._set_files(e, e.files, size)

    def _drop_disk_copy(self, e: Entry) -> None:
        """Removes a session from the disk tier; with no copy in host memory either, it is gone."""
        if e.host is None:
            self._drop(e)
            return
        self._set_manifest(e, None, {})
        e.write = Write.NEVER  # not written again this turn: it would only push another session out
        self._delete_folder(e)

    # -- compute and turns ------------------------------------------------------------------------------
    def forward_started(self) -> None:
        """A model forward that uses this store begins: the save thread yields to it (saves wait for a quiet
        moment rather than competing with compute; see `SaveThread`). Called by the cache's forward wrapper."""
        with self._lock:
            self._forwards_active += 1

    def forward_finished(self) -> None:
        """The forward of :meth:`forward_started` ended."""
        with self._cond:
            self._forwards_active -= 1
            self._last_forward = time.monotonic()
            self._cond.notify_all()

    def _append(self, writer: "TurnWriter", token_ids, keys, values) -> bool:
        with self._cond:
            if self._closed:  # closed during a turn (shutdown): the turn goes on, it is just not stored
                writer.dead = True
                return False
            e = self._entries.get(writer.key)
            if not writer.started:
                e = self._start_turn(writer, e)
            elif e is None or e.owner != writer.turn:
                self._stats.stale_writes += 1
                self._once.warning("stale", "session %r was taken over by a newer turn (or removed); writes of the "
                                "older turn are dropped", writer.key[1])
                return False
            buf = e.host
            if buf is None:  # evicted explicitly mid-turn: what was written is durable, the rest is dropped
                self._stats.stale_writes += 1
                writer.dead = True
                return False
            needed = buf.bytes_after_append(int(token_ids.numel()))
            if needed > self.config.host_bytes:
                # Outgrown the host tier: the rest of the session is not stored. What is durable stays (a valid
                # prefix that a later turn reuses): deleting data a flush() acknowledged would be a surprise.
                self._stats.rejected_too_large += 1
                self._once.warning("too_large", "session %r needs %d bytes, more than the host tier's %d: the rest of "
                                "it is not stored (raise `host_bytes` to keep it)", writer.key[1], needed,
                                self.config.host_bytes)
                writer.dead = True
                e.writers.discard(writer.turn)
                if e.persisted and e.pins == 0:
                    e.write = Write.BEHIND
                    self._set_host(e, None)
                elif e.pins == 0:
                    self._drop(e)
                return False
            room = needed - buf.nbytes
            if not self._make_host_room(room, exclude=e):
                # Backpressure: victims are being written to disk and leave host memory when that completes.
                # Wait (bounded) for them rather than overshoot the limit. While it waits, the save thread must
                # not yield to compute (this append *is* the compute): see `_yield_for_save`.
                deadline = time.monotonic() + self.config.io_timeout_s
                self._room_waiters += 1
                self._cond.notify_all()
                try:
                    while not self._make_host_room(room, exclude=e):
                        if time.monotonic() >= deadline or not any(
                                x is not e and x.host is not None and (x.write is Write.DEMOTE or x.pins)
                                for x in self._entries.values()):
                            break  # nothing is being written out or loaded: waiting would only stall the turn
                        self._cond.wait(timeout=0.05)
                        if self._entries.get(writer.key) is not e or e.owner != writer.turn or e.host is not buf:
                            self._stats.stale_writes += 1
                            return False
                finally:
                    self._room_waiters -= 1
                if not self._make_host_room(room, exclude=e):
                    # Everything else is pinned (running turns, loads) or cannot be written: refuse to save the
                    # rest of this turn rather than exceed `host_bytes`. What is stored stays a valid prefix.
                    self._stats.rejected_no_room += 1
                    self._once.warning("no_room", "host tier full of sessions that cannot move (running turns, "
                                    "loads, failed writes): the rest of session %r's turn is not stored",
                                    writer.key[1])
                    writer.dead = True
                    return False
            buf.append(token_ids, keys, values)
            self._host.account(e)
            self._touch(e)
            self._stats.appended_tokens += int(token_ids.numel())
            e.last_write = time.monotonic()
            if self._lower is not None and e.dirty:
                self._dirty.add(e.key)
                if e.length - e.persisted >= self.config.chunk_tokens:
                    self._cond.notify_all()
            return True

    def _start_turn(self, writer: "TurnWriter", e: Entry | None) -> Entry:
        """The first write of a turn: rebases the session on ``base[keep]`` (copy-free when possible)."""
        writer.started = True
        base, keep = writer.base, writer.keep
        writer.base = None  # the snapshot is no longer needed: let its memory go
        n = int(keep.numel())
        same_lineage = e is not None and base is not None and base.generation == e.generation and n > 0
        if same_lineage and e.host is not None and base.source is e.host and n <= e.host.length \
                and torch.equal(keep, torch.arange(n)):
            if n < e.host.length:
                self._cut(e, n)
            # else the common case: append after the history, in place
        elif same_lineage:
            buf = self._host.selected(base, keep)
            self._set_host(e, buf)
            e.generation += 1
            if e.manifest is not None:
                # The kept tokens that were durable stay durable: only the manifest changes, no data is rewritten.
                durable = keep[keep < e.persisted]
                self._set_manifest(e, e.manifest.select(ranges(durable)), e.chunks)
        else:
            old = e
            if old is not None:
                # (Pinned only by a load, which leaves files alone when it finds its entry gone; a save in flight
                # pins it too, and deletes the whole folder when it finds its entry gone: saver.py.)
                if self._disk is not None and old.pins == (old.loading is not None):
                    # Another history replaces the session (a recomputed turn, an edited conversation): its disk
                    # copy stays until the new one is durable (`_hand_over`), so a crash in between, or a failed
                    # write, still leaves the older copy rather than nothing.
                    self._unindex(old)
                else:
                    self._drop(old)
                    old = None
            if base is not None and n:
                buf = self._host.selected(base, keep)
            else:
                buf = self._host.new_buffer(writer.geometry, writer.dtype)
            e = Entry(key=writer.key, layout=(buf.geometry, buf.dtype))
            e.last_access = time.monotonic()
            if old is not None:
                self._hand_over(old, e)
            self._entries[writer.key] = e
            self._set_host(e, buf)
        e.owner = writer.turn
        e.live = weakref.ref(writer) if writer.state_source is not None else None
        e.writers = {writer.turn}  # pinned in host memory until the turn closes; older turns' pins are void
        if e.write is Write.NEVER:
            e.write = Write.BEHIND  # a new turn: the disk tier may have room again
        return e

    # -- reopening --------------------------------------------------------------------------------------
    def _reopen(self) -> None:
        now_wall, now = time.time(), time.monotonic()
        for found in self._disk.scan():
            manifest = found.manifest
            if manifest.length == 0:
                continue
            if not all(serves(self.config.codec, c) for c in found.codecs):
                # Stored with a codec less accurate than this store's (e.g. int4 KV reopened by a lossless
                # store): never served, so its files go rather than hold disk space nothing counts.
                self._once.warning("codec", "disk tier: sessions stored with a less accurate codec than "
                                   "kv_codec=%r are removed (recomputed when used)", self.config.kv_codec)
                self._disk.remove((manifest.fingerprint, manifest.session_id))
                continue
            e = Entry(key=(manifest.fingerprint, manifest.session_id), layout=found.layout)
            self._next_chunk[e.key] = manifest.next_chunk
            e.last_access = now - max(0.0, now_wall - found.mtime)
            self._entries[e.key] = e
            self._set_manifest(e, manifest, found.chunks)
            self._set_files(e, {name: size for name, (size, _) in found.chunks.items()}, found.manifest_size)
        self._expire()


