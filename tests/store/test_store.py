"""The in-memory AttnStore: capacity, eviction order, ownership of sessions, copy-on-write snapshots."""

from __future__ import annotations

import pytest
import torch

from hf_attnstore import AttnStore, parse_bytes
from hf_attnstore.store.policy import make_policy

from .kvdata import layer_of

FP = "f" * 64
LAYERS, HEADS, DIM = 2, 2, 4
BYTES_PER_TOKEN = 2 * LAYERS * HEADS * DIM * 4 + 8  # fp32 keys and values + the int64 id


def kv(n: int, start: float = 0.0):
    """Per-layer keys/values whose values encode (layer, token) so copies can be checked exactly."""
    base = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1) + start
    keys = [(base + 1000 * layer).expand(1, HEADS, n, DIM).contiguous() for layer in range(LAYERS)]
    return keys, [k + 0.5 for k in keys]


def write(store, session, ids, base=None, keep=None):
    writer = store.open_turn(session, FP, base, keep if keep is not None else torch.arange(0))
    keys, values = kv(len(ids), start=float(ids[0]))
    return writer, writer.append(torch.tensor(ids), keys, values)


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 1024**3
    assert parse_bytes("1.5 KB") == 1500
    assert parse_bytes(4096) == 4096
    for bad in ("lots", "-1GiB", "3 parsecs"):
        with pytest.raises(ValueError, match="size"):
            parse_bytes(bad, "size")
    with pytest.raises(ValueError, match="positive"):
        parse_bytes(0)
    with pytest.raises(TypeError):
        parse_bytes(None)


def test_bad_store_options():
    with pytest.raises(ValueError, match="policy"):
        AttnStore(policy="random")
    with pytest.raises(ValueError, match="host_bytes"):
        AttnStore(host_bytes="nope")


def test_round_trip_and_miss():
    store = AttnStore(host_bytes="1MiB")
    assert store.lookup("a", FP) is None
    write(store, "a", list(range(10)))
    snap = store.lookup("a", FP)
    assert snap.token_ids.tolist() == list(range(10))
    keys, values = kv(10)
    for layer in range(LAYERS):
        k, v = layer_of(snap, layer)
        assert torch.equal(k, keys[layer]) and torch.equal(v, values[layer])
    assert store.lookup("a", "0" * 64) is None  # another model
    stats = store.stats()
    assert (stats.lookups, stats.hits, stats.misses, stats.sessions) == (3, 1, 2, 1)


def test_in_place_append_keeps_old_snapshots_intact():
    store = AttnStore(host_bytes="1MiB")
    write(store, "a", [1, 2, 3])
    old = store.lookup("a", FP)
    w = store.open_turn("a", FP, old, torch.arange(3))
    w.append(torch.tensor([4, 5]), *kv(2, start=3.0))
    new = store.lookup("a", FP)
    assert new.token_ids.tolist() == [1, 2, 3, 4, 5]
    assert new.source is old.source and new.parts[0][0] is old.parts[0][0]  # in place: no copy of the history
    assert old.token_ids.tolist() == [1, 2, 3]


def test_cut_then_append_starts_a_new_segment_instead_of_overwriting_visible_data():
    store = AttnStore(host_bytes="1MiB")
    write(store, "a", [1, 2, 3, 4, 5])
    old = store.lookup("a", FP)
    w = store.open_turn("a", FP, old, torch.arange(2))  # an edited history keeps only 2 tokens
    w.append(torch.tensor([9, 9]), *kv(2, start=50.0))
    assert store.lookup("a", FP).token_ids.tolist() == [1, 2, 9, 9]
    assert old.token_ids.tolist() == [1, 2, 3, 4, 5]
    assert layer_of(old, 0)[0][0, 0, :, 0].tolist() == [1, 2, 3, 4, 5]


def test_gathered_rebase_for_truncation():
    store = AttnStore(host_bytes="1MiB")
    write(store, "a", list(range(10)))
    old = store.lookup("a", FP)
    keep = torch.tensor([0, 1, 6, 7, 8, 9])
    w = store.open_turn("a", FP, old, keep)
    w.append(torch.tensor([42]), *kv(1, start=42.0))
    snap = store.lookup("a", FP)
    assert snap.token_ids.tolist() == [0, 1, 6, 7, 8, 9, 42]
    assert layer_of(snap, 1)[0][0, 0, :, 0].tolist() == [1000 + t for t in [0, 1, 6, 7, 8, 9, 42]]
    # Both kept ranges still point into the old segment (no copy); the new token went in place after the
    # old fill mark, extending the second range.
    assert len(snap.parts) == 2 and snap.parts[0][0] is old.parts[0][0]


def test_a_turn_that_never_writes_changes_nothing():
    store = AttnStore(host_bytes="1MiB")
    write(store, "a", [1, 2, 3, 4])
    store.open_turn("a", FP, store.lookup("a", FP), torch.arange(1))
    assert store.lookup("a", FP).token_ids.tolist() == [1, 2, 3, 4]


def test_newest_turn_owns_the_session():
    store = AttnStore(host_bytes="1MiB")
    write(store, "a", [1, 2])
    snap = store.lookup("a", FP)
    older = store.open_turn("a", FP, snap, torch.arange(2))
    newer = store.open_turn("a", FP, snap, torch.arange(2))
    assert newer.append(torch.tensor([3]), *kv(1, 3.0))
    assert older.append(torch.tensor([7]), *kv(1, 7.0))  # first write of a turn takes over...
    assert not newer.append(torch.tensor([4]), *kv(1, 4.0))  # ...and the other turn is now stale
    assert store.lookup("a", FP).token_ids.tolist() == [1, 2, 7]
    assert store.stats().stale_writes == 1


@pytest.mark.parametrize("policy, expected_left", [("lru", {"a", "c"}), ("fifo", {"b", "c"})])
def test_eviction_order(policy, expected_left):
    block = 16 * BYTES_PER_TOKEN  # buffers grow in blocks of 16 tokens
    store = AttnStore(host_bytes=2 * block, policy=policy)
    write(store, "a", [1, 2])
    write(store, "b", [3, 4])
    store.lookup("a", FP)  # LRU: a is now more recent than b
    write(store, "c", [5, 6])
    assert set(store.sessions()) == expected_left
    assert store.stats().host_drops == 1
    assert store.stats().host_bytes_used <= 2 * block


def test_session_larger_than_capacity_is_not_stored():
    store = AttnStore(host_bytes=100 * BYTES_PER_TOKEN)
    write(store, "small", [1])
    writer, ok = write(store, "big", list(range(200)))
    assert not ok and store.lookup("big", FP) is None
    assert store.stats().rejected_too_large == 1
    assert not writer.append(torch.tensor([1]), *kv(1))  # the turn stays inert
    assert store.lookup("small", FP) is not None  # nothing else was lost


def test_delete():
    store = AttnStore(host_bytes="1MiB")
    write(store, "a", [1])
    assert "a" in store and store.delete("a")
    assert "a" not in store and not store.delete("a")


def test_policy_textbook_orders():
    lru, fifo = make_policy("lru"), make_policy("fifo")
    for p in (lru, fifo):
        for key in "abc":
            p.insert(key)
        p.touch("a")
    assert list(lru.victims()) == ["b", "c", "a"]
    assert list(fifo.victims()) == ["a", "b", "c"]


def test_turn_writer_truncate_cuts_the_session_and_appends_after_the_cut(tmp_path):
    from .kvdata import FP, expect, kv

    store = AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), fsync=False, idle_flush_s=0.05, chunk_tokens=4)
    with store.open_turn("s", FP, None, torch.arange(0)) as w:
        assert w.append(torch.arange(10), *kv(list(range(10))))
        store.flush()  # durable first: the cut must also reach the disk tier
        w.truncate(6)
        assert w.append(torch.tensor([60, 61]), *kv([60, 61]))
    expect_ids = list(range(6)) + [60, 61]
    snap = store.lookup("s", FP)
    assert snap.token_ids.tolist() == expect_ids
    store.close()
    with AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), fsync=False) as reopened:
        got = reopened.lookup("s", FP)
        assert got.token_ids.tolist() == expect_ids
        keys, _ = kv(expect_ids)
        assert torch.equal(layer_of(got, 2)[0], keys[2])
    del expect


def test_prefetch_and_schedule_on_a_host_only_store_are_no_ops():
    """A store with no lower tier has nothing to load: prefetch starts nothing and raises nothing (the pipeline
    sends it hints before every turn)."""
    store = AttnStore(host_bytes="1MiB", policy="lookahead")
    kv = [torch.zeros(1, 2, 3, 4)]
    with store.open_turn("a", "fp", None, torch.empty(0)) as turn:
        assert turn.append(torch.tensor([1, 2, 3]), kv, kv)
    assert store.prefetch(["a", "b"], "fp") == 0
    assert store.prefetch(["a"]) == 0
    store.set_schedule(["b", "a"])
    assert store.tier_of("a", "fp") == "host"
