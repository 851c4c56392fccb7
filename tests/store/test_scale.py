"""Per-turn work independent of the sessions held (issue 56, STYLE.md habit 9), asserted by counting, not timing.

Each test builds the same store twice, with few and with many sessions over one shared system prompt, wraps the
index's collections (the entries, the policies' orders, the prefix table's sharers, the dirty marks) in ones that
count every item read from them, runs one operation, and asserts that it read as many items either way: a scan of
the index would read more with more sessions.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest
import torch

from hf_attnstore import AttnStore
from hf_attnstore.store.index import BLOCK, PrefixTable

from .kvdata import BYTES_PER_TOKEN, FP, write_turn
from .test_states import FAST

SYSTEM = torch.arange(1000, 1000 + 16 * BLOCK)  # a shared system prompt of 1,024 tokens
FEW, MANY = 40, 400


class Reads:
    """A count of the items read from the collections `counting` wrapped."""

    def __init__(self):
        self.n = 0
        self.thread = threading.get_ident()  # the store's threads read the index too, at their own pace

    def add(self) -> None:
        if threading.get_ident() == self.thread:
            self.n += 1

    def counting(self, collection):
        """A copy of `collection` (a dict, an OrderedDict or a set) whose iterations and lookups add to the count."""
        reads = self

        def walk(items):
            for item in items:
                reads.add()
                yield item

        if isinstance(collection, set):
            class CountedSet(set):
                def __iter__(self):
                    return walk(super().__iter__())
            return CountedSet(collection)
        base = OrderedDict if isinstance(collection, OrderedDict) else dict

        class CountedDict(base):
            def __iter__(self):
                return walk(super().__iter__())

            def __reversed__(self):
                return walk(super().__reversed__())

            def values(self):
                return walk(super().values())

            def items(self):
                return walk(super().items())

            def get(self, key, default=None):
                reads.add()
                return super().get(key, default)

            def __getitem__(self, key):
                reads.add()
                return super().__getitem__(key)
        return CountedDict(collection)


def _prompt(i: int) -> torch.Tensor:
    """Session `i`'s ids: the system prompt, then 128 of its own."""
    return torch.cat([SYSTEM, torch.arange(128) + 100_000 * (i + 1)])


def _table_reads(sessions: int, every_depth: bool) -> tuple[int, list]:
    table = PrefixTable()
    for i in range(sessions):
        table.add((FP, f"s{i}"), _prompt(i))
    reads = Reads()
    for block, users in list(table._sessions.items()):
        table._sessions[block] = reads.counting(users)
    new_chat = torch.cat([SYSTEM, torch.tensor([7, 8, 9])])
    found = table.candidates(FP, new_chat, exclude=(FP, "s3"), every_depth=every_depth)
    return reads.n, found


def test_a_prefix_lookup_reads_the_newest_sharers_of_each_block_not_all_of_them():
    for every_depth in (False, True):
        few, found_few = _table_reads(FEW, every_depth)
        many, found_many = _table_reads(MANY, every_depth)
        assert few == many, (every_depth, few, many)
        # The same answer as a scan: the newest 4 sessions sharing the 16 blocks of the system prompt.
        assert found_many == [((FP, f"s{i}"), 16 * BLOCK) for i in range(MANY - 1, MANY - 5, -1)]


def _held(tmp_path, sessions: int, **config) -> AttnStore:
    """A store holding `sessions` sessions of 64 tokens, all on disk, the last few also in host memory (clean)."""
    store = AttnStore(host_bytes=8 * 64 * BYTES_PER_TOKEN, disk_dir=str(tmp_path / f"n{sessions}"),
                      **{**FAST, "chunk_tokens": 64, **config})
    for i in range(sessions):
        ids = list(range(i * 64, (i + 1) * 64))
        write_turn(store, f"s{i}", ids)
    store.flush()
    return store


def _count_index(store: AttnStore) -> Reads:
    """Wraps the index's collections in counting ones (see `Reads`; the caller holds the index's lock); only this
    thread's reads count."""
    index, reads = store._index, Reads()
    index.entries = reads.counting(index.entries)
    index.dirty = reads.counting(index.dirty)
    for policy in (index.host.policy, index.disk_policy):
        policy.order = reads.counting(policy.order)
    return reads


@pytest.mark.parametrize("policy", ["lru", "lookahead"])
def test_making_host_room_walks_the_policys_order_only_as_far_as_it_evicts(tmp_path, policy):
    counts = []
    for sessions in (FEW, MANY):
        store = _held(tmp_path, sessions, policy=policy)
        store.set_schedule([f"s{sessions - 1}", f"s{sessions - 2}"])  # the newest two have jobs waiting
        with store._index.lock:
            host = [k[1] for k in store._index.host.policy.victims()]
            reads = _count_index(store)
            freed = store._eviction.make_host_room(3 * 64 * BYTES_PER_TOKEN, exclude=None)
        counts.append(reads.n)
        demoted = [sid for sid in host if store._index.entries[(FP, sid)].host is None]
        store.close()
        # The policy's first three (the least recently used; with a look-ahead, not the queued ones).
        assert freed and demoted == host[:3] and f"s{sessions - 1}" not in demoted, (demoted, host)
    assert counts[0] == counts[1], counts


def test_the_save_worker_takes_its_next_job_from_a_queue_not_a_scan_of_the_dirty_sessions(tmp_path):
    counts = []
    for sessions in (FEW, MANY):
        store = AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path / f"n{sessions}"), **{**FAST, "chunk_tokens": 64})
        index = store._index
        with index.lock:
            index.forward_started()  # the model computes: every session is written behind it, later
        for i in range(sessions):
            write_turn(store, f"s{i}", list(range(i * 64, i * 64 + 10)))  # (less than a chunk)
        with index.cond:
            assert store._saves.next_save() is None  # every one waits for the gap after the turn
            assert len(index.dirty) == sessions
            store._eviction.evict_from_host(index.entries[(FP, "s7")])  # room needed: written at once
            reads = _count_index(store)
            chosen = store._saves.next_save()
            counts.append(reads.n)
            assert chosen is index.entries[(FP, "s7")]
            index.forward_ended()
        store.close()
    assert counts[0] == counts[1], counts


def test_expiry_pops_the_sessions_due_not_every_session_held(monkeypatch):
    import time

    clock = [time.monotonic()]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])  # the store's clock
    counts = []
    for sessions in (FEW, MANY):
        store = AttnStore(host_bytes="16MiB", ttl_s=100)
        for i in range(5):
            write_turn(store, f"old{i}", [i, i + 1])
        store.retain("old4", FP, 1000)
        clock[0] += 60
        assert store.lookup("old0", FP) is not None  # used: its TTL starts again
        for i in range(sessions):
            write_turn(store, f"s{i}", [i, i + 1])
        clock[0] += 50  # old1, old2, old3 idle for more than 100 s now; old4 too, but retained
        with store._index.lock:
            store._index.apply_ended_turns()  # (the turns' ends, each the work of its own turn)
            reads = _count_index(store)
            store._index.expire()
            counts.append(reads.n)
        assert {"old0", "old4"} <= {sid for _, sid in store._index.entries} and len(store._index.entries) == sessions + 2
        assert store.stats().ttl_expired == 3
        with store._index.lock:  # nothing more is due: nothing is read
            reads = _count_index(store)
            store._index.expire()
            assert reads.n == 0
        clock[0] += 60  # now the many are idle for 110 s: they expire, old0 (touched 110 s ago) too
        assert store.lookup("old4", FP) is not None and len(store._index.entries) == 1
        store.close()
    assert counts[0] == counts[1], counts


def test_a_call_naming_a_session_finds_its_entries_without_walking_every_entry():
    counts = []
    for sessions in (FEW, MANY):
        store = AttnStore(host_bytes="16MiB")
        for i in range(sessions):
            write_turn(store, f"s{i}", [i, i + 1])
        write_turn(store, "s3", [7, 8, 9], fp="another-model")  # the same session id under another model
        with store._index.lock:
            store._index.apply_ended_turns()
            reads = _count_index(store)
        assert "s3" in store and "nobody" not in store
        store.evict("s3")  # no lower tier: both of its entries go
        assert not store.delete("s3") and store.delete("s4", FP)
        counts.append(reads.n)
        assert len(store._index.entries) == sessions - 2
        store.close()
    assert counts[0] == counts[1], counts


def _gauges_by_scan(store: AttnStore) -> tuple[int, int, int]:
    """(host, disk, retained sessions) counted over every entry, as `stats()` once did."""
    import time

    index, now = store._index, time.monotonic()
    with index.lock:
        entries = list(index.entries.items())
        return (sum(e.host is not None for _, e in entries), sum(e.manifest is not None for _, e in entries),
                sum(index.is_retained(key, now) for key, _ in entries))


def test_the_stats_read_no_entry_and_their_gauges_equal_a_scan(tmp_path):
    """The pipeline reads `stats()` before every scheduling step (its look-ahead windows): its gauges are kept as the
    index changes. After loads, evictions, deletions, a replaced history and a reopen they equal a count over every
    entry."""
    counts = []
    for sessions in (FEW, MANY):
        store = _held(tmp_path, sessions)
        store.retain("s1", FP, 1000)
        store.retain("gone", FP, 1000)  # retained, never stored: not a held session
        with store._index.lock:
            reads = _count_index(store)
        s = store.stats()
        counts.append(reads.n)
        assert (s.host_sessions, s.disk_sessions, s.retained_sessions) == _gauges_by_scan(store) == (8, sessions, 1)
        for i in range(0, sessions, 7):  # loaded back into host memory (evicting others)
            snapshot = store.lookup(f"s{i}", FP)
            snapshot.loader is None or snapshot.loader.wait_all()
        store.evict("s2")
        store.delete("s3")
        write_turn(store, "s5", list(range(9000, 9064)))  # a new history under an old id
        write_turn(store, "new", list(range(7000, 7010)))  # in host memory only, until its save
        s = store.stats()
        assert (s.host_sessions, s.disk_sessions, s.retained_sessions) == _gauges_by_scan(store), s
        store.flush()
        s = store.stats()
        assert (s.host_sessions, s.disk_sessions) == _gauges_by_scan(store)[:2] and s.disk_sessions == sessions, s
        store.close()
        reopened = AttnStore(host_bytes=8 * 64 * BYTES_PER_TOKEN, disk_dir=str(tmp_path / f"n{sessions}"),
                             **{**FAST, "chunk_tokens": 64})
        s = reopened.stats()
        assert (s.host_sessions, s.disk_sessions) == _gauges_by_scan(reopened)[:2] == (0, sessions), s
        reopened.close()
    assert counts[0] == counts[1], counts
