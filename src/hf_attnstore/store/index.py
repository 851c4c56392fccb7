"""The index: what the store knows about every session, under one lock, and the decisions that change it.

`StoreState` holds every session's `Entry` (keyed by ``(fingerprint, session_id)``), the byte counters, pins, dirty
marks, disk reservations, the statistics and the queues to the I/O threads; beside it, the prefix table
(`PrefixTable`: which sessions begin with which prefix, chained block hashes as vLLM's automatic prefix caching
keys its blocks), host memory's bookkeeping (`HostTier`: bytes and the policy's order) and making room
(`Eviction`: host demotion, the disk limit, partial eviction). The store, the turn writer's sink and the planners
read it while holding `StoreState.lock`; **only `StoreState`'s methods change it** (tests/store/test_ownership.py).
The I/O threads never see it: the save thread talks to `SavePlanner`, the load thread reports through a callback,
a turn's writer through its `TurnSink`.

Sessions are named paths over chunks: an entry's durable copy is a manifest, a list of spans over chunk files,
each chunk identified by a digest chained over every token id before it (format.py), so sessions whose histories
start alike share chunks, and eviction frees a chunk only when its last user lets go (docs/design.md, "The
store's state and its owner").

Example:
    >>> from hf_attnstore.store.config import StoreConfig
    >>> state = StoreState(StoreConfig(host_bytes="1MiB"), has_disk=False, has_lower=False)
    >>> with state.lock:
    ...     state.check_open()
    ...     len(state.entries), state.disk_used
    (0, 0)
"""

from __future__ import annotations

import enum
import hashlib
import heapq
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, fields
from itertools import islice

import torch

from .buffer import LoadHandle, SessionBuffer, SessionKV
from .config import StoreConfig
from .format import Manifest, prefix_digest
from .policy import choose_head_drops, choose_victims, head_drop_candidates, make_policy
from .states import SessionState
from .stats import OnceLogger, StoreStats
from .tiers.base import CHUNK_SUFFIX, Key, MANIFEST, Tier
from .tiers.disk import DiskTier

logger = logging.getLogger("hf_attnstore.store.store")


MAX_RETAINED = 1_000_000  # sessions with a retention deadline (`StoreState.retain`): a bounded index

class StoreState:
    """The entries of every session and the counters of every tier, owned under one lock (see the module
    docstring). Methods other than `publish_states` and `queue_ended_turn` expect the caller to hold `lock`.

    Example:
        >>> from hf_attnstore.store.config import StoreConfig
        >>> from hf_attnstore.store.index import Entry
        >>> state = StoreState(StoreConfig(host_bytes="1MiB"), has_disk=False, has_lower=False)
        >>> with state.lock:  # every method but publish_states and queue_ended_turn expects it held
        ...     state.entries[("model-a", "chat-1")] = Entry(key=("model-a", "chat-1"))
        ...     sorted(state.entries), state.stats.host_bytes_limit
        ([('model-a', 'chat-1')], 1048576)
    """

    def __init__(self, config: StoreConfig, *, has_disk: bool, has_lower: bool):
        self.config = config
        self.has_disk, self.has_lower = has_disk, has_lower
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)  # notified whenever saves, loads or room may proceed
        self.entries: dict[Key, Entry] = {}
        # The keys of `entries` by session id (one per fingerprint, `keys_of`): a call naming a session (`evict`,
        # `delete`, a prefetch) finds its entries without walking every entry.
        self._keys_by_sid: dict[str, dict[Key, None]] = {}
        self.host = HostTier(config.host_bytes, config.policy, config.pin_memory)
        self.disk_policy = make_policy(config.policy)
        self.stats = StoreStats(host_bytes_limit=config.host_bytes, disk_bytes_limit=config.disk_bytes)
        self.disk_used = 0  # files of indexed sessions, folders queued for deletion, writes in flight
        # Files that several sessions' folders name or named (hard links of a shared prefix's chunks): identity
        # -> [bytes, {(key, name)}], counted in `disk_used` once while any name is left, whoever names them. The
        # file system keeps the bytes as long, so deleting one session never takes a chunk another manifest names.
        self.linked: dict[tuple, list] = {}
        # Shared files that refused another name (the file system's link limit, 65,000 on ext4) -> the session that
        # wrote its own copy instead: new sessions link that copy (`SavePlanner.shared_chunks`), so a prompt shared
        # by more sessions than the limit is on disk once per 65,000 of them.
        self.full_links: dict[tuple, Key] = {}
        self.dirty: set[Key] = set()
        # The save worker's queue of those (`next_dirty`): each dirty key is in exactly one of `_due_urgent` (a flush
        # or a demotion), `_due` (to look at, first come first) and `_parked` (not to be written yet: until a time
        # in `_wakeups`, until the model is quiet (`_parked_quiet`), or until the entry changes, `_wake`). So the
        # worker looks at each key once per change of its entry, not at every dirty key for each piece of work.
        self._due_urgent: OrderedDict[Key, None] = OrderedDict()
        self._due: OrderedDict[Key, None] = OrderedDict()
        self._parked: dict[Key, float | None] = {}
        self._parked_quiet: dict[Key, None] = {}
        self._wakeups: list[tuple[float, int, Key]] = []  # (time, sequence, key), a heap; stale items are skipped
        self._wakeup_seq = 0
        # The entries whose write is `Write.DEMOTE` (`set_write` keeps it): the host bytes already on their way out,
        # which eviction counts before choosing more victims. A set, not a running sum of those bytes: what a
        # session's leaving frees changes when another session starts or stops sharing its segments
        # (`HostTier.freed_by`), and these are few (as many as the room being made needs), however many are held.
        self.demoting: set[Entry] = set()
        self.pinned: set[Entry] = set()  # the entries with pins (`pin`, `start_load`): loads and writes in flight
        self.remirror: set[Key] = set()  # sessions to copy again to a mirror tier that lost its data (saver.py)
        self.next_chunk: dict[Key, int] = {}  # per session, only ever grows
        # Deletions for the save thread, in order: (key, bytes freed, None) deletes a session's folder;
        # (key, bytes freed, (manifest, chunk)) writes the manifest of a partially evicted session, then
        # deletes `chunk` (if not None). Their bytes stay counted in `disk_used` until done (`deleting`).
        self.deletes: list[tuple[Key, int, tuple | None]] = []
        self.deleting = 0
        self.manifest_room = 0  # counted in `disk_used` for the new manifest a queued head drop writes (index.py)
        self.deletions = 0  # queued or running (some free no counted bytes): what a flush() waits for
        # Closed writers and hybrid models' states: (key, turn, state or None, whether the turn ended), appended
        # without the lock (a writer's finalizer may run anywhere) and applied under it.
        self.ended_turns: deque[tuple[Key, int, SessionState | None, bool]] = deque()
        self.loads_active = 0
        self.forwards_active = 0  # model forwards running through caches of this store
        self.room_waiters = 0  # appends blocked until demotions free host memory
        self.last_forward = 0.0
        self.once = OnceLogger(logger)  # each kind of warning once per store
        self.closed = False
        self.prefixes = PrefixTable()  # which sessions begin with which prefix (prefix sharing, index.py)
        # Prompts' blocks, deduplicated across sessions (`block_pool`: the lab's trace replay plugs one in,
        # lab/block_pool.py); None: no pool.
        self.blocks = config.block_pool.build(config.pin_memory) if config.block_pool is not None else None
        # Sessions a client asked to keep (OpenAI's `prompt_cache_retention`): key -> monotonic deadline before
        # which `ttl_s` does not expire them. Capacity may still evict them (counted in `retained_dropped`).
        self.retained: OrderedDict[Key, float] = OrderedDict()
        self._retained_until: list[tuple[float, Key]] = []  # (deadline, key), a heap: `expire` forgets past ones
        # Expiry by idleness (`ttl_s`) from a time-ordered heap, not a scan of every entry at each lookup: per key one
        # live item (`_expiry_at`: its time), a lower bound of when the session may expire. A touch only moves
        # that later, so it pushes nothing; `expire` pops what is due and pushes again what was touched or retained
        # since. Sessions due but pinned or running a turn wait in `_expiry_blocked`, looked at by every `expire`.
        self._expiry: list[tuple[float, int, Key]] = []
        self._expiry_at: dict[Key, float] = {}
        self._expiry_blocked: dict[Key, None] = {}
        self._expiry_seq = 0

    def take_deletes(self) -> list[tuple[Key, int, tuple | None]]:
        """The queued deletions, for the save thread to run (lock held)."""
        deletes, self.deletes = self.deletes, []
        return deletes

    def keys_of(self, session_id: str) -> list[Key]:
        """The indexed keys of a session id (one per model that stored it), without a walk of every entry."""
        return list(self._keys_by_sid.get(session_id, ()))

    def _forget_key(self, key: Key) -> None:
        keys = self._keys_by_sid.get(key[1])
        if keys is not None:
            keys.pop(key, None)
            if not keys:
                del self._keys_by_sid[key[1]]

    def check_open(self) -> None:
        if self.closed:
            raise ValueError("this AttnStore is closed")

    def touch(self, e: Entry) -> None:
        e.last_access = time.monotonic()
        self.host.touch(e)
        if e.manifest is not None:
            self.disk_policy.touch(e.key)

    def order_disk_by_access(self) -> None:
        """Puts the disk copies' eviction order in the order of the sessions' last accesses (lock held): once,
        after a reopen that indexed them in the disk's order."""
        keys = sorted((e.last_access, i, key) for i, (key, e) in enumerate(self.entries.items())
                      if e.manifest is not None)
        for *_, key in keys:
            self.disk_policy.remove(key)
            self.disk_policy.insert(key)

    def set_host(self, e: Entry, buf: SessionBuffer | None) -> None:
        """Makes `buf` the session's host copy (replacing any other), or lets it go (None): its bytes are freed
        when the last snapshot of it is."""
        if buf is None and e.host is not None:
            self._undirty(e.key)  # what is not written by now is given up with the buffer
            self.host.policy.remove(e.key)
        elif buf is not None and e.host is None:
            self.host.policy.insert(e.key)
        e.host = buf
        self.account(e)
        self._wake(e.key)

    def account(self, e: Entry) -> None:
        """Brings the host tier's count up to date after the session's buffer grew, shrank or changed."""
        e.host_segments, e.host_accounted = self.host.account(e.host, e.host_segments, e.host_accounted)

    def set_manifest(self, e: Entry, manifest: Manifest | None, chunks: dict[str, tuple[int, int]]) -> None:
        if manifest is None and e.manifest is not None:
            self.disk_policy.remove(e.key)
        elif manifest is not None and e.manifest is None:
            self.disk_policy.insert(e.key)
        e.manifest = manifest
        e.chunks = {c: chunks[c] for c in {s.chunk for s in manifest.spans}} if manifest else {}
        self._wake(e.key)  # what is left to write changed

    def set_files(self, e: Entry, files: dict[str, int], manifest_size: int) -> int:
        """Sets the session's files (lock held). Returns the bytes of shared files whose last name went with
        them: a caller that queues their deletion keeps them counted until it is done (`queue_delete`)."""
        self.disk_used -= e.disk_bytes
        e.files, e.manifest_size = files, manifest_size
        freed = 0
        for name in [n for n in e.linked if n not in files]:  # a shared file's name went with them
            freed += self._release(e.key, name, e.linked.pop(name))
        self.disk_used += e.disk_bytes
        return freed

    def mark_linked(self, e: Entry, name: str, inode: tuple, nbytes: int) -> None:
        """Counts the session's file `name` (of `nbytes`) as one name of the shared file `inode` (lock held)."""
        self.disk_used -= e.disk_bytes
        e.linked[name] = inode
        self.disk_used += e.disk_bytes
        family = self.linked.get(inode)
        if family is None:
            family = self.linked[inode] = [blocks(nbytes), set()]
            self.disk_used += family[0]
        family[1].add((e.key, name))

    def link_refused(self, source: Key, name: str, copy: Key) -> None:
        """The file system refused another name for `source`'s shared file `name` (its link limit): session `copy`
        writes its own instead, which later sessions link (`full_links`; lock held)."""
        e = self.entries.get(source)
        inode = e.linked.get(name) if e is not None else None
        if inode is not None:
            self.full_links[inode] = copy

    def forget_full_link(self, inode: tuple) -> None:
        """The copy that stood for a full shared file is gone (lock held): the file may be offered again (a link
        it refuses names a new copy)."""
        self.full_links.pop(inode, None)

    def add_link(self, e: Entry, name: str, inode: tuple, nbytes: int, source: Key, source_name: str) -> None:
        """Records that the save thread made the session's file `name` a link of `source`'s file `source_name`
        (lock held). The file joins its family (by identity, whoever else names it now); the source's name
        joins too while the source still counts it as its own."""
        src = self.entries.get(source)
        if src is not None and source_name in src.files and source_name not in src.linked:
            self.mark_linked(src, source_name, inode, nbytes)
        self.mark_linked(e, name, inode, nbytes)

    def shared_bytes(self, key: Key, name: str, inode: tuple) -> int:
        """What deleting this name of a shared file frees: the file's bytes if it is the last name, else 0."""
        family = self.linked.get(inode)
        return family[0] if family is not None and family[1] == {(key, name)} else 0

    def _release(self, key: Key, name: str, inode: tuple) -> int:
        """A name of a shared file is gone; returns the file's bytes when it was the last one (no longer counted).
        A family is kept while any name is left, even one: the file stays counted once, whoever links it next."""
        family = self.linked.get(inode)
        if family is None:
            return 0
        family[1].discard((key, name))
        if family[1]:
            return 0
        del self.linked[inode]
        self.full_links.pop(inode, None)  # (the file is gone: its identity may be a new file's)
        self.disk_used -= family[0]
        return family[0]

    def delete_folder(self, e: Entry) -> None:
        """Queues the deletion of the session's folder; its bytes stay counted until it is gone."""
        nbytes = e.disk_bytes
        nbytes += self.set_files(e, {}, 0)
        self.queue_delete(e.key, nbytes, None)

    def queue_delete(self, key: Key, nbytes: int, head: tuple | None) -> None:
        self.disk_used += nbytes
        self.deleting += nbytes
        self.deletions += 1
        self.deletes.append((key, nbytes, head))
        self.cond.notify_all()

    def drop(self, e: Entry) -> None:
        """Removes a session from the index and (asynchronously) from disk."""
        if self.entries.get(e.key) is e:
            del self.entries[e.key]
            self._forget_key(e.key)
            self.prefixes.remove(e.key)
            self._wake(e.key)  # (a dirty mark of the key is looked at, and forgotten)
        self.set_host(e, None)
        self.set_manifest(e, None, {})
        if self.has_disk:
            self.delete_folder(e)

    def unindex(self, e: Entry) -> None:
        """Takes an entry out of the index, host memory and the disk policy, leaving its files (lock held)."""
        if self.entries.get(e.key) is e:
            del self.entries[e.key]
            self._forget_key(e.key)
            self.prefixes.remove(e.key)
            self._wake(e.key)
        self.set_host(e, None)
        if e.manifest is not None:
            self.disk_policy.remove(e.key)

    def hand_over(self, e: Entry, n: Entry) -> None:
        """Gives the session's new entry `n` the disk files of its old entry `e` (out of the index), deleting
        none (lock held). The folder's manifest stays `e`'s, a valid older copy of the session (what a crash
        leaves), until `n`'s first save writes its own over it and collects `e`'s files; a failed save of `n`
        keeps them (`n.chunks` names them, see saver.py `files_to_keep`), and if `n`'s host copy goes before its own
        copy is durable, the older copy is the session again (`release_host`). They never go to make room for
        `n`'s save (`Eviction.reserve_disk`): the durable copy stays until its successor is durable."""
        if e.manifest is not None:
            names = {s.chunk for s in e.manifest.spans} | ({e.manifest.state.name} if e.manifest.state else set())
            n.chunks = {name: e.chunks.get(name, (e.files.get(name, 0), 0)) for name in names}
        else:
            n.chunks = dict(e.chunks)  # an entry that was handed an older copy itself, and never saved
        n.files, n.manifest_size, e.files, e.manifest_size = e.files, e.manifest_size, {}, 0
        n.linked, e.linked = e.linked, {}
        n.predecessor = e.manifest if e.manifest is not None else e.predecessor
        e.successor = n

    def heir(self, e: Entry) -> Entry | None:
        """The indexed entry `e` handed its files to, directly or through later hand-overs, or None (lock held): not
        any entry of the same key (a session deleted, then started again, is another session)."""
        n = e.successor
        while n is not None and self.entries.get(n.key) is not n:
            n = n.successor
        return n

    def inherit(self, n: Entry, manifest: Manifest | None, made: dict, manifest_size: int, kept: set,
                linked: dict) -> None:
        """A save of the entry `n` replaced (`hand_over`) finished after the hand-over: the files it made that stay
        (`kept`) are `n`'s to count and collect, and if its `manifest` landed, that is the older copy `n` keeps
        (lock held). `linked`: those that are links of another session's files (name -> (bytes, tokens, identity,
        source, its name)), counted once with their family."""
        for name, (size, _, inode, source, source_name) in linked.items():
            if name in kept:
                self.add_link(n, name, inode, size, source, source_name)
        files = {**n.files, **{name: size for name, (size, _) in made.items() if name in kept}}
        if manifest is not None and n.manifest is None:
            n.chunks = {name: made.get(name) or n.chunks.get(name, (files.get(name, 0), 0))
                        for name in {s.chunk for s in manifest.spans} | ({manifest.state.name} if manifest.state else set())}
            n.predecessor = manifest
        self.set_files(n, files, manifest_size if manifest is not None else n.manifest_size)

    def release_host(self, e: Entry) -> None:
        """The session's host copy goes (it outgrew the host tier, or could not be written): what is durable stays,
        its own durable prefix or the older copy it was handed (`hand_over`), which becomes the session again;
        with neither, the session goes (lock held). The one way a host copy is given up without a deletion of
        what a flush() acknowledged."""
        if e.manifest is None and e.predecessor is not None and self.entries.get(e.key) is e:
            e.generation += 1  # a save of the new history in flight must not commit over it
            self.set_manifest(e, e.predecessor, e.chunks)
            e.predecessor = None
            if not e.manifest.head:
                self.prefixes.add(e.key, e.manifest.token_ids)
        if e.manifest is not None:
            self.set_host(e, None)
        else:
            self.drop(e)

    def reindex(self, e: Entry) -> None:
        """Replaces an entry whose load failed by a fresh one holding the same durable copy (lock held)."""
        c = Entry(key=e.key, layout=e.layout, generation=e.generation + 1, last_access=e.last_access,
                  mirrored=set(e.mirrored), refused=e.refused)
        self.unindex(e)
        self.entries[c.key] = c
        self._keys_by_sid.setdefault(c.key[1], {})[c.key] = None
        self._expires(c.key, c.last_access)
        self.set_manifest(c, e.manifest, e.chunks)  # (wakes the key: another entry is to be looked at)
        if c.manifest is not None and not c.manifest.head:
            self.prefixes.add(c.key, c.manifest.token_ids)
        c.files, c.manifest_size, e.files, e.manifest_size = e.files, e.manifest_size, {}, 0
        c.linked, e.linked = e.linked, {}

    def retain(self, key: Key, seconds: float) -> None:
        """Keeps `key`'s session from expiring by idleness for `seconds` from now (lock held); the index of such
        deadlines holds at most `MAX_RETAINED` sessions (the earliest asked for go first)."""
        self.retained[key] = max(self.retained.get(key, 0.0), time.monotonic() + seconds)
        self.retained.move_to_end(key)
        heapq.heappush(self._retained_until, (self.retained[key], key))
        while len(self.retained) > MAX_RETAINED:
            gone, _ = self.retained.popitem(last=False)
            e = self.entries.get(gone)
            if e is not None:
                self._expires(gone, e.last_access)  # no longer kept: it may expire sooner than its item says

    def is_retained(self, key: Key, now: float | None = None) -> bool:
        return self.retained.get(key, 0.0) > (time.monotonic() if now is None else now)

    def dropped(self, e: Entry) -> None:
        """Counts a capacity eviction that took a retained session's last copy (lock held)."""
        if self.is_retained(e.key):
            self.stats.retained_dropped += 1

    def _expires(self, key: Key, last_access: float) -> None:
        """The session `key` may expire `ttl_s` after `last_access` (an entry indexed, or no longer retained): pushed
        unless its live item is no later already."""
        ttl = self.config.ttl_s
        if ttl is None:
            return
        at = last_access + ttl
        if self._expiry_at.get(key, float("inf")) > at:
            self._expiry_at[key] = at
            self._expiry_seq += 1
            heapq.heappush(self._expiry, (at, self._expiry_seq, key))

    def expire(self) -> None:
        """Forgets past retention deadlines and drops the sessions idle for longer than `ttl_s` (not pinned, running
        no turn, not retained). Pops only what is due: its work is the sessions expiring, not the sessions held."""
        now = time.monotonic()
        while self._retained_until and self._retained_until[0][0] <= now:
            until, key = heapq.heappop(self._retained_until)
            if self.retained.get(key) == until:
                del self.retained[key]
        ttl = self.config.ttl_s
        if ttl is None:
            return
        self.apply_ended_turns()
        due = list(self._expiry_blocked)
        while self._expiry and self._expiry[0][0] <= now:
            at, _, key = heapq.heappop(self._expiry)
            if self._expiry_at.get(key) == at:  # (else a stale item: the key has an earlier one, or none)
                del self._expiry_at[key]
                due.append(key)
        for key in due:
            self._expiry_blocked.pop(key, None)
            e = self.entries.get(key)
            if e is None:
                continue
            if now - e.last_access > ttl and not self.is_retained(key, now):
                if e.pins == 0 and not e.writers:
                    self.drop(e)
                    self.stats.ttl_expired += 1
                else:
                    self._expiry_blocked[key] = None  # looked at again by the next call
                continue
            at = max(e.last_access + ttl, self.retained.get(key, 0.0))  # touched or retained since
            if at <= now:
                self._expiry_blocked[key] = None  # (on the boundary: the next call decides)
            else:
                self._expiry_at.pop(key, None)
                self._expires(key, at - ttl)

    def cut(self, e: Entry, length: int) -> None:
        """Shortens a session. A new generation: a save in flight may hold tokens past the cut, and must not
        commit them (it would describe a history that no longer exists)."""
        e.host.truncate(length)
        self.account(e)  # a state of the cut tokens went with them
        self._wake(e.key)
        e.generation += 1
        if e.persisted > length:
            self.set_manifest(e, e.manifest.select([(0, length)]), e.chunks)

    def apply_ended_turns(self) -> None:
        """Unpins the sessions of turns that ended (see TurnWriter.close), keeping their end-of-turn states."""
        while self.ended_turns:
            key, turn, state, ended = self.ended_turns.popleft()
            e = self.entries.get(key)
            if e is None:
                continue
            if state is not None:
                self.keep_state(e, turn, state)
            if ended:
                e.writers.discard(turn)
                live = e.live() if e.live is not None else None
                if live is None or live.turn == turn:
                    e.live = None
                self.keep_encoded(e)  # encoded copies that waited for the turn to end (buffer.py)
                if e.host is not None and e.host.length and not e.host.missing_head and not e.writers:
                    self.prefixes.add(key, e.host.snapshot().token_ids)  # what other sessions may now share

    def publish_states(self, keys) -> None:
        """Asks the open turns of these sessions for their hybrid models' states, where the session's stored
        state is not the one after all its tokens (a next turn's lookup, a flush, while the previous turn's
        cache is still referenced). Called without the lock: the states are copied meanwhile."""
        writers = []
        with self.lock:
            for key in list(self.entries) if keys is None else keys:
                e = self.entries.get(key)
                writer = e.live() if e is not None and e.live is not None else None
                buf = e.host if e is not None else None
                if writer is not None and writer.turn == e.owner and not writer.dead and buf is not None \
                        and (buf.state is None or buf.state.tokens != buf.length):
                    writers.append(writer)
        for writer in writers:
            writer.publish_state()

    def keep_state(self, e: Entry, turn: int, state: SessionState) -> None:
        """Keeps a hybrid model's end-of-turn state with the session, if it is the state after exactly the KV
        stored: the turn still owns the session, and every token it computed was stored (no refused append,
        no cut). It is sealed with the digest of those ids, which a later turn's prompt must extend."""
        buf = e.host
        if e.owner != turn or buf is None or buf.length != state.tokens or buf.missing_head or state.tokens == 0:
            self.stats.states_refused += 1
            return
        ids = buf.snapshot().token_ids
        buf.state = state.sealed(e.key, prefix_digest(e.key[0], ids))
        self.account(e)
        self.stats.states_kept += 1
        if self.has_lower and e.dirty:
            self._mark(e.key)
            self.cond.notify_all()

    def keep_encoded(self, e: Entry, encoded: list = ()) -> None:
        """Makes encoded copies of a session's chunks (written by the save thread, or read by a load) its host
        copy of them (buffer.py, `SessionBuffer.compact`).

        Only between turns: while a turn runs on the session, or a load or another write is in flight, its
        buffers must not change under them, so the copies wait with the buffer (`stash`) and are applied
        when the last of those ends.
        """
        if e.host is None:
            return
        if encoded:
            e.host.stash(list(encoded))
        if e.host.pending and not (e.pins or e.writers or e.loading is not None):
            tokens = e.host.compact()
            self.stats.host_encoded_tokens += tokens
        self.account(e)

    # -- the owner's transitions: with the methods above, the only writers of entries, pins, dirty marks,
    # reservations and stats (tests/store/test_ownership.py). Each expects the caller to hold `lock` unless it
    # says otherwise.
    def count(self, **deltas: float) -> None:
        """Adds to counters of `stats`, e.g. ``count(misses=1)``."""
        for name, delta in deltas.items():
            setattr(self.stats, name, getattr(self.stats, name) + delta)

    def record(self, **values: float) -> None:
        """Sets gauges of `stats` (the last resume decision's inputs)."""
        for name, value in values.items():
            setattr(self.stats, name, value)

    def stats_snapshot(self, local_disk: bool, remote_down: int) -> StoreStats:
        """A copy of the counters with the gauges of this moment."""
        s = StoreStats(**{f.name: getattr(self.stats, f.name) for f in fields(StoreStats)})
        # Gauges kept as the index changes, not counted over the entries: the scheduler reads them before every
        # step (`ChatPipeline` sizes its look-ahead windows by them), so a scan would grow each step with the
        # sessions held. Each tier's eviction order holds exactly the sessions that tier holds.
        s.sessions = len(self.entries)
        s.host_sessions = len(self.host.policy)
        s.disk_sessions = len(self.disk_policy) if local_disk else 0
        s.host_bytes_used, s.disk_bytes_used = self.host.used, self.disk_used
        s.loads_in_flight, s.saves_pending = self.loads_active, len(self.dirty)
        s.pool_blocks = len(self.blocks) if self.blocks is not None else 0
        s.remote_down = remote_down
        now = time.monotonic()  # (a walk of the sessions with a retention deadline, not of every session)
        s.retained_sessions = sum(until > now and key in self.entries for key, until in self.retained.items())
        return s

    def pin(self, e: Entry) -> None:
        """A load or a write of the session is in flight: its buffers must not change, eviction skips it."""
        e.pins += 1
        self.pinned.add(e)

    def unpin(self, e: Entry) -> None:
        e.pins -= 1
        if e.pins == 0:
            self.pinned.discard(e)
        self._wake(e.key)  # a save that waited for the pin may run

    def mark_dirty(self, e: Entry, write: Write | None = None) -> None:
        """The session has tokens to write (`write`: how soon, else as it was)."""
        if write is not None:
            self.set_write(e, write)
        self._mark(e.key)

    def mark_clean(self, e: Entry, write: Write | None = None) -> None:
        """Nothing of the session is to be written now (`write`: what then, else as it was)."""
        if write is not None:
            self.set_write(e, write)
        self._undirty(e.key)

    def set_write(self, e: Entry, write: Write) -> None:
        """What the save thread does with the session's unwritten tokens (the one writer of `Entry.write`)."""
        e.write = write
        if write is Write.DEMOTE:
            self.demoting.add(e)
        else:
            self.demoting.discard(e)
        self._wake(e.key)  # urgent or not, backing off or not

    def room_coming(self, exclude: Entry) -> bool:
        """Whether another indexed host session is being written out of host memory or is pinned (a load or a write
        in flight): host room may come. Asked from the demotions and pins in flight, not from every entry."""
        return any(x is not exclude and self.entries.get(x.key) is x and x.host is not None
                   and (x.write is Write.DEMOTE or x.pins) for x in self.demoting | self.pinned)

    def demoting_entries(self) -> list[Entry]:
        """The indexed entries being written out of host memory (`Write.DEMOTE`); forgets those no longer indexed."""
        gone = [e for e in self.demoting if self.entries.get(e.key) is not e]
        self.demoting.difference_update(gone)
        return list(self.demoting)

    def new_history(self, e: Entry) -> None:
        """A new generation: a save in flight may hold tokens past a cut or of a replaced copy, and must not
        commit them."""
        e.generation += 1

    def reserve_disk(self, nbytes: int) -> None:
        """Counts `nbytes` about to be written (a save's bound) before they are, so the files never exceed the
        limit; `release_disk` gives back what was not written."""
        self.disk_used += nbytes

    def release_disk(self, nbytes: int) -> None:
        self.disk_used -= nbytes

    def reserve_manifest_room(self, nbytes: int) -> None:
        """Room for the largest new manifest a queued head drop writes beside the old one (index.py)."""
        if nbytes > self.manifest_room:
            self.disk_used += nbytes - self.manifest_room
            self.manifest_room = nbytes

    def deletes_done(self, deletes: list[tuple[Key, int, tuple | None]]) -> None:
        """Queued deletions ran (failed or not): their bytes are no longer counted."""
        nbytes = sum(item[1] for item in deletes)
        self.disk_used -= nbytes
        self.deleting -= nbytes
        self.deletions -= len(deletes)
        if not self.deletes:  # no head drop left to write a manifest beside its old one
            self.disk_used -= self.manifest_room
            self.manifest_room = 0

    def forget_replaced(self, e: Entry) -> None:
        """Lets the older copy a new history keeps (`hand_over`) go, with its folder."""
        e.predecessor, e.chunks = None, {}
        self.delete_folder(e)

    def drop_disk_copy(self, e: Entry) -> None:
        """Removes a session from the disk tier; with no copy in host memory either, it is gone."""
        if e.host is None:
            self.drop(e)
            return
        self.set_manifest(e, None, {})
        self.set_write(e, Write.NEVER)  # not written again this turn: it would only push another session out
        self.delete_folder(e)

    def start_load(self, e: Entry, buf: SessionBuffer, job) -> None:
        """A load of the session into `buf` is submitted (`job`, loader.py): pinned until `end_load`."""
        e.loading, e.load_job = job.handle, job
        e.pins += 1
        self.pinned.add(e)
        self.set_host(e, buf)
        self.loads_active += 1
        self._wake(e.key)

    def end_load(self, e: Entry, handle) -> None:
        e.pins -= 1
        if e.pins == 0:
            self.pinned.discard(e)
        self.loads_active -= 1
        if e.loading is handle:
            e.loading, e.load_job = None, None
        self._wake(e.key)

    def loaded_remote(self, e: Entry, dirty: bool) -> None:
        """A copy found remotely is local now (`dirty`: to be written to the lower tier behind the turn)."""
        e.remote = None
        e.last_write = time.monotonic()
        if dirty:
            self._mark(e.key)

    def give_up_remote(self, e: Entry) -> None:
        """A remote copy adopted over an unsaved new history failed to load: the older copy stays."""
        e.remote = None
        self.release_host(e)

    def add_mirrored(self, e: Entry, digests) -> None:
        """Chunks of the session that this store put in the remote tier."""
        e.mirrored |= digests

    def set_mirrored(self, e: Entry, digests: set) -> None:
        e.mirrored = digests

    def lost_mirror(self) -> None:
        """The remote tier lost what it held: no chunk is known to be there any more."""
        for e in self.entries.values():
            e.mirrored.clear()

    def queue_remirror(self, key: Key) -> None:
        self.remirror.add(key)

    def unqueue_remirror(self, key: Key | None = None) -> None:
        """The session is no longer to be copied again to the mirror (None: none is, the store closing)."""
        if key is None:
            self.remirror.clear()
        else:
            self.remirror.discard(key)

    def take_chunk_numbers(self, key: Key, count: int) -> int:
        """The first of `count` new chunk numbers of the session (they only ever grow)."""
        first = self.next_chunk.get(key, 0)
        self.next_chunk[key] = first + count
        return first

    def save_failed(self, e: Entry, error: BaseException | None = None, retry_at: float = 0.0) -> None:
        """A write of the session failed: retried after `retry_at` (`error`; None: written whole again at once)."""
        if error is not None:
            e.last_error = error
            self.set_write(e, Write.FAILED)
            e.retry_at = retry_at
        e.failures += 1
        self._wake(e.key)

    def never_write(self, e: Entry, error: BaseException) -> None:
        """The session is larger than the lower tier can hold: not written again until its next turn."""
        self._undirty(e.key)
        e.last_error = error
        self.set_write(e, Write.NEVER)

    def save_ok(self, e: Entry) -> None:
        e.failures, e.last_error = 0, None
        if e.write is Write.FAILED:
            self.set_write(e, Write.BEHIND)

    def saved(self, e: Entry, manifest: Manifest, chunks: dict) -> None:
        """The session's own copy is durable as `manifest`: the older copy it was handed is collected."""
        self.set_manifest(e, manifest, chunks)
        e.predecessor = None

    def forget_dirty(self, key: Key) -> None:
        """A session gone, or with nothing to write, leaves the dirty set."""
        self._undirty(key)

    # -- the save worker's queue of dirty sessions (see `__init__`) ------------------------------------------
    def _mark(self, key: Key) -> None:
        self.dirty.add(key)
        self._wake(key)

    def _undirty(self, key: Key) -> None:
        self.dirty.discard(key)
        self._due_urgent.pop(key, None)
        self._due.pop(key, None)
        self._parked.pop(key, None)
        self._parked_quiet.pop(key, None)

    def _wake(self, key: Key) -> None:
        """The key's entry changed (or was replaced): if it is dirty, the save worker looks at it again. Called by
        every method here that changes what `SavePlanner.next_save` decides from (the entry, its host copy's
        length, durable copy, write, pins, load); a wrong wake-up costs one look, a missed one a stalled save."""
        if key not in self.dirty:
            return
        e = self.entries.get(key)
        urgent = e is not None and e.urgent
        if key in (self._due_urgent if urgent else self._due):
            return
        self._parked.pop(key, None)
        self._parked_quiet.pop(key, None)
        (self._due if urgent else self._due_urgent).pop(key, None)
        (self._due_urgent if urgent else self._due)[key] = None

    def next_dirty(self, now: float, quiet: bool) -> Key | None:
        """The next dirty session for the save worker to look at (lock held): urgent ones first, then in the order
        they became due; None when every dirty session is parked. The worker either chooses it or parks or forgets
        it (`park_dirty`, `forget_dirty`) before asking again."""
        while self._wakeups and self._wakeups[0][0] <= now:
            until, _, key = heapq.heappop(self._wakeups)
            if key in self._parked and self._parked[key] == until:
                self._wake(key)
        if quiet and self._parked_quiet:
            for key in list(self._parked_quiet):
                self._wake(key)
        for due in (self._due_urgent, self._due):
            if due:
                return next(iter(due))
        return None

    def park_dirty(self, key: Key, until: float | None = None, quiet: bool = False) -> None:
        """The dirty session is not to be written now: looked at again at `until` (a monotonic time), once the
        model is quiet (`quiet`), or when its entry changes (`_wake`), whichever comes first."""
        if key not in self.dirty:
            return
        self._due_urgent.pop(key, None)
        self._due.pop(key, None)
        self._parked[key] = until
        if until is not None:
            self._wakeup_seq += 1
            heapq.heappush(self._wakeups, (until, self._wakeup_seq, key))
        if quiet:
            self._parked_quiet[key] = None

    def refuse_remote(self, e: Entry, signature: tuple | None) -> None:
        """A remote copy that failed to verify or load is not tried again (`remote_signature`)."""
        e.refused = signature

    def add(self, e: Entry, last_access: float | None = None) -> None:
        """Puts an entry in the index (replacing any other of its key)."""
        if last_access is not None:
            e.last_access = last_access
        self.entries[e.key] = e
        self._keys_by_sid.setdefault(e.key[1], {})[e.key] = None
        self._wake(e.key)
        self._expires(e.key, e.last_access)

    def reopened(self, e: Entry, manifest: Manifest, files: dict, manifest_size: int, chunks: dict,
                 last_access: float) -> None:
        """A session found on disk when the store reopens: indexed with its manifest and files."""
        e.last_access = last_access
        self.next_chunk[e.key] = manifest.next_chunk
        self.entries[e.key] = e
        self._keys_by_sid.setdefault(e.key[1], {})[e.key] = None
        self._expires(e.key, last_access)
        self.set_manifest(e, manifest, chunks)
        self.set_files(e, files, manifest_size)
        if not manifest.head:
            self.prefixes.add(e.key, manifest.token_ids)  # rebuilt from the manifests, never a file

    def adopt_remote(self, e: Entry | None, n: Entry, manifest: Manifest, local_disk: bool, durable: bool) -> Entry:
        """Indexes `n`, the entry of the remote copy `manifest`, in place of the local entry `e` (if any).

        A local durable copy is never deleted here: with a disk tier (`local_disk`), `n` takes over `e`'s files
        (the session's folder, whose manifest stays valid until the remote copy, once loaded, is written over it)
        and keeps it as its `fallback`, put back if the remote copy fails to load (`restore_local`); without one,
        nothing of `e` is local but a host copy. `durable`: the remote tier is the tier below host memory, so the
        remote copy is the session's durable copy, as a disk copy would be."""
        if e is not None:
            if not local_disk:
                self.drop(e)
            else:
                self.unindex(e)  # its host copy goes (and the session's dirty tail, if any, with it)
                # A remote copy not loaded yet stands for the local copy it was to replace: that is the fallback.
                n.fallback, e.fallback = (e if e.manifest is not None else e.fallback), None
                self.hand_over(e, n)
        if durable:
            # Its chunks are named by digest; their token counts are the spans' (a later save may rewrite the last).
            self.set_manifest(n, manifest, {s.chunk: (0, s.end) for s in manifest.spans})
        else:
            n.remote = manifest
            n.mirrored = {span.digest for span in manifest.spans}
        n.last_access = time.monotonic()
        self.entries[n.key] = n
        self._keys_by_sid.setdefault(n.key[1], {})[n.key] = None
        self._wake(n.key)
        self._expires(n.key, n.last_access)
        return n

    def restore_local(self, e: Entry, refuse: tuple | None = None) -> bool:
        """Puts back the local copy that the remote entry `e` was to replace, if it has one and `e` is still
        indexed. Returns whether it did. `refuse`: the signature of a remote copy not to try again."""
        old = e.fallback
        if old is None or self.entries.get(e.key) is not e:
            return False
        e.fallback = None
        self.set_host(e, None)  # a failed load's buffer (the snapshot handed out keeps its own reference)
        old.files, old.manifest_size, e.files, e.manifest_size = e.files, e.manifest_size, {}, 0
        old.linked, e.linked = e.linked, {}
        e.chunks = {}
        old.generation = max(old.generation, e.generation) + 1  # no snapshot of the failed load is of its lineage
        self.entries[e.key] = old
        self._expires(e.key, old.last_access)
        self.set_write(old, old.write)  # (counted again among the demotions if it was one; its dirty mark looked at)
        self.disk_policy.insert(e.key)
        if refuse is not None:
            old.refused = refuse
        self.stats.remote_restores += 1
        return True

    def forget_fallback(self, e: Entry) -> None:
        """The remote copy is verified and loaded: it replaces the local copy (written over it behind the turn)."""
        e.fallback = None

    def close(self) -> None:
        self.closed = True

    def forward_started(self) -> None:
        self.forwards_active += 1

    def forward_ended(self) -> None:
        self.forwards_active -= 1
        self.last_forward = time.monotonic()

    def queue_ended_turn(self, key: Key, turn: int, state: SessionState | None, ended: bool) -> None:
        """A turn ended (or offers its states): applied at the next decision (`apply_ended_turns`). Needs no lock
        (a writer's finalizer may run while this thread holds it): a deque's append is atomic."""
        self.ended_turns.append((key, turn, state, ended))

    def room_wait(self, delta: int) -> None:
        """An append starts (+1) or stops (-1) waiting for host room (the save thread does not yield meanwhile)."""
        self.room_waiters += delta

    def offered_prefix(self, e: Entry, token_ids, blocks_offered: int) -> None:
        """The session's stored tokens are offered for sharing (index.py), `blocks_offered` whole blocks of them."""
        self.prefixes.add(e.key, token_ids)
        e.prefix_blocks = blocks_offered

    def match_blocks(self, fingerprint: str, ids) -> tuple[int, SessionKV | None]:
        """The block pool's lookup of a prompt (`BlockPool.match`), counted: ``(tokens found, their KV)``; (0, None)
        without a pool."""
        if self.blocks is None:
            return 0, None
        found, snap = self.blocks.match(fingerprint, ids)
        self.stats.block_lookups += 1
        self.stats.block_hit_tokens += found
        return found, snap

    def pool_prompt(self, e: Entry) -> None:
        """A turn's first forward is stored: the session now holds the turn's prompt, whose blocks enter the pool
        (`BlockPool.store`): the tokens with exact, lossless KV only, and none of a session whose head has no KV."""
        buf = e.host
        if self.blocks is None or buf is None or buf.missing_head:
            return
        snap = buf.snapshot()
        end = snap.exact_prefix()
        if end < snap.length:  # cut short by inexact KV: whole blocks only (a prompt's end makes a partial block)
            end -= end % self.blocks.config.block_tokens
        if snap.lossy_before(end) is not None:
            return  # KV dequantized from a lossy codec: not what the model computes, never shared as exact
        inserted, evicted = self.blocks.store(e.key[0], snap, end)
        self.stats.blocks_inserted += inserted
        self.stats.blocks_evicted += evicted

    def appended(self, e: Entry, tokens: int) -> None:
        """A turn appended `tokens` to the session's host copy."""
        self.account(e)
        self.touch(e)
        self.stats.appended_tokens += tokens
        e.last_write = time.monotonic()
        self._wake(e.key)  # a whole chunk to write now, perhaps

    def writer_refused(self, e: Entry, turn: int) -> None:
        """The turn's appends are refused (the session outgrew the host tier): its host copy may go."""
        e.writers.discard(turn)
        if e.pins == 0:
            self.set_write(e, Write.BEHIND)
            self.release_host(e)

    def owned_by(self, e: Entry, turn: int, live) -> None:
        """The turn owns the session now: pinned in host memory until it closes (older turns' pins are void)."""
        e.owner = turn
        e.live = live
        e.writers = {turn}
        e.prefix_blocks = 0  # the new turn's history is offered again as it grows
        if e.write is Write.NEVER:
            self.set_write(e, Write.BEHIND)  # a new turn: the disk tier may have room again


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


DISK_BLOCK = 4096  # bytes of a file-system block: what a file occupies on disk is counted in them


def blocks(nbytes: int) -> int:
    """Bytes a file occupies on disk: its size rounded up to whole 4 KiB blocks (what `du` counts).

    Example:
        >>> blocks(0), blocks(1), blocks(4096), blocks(4097)
        (0, 4096, 4096, 8192)
    """
    return -(-nbytes // DISK_BLOCK) * DISK_BLOCK


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
    load_job: object | None = None  # the loader's LoadJob for this entry, while one is queued or running
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
        """Whether the host copy has a hybrid-model state that the durable copy lacks (states.py)."""
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


BLOCK = 64  # tokens per hashed block


def block_hashes(token_ids: torch.Tensor, block: int = BLOCK, partial: bool = False) -> list[bytes]:
    """The chained hash of every whole block of `token_ids` (1-D, int64): entry k names ids[: (k + 1) * block].

    Args:
        token_ids: The ids.
        block: Tokens per block.
        partial: Also hash the trailing partial block, if any (its hash names the whole of `token_ids`; it differs
            from the hash of any whole block, whose bytes are longer).

    Example:
        >>> hashes = block_hashes(torch.arange(150))  # two whole blocks of 64; the 22 tokens after them are not hashed
        >>> len(hashes), hashes[0] == block_hashes(torch.arange(64))[0]
        (2, True)
        >>> len(block_hashes(torch.arange(150), block=64, partial=True))  # the 22 tokens too
        3
    """
    ids = token_ids.detach().to("cpu", torch.long).contiguous().view(-1)
    out, h = [], b""
    data = ids.numpy().tobytes()
    width = block * 8
    for k in range(-(-ids.numel() // block) if partial else ids.numel() // block):
        h = hashlib.blake2b(h + data[k * width : (k + 1) * width], digest_size=16).digest()
        out.append(h)
    return out


class PrefixTable:
    """Sessions by the prefixes they begin with (see the module docstring). Guarded by the store's lock
    (`StoreState.lock`).

    Example:
        >>> table = PrefixTable()
        >>> table.add(("model-a", "alice"), torch.arange(130))
        >>> table.candidates("model-a", torch.cat([torch.arange(100), torch.tensor([7])]))  # one whole block shared
        [(('model-a', 'alice'), 64)]
    """

    def __init__(self):
        self._sessions: dict[tuple[str, bytes], dict[Key, None]] = {}  # (fingerprint, hash) -> keys, oldest first
        self._hashes: dict[Key, list[bytes]] = {}  # what each session was added under

    def add(self, key: Key, token_ids: torch.Tensor) -> None:
        """Records (or re-records, after it grew or changed) that session `key` begins with these ids."""
        self.remove(key)
        hashes = block_hashes(token_ids)
        for h in hashes:
            users = self._sessions.setdefault((key[0], h), {})
            users[key] = None  # newest last
        if hashes:
            self._hashes[key] = hashes

    def remove(self, key: Key) -> None:
        for h in self._hashes.pop(key, ()):
            users = self._sessions.get((key[0], h))
            if users is not None:
                users.pop(key, None)
                if not users:
                    del self._sessions[(key[0], h)]

    def candidates(self, fingerprint: str, token_ids: torch.Tensor, exclude: Key | None = None,
                   limit: int = 4, every_depth: bool = False, oldest: int = 0) -> list[tuple[Key, int]]:
        """Up to `limit` sessions sharing the longest whole-block prefix with `token_ids`, newest first, each with
        the tokens that prefix covers (a lower bound: the store extends it by comparing ids). `every_depth`: also
        up to `limit` of those sharing each shorter prefix, deepest first (for a caller that may use less of a
        session than it shares: a dense turn reuses a session's exact tokens only). `oldest`: also up to that
        many of the oldest sharers, after the newest (the likeliest to be saved already)."""
        levels: list[list[tuple[Key, int]]] = []
        for k, h in enumerate(block_hashes(token_ids)):
            users = self._sessions.get((fingerprint, h)) or {}
            # The newest `limit` sharers only, not all of them: one system prompt is shared by every session of
            # the store, and this runs for each block of every prompt (at most `limit` + `oldest` + 2 keys read
            # per block: `exclude` is one key).
            found = list(islice((key for key in reversed(users) if key != exclude), limit))
            if oldest:
                found += [key for key in islice((key for key in users if key != exclude), oldest) if key not in found]
            if not found:
                break
            levels.append([(key, (k + 1) * BLOCK) for key in found])
        if not every_depth:
            return levels[-1] if levels else []
        out, seen = [], set()
        for level in reversed(levels):
            for key, tokens in level:
                if key not in seen:
                    seen.add(key)
                    out.append((key, tokens))
        return out

    def __len__(self) -> int:
        return len(self._hashes)


class HostTier:
    """Host memory's share of the store's state (not thread-safe: the store's lock guards it).

    Args:
        limit: Bytes of KV the tier may hold (`host_bytes`).
        policy: Name of the eviction policy (see :mod:`hf_attnstore.store.policy`).
        pin_memory: Whether buffers are allocated in page-locked memory (for asynchronous copies to CUDA).

    Example:
        >>> host = HostTier(limit=1 << 20, policy="lru", pin_memory=False)
        >>> buf = host.new_buffer((2, 4, 8), torch.float16)
        >>> counted, nbytes = host.account(buf, {}, 0)  # an empty buffer holds no segment yet
        >>> nbytes, host.used, host.fits(1 << 20)
        (0, 0, True)
    """

    name = "host"

    def __init__(self, limit: int, policy: str, pin_memory: bool):
        self.limit, self.pin_memory = limit, pin_memory
        self.policy = make_policy(policy)
        self.used = 0
        # Segments are shared between sessions (a prefix another session starts from, `SessionBuffer.selected`):
        # each is counted once, while any session's buffer refers to it. id -> [segment, users].
        self._segments: dict[int, list] = {}

    @staticmethod
    def contains(e: Entry) -> bool:
        return e.host is not None

    def account(self, buf: SessionBuffer | None, counted: dict, accounted: int) -> tuple[dict, int]:
        """Brings the count up to date after a session's buffer grew, shrank or changed (`counted`, `accounted`:
        its segments and bytes at its last accounting): a segment counts when its first user takes it and stops
        counting when its last user lets it go; a state counts per session. Returns the new segments and bytes,
        which the index keeps on the entry (`StoreState.account`)."""
        now = buf.segments() if buf is not None else {}
        state = buf.state.nbytes if buf is not None and buf.state is not None else 0
        old_state = accounted - sum(seg.nbytes for seg in counted.values())
        for sid in counted.keys() - now.keys():
            held = self._segments[sid]
            held[1] -= 1
            if held[1] == 0:
                self.used -= held[0].nbytes
                del self._segments[sid]
        for sid in now.keys() - counted.keys():
            held = self._segments.setdefault(sid, [now[sid], 0])
            held[1] += 1
            if held[1] == 1:
                self.used += held[0].nbytes
        self.used += state - old_state
        return now, sum(seg.nbytes for seg in now.values()) + state

    def freed_by(self, e: Entry) -> int:
        """Bytes that would be freed if the session left host memory: its segments no other session uses, and
        its state."""
        own = sum(seg.nbytes for sid, seg in e.host_segments.items() if self._segments[sid][1] == 1)
        return own + e.host_accounted - sum(seg.nbytes for seg in e.host_segments.values())

    def touch(self, e: Entry) -> None:
        if e.host is not None:
            self.policy.touch(e.key)

    def fits(self, extra: int) -> bool:
        return self.used + extra <= self.limit

    def position(self, key) -> int | None:
        """Where the session's next job is in a look-ahead policy's queue (None: not queued, or no queue)."""
        return self.policy.position(key)

    # -- allocation -----------------------------------------------------------------------------------
    def new_buffer(self, geometry: tuple, dtype: torch.dtype) -> SessionBuffer:
        return SessionBuffer(geometry, dtype, self.pin_memory)

    def selected(self, base: SessionKV, keep: torch.Tensor) -> SessionBuffer:
        """A buffer holding ``base[keep]``: shares `base`'s segments where the kept tokens are contiguous."""
        return SessionBuffer.selected(base, keep, self.pin_memory)

    def for_load(self, geometry: tuple, dtype: torch.dtype, length: int) -> SessionBuffer:
        """An empty buffer of exactly `length` tokens for a load from a lower tier."""
        return SessionBuffer.for_load(geometry, dtype, length, self.pin_memory)


class NoDiskRoom(Exception):
    """A write would take the disk tier over `disk_bytes` even after evicting every other session."""


class DiskBusy(OSError):
    """A write does not fit now because the sessions that would make room are being read or written: a failed
    write, retried (with back-off, and at once by a flush), not a refusal."""


class Eviction:
    """Host demotion and the disk limit, over the store's state (see the module docstring).

    Example:
        >>> from hf_attnstore.store.config import StoreConfig
        >>> config = StoreConfig(host_bytes="1MiB")
        >>> state = StoreState(config, has_disk=False, has_lower=False)
        >>> eviction = Eviction(state, config, disk=None, lower=None)
        >>> with state.lock:
        ...     eviction.make_host_room(1024, exclude=None)  # an empty host tier has room
        True
    """

    def __init__(self, state: StoreState, config: StoreConfig, disk: DiskTier | None, lower: Tier | None):
        self.state, self.config, self.disk, self.lower = state, config, disk, lower

    def make_host_room(self, extra: int, exclude: Entry | None, keep_sooner_than: int | None = None) -> bool:
        """Demotes (or drops) host sessions until `extra` more bytes fit. Pinned ones stay; dirty ones are
        persisted first and demoted when that completes. With `keep_sooner_than` (a prefetch for the job at
        that queue position), sessions whose next job comes sooner are never evicted for it."""
        limit = self.state.host.limit
        if self.state.host.fits(extra):
            return True  # the common case, once per appended token: no scan of the index
        self.state.apply_ended_turns()
        host = self.state.host
        # Bytes already on their way out: the demotions in flight, not a sum over every entry.
        freeing = sum(host.freed_by(e) for e in self.state.demoting_entries())
        entries = self.state.entries

        def movable(key) -> bool:  # already being written out counts in `freeing`; pinned ones stay
            e = entries[key]
            return e is not exclude and e.write is not Write.DEMOTE and e.pins == 0 and not e.writers

        for key in choose_victims(self.state.host.policy.victims(), lambda key: host.freed_by(entries[key]), movable,
                                  self.state.host.used - freeing + extra - limit,
                                  self.state.host.position, keep_sooner_than):
            self.evict_from_host(entries[key])
        return self.state.host.fits(extra)

    def evict_from_host(self, e: Entry) -> None:
        """Demotes a session to disk, or drops it when it cannot be kept there. Sessions being loaded or
        written, or whose turn is running, are pinned and stay; unwritten ones are written first (then demoted
        by _finish_persist)."""
        self.state.apply_ended_turns()
        if e.pins or e.writers:
            return
        # A host copy still missing a head its turn did not recompute, and not durable that far (a remote copy
        # loaded without its head, `recompute_by_cost`), cannot be written: dropped (the remote copy stays).
        unwritable = e.host is not None and e.host.missing_head > e.persisted
        if self.lower is None or e.write is Write.NEVER or e.length == 0 or unwritable:
            if e.manifest is None:  # its only copy
                self.state.dropped(e)
            self.state.release_host(e)  # its durable copy, if any, stays
            self.state.count(host_drops=1)
        elif e.dirty:
            self.state.mark_dirty(e, Write.DEMOTE)
            self.state.cond.notify_all()
        else:
            assert e.manifest is not None and e.persisted == e.length, "a clean session is entirely below host"
            self.state.set_host(e, None)
            self.state.count(demotions=1)

    def enforce_disk(self, current: Entry | None) -> bool:
        """Drops other sessions' disk copies (or, with `partial_eviction`, their leading chunks first) while
        the disk tier is over its limit. Returns whether it fits once the queued deletions have run (the caller
        runs them before writing)."""
        limit = self.config.disk_bytes
        entries = self.state.entries
        if self.state.disk_used - self.state.deleting > limit:
            self.drop_replaced_copies(current, self.state.disk_used - self.state.deleting - limit)
        while self.config.partial_eviction and self.state.disk_used - self.state.deleting > limit:
            # (Again while it frees something: the room a head drop's new manifest takes counts only once chosen.)
            queued = len(self.state.deletes)
            self.drop_disk_heads(current, self.state.disk_used - self.state.deleting - limit)
            if len(self.state.deletes) == queued:
                break
        for key in choose_victims(self.state.disk_policy.victims(), lambda key: entries[key].disk_bytes,
                                  lambda key: entries[key] is not current and entries[key].pins == 0,
                                  self.state.disk_used - self.state.deleting - limit):
            self.state.count(disk_drops=1)
            self.state.dropped(entries[key])
            self.drop_disk_copy(entries[key])
        return self.state.disk_used - self.state.deleting <= limit

    def replaced_copies(self, current: Entry | None, loading: bool = False):
        """Other sessions' older copies that a new history keeps until its own copy is durable (`StoreState.hand_over`)
        and that may go for room now (`loading`: or once their loads end). The session being written keeps its
        own: a durable copy is never dropped for its own successor."""
        for e in self.state.entries.values():
            if e is not current and e.manifest is None and e.predecessor is not None and e.files \
                    and (e.pins == 0 or loading and e.loading is not None):
                yield e

    def drop_replaced_copies(self, current: Entry | None, overflow: int) -> None:
        """Room from other sessions' replaced histories first (a capacity eviction, counted in `disk_drops`): they
        are the least likely to be resumed. The session's new history stays in host memory, to be written."""
        for e in list(self.replaced_copies(current)):
            if overflow <= 0:
                return
            overflow -= e.disk_bytes
            self.state.count(disk_drops=1)
            self.state.forget_replaced(e)

    def drop_disk_heads(self, current: Entry | None, overflow: int) -> None:
        """Partial eviction: drops leading chunks of idle sessions' disk copies, lowest retention value first
        (`placement.choose_head_drops`). Sessions loading, being written, running a turn or queued by the
        scheduler are left whole."""
        now, policy = time.monotonic(), self.state.disk_policy

        def describe(key):
            e = self.state.entries[key]
            # A hybrid model's session (with a state) stays whole: its head could not be recomputed without
            # recomputing the states, i.e. the whole session.
            if e is current or e.pins or e.writers or e.manifest is None or not e.manifest.spans \
                    or e.manifest.state is not None or policy.position(key) is not None:
                return None
            return now - e.last_access, self.head_units(e), e.disk_bytes

        candidates = head_drop_candidates(policy.victims(), overflow, describe)
        for key in choose_head_drops(candidates, overflow):
            e = self.state.entries.get(key)
            if e is None or e.manifest is None:
                continue
            if len(e.manifest.spans) == 1:  # its last chunk: the session leaves the disk tier
                self.state.count(disk_drops=1)
                self.state.dropped(e)
                self.drop_disk_copy(e)
            else:
                self.drop_disk_head(e)

    def head_units(self, e: Entry) -> list[tuple[int, int, int]]:
        """The session's stored chunks in order as (start, end, bytes freed when dropped); the last frees
        everything left (the manifest, chunks not yet collected)."""
        spans, units, pos = e.manifest.spans, [], e.manifest.head
        for i, span in enumerate(spans):
            if any(s.chunk == span.chunk for s in spans[i + 1 :]):
                freed = 0  # a later span reads the chunk too
            elif span.chunk in e.linked:  # a shared prefix's file: freed only with its last name
                freed = self.state.shared_bytes(e.key, span.chunk, e.linked[span.chunk])
            else:
                freed = blocks(e.files.get(span.chunk, 0))
            units.append((pos, pos + span.length, freed))
            pos += span.length
        a, b, _ = units[-1]
        units[-1] = (a, b, e.disk_bytes - sum(u[2] for u in units[:-1]))
        return units

    def drop_disk_head(self, e: Entry) -> None:
        """Drops the first stored chunk of a session's disk copy: the index at once, the files on the save
        thread (the new manifest first, then the chunk, so a crash in between leaves an orphan chunk)."""
        old = e.manifest
        manifest = old.drop_head_span()
        chunk = old.spans[0].chunk
        gone = chunk if all(s.chunk != chunk for s in manifest.spans) else None
        self.state.set_manifest(e, manifest, e.chunks)
        files = dict(e.files)
        size = files.pop(gone) if gone in files else None
        # A shared file frees its bytes only with its last name (`StoreState.set_files` says how many).
        nbytes = blocks(size) if size is not None and gone not in e.linked else 0
        nbytes += self.state.set_files(e, files, e.manifest_size)
        # The new manifest is written beside the old one (a temporary file, then a rename) before the chunk goes:
        # room for the largest such temporary is counted until the queued deletions have run (`run_deletes`; they
        # run one at a time), so `disk_bytes` holds while they do.
        room = blocks(len(manifest.encode()))
        self.state.reserve_manifest_room(room)
        self.state.queue_delete(e.key, nbytes, (manifest, gone))
        self.state.count(head_drops=1, head_dropped_tokens=old.spans[0].length)

    def reserve_disk(self, e: Entry, nbytes: int, exact: bool = False) -> int:
        """Makes room for `nbytes` before they are written (save thread), so the files on disk never exceed
        `disk_bytes`: other sessions' copies are dropped first and their folders deleted now. A file is counted
        in 4 KiB blocks; `exact`: `nbytes` is already a sum of such blocks (a job's bound, `SaveThread`).

        Whether the bytes can fit at all is asked first: when not even dropping every other session's copy that
        may go would make room, nothing is dropped (a refusal loses nothing else). The session's own durable
        copy is never dropped for it either: it stays until its successor is durable (`StoreState.hand_over`).

        Raises:
            NoDiskRoom: The session alone would not fit.
        """
        if self.disk is None:
            return 0  # saved to the remote tier: its memory is Redis's to limit (maxmemory), not `disk_bytes`
        size = nbytes if exact else blocks(nbytes)
        busy = False
        with self.state.cond:
            over = self.state.disk_used - self.state.deleting + size - self.config.disk_bytes
            fits = over <= 0 or over <= self.evictable_bytes(e)  # (the common case asks no session)
            busy = not fits and over <= self.evictable_bytes(e, pinned=True)
            if fits:
                self.state.reserve_disk(size)
                fits = self.enforce_disk(e)
                if not fits:  # (sessions pinned meanwhile: what was dropped went in good faith)
                    self.state.release_disk(size)
            deletes = self.state.take_deletes()
        self.run_deletes(deletes)
        if busy:
            raise DiskBusy(f"session {e.key[1]!r} does not fit in the disk tier while the sessions that would make "
                           "room for it are being read or written; retried")
        if not fits:
            raise NoDiskRoom(f"session {e.key[1]!r} is larger than the disk tier (`disk_bytes` "
                             f"{self.config.disk_bytes}) next to the sessions that cannot leave it")
        return size

    def evictable_bytes(self, current: Entry, pinned: bool = False) -> int:
        """The disk bytes dropping every other session's copy that may go now would free (lock held): copies that
        are not pinned (`pinned`: those being loaded too, once their loads end; the other pins are the running
        save's own, its links' sources), and shared files all of whose names are in them."""
        entries, gone = self.state.entries, set()
        total = 0
        for key in self.state.disk_policy.victims():
            e = entries.get(key)
            if e is not None and e is not current and (e.pins == 0 or pinned and e.loading is not None):
                total += e.disk_bytes
                gone.add(key)
        for e in self.replaced_copies(current, pinned):
            total += e.disk_bytes
            gone.add(e.key)
        for nbytes, names in self.state.linked.values():
            if names and all(key in gone for key, _ in names):
                total += nbytes
        return total

    def run_deletes(self, deletes: list[tuple[Key, int, tuple | None]]) -> None:
        """Runs queued deletions (save thread, without the lock; see `StoreState.deletes`). A deletion that fails
        (EACCES, EIO) is logged and the others go on; the bytes are released from the count either way (what is left
        is collected when the folder is next scanned)."""
        try:
            for key, nbytes, head in deletes:
                try:
                    self.run_delete(key, nbytes, head)
                except OSError as exc:
                    self.state.once.warning("delete", "disk tier: deleting files of session %r failed (%s)", key[1], exc)
        finally:
            if deletes:
                with self.state.cond:
                    self.state.deletes_done(deletes)
                    self.state.cond.notify_all()  # a flush() may be waiting for them

    def run_delete(self, key: Key, nbytes: int, head: tuple | None) -> None:
        if head is None:
            self.disk.remove(key)
            return
        manifest, chunk = head
        try:
            # Now, on this thread: behind the tier's write queue it would wait for every chunk queued before
            # it (a timeout there would drop a copy whose manifest still lands later).
            size = self.disk.write(key, MANIFEST, manifest.encode())
        except OSError as exc:
            # The index says the chunk is dropped, the disk still has the old manifest: make them agree by
            # letting the whole disk copy go (a clean miss later; the chunk is deleted with the folder).
            self.state.once.warning("head_drop", "disk tier: writing the manifest of partially evicted session %r "
                               "failed (%s); its disk copy is dropped", key[1], exc)
            with self.state.cond:
                e = self.state.entries.get(key)
                if e is not None and e.manifest is manifest:
                    # The chunk is still there: count it with the folder, whose deletion removes it.
                    self.state.set_files(e, {**e.files, chunk: nbytes} if chunk else e.files, e.manifest_size)
                    self.drop_disk_copy(e)
            return
        if chunk is not None:
            self.disk.delete(key, [chunk + CHUNK_SUFFIX])
        with self.state.cond:
            e = self.state.entries.get(key)
            if e is not None and e.manifest is manifest:
                self.state.set_files(e, e.files, size)

    def drop_disk_copy(self, e: Entry) -> None:
        """Removes a session from the disk tier; with no copy in host memory either, it is gone."""
        self.state.drop_disk_copy(e)
