"""AttnStore: the hierarchical KV store (host memory, then lower tiers) behind AttnStoreCache.

This file is the public API (`find`, `lookup`, `open_turn`, `prefetch`, `flush`, `stats`, ...) and what one `find`
returns (`Found`, `Match`: vLLM's ``get_computed_blocks``, SGLang's ``match_prefix``). It composes the things the
store is made of, one module each: the index (index.py: every entry, pins, dirty marks, byte counters, prefixes,
host memory's order and making room, under one lock, held here as `_index`); the turn writer (writer.py: what a
running turn appends); the save worker (saver.py: what to write next, the thread that writes it, refills); the
loader (loader.py: what to load, the thread that reads it, the measured costs); host memory (buffer.py); the
tiers below it (tiers/: the interface, the disk, Redis), the file format (format.py), the policies (policy.py)
and the codecs (codec.py). With a remote tier, the choice between a local copy and a longer remote one hooks in
(remote_choice.py); a local store never runs it.

Threads. Two I/O threads only move bytes: the load thread reads chunks into host buffers it was handed, the
save thread writes host buffers to a lower tier. Neither sees the index: they report through the planners'
callbacks, which take its lock. Loads have priority: the save thread waits for running loads between chunks
(concurrent reads and writes slowed both by 18-20% in Pensieve).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .buffer import LoadError, SessionKV
from .codec import serves
from .config import StoreConfig, StoreTuning, build_config
from .format import prefix_digest
from .index import Entry, Eviction, Key, NoDiskRoom, StoreState, Write, validate_session_id
from .loader import LoadPlanner, ResumeCosts
from .remote_choice import RemoteChoice
from .saver import SavePlanner
from .states import SessionState
from .stats import StoreStats
from .tiers.disk import DiskTier
from .tiers.redis import RemoteTier
from .writer import TurnSink, TurnWriter

logger = logging.getLogger(__name__)

POOL_SESSION = "<block pool>"  # what `Found.shared` names when the prefix comes from the block pool (`block_pool`)


class StoreIOError(RuntimeError):
    """Writing to the disk tier failed; the failed entries never became visible.

    Example:
        >>> store = AttnStore(host_bytes="1MiB")
        >>> try:
        ...     store.flush()  # writes pending KV to the disk tier (none here)
        ... except StoreIOError as error:  # a disk write failed: what it wrote never became visible
        ...     print("disk trouble:", error)
        >>> store.close()
    """


def _io_error(error: BaseException) -> bool:
    """Whether a failed read is the device's (keep the data) rather than the data's: damaged (FormatError) or
    gone (a file or folder missing or replaced), which is deleted."""
    return isinstance(error, OSError) and not isinstance(
        error, (FileNotFoundError, NotADirectoryError, IsADirectoryError))


class AttnStore:
    """A bounded, hierarchical store of pre-RoPE KV caches, one per (model, session).

    Host memory holds the sessions in use; sessions evicted from it are demoted to the disk tier (if
    any), from which a later turn loads them back layer by layer. Everything a turn computes is saved
    asynchronously: `generate` never waits for the disk. A failure of the store is never an exception
    during generation: damaged or missing data is a miss (see :class:`StoreConfig` for the options).

    Usually handed to :class:`~hf_attnstore.AttnStoreCache`, which reads and writes it; directly:

    Example:
        >>> import tempfile, torch
        >>> kv = [torch.zeros(1, 2, 3, 4) for _ in range(2)]  # per layer: [1, kv_heads, tokens, head_dim]
        >>> store = AttnStore(host_bytes="1GiB", disk_dir=tempfile.mkdtemp(), disk_bytes="10GiB")
        >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
        ...     turn.append(torch.tensor([5, 6, 7]), kv, kv)
        True
        >>> store.flush()  # durable on disk
        >>> store.lookup("chat-1", "model-a").token_ids.tolist()
        [5, 6, 7]
        >>> store.close()
    """

    def __init__(self, host_bytes: int | str = "2GiB", disk_dir: str | os.PathLike | None = None, *,
                 disk_bytes: int | str = "100GiB", remote: str | None = None, remote_required: bool = False,
                 policy: str = "lru", ttl_s: float | None = None, namespace: str | None = None,
                 kv_codec: str | None = None, share_prefixes: bool = True, partial_eviction: bool = False,
                 recompute_by_cost: bool = False, tuning: StoreTuning | None = None,
                 config: StoreConfig | None = None, **legacy):
        """The everyday options; the tuning knobs go in `tuning` (see :class:`StoreConfig` for what each means).

        Raises:
            TypeError: An unknown option, or one of the wrong type.
            DiskLockedError: Another store has `disk_dir` open.
        """
        config = build_config(config, tuning, legacy, host_bytes=host_bytes, disk_dir=disk_dir, disk_bytes=disk_bytes,
                              remote=remote, remote_required=remote_required, policy=policy, ttl_s=ttl_s,
                              namespace=namespace, kv_codec=kv_codec, share_prefixes=share_prefixes,
                              partial_eviction=partial_eviction, recompute_by_cost=recompute_by_cost)
        self.config = config
        self._index = StoreState(config, has_disk=config.disk_dir is not None,
                                 has_lower=config.disk_dir is not None or config.remote is not None)
        self._next_turn = 0
        self._disk = DiskTier(config.disk_dir, fsync=config.fsync,
                              timeout_s=config.io_timeout_s) if config.disk_dir else None
        self._threads: list[threading.Thread] = []
        self._remote: RemoteTier | None = None
        try:
            self._reopening = Reopening(self) if self._disk is not None else None
            if self._reopening is not None and not config.reopen_in_background:
                self._reopening.run()
            if config.remote is not None:
                # Unreachable at start: the tier starts down (misses, reconnected in the background), unless
                # `remote_required`. Refused credentials and malformed URLs always raise.
                self._remote = RemoteTier(config.remote, config.remote_ttl_s, config.remote_timeout_s,
                                          required=config.remote_required)
                if not self._remote.connected:
                    self._index.count(remote_errors=1)
        except BaseException:
            if self._disk is not None:
                self._disk.close()
            raise
        # The tier sessions are saved to and demoted to: the disk, else the remote tier itself. With both, the
        # remote tier holds a copy of what is durable on disk (the save thread's mirror).
        self._lower = self._disk if self._disk is not None else self._remote
        # The choice between a local copy and a longer remote one hooks in only with a remote tier: a local store's
        # lookups are the index's alone (`_find_remote`, `_adopt`).
        self._remote_choice = RemoteChoice(self._index, self._remote, config, local_disk=self._disk is not None,
                                           durable=self._lower is self._remote) if self._remote is not None else None
        self._eviction = Eviction(self._index, config, self._disk, self._lower)
        self._turns = TurnSink(self._index, self._eviction, config, self._disk, self._lower)
        self._loads: LoadPlanner | None = None
        self._costs = ResumeCosts()  # measured load and prefill rates (`recompute_by_cost`)
        if self._lower is not None:
            self._loads = LoadPlanner(self._index, self._eviction, config, self._lower, self._remote, self._load_done,
                                      self._costs)
            self._saves = SavePlanner(self._index, self._eviction, self._loads, config, self._lower, self._disk,
                                      mirror=self._remote if self._lower is self._disk else None)
            self._threads += [self._loads.loader.thread, self._saves.thread.thread]
        if self._reopening is not None and self._reopening.active:
            self._reopening.start()  # last: a session it indexes may be loaded, saved or evicted at once

    def _find_remote(self, key: Key):
        """The remote tier's copy of a session, if it may serve here (`RemoteChoice.find`; network I/O: call
        without the lock); None without a remote tier."""
        return self._remote_choice.find(key) if self._remote_choice is not None else None

    def _adopt(self, key: Key, found) -> Entry | None:
        """The entry a lookup uses (lock held): the index's, or the remote copy `found` (`RemoteChoice.adopt`)."""
        if found is None:
            return self._index.entries.get(key)
        return self._remote_choice.adopt(key, found)

    def lookup(self, session_id: str, fingerprint: str, prefill_key: str | None = None) -> SessionKV | None:
        """A snapshot of the session's KV for this model, or ``None`` (a miss).

        A session found only below host memory starts loading into it at once; the snapshot's
        :meth:`~SessionKV.layer_parts` waits for each layer as needed. With `recompute_by_cost` and a
        `prefill_key` (the caller can recompute a head, and reports its model's prefills under that key to
        :attr:`costs`), leading chunks estimated faster to recompute than to load are left out of
        the load: the snapshot's `head` tells how many tokens the caller recomputes (as for a partially
        evicted session). With a remote tier, the session is
        also looked up there (one round trip): when it is missing here, or longer there (another server
        extended it), the remote copy is loaded. A remote copy replaces a local one only once its chunk headers
        are verified and it has loaded: any failure is a remote miss, and the local copy is served (now, or
        at the next lookup when the failure shows during the load: this snapshot's layers then raise
        ``LoadError``, and the turn recomputes).

        Example:
            >>> store = AttnStore(host_bytes="1MiB")
            >>> store.lookup("chat-1", "model-a") is None  # nothing stored yet: a miss
            True
        """
        key = (fingerprint, validate_session_id(session_id))
        self._claim(key)
        self._index.publish_states([key])  # the previous turn's cache may still be open (and hold the states)
        found = self._find_remote(key)  # network I/O: outside the lock
        with self._index.lock:
            return self._lookup_locked(key, found, prefill_key)

    def _lookup_locked(self, key: Key, found, prefill_key: str | None) -> SessionKV | None:
        """`lookup` under the index's lock, with the remote tier's answer `found` (`RemoteChoice.find`)."""
        self._index.check_open()
        self._index.apply_ended_turns()  # a turn that just ended may have left the state this lookup needs
        self._index.expire()
        self._index.count(lookups=1)
        e = self._adopt(key, found)
        if e is None or e.length == 0:
            self._index.count(misses=1)
            return None
        self._index.touch(e)
        if e.host is not None:
            self._index.count(hits_host=1)
            if e.load_job is not None:
                self._loads.loader.promote(e.load_job)  # a prefetch this turn now waits for
            return e.host.snapshot(loader=e.loading, tier="host", generation=e.generation, key=key)
        tier = self._lower.name if e.manifest is not None else "remote"
        started = self._loads.start(e, prefill_key=prefill_key)
        if not started and e.fallback is not None and self._remote_choice.restore_local(
                e, refuse=e.remote if self._remote.available() else None):
            # The remote copy cannot be loaded now (the tier just failed) or ever (it does not fit host
            # memory: refused until it changes): the local copy it was to replace is served instead.
            e = self._index.entries[key]
            self._index.touch(e)
            tier = self._lower.name
            started = self._loads.start(e, prefill_key=prefill_key)
        if not started:
            self._index.count(misses=1)
            return None
        if tier == "disk":
            self._index.count(hits_disk=1)
        else:
            self._index.count(hits_remote=1)
        return e.host.snapshot(loader=e.loading, tier=tier, generation=e.generation, key=key)

    def _load_done(self, job, error: BaseException | None) -> None:
        """The load thread's report: first the remote choice's part for a remote copy that was to replace a local
        one (put the local copy back if the load failed; forget it once the remote copy has loaded), then the
        bookkeeping of every load (`LoadPlanner.finish`), which no longer finds the failed entry indexed."""
        e = job.entry
        with self._index.cond:
            restored = self._remote_choice is not None and self._remote_choice.loaded(job, error)
            if error is not None and not restored and job.tier is self._disk and _io_error(error) \
                    and self._index.entries.get(e.key) is e and not e.writers:
                # The disk failed to read the copy (EIO, EMFILE, ...), which is not damaged or missing data: a
                # miss now, but the copy stays (indexed afresh), as it may well be readable at the next turn.
                self._index.reindex(e)
                self._index.once.warning("disk_read", "disk tier: reading session %r failed (%s); a miss now, its disk "
                                   "copy is kept", e.key[1], error)
        self._loads.finish(job, error)

    def _claim(self, key: Key) -> None:
        """While the store reopens in the background, indexes the session this call names first (`Reopening`)."""
        if self._reopening is not None and self._reopening.active:
            self._reopening.claim(key)

    @property
    def reopening(self) -> bool:
        """Whether sessions found on disk are still being indexed (only with `reopen_in_background`)."""
        return self._reopening is not None and self._reopening.active

    def wait_reopened(self, timeout: float | None = None) -> bool:
        """Waits until every session found on disk is indexed (`reopen_in_background`); returns whether they are
        (False: `timeout` seconds passed first). Immediate for a store that reopened before its constructor returned.

        Example:
            >>> store = AttnStore(host_bytes="1MiB")
            >>> store.wait_reopened(timeout=1), store.reopening
            (True, False)
            >>> store.close()
        """
        return self._reopening is None or self._reopening.wait(timeout)

    def lookup_prefix(self, fingerprint: str, token_ids: torch.Tensor, exclude: str | None = None,
                      longer_than: int = 0, exact: bool = False) -> tuple[str, int] | None:
        """The stored session (other than `exclude`) whose ids begin with the longest prefix of `token_ids`
        under this fingerprint, and that prefix's length; ``None`` when none shares more than `longer_than`
        tokens, or ``share_prefixes`` is off. Candidates come from the prefix table (whole blocks of 64 tokens,
        index.py); their real ids are compared here, so the length is exact and may end inside a block.
        Sessions whose leading chunks were evicted (partial eviction) are not offered. Pass the session to
        :meth:`lookup` to get its KV, and that snapshot to :meth:`open_turn` as the base of a new history.
        `exact`: only tokens whose KV is exact count (not those computed under sparse attention, `kv_budget`): what a
        dense turn may reuse.

        Example:
            >>> store = AttnStore(host_bytes="1MiB")
            >>> system = torch.arange(100)  # a shared system prompt of 100 tokens
            >>> kv = [torch.zeros(1, 2, 102, 4)]
            >>> with store.open_turn("alice", "model-a", None, torch.empty(0)) as turn:
            ...     _ = turn.append(torch.cat([system, torch.tensor([7, 8])]), kv, kv)
            >>> store.lookup_prefix("model-a", torch.cat([system, torch.tensor([9])]), exclude="bob")
            ('alice', 100)
        """
        if not self.config.share_prefixes:
            return None
        if exclude is not None:
            validate_session_id(exclude)
        ids = torch.as_tensor(token_ids).detach().to("cpu", torch.long).view(-1)
        with self._index.lock:
            self._index.check_open()
            self._index.apply_ended_turns()
            return self._prefix_locked(fingerprint, ids, exclude, longer_than, exact)

    def _prefix_locked(self, fingerprint: str, ids: torch.Tensor, exclude: str | None, longer_than: int,
                       exact: bool) -> tuple[str, int] | None:
        """`lookup_prefix` under the index's lock."""
        best = None
        for key, _ in self._index.prefixes.candidates(fingerprint, ids, (fingerprint, exclude), every_depth=exact):
            e = self._index.entries.get(key)
            if e is None or e.length <= longer_than:
                continue
            if e.host is not None:
                if e.host.missing_head:
                    continue
                snap = e.host.snapshot()
                stored = snap.token_ids[: snap.exact_prefix() if exact else None]
            else:
                durable = e.manifest or e.remote
                if durable is None or durable.head:
                    continue
                stored = durable.token_ids[: durable.exact_tokens if exact else None]
            n = min(stored.numel(), ids.numel())
            differ = (stored[:n] != ids[:n]).nonzero()
            n = int(differ[0]) if differ.numel() else n
            if n > longer_than and (best is None or n > best[1]):
                best = (key[1], n)
        if best is not None:
            self._index.count(prefix_hits=1)
        return best

    def find(self, session_id: str, fingerprint: str, prompt_ids: torch.Tensor, *, prefill_key: str | None = None,
             exact: bool = True, share: bool = True, wait_first: bool = False,
             geometry: tuple | None = None) -> Found:
        """Everything a turn of `session_id` needs to plan its reuse of stored KV for `prompt_ids`, in one call.

        Does what :meth:`lookup`, :meth:`lookup_prefix` and a second :meth:`lookup` did for a turn, under the
        index's lock once (the remote tier is asked before, without it): the session's own KV, and, with `share`
        (and ``share_prefixes``), another session that begins with a longer prefix of the prompt than the own
        KV shares with it, when one does. Each match comes with its snapshot (which holds what the turn will load),
        the ids whose KV may be reused, and what the store verified: a match whose shapes differ from `geometry`,
        whose load failed while `wait_first` waited, or (for the shared one) that lacks its head is not returned. With a
        ``block_pool``, the shared match may be the pool's leading blocks of the prompt instead, when they are longer
        (named ``POOL_SESSION``); the pool is asked, and its hit counted, for every prompt. Pass the chosen
        match's snapshot to :meth:`open_turn`.

        Args:
            session_id, fingerprint: The session and the key of the model's KV, as for `lookup`.
            prompt_ids: The turn's whole prompt, 1-D ids.
            prefill_key: As for `lookup` (`recompute_by_cost`); for the own session only.
            exact: Only tokens whose KV is exact count (not those computed under sparse attention): a dense turn.
            share: Look for another session's longer prefix (not for a hybrid model, whose states belong to one
                history, nor for a prompt that truncation cuts).
            wait_first: Wait until the first layer of a match still loading is read (without the lock): its
                check covers the states stored with it (`Match.state`, verified to summarize exactly this
                session's first ids) and its tokens without KV (`Match.absent`). A load that fails is a miss. The
                shared match is waited for only when not `exact` (a sparse turn needs its absent tokens).
            geometry: The model's KV geometry (`fingerprint.kv_geometry`): stored KV of other shapes is a miss.

        Returns:
            A :class:`Found`; ``Found(None, None)`` on a miss.

        Example:
            >>> store = AttnStore(host_bytes="1MiB")
            >>> system = torch.arange(100)  # a shared system prompt of 100 tokens
            >>> kv = [torch.zeros(1, 2, 102, 4)]
            >>> with store.open_turn("alice", "model-a", None, torch.empty(0)) as turn:
            ...     _ = turn.append(torch.cat([system, torch.tensor([7, 8])]), kv, kv)
            >>> found = store.find("bob", "model-a", torch.cat([system, torch.tensor([9])]))
            >>> found.own is None, found.shared.session_id, found.shared.length
            (True, 'alice', 100)
        """
        key = (fingerprint, validate_session_id(session_id))
        self._claim(key)
        ids = torch.as_tensor(prompt_ids).detach().to("cpu", torch.long).view(-1)
        self._index.publish_states([key])  # the previous turn's cache may still be open (and hold the states)
        remote = self._find_remote(key)  # network I/O: outside the lock
        other = None
        with self._index.lock:
            own = self._fits(self._lookup_locked(key, remote, prefill_key), geometry)
            # The block pool is asked for every prompt (its hit is counted even where the turn cannot use it).
            pooled, pool_snap = self._index.match_blocks(fingerprint, ids)
            limit = ids.numel() - 1  # a turn computes at least one token: reuse ends before the last
            if share and limit > 0:
                reusable = own.token_ids[: own.exact_prefix() if exact else None] if own is not None else ids[:0]
                n = min(reusable.numel(), limit)
                differ = (reusable[:n] != ids[:n]).nonzero()
                longer_than = int(differ[0]) if differ.numel() else n
                best = (self._prefix_locked(fingerprint, ids, key[1], longer_than, exact)
                        if self.config.share_prefixes and longer_than < limit else None)
                if best is not None and min(best[1], limit) > longer_than:
                    snap = self._fits(self._lookup_locked((fingerprint, best[0]), None, None), geometry)
                    if snap is not None and not snap.head:
                        other = (snap, best[1])
                if pool_snap is not None and min(pooled, limit) > max(longer_than, other[1] if other else 0) \
                        and (geometry is None or pool_snap.source.geometry == geometry):
                    other = (pool_snap, pooled)
        # Waiting for a load happens without the lock: the load thread reports under it.
        own = match_of(own, None, exact, wait_first) if own is not None else None
        shared = match_of(other[0], other[1], exact, wait_first and not exact) if other is not None else None
        if shared is not None and other[0] is pool_snap:
            shared = dataclasses.replace(shared, session_id=POOL_SESSION)
        return Found(own, shared)

    def _fits(self, snapshot: SessionKV | None, geometry: tuple | None) -> SessionKV | None:
        """The snapshot, or None when its shapes differ from the model's `geometry` (a miss, never an error)."""
        if snapshot is None or geometry is None or snapshot.source.geometry == geometry:
            return snapshot
        self._index.once.warning("geometry", "stored KV of session %r does not fit the model: ignored", snapshot.key[1])
        return None

    def open_turn(self, session_id: str, fingerprint: str, base: SessionKV | None, keep: torch.Tensor) -> "TurnWriter":
        """Starts a turn: its writes make the session ``base[keep]`` followed by what it appends.

        Nothing changes until the first append, so a turn that never runs loses nothing. The newest turn
        of a session owns it; appends of older turns are dropped and counted as stale.

        Example:
            >>> store = AttnStore(host_bytes="1MiB")
            >>> kv = [torch.zeros(1, 2, 3, 4)]  # one layer: [1, kv_heads, tokens, head_dim]
            >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
            ...     turn.append(torch.tensor([5, 6, 7]), kv, kv)
            True
            >>> base = store.lookup("chat-1", "model-a")
            >>> one = [torch.ones(1, 2, 1, 4)]
            >>> with store.open_turn("chat-1", "model-a", base, torch.arange(2)) as turn:  # keeps 2 tokens, appends 1
            ...     turn.append(torch.tensor([9]), one, one)
            True
            >>> store.token_ids("chat-1", "model-a").tolist()
            [5, 6, 9]
        """
        key = (fingerprint, validate_session_id(session_id))
        self._claim(key)
        with self._index.lock:
            self._index.check_open()
            self._next_turn += 1
            writer = TurnWriter(self._turns, key, self._next_turn, base, keep)
        # A writer dropped without close() ends its turn too (deque.append is safe in a finalizer).
        weakref.finalize(writer, self._index.ended_turns.append, (key, writer.turn, None, True))
        return writer

    def prefetch(self, session_ids, fingerprint: str | Sequence[str] | None = None,
                 prefill_key: str | None = None) -> int:
        """Starts loading these sessions from lower tiers into host memory. Returns how many loads started.

        With `fingerprint` (or several: a model whose KV is keyed per RoPE regime, see
        ``AttnStoreCache.fingerprints_of``) and a remote tier, sessions are also looked up there (one round
        trip each and fingerprint). Without it, a session is prefetched under whichever model stored it.
        With `prefill_key` (as `lookup` takes it) and `recompute_by_cost`, the load of the *first* session is
        decided by cost as its turn's own lookup would be: it is for a turn about to run, which recomputes what is
        left out. The others, and a look-ahead prefetch without a key, load whole: off the critical path.

        Example:
            >>> import tempfile
            >>> store = AttnStore(host_bytes="1MiB", disk_dir=tempfile.mkdtemp())
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
            ...     _ = turn.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> store.evict("chat-1"); store.flush()  # now on disk only
            >>> store.prefetch(["chat-1"])  # its next turn will find it in host memory
            1
            >>> store.close()
        """
        wanted = [validate_session_id(s) for s in session_ids]
        fingerprints = [fingerprint] if fingerprint is None or isinstance(fingerprint, str) else list(fingerprint)
        keys = [(fp, sid) for sid in dict.fromkeys(wanted) for fp in fingerprints]
        for key in keys:
            if key[0] is not None:
                self._claim(key)
        found = {}
        if self._remote is not None:
            for key in keys:
                if key[0] is not None:
                    found[key] = self._find_remote(key)  # network I/O: outside the lock
        with self._index.lock:
            self._index.check_open()
            for key, hit in found.items():
                self._adopt(key, hit)
            # Remembered, in order: sessions that do not fit yet are fetched when a write-out frees room.
            if self._loads is None:
                return 0  # host memory only: nothing to load from
            self._loads.wanted, self._loads.wanted_key = keys, prefill_key
            return self._loads.retry_prefetch()

    def set_schedule(self, session_ids: list[str]) -> None:
        """Tells a scheduler-aware policy (``policy="lookahead"``) the sessions of the waiting jobs, in order.

        Ignored by policies that do not look ahead.

        Example:
            >>> store = AttnStore(host_bytes="1MiB", policy="lookahead")
            >>> store.set_schedule(["chat-7", "chat-2"])  # chat-7's job runs next: evicted last
        """
        with self._index.lock:
            for policy in (self._index.host.policy, self._index.disk_policy):
                policy.set_queue(list(session_ids))

    def evict(self, session_id: str) -> None:
        """Moves the session out of host memory: to the tier below (after its pending writes), or drops it.

        Example:
            >>> store = AttnStore(host_bytes="1MiB")  # no lower tier: evicting drops the session
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
            ...     _ = turn.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> store.evict("chat-1")
            >>> store.tier_of("chat-1", "model-a") is None
            True
        """
        validate_session_id(session_id)
        with self._index.lock:
            for e in [self._index.entries[k] for k in self._index.keys_of(session_id)]:
                if e.host is not None:
                    self._eviction.evict_from_host(e)

    def retain(self, session_id: str, fingerprint: str, seconds: float) -> None:
        """Keeps the session from expiring by idleness (`ttl_s`) for `seconds` from now, whether it is stored yet
        or not (OpenAI's ``prompt_cache_retention``). Capacity may still evict it: counted in
        `StoreStats.retained_dropped`.

        Example:
            >>> store = AttnStore(host_bytes="1MiB", ttl_s=60)
            >>> store.retain("chat-1", "model-a", 24 * 3600)
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
            ...     _ = turn.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> store.stats().retained_sessions
            1
        """
        if not seconds > 0:
            raise ValueError(f"`seconds` must be positive, got {seconds!r}")
        key = (fingerprint, validate_session_id(session_id))
        self._claim(key)
        with self._index.lock:
            self._index.check_open()
            self._index.retain(key, float(seconds))

    def delete(self, session_id: str, fingerprint: str | None = None) -> bool:
        """Removes the session's KV from every tier, for every model (or only that stored under `fingerprint`).
        Returns whether anything was removed (while the store reopens in the background, sessions not indexed yet
        are removed when they are reached, and do not count here unless `fingerprint` names them).

        Example:
            >>> store = AttnStore(host_bytes="1MiB")
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
            ...     _ = turn.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> store.delete("chat-1"), store.delete("chat-1")
            (True, False)
        """
        validate_session_id(session_id)
        if fingerprint is not None:
            self._claim((fingerprint, session_id))
        with self._index.lock:
            if fingerprint is None and self._reopening is not None:
                self._reopening.forget(session_id)  # its folders not indexed yet go when the reopen reaches them
            victims = [self._index.entries[k] for k in self._index.keys_of(session_id)
                       if fingerprint is None or k[0] == fingerprint]
            for e in victims:
                self._index.drop(e)
                if self._remote is not None:
                    self._remote.remove(e.key)  # queued behind its pending writes: never resurrected
            return bool(victims)

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every session is durable on disk, or in the remote tier when there is no disk tier
        (a no-op without either), and the deletions queued before it (`delete`, eviction) are done.

        Writes that failed earlier (full disk, I/O error) are retried once now. A remote tier that lost its data
        (a restarted Redis) is noticed here, and the sessions it lost are written again before this returns.

        Raises:
            StoreIOError: Some sessions are still not durable after the retry, or were refused as larger than
                the disk tier can hold next to what cannot leave it (not retried until their next turn); the
                message names them. They
                keep being served from host memory, stay pending (a later flush retries them), and their
                failed state never became visible on disk.
            TimeoutError: Not durable within `timeout` seconds.

        Example:
            >>> import tempfile
            >>> store = AttnStore(host_bytes="1MiB", disk_dir=tempfile.mkdtemp())
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
            ...     _ = turn.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> store.flush(timeout=30)
            >>> store.stats().saves_pending
            0
            >>> store.close()
        """
        if self._lower is None:
            return
        timeout = self.config.io_timeout_s if timeout is None else timeout
        self._index.publish_states(None)
        self._saves.check_lost()  # a remote tier that lost its data is written again before this returns
        with self._index.cond:
            self._index.apply_ended_turns()  # end-of-turn states are part of what becomes durable
            for key in list(self._index.dirty):
                e = self._index.entries.get(key)
                if e is not None and e.write is not Write.DEMOTE:
                    self._index.set_write(e, Write.FLUSH)  # a failed write is retried now
            self._index.cond.notify_all()

            def settled() -> bool:  # every pending write has completed or failed again, every deletion is done
                if self._index.closed:
                    return True
                # (Asked again at every save's end: the entries are walked only while some load is in flight.)
                if self._index.loads_active and any(e.loading is not None and e.remote is not None
                                                    for e in self._index.entries.values()):
                    return False  # a session found in the remote tier is loading: once local, it is written too
                return self._index.deletions == 0 and not self._index.remirror and all(
                    self._index.entries.get(k) is None or self._index.entries[k].write is Write.FAILED
                    for k in self._index.dirty)

            if not self._index.cond.wait_for(settled, timeout):
                raise TimeoutError(f"the {self._lower.name} tier did not become durable within {timeout} s")
            failed = [self._index.entries[k] for k in self._index.dirty if self._index.entries.get(k) is not None]
            # Sessions refused as larger than the disk tier (`NoDiskRoom`): kept in host memory only, not durable.
            failed += [e for e in self._index.entries.values() if e.write is Write.NEVER and e.host is not None
                       and e.host.length > e.persisted and isinstance(e.last_error, NoDiskRoom)]
        if failed:
            names = ", ".join(repr(e.key[1]) for e in failed[:5]) + (" ..." if len(failed) > 5 else "")
            raise StoreIOError(f"{len(failed)} session(s) are not durable in the {self._lower.name} tier ({names}): "
                               f"{failed[0].last_error}") from failed[0].last_error

    def stats(self) -> StoreStats:
        """A snapshot of the counters.

        Example:
            >>> store = AttnStore(host_bytes="1MiB")
            >>> _ = store.lookup("chat-1", "model-a")
            >>> s = store.stats()
            >>> s.lookups, s.misses, s.hits
            (1, 1, 0)
        """
        with self._index.lock:
            return self._index.stats_snapshot(local_disk=bool(self._disk),
                                              remote_down=int(self._remote is not None and not self._remote.available()))

    def token_ids(self, session_id: str, fingerprint: str) -> torch.Tensor | None:
        """The ids a session's stored KV covers (without loading anything), or ``None``.

        With a remote tier, a session missing here or longer there is looked up there too (as by `lookup`),
        so a server that never saw a conversation resumes it where another server left it.

        Example:
            >>> store = AttnStore(host_bytes="1MiB")
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
            ...     _ = turn.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> store.token_ids("chat-1", "model-a").tolist(), store.token_ids("chat-1", "model-b")
            ([5, 6, 7], None)
        """
        key = (fingerprint, validate_session_id(session_id))
        self._claim(key)
        found = self._find_remote(key)  # network I/O: outside the lock
        with self._index.lock:
            e = self._adopt(key, found)
            if e is None or e.length == 0:
                return None
            if e.host is not None:
                return e.host.snapshot().token_ids.clone()
            return (e.manifest or e.remote).token_ids.clone()

    @property
    def costs(self) -> ResumeCosts:
        """The measured rates that `recompute_by_cost` decides by: each lower tier's load rate (measured by the
        load thread) and each model's prefill rate (reported by `AttnStoreCache`, when the store's
        `recompute_by_cost` is on, under the `prefill_key` it passes to `lookup`, through
        :meth:`ResumeCosts.observe_prefill`; a caller may report its own).

        Example:
            >>> store = AttnStore(host_bytes="1MiB")
            >>> store.costs.load_bytes_per_s("disk") is None  # nothing loaded yet: nothing assumed
            True
        """
        return self._costs

    def fill_head(self, snapshot: SessionKV, keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
        """Gives a partially evicted session its recomputed head back in host memory (see `SessionKV.head`).

        Called by the turn that recomputed it (AttnStoreCache), with per-layer pre-RoPE ``[1, kv_heads, head,
        head_dim]`` tensors of the snapshot's first ``snapshot.head`` tokens. The first caller fills the buffer;
        a concurrent or later one finds it claimed and changes nothing. Returns whether this call filled it.

        Example:
            >>> store = AttnStore(host_bytes="1MiB")
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
            ...     _ = turn.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> snap = store.lookup("chat-1", "model-a")
            >>> snap.head, store.fill_head(snap, kv, kv)  # nothing evicted: no head to fill, nothing changes
            (0, False)
        """
        buf, head = snapshot.source, snapshot.head
        with self._index.lock:
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
            with self._index.lock:
                buf.head_claimed = False
            raise
        with self._index.cond:
            buf.missing_head = 0  # a truncation meanwhile only shortened it; the tokens kept are filled
            e = self._index.entries.get(snapshot.key) if snapshot.key is not None else None
            if e is not None and e.host is buf and e.remote is None and e.dirty:
                # A remote copy loaded without its head (`recompute_by_cost`) is written locally now that it is
                # whole (LoadPlanner.finish left it out of the dirty set until then).
                self._index.mark_dirty(e)
                self._index.cond.notify_all()
        return True

    def tier_of(self, session_id: str, fingerprint: str) -> str | None:
        """``"host"``, ``"disk"``, ``"remote"`` or ``None``: where the session's KV is now (``"remote"``: only in
        the shared remote tier, as far as this store knows).

        Example:
            >>> store = AttnStore(host_bytes="1MiB")
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
            ...     _ = turn.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> store.tier_of("chat-1", "model-a"), store.tier_of("chat-2", "model-a")
            ('host', None)
        """
        validate_session_id(session_id)
        self._claim((fingerprint, session_id))
        with self._index.lock:
            e = self._index.entries.get((fingerprint, session_id))
            if e is None:
                return None
            return "host" if e.host is not None else self._lower.name if e.manifest is not None else "remote"

    def sessions(self) -> list[str]:
        """Session ids with stored KV (for any model).

        Example:
            >>> store = AttnStore(host_bytes="1MiB")
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> for sid in ("b", "a"):
            ...     with store.open_turn(sid, "model-a", None, torch.empty(0)) as turn:
            ...         _ = turn.append(torch.tensor([5, 6, 7]), kv, kv)
            >>> store.sessions(), "a" in store
            (['a', 'b'], True)
        """
        with self._index.lock:
            return sorted({sid for _, sid in self._index.entries})

    def __contains__(self, session_id: str) -> bool:
        validate_session_id(session_id)
        with self._index.lock:
            return bool(self._index.keys_of(session_id))

    def close(self, flush: bool = True) -> None:
        """Persists pending writes (unless `flush=False`) and stops the I/O threads. Idempotent.

        Example:
            >>> with AttnStore(host_bytes="1MiB") as store:  # the context manager closes it
            ...     store.sessions()
            []
            >>> store.close()  # idempotent
        """
        if self._index.closed:
            return
        try:
            if flush:
                self.flush()
        finally:
            with self._index.cond:
                self._index.close()
                self._index.cond.notify_all()
            if self._threads:
                self._loads.loader.stop()
            for thread in self._threads:
                thread.join(timeout=self.config.io_timeout_s)
            if self._reopening is not None:
                self._reopening.close()  # (it stops at the next folder: the index is closed)
            if self._disk is not None:
                self._disk.close()
            if self._remote is not None:
                self._remote.close()

    def __enter__(self) -> "AttnStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def forward_started(self) -> None:
        """A model forward that uses this store begins: the save thread yields to it (saves wait for a quiet
        moment rather than competing with compute; see `SaveThread`). Called by the cache's forward wrapper.

        Example:
            >>> store = AttnStore(host_bytes="1MiB")
            >>> store.forward_started()
            >>> try:
            ...     pass  # the model's forward
            ... finally:
            ...     store.forward_finished()
        """
        with self._index.lock:
            self._index.forward_started()

    def forward_finished(self) -> None:
        """The forward of :meth:`forward_started` ended.

        Example:
            >>> store = AttnStore(host_bytes="1MiB")
            >>> store.forward_started()
            >>> store.forward_finished()  # saves may run again
            >>> store.close()
        """
        with self._index.cond:
            self._index.forward_ended()
            self._index.cond.notify_all()

class Reopening:
    """Indexes the sessions a disk tier holds when the store opens on it.

    At once, before the constructor returns (`run`), or on a thread while the store serves (`start`, with
    `reopen_in_background`): then every call that names a session claims it first (`claim`), which indexes that
    session's folder (named by its key) at once if the thread has not, so a resumed session is never missed. A
    folder is handled once, by whichever comes first; the thread changes nothing in a session's folder (a crash's
    temporary files, a damaged folder) without the index's lock, and never a folder a call claimed. A session
    deleted by id alone while the thread runs (`forget`) has its folders, and their remote copies, removed when the
    thread reaches them.

    Example:
        >>> import tempfile, torch
        >>> kv = [torch.zeros(1, 2, 3, 4)]
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     with AttnStore(host_bytes="1MiB", disk_dir=folder) as store:
        ...         with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
        ...             _ = turn.append(torch.tensor([5, 6, 7]), kv, kv)
        ...     with AttnStore(host_bytes="1MiB", disk_dir=folder,
        ...                    tuning=StoreTuning(reopen_in_background=True)) as store:
        ...         length = store.lookup("chat-1", "model-a").length  # indexed by this call, or by the thread
        ...         print(length, store.wait_reopened(timeout=60), store.reopening)
        3 True False
    """

    def __init__(self, store: "AttnStore"):
        self.index, self.disk, self.config = store._index, store._disk, store.config
        self.store = weakref.proxy(store)  # (its remote tier, made after this: a forgotten session's copy there)
        self.active = True  # read without the lock by the calls (a stale True only costs taking it)
        self.done = threading.Event()
        self.handled: set[str] = set()  # folder names indexed, claimed or removed (lock held)
        self.forgotten: set[str] = set()  # session ids deleted while reopening, for any model (lock held)
        self.links: dict[tuple, list] = {}  # a shared file -> [its names counted as shared yet, first holder]
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        """Indexes every session now (the constructor's reopen)."""
        sessions = list(self.disk.scan())
        with self.index.lock:
            for found in sessions:
                self._index_one(found)
            self._finish()

    def start(self) -> None:
        """Indexes the sessions on a thread (`reopen_in_background`)."""
        self.thread = threading.Thread(target=self._scan, name="attnstore-reopen", daemon=True)
        self.thread.start()

    def _scan(self) -> None:
        try:
            # (Each folder is looked up just before it is read: one a call has claimed is not read at all.)
            unclaimed = (folder for folder in self.disk.folders() if not self._handled(folder.name))
            for folder, found, doomed, error in self.disk.read_folders(unclaimed):
                if self.index.closed:
                    return
                try:
                    if error is not None:
                        raise error
                    with self.index.lock:
                        if folder.name in self.handled or self.index.closed:
                            continue  # a call claimed it meanwhile (and may be writing there)
                        self.handled.add(folder.name)
                        try:
                            self.disk.remove_paths(doomed)
                            if found is not None:
                                self._index_one(found)
                        except BaseException:
                            self.handled.discard(folder.name)  # a call naming it tries again
                            raise
                except Exception as exc:  # one folder's failure must not stop the rest: report it, go on
                    logger.exception("disk tier: reopening %s failed (%s); it is tried again when a call names it",
                                     folder.name, exc)
        except Exception as exc:
            logger.exception("disk tier: the reopen scan failed (%s); sessions not indexed yet are indexed when "
                             "named", exc)
        finally:
            with self.index.cond:
                try:
                    if not self.index.closed:
                        # Indexed in the disk's order, not the sessions' last accesses (a reopen at once sorts
                        # first): the eviction order is put right once, those used since start-up last.
                        self.index.order_disk_by_access()
                except Exception as exc:
                    logger.exception("disk tier: ordering the reopened sessions failed (%s)", exc)
                finally:
                    self._finish()
                    self.index.cond.notify_all()

    def _handled(self, name: str) -> bool:
        with self.index.lock:
            return name in self.handled

    def claim(self, key: Key) -> None:
        """Indexes the session's folder now if the thread has not handled it (a call names it)."""
        if not self.active:
            return
        folder = self.disk.session_dir(*key)
        with self.index.lock:
            if not self.active or self.index.closed or folder.name in self.handled:
                return
            self.handled.add(folder.name)  # first: the thread skips it from now on
            if key in self.index.entries:
                return  # (indexed some other way: the thread never touches it now)
            # One folder's reading under the lock, once per session while reopening: simpler than any handshake
            # with the thread, and a call that names it must wait for it anyway.
            try:
                found, doomed = self.disk.scan_folder(folder)
                self.disk.remove_paths(doomed)
                if found is not None:
                    self._index_one(found)
            except Exception as exc:  # the call goes on with a miss; the next one naming it tries again
                self.handled.discard(folder.name)
                logger.exception("disk tier: reopening %s failed (%s); served as a miss", folder.name, exc)

    def forget(self, session_id: str) -> None:
        """The session is deleted for every model (lock held): folders of it not indexed yet go when reached."""
        if self.active:
            self.forgotten.add(session_id)

    def wait(self, timeout: float | None) -> bool:
        return self.done.wait(timeout)

    def close(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=self.config.io_timeout_s)

    def _index_one(self, found) -> None:
        """Indexes one valid session found on disk (lock held)."""
        manifest = found.manifest
        key = (manifest.fingerprint, manifest.session_id)
        if manifest.length == 0 or key in self.index.entries:
            return
        if manifest.session_id in self.forgotten:
            self.disk.remove(key)
            remote = getattr(self.store, "_remote", None)
            if remote is not None:
                remote.remove(key)  # as `delete` removes an indexed session's: never resurrected from there
            return
        if not all(serves(self.config.codec, c) for c in found.codecs):
            # Stored with a codec less accurate than this store's (e.g. int4 KV reopened by a lossless
            # store): never served, so its files go rather than hold disk space nothing counts.
            self.index.once.warning("codec", "disk tier: sessions stored with a less accurate codec than "
                                    "kv_codec=%r are removed (recomputed when used)", self.config.kv_codec)
            self.disk.remove(key)
            return
        if found.sparse and not self.config.sparse_copies:  # likewise: sparse cold copies, not asked for
            self.index.once.warning("sparse", "disk tier: sessions kept as sparse cold copies are removed "
                                    "(`sparse_copies` is off; recomputed when used)")
            self.disk.remove(key)
            return
        e = Entry(key=key, layout=found.layout)
        now_wall, now = time.time(), time.monotonic()
        # (The prefix table is rebuilt from the manifests, never read from a file.)
        self.index.reopened(e, manifest, {name: size for name, (size, _) in found.chunks.items()},
                            found.manifest_size, found.chunks, now - max(0.0, now_wall - found.mtime))
        # Shared files are counted once, from the names the valid manifests reference (the scan collected the
        # others): the file system's links are the reference counts, rebuilt here, never read from a file. A file
        # is counted as shared from its second holder on; one whose first holder is gone meanwhile stays that
        # holder's no longer.
        for name, inode in found.inodes.items():
            size = found.chunks[name][0]
            family = self.links.get(inode)
            if family is None:
                self.links[inode] = [False, (e, name, size)]
                continue
            if not family[0]:
                first, first_name, first_size = family[1]
                if self.index.entries.get(first.key) is first and first_name in first.files:
                    self.index.mark_linked(first, first_name, inode, first_size)
                family[0], family[1] = True, None
            self.index.mark_linked(e, name, inode, size)

    def _finish(self) -> None:
        """The reopen is over (lock held): what it held is dropped, and sessions past their TTL expire."""
        self.active = False
        self.handled, self.forgotten, self.links = set(), set(), {}
        if not self.index.closed:
            self.index.expire()
        self.done.set()


@dataclass(frozen=True)
class Match:
    """One stored session a turn may reuse KV from.

    Attributes:
        session_id: The session the KV was stored by.
        token_ids: The ids whose KV may be reused, ``[n]`` (int64, CPU): for an exact lookup, the session's tokens
            before the first one computed under sparse attention; for a shared prefix, the prefix.
        snapshot: The stored KV (the turn loads from it); None only where a planner is tested on plain tensors.
        tier: Where the KV comes from: ``"host"``, ``"disk"`` or ``"remote"``.
        head: Leading tokens without KV (a partially evicted session, or chunks cheaper to recompute): the
            turn recomputes them.
        absent: Where tokens lack KV, ``[kv_slots, kv_heads, len(token_ids)]`` (sparse cold copies), or None.
        state: The states (and scores) stored with the session, verified to be this session's and to summarize
            exactly its first ``state.tokens`` ids; None when there are none or they are in doubt.
            `absent` and `state` are known once the first layer is read: for a match still loading, only when
            `find` waited for it (`wait_first`), else None.

    Example:
        >>> m = Match("alice", torch.tensor([5, 6, 7]), None, "host")
        >>> m.length
        3
    """

    session_id: str
    token_ids: torch.Tensor
    snapshot: SessionKV | None
    tier: str
    head: int = 0
    absent: torch.Tensor | None = None
    state: SessionState | None = None

    @property
    def length(self) -> int:
        """How many tokens the match offers."""
        return int(self.token_ids.numel())


@dataclass(frozen=True)
class Found:
    """The result of :meth:`AttnStore.find <hf_attnstore.store.AttnStore.find>`.

    Attributes:
        own: The session's own stored KV, or None (a miss).
        shared: Another session whose stored ids begin with a longer prefix of the prompt than `own` shares with
            it (a shared system prompt, a regenerated or edited turn, a branch), or None.

    Example:
        >>> Found(None, None).own is None
        True
    """

    own: Match | None
    shared: Match | None = None


def verified_state(snapshot: SessionKV) -> SessionState | None:
    """The states stored with `snapshot` if they are the snapshot's session's and summarize exactly its first
    ``state.tokens`` ids (their digest matches), else None. A snapshot still loading must have its first layer
    (the loader reads and verifies the state before it).

    Example:
        >>> from hf_attnstore.store import AttnStore
        >>> from hf_attnstore.store.states import SessionState
        >>> store = AttnStore(host_bytes="1MiB")
        >>> kv = [torch.zeros(1, 2, 3, 4)]
        >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
        ...     _ = turn.append(torch.tensor([5, 6, 7]), kv, kv)
        ...     turn.close(SessionState.capture(3, {"L0000.r0": torch.ones(2, 4)}))  # a hybrid model's states
        >>> verified_state(store.lookup("chat-1", "model-a")).tokens
        3
    """
    state = snapshot.state if snapshot.loader is None else snapshot.source.state
    if state is None or snapshot.key is None or state.tokens > snapshot.length or state.key != snapshot.key \
            or state.prefix != prefix_digest(snapshot.key[0], snapshot.token_ids[: state.tokens]):
        return None
    return state


def match_of(snapshot: SessionKV, end: int | None, exact: bool, wait_first: bool) -> Match | None:
    """The :class:`Match` of a snapshot's first `end` tokens (None: all); `exact`: only those before the first
    inexact one. `wait_first`: a snapshot still loading is waited for until its first layer, whose check covers
    the states and the absent tokens (call without the store's lock: the load thread reports under it); a load
    that failed is a miss (None).

    Example:
        >>> from hf_attnstore.store import AttnStore
        >>> store = AttnStore(host_bytes="1MiB")
        >>> kv = [torch.zeros(1, 2, 3, 4)]
        >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
        ...     _ = turn.append(torch.tensor([5, 6, 7]), kv, kv, inexact_at=2)  # token 7 under sparse attention
        >>> match = match_of(store.lookup("chat-1", "model-a"), None, exact=True, wait_first=True)
        >>> match.session_id, match.token_ids.tolist(), match.tier
        ('chat-1', [5, 6], 'host')
    """
    if wait_first and snapshot.loader is not None:
        try:
            snapshot.loader.wait_layer(0)
        except LoadError:
            return None
    end = snapshot.length if end is None else min(end, snapshot.length)
    if exact:
        end = snapshot.exact_prefix(end)
    absent = snapshot.absent() if wait_first or snapshot.loader is None else None
    state = verified_state(snapshot) if wait_first or snapshot.loader is None else None
    return Match(session_id=snapshot.key[1] if snapshot.key is not None else "", token_ids=snapshot.token_ids[:end],
                 snapshot=snapshot, tier=snapshot.tier, head=snapshot.head,
                 absent=absent[:, :, :end] if absent is not None else None, state=state)
