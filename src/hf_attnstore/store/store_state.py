"""The store's state and its one owner: every session's entry (the index of sessions by key, with the prefix table
beside it), the byte counters, pins, dirty marks and the queues between the store and its I/O threads, under one
lock.

A `StoreState` holds all of it; the deciders around it (placement in eviction.py, loads in load_planner.py, saves
in saver.py, a turn's appends in turn_sink.py, the public API in store.py) read it only while holding
`StoreState.lock`, and change it only through the methods here: entries' fields, pins, dirty marks, disk
reservations, queues and stats are written in this module alone (tests/store/test_ownership.py). The I/O threads
never see it: the save thread talks to `SavePlanner`, the load thread reports through a callback, a turn's writer
through its `TurnSink`.

Sessions are named paths over chunks: an entry is keyed by ``(fingerprint, session_id)`` and its durable copy is a
manifest, a list of spans over chunk files, each chunk identified by a digest chained over every token id
before it (format.py). Which sessions begin with which prefix is the prefix table's (`PrefixTable`,
prefixes.py), held here (docs/design.md, "The store's state and its owner").

Example:
    >>> from hf_attnstore.store.config import StoreConfig
    >>> state = StoreState(StoreConfig(host_bytes="1MiB"), has_disk=False, has_lower=False)
    >>> with state.lock:
    ...     state.check_open()
    ...     len(state.entries), state.disk_used
    (0, 0)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import fields

from .block_pool import BlockPool
from .buffer import SessionBuffer, SessionKV
from .config import StoreConfig
from .entry import Entry, Key, Write, blocks
from .format import Manifest, prefix_digest
from .host import HostTier
from .logs import OnceLogger
from .policy import make_policy
from .prefixes import PrefixTable
from .state import SessionState
from .stats import StoreStats

logger = logging.getLogger("hf_attnstore.store.store")


MAX_RETAINED = 1_000_000  # sessions with a retention deadline (`StoreState.retain`): a bounded index

class StoreState:
    """The entries of every session and the counters of every tier, owned under one lock (see the module
    docstring). Methods other than `publish_states` and `queue_ended_turn` expect the caller to hold `lock`.

    Example:
        >>> from hf_attnstore.store.config import StoreConfig
        >>> from hf_attnstore.store.entry import Entry
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
        self.host = HostTier(config.host_bytes, config.policy, config.pin_memory)
        self.disk_policy = make_policy(config.policy)
        self.stats = StoreStats(host_bytes_limit=config.host_bytes, disk_bytes_limit=config.disk_bytes)
        self.disk_used = 0  # files of indexed sessions, folders queued for deletion, writes in flight
        # Files that several sessions' folders name or named (hard links of a shared prefix's chunks): identity
        # -> [bytes, {(key, name)}], counted in `disk_used` once while any name is left, whoever names them. The
        # file system keeps the bytes as long, so deleting one session never takes a chunk another manifest names.
        self.linked: dict[tuple, list] = {}
        self.dirty: set[Key] = set()
        self.remirror: set[Key] = set()  # sessions to copy again to a mirror tier that lost its data (refill.py)
        self.next_chunk: dict[Key, int] = {}  # per session, only ever grows
        # Deletions for the save thread, in order: (key, bytes freed, None) deletes a session's folder;
        # (key, bytes freed, (manifest, chunk)) writes the manifest of a partially evicted session, then
        # deletes `chunk` (if not None). Their bytes stay counted in `disk_used` until done (`deleting`).
        self.deletes: list[tuple[Key, int, tuple | None]] = []
        self.deleting = 0
        self.manifest_room = 0  # counted in `disk_used` for the new manifest a queued head drop writes (eviction.py)
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
        self.prefixes = PrefixTable()  # which sessions begin with which prefix (prefix sharing, prefixes.py)
        # Prompts' blocks, deduplicated across sessions (`block_pool`, block_pool.py); None: no pool.
        self.blocks = BlockPool(config.block_pool, config.pin_memory) if config.block_pool is not None else None
        # Sessions a client asked to keep (OpenAI's `prompt_cache_retention`): key -> monotonic deadline before
        # which `ttl_s` does not expire them. Capacity may still evict them (counted in `retained_dropped`).
        self.retained: OrderedDict[Key, float] = OrderedDict()

    def take_deletes(self) -> list[tuple[Key, int, tuple | None]]:
        """The queued deletions, for the save thread to run (lock held)."""
        deletes, self.deletes = self.deletes, []
        return deletes

    def check_open(self) -> None:
        if self.closed:
            raise ValueError("this AttnStore is closed")

    def touch(self, e: Entry) -> None:
        e.last_access = time.monotonic()
        self.host.touch(e)
        if e.manifest is not None:
            self.disk_policy.touch(e.key)

    def set_host(self, e: Entry, buf: SessionBuffer | None) -> None:
        """Makes `buf` the session's host copy (replacing any other), or lets it go (None): its bytes are freed
        when the last snapshot of it is."""
        if buf is None and e.host is not None:
            self.dirty.discard(e.key)  # what is not written by now is given up with the buffer
            self.host.policy.remove(e.key)
        elif buf is not None and e.host is None:
            self.host.policy.insert(e.key)
        e.host = buf
        self.account(e)

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
            self.prefixes.remove(e.key)
        self.set_host(e, None)
        self.set_manifest(e, None, {})
        if self.has_disk:
            self.delete_folder(e)

    def unindex(self, e: Entry) -> None:
        """Takes an entry out of the index, host memory and the disk policy, leaving its files (lock held)."""
        if self.entries.get(e.key) is e:
            del self.entries[e.key]
            self.prefixes.remove(e.key)
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
        self.set_manifest(c, e.manifest, e.chunks)
        if c.manifest is not None and not c.manifest.head:
            self.prefixes.add(c.key, c.manifest.token_ids)
        c.files, c.manifest_size, e.files, e.manifest_size = e.files, e.manifest_size, {}, 0
        c.linked, e.linked = e.linked, {}

    def retain(self, key: Key, seconds: float) -> None:
        """Keeps `key`'s session from expiring by idleness for `seconds` from now (lock held); the index of such
        deadlines holds at most `MAX_RETAINED` sessions (the earliest asked for go first)."""
        self.retained[key] = max(self.retained.get(key, 0.0), time.monotonic() + seconds)
        self.retained.move_to_end(key)
        while len(self.retained) > MAX_RETAINED:
            self.retained.popitem(last=False)

    def is_retained(self, key: Key, now: float | None = None) -> bool:
        return self.retained.get(key, 0.0) > (time.monotonic() if now is None else now)

    def dropped(self, e: Entry) -> None:
        """Counts a capacity eviction that took a retained session's last copy (lock held)."""
        if self.is_retained(e.key):
            self.stats.retained_dropped += 1

    def expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, until in self.retained.items() if until <= now]:
            del self.retained[key]
        ttl = self.config.ttl_s
        if ttl is None:
            return
        self.apply_ended_turns()
        for e in [e for e in self.entries.values() if now - e.last_access > ttl and e.pins == 0 and not e.writers
                  and not self.is_retained(e.key, now)]:
            self.drop(e)
            self.stats.ttl_expired += 1

    def cut(self, e: Entry, length: int) -> None:
        """Shortens a session. A new generation: a save in flight may hold tokens past the cut, and must not
        commit them (it would describe a history that no longer exists)."""
        e.host.truncate(length)
        self.account(e)  # a state of the cut tokens went with them
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
                self.keep_encoded(e)  # encoded copies that waited for the turn to end (encoded.py)
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
            self.dirty.add(e.key)
            self.cond.notify_all()

    def keep_encoded(self, e: Entry, encoded: list = ()) -> None:
        """Makes encoded copies of a session's chunks (written by the save thread, or read by a load) its host
        copy of them (encoded.py, `SessionBuffer.compact`).

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
        s.sessions = len(self.entries)
        s.host_sessions = sum(e.host is not None for e in self.entries.values())
        s.disk_sessions = sum(e.manifest is not None for e in self.entries.values()) if local_disk else 0
        s.host_bytes_used, s.disk_bytes_used = self.host.used, self.disk_used
        s.loads_in_flight, s.saves_pending = self.loads_active, len(self.dirty)
        s.pool_blocks = len(self.blocks) if self.blocks is not None else 0
        s.remote_down = remote_down
        now = time.monotonic()
        s.retained_sessions = sum(self.is_retained(key, now) for key in self.entries)
        return s

    def pin(self, e: Entry) -> None:
        """A load or a write of the session is in flight: its buffers must not change, eviction skips it."""
        e.pins += 1

    def unpin(self, e: Entry) -> None:
        e.pins -= 1

    def mark_dirty(self, e: Entry, write: Write | None = None) -> None:
        """The session has tokens to write (`write`: how soon, else as it was)."""
        if write is not None:
            e.write = write
        self.dirty.add(e.key)

    def mark_clean(self, e: Entry, write: Write | None = None) -> None:
        """Nothing of the session is to be written now (`write`: what then, else as it was)."""
        if write is not None:
            e.write = write
        self.dirty.discard(e.key)

    def set_write(self, e: Entry, write: Write) -> None:
        e.write = write

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
        """Room for the largest new manifest a queued head drop writes beside the old one (eviction.py)."""
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
        e.write = Write.NEVER  # not written again this turn: it would only push another session out
        self.delete_folder(e)

    def start_load(self, e: Entry, buf: SessionBuffer, job) -> None:
        """A load of the session into `buf` is submitted (`job`, load_thread.py): pinned until `end_load`."""
        e.loading, e.load_job = job.handle, job
        e.pins += 1
        self.set_host(e, buf)
        self.loads_active += 1

    def end_load(self, e: Entry, handle) -> None:
        e.pins -= 1
        self.loads_active -= 1
        if e.loading is handle:
            e.loading, e.load_job = None, None

    def loaded_remote(self, e: Entry, dirty: bool) -> None:
        """A copy found remotely is local now (`dirty`: to be written to the lower tier behind the turn)."""
        e.remote = None
        e.last_write = time.monotonic()
        if dirty:
            self.dirty.add(e.key)

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
            e.last_error, e.write = error, Write.FAILED
            e.retry_at = retry_at
        e.failures += 1

    def never_write(self, e: Entry, error: BaseException) -> None:
        """The session is larger than the lower tier can hold: not written again until its next turn."""
        self.dirty.discard(e.key)
        e.write, e.last_error = Write.NEVER, error

    def save_ok(self, e: Entry) -> None:
        e.failures, e.last_error = 0, None
        if e.write is Write.FAILED:
            e.write = Write.BEHIND

    def saved(self, e: Entry, manifest: Manifest, chunks: dict) -> None:
        """The session's own copy is durable as `manifest`: the older copy it was handed is collected."""
        self.set_manifest(e, manifest, chunks)
        e.predecessor = None

    def forget_dirty(self, key: Key) -> None:
        """A session gone, or with nothing to write, leaves the dirty set."""
        self.dirty.discard(key)

    def refuse_remote(self, e: Entry, signature: tuple | None) -> None:
        """A remote copy that failed to verify or load is not tried again (`remote_signature`)."""
        e.refused = signature

    def add(self, e: Entry, last_access: float | None = None) -> None:
        """Puts an entry in the index (replacing any other of its key)."""
        if last_access is not None:
            e.last_access = last_access
        self.entries[e.key] = e

    def reopened(self, e: Entry, manifest: Manifest, files: dict, manifest_size: int, chunks: dict,
                 last_access: float) -> None:
        """A session found on disk when the store reopens: indexed with its manifest and files."""
        e.last_access = last_access
        self.next_chunk[e.key] = manifest.next_chunk
        self.entries[e.key] = e
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
        """The session's stored tokens are offered for sharing (prefixes.py), `blocks_offered` whole blocks of them."""
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

    def writer_refused(self, e: Entry, turn: int) -> None:
        """The turn's appends are refused (the session outgrew the host tier): its host copy may go."""
        e.writers.discard(turn)
        if e.pins == 0:
            e.write = Write.BEHIND
            self.release_host(e)

    def owned_by(self, e: Entry, turn: int, live) -> None:
        """The turn owns the session now: pinned in host memory until it closes (older turns' pins are void)."""
        e.owner = turn
        e.live = live
        e.writers = {turn}
        e.prefix_blocks = 0  # the new turn's history is offered again as it grows
        if e.write is Write.NEVER:
            e.write = Write.BEHIND  # a new turn: the disk tier may have room again
