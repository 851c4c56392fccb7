"""The store's index and its one owner: every session's entry, the byte counters and the queues between the
store and its I/O threads, under one lock.

An `Index` holds the state; the deciders around it (placement in eviction.py, loads in reader.py, saves in
saver.py, a turn's appends in turns.py, the public API in store.py) read and change it only while holding
`Index.lock`, and only through the entries and the methods here. The I/O threads never see it: the save
thread talks to `SavePlanner`, the load thread reports through a callback, a turn's writer through `Turns`.

Sessions are named paths over chunks: an entry is keyed by ``(fingerprint, session_id)`` and its durable copy is a
manifest, a list of spans over chunk files, each chunk identified by a digest chained over every token id
before it (format.py). Two sessions whose histories start alike name chunks of equal digests: what sharing
them across sessions needs (the prefix-sharing issue) is a table of chunks by digest with the sessions using
each, beside the entries here (docs/design.md, "The index").

Example:
    >>> from hf_attnstore.store.config import StoreConfig
    >>> index = Index(StoreConfig(host_bytes="1MiB"), has_disk=False, has_lower=False)
    >>> with index.lock:
    ...     index.check_open()
    ...     len(index.entries), index.disk_used
    (0, 0)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from .buffer import SessionBuffer
from .config import StoreConfig
from .entry import Entry, Key, blocks
from .format import Manifest, prefix_digest
from .host import HostTier
from .logs import OnceLogger
from .policy import make_policy
from .prefixes import PrefixTable
from .state import SessionState
from .stats import StoreStats

logger = logging.getLogger("hf_attnstore.store.store")


class Index:
    """The entries of every session and the counters of every tier, owned under one lock (see the module
    docstring). Methods other than `publish_states` expect the caller to hold `lock`."""

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
        if buf is not None:
            self.host.put(e, buf)
            return
        if e.host is not None:
            self.dirty.discard(e.key)  # what is not written by now is given up with the buffer
        self.host.remove(e)

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

    def expire(self) -> None:
        ttl = self.config.ttl_s
        if ttl is None:
            return
        now = time.monotonic()
        self.apply_ended_turns()
        for e in [e for e in self.entries.values() if now - e.last_access > ttl and e.pins == 0 and not e.writers]:
            self.drop(e)
            self.stats.ttl_expired += 1

    def cut(self, e: Entry, length: int) -> None:
        """Shortens a session. A new generation: a save in flight may hold tokens past the cut, and must not
        commit them (it would describe a history that no longer exists)."""
        e.host.truncate(length)
        self.host.account(e)  # a state of the cut tokens went with them
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
        self.host.account(e)
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
        self.host.account(e)
