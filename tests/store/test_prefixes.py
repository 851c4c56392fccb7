"""Prefix sharing in the store: the prefix table, `AttnStore.lookup_prefix`, and shared segments counted once."""

from __future__ import annotations

import pytest
import torch

from hf_attnstore import AttnStore
from hf_attnstore.store.index import BLOCK, PrefixTable

FP = "f" * 64


def _kv(n: int):
    return [torch.randn(1, 2, n, 4) for _ in range(2)]


def _store_session(store, sid, ids, fp=FP):
    kv = _kv(ids.numel())
    with store.open_turn(sid, fp, None, torch.empty(0)) as turn:
        assert turn.append(ids, kv, kv)


def test_table_proposes_the_longest_whole_block_prefix_newest_first():
    table = PrefixTable()
    system = torch.arange(3 * BLOCK)
    table.add((FP, "a"), torch.cat([system, torch.arange(10)]))
    table.add((FP, "b"), system[: 2 * BLOCK])
    table.add(("other-model", "c"), system)
    assert table.candidates(FP, system) == [((FP, "a"), 3 * BLOCK)]
    assert table.candidates(FP, system[: 2 * BLOCK + 5]) == [((FP, "b"), 2 * BLOCK), ((FP, "a"), 2 * BLOCK)]
    assert table.candidates(FP, system, exclude=(FP, "a")) == [((FP, "b"), 2 * BLOCK)]
    assert table.candidates(FP, system[: BLOCK - 1]) == []  # shorter than a block: not looked up
    table.remove((FP, "a"))
    table.remove((FP, "b"))
    assert table.candidates(FP, system) == [] and len(table) == 1  # the other model's


def test_every_depth_also_proposes_sessions_that_share_less_deepest_first():
    table = PrefixTable()
    system = torch.arange(3 * BLOCK)
    table.add((FP, "a"), system)
    table.add((FP, "b"), system[: 2 * BLOCK])
    table.add((FP, "c"), system[:BLOCK])
    assert table.candidates(FP, system) == [((FP, "a"), 3 * BLOCK)]
    assert table.candidates(FP, system, every_depth=True) == [((FP, "a"), 3 * BLOCK), ((FP, "b"), 2 * BLOCK),
                                                              ((FP, "c"), BLOCK)]


def test_lookup_prefix_is_exact_and_may_end_inside_a_block():
    store = AttnStore(host_bytes="16MiB")
    system = torch.randint(0, 1000, (150,))
    _store_session(store, "a", torch.cat([system, torch.tensor([1, 2, 3])]))
    prompt = torch.cat([system, torch.tensor([1, 2, 9])])
    assert store.lookup_prefix(FP, prompt) == ("a", 152)  # past the two whole blocks, id by id
    assert store.lookup_prefix(FP, prompt, exclude="a") is None
    assert store.lookup_prefix(FP, prompt, longer_than=152) is None
    assert store.lookup_prefix("another-model", prompt) is None
    other = prompt.clone()
    other[5] += 1  # diverges in the first block: nothing shared
    assert store.lookup_prefix(FP, other) is None
    assert store.stats().prefix_hits == 1


def test_a_removed_or_changed_session_is_never_offered():
    store = AttnStore(host_bytes="16MiB")
    system = torch.randint(0, 1000, (200,))
    _store_session(store, "a", system)
    store.delete("a")
    assert store.lookup_prefix(FP, system) is None
    _store_session(store, "b", system)
    _store_session(store, "b", torch.randint(0, 1000, (200,)))  # another history replaced it: the table is stale
    assert store.lookup_prefix(FP, system) is None  # the ids are compared, never trusted from the table


def test_share_prefixes_off_shares_nothing():
    store = AttnStore(host_bytes="16MiB", share_prefixes=False)
    system = torch.randint(0, 1000, (200,))
    _store_session(store, "a", system)
    assert store.lookup_prefix(FP, system) is None
    with pytest.raises(TypeError, match="share_prefixes"):
        AttnStore(share_prefixes="yes")


def test_shared_segments_count_once_until_their_last_user_goes():
    store = AttnStore(host_bytes="64MiB")
    system = torch.randint(0, 1000, (1000,))
    _store_session(store, "a", system)
    one = store.stats().host_bytes_used
    base = store.lookup("a", FP)
    for sid in ("b", "c"):
        with store.open_turn(sid, FP, base, torch.arange(1000)) as turn:  # starts from a's tokens, then 5 more
            assert turn.append(torch.arange(5), _kv(5), _kv(5))
    assert store.token_ids("b", FP)[:1000].equal(system)
    three = store.stats().host_bytes_used
    assert one < three < 1.1 * one
    store.delete("a")
    assert store.stats().host_bytes_used == three  # a's segment is still b's and c's prefix
    store.delete("b")
    store.delete("c")
    assert store.stats().host_bytes_used == 0


def test_reopen_rebuilds_the_table_from_the_manifests(tmp_path):
    system = torch.randint(0, 1000, (300,))
    with AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path)) as store:
        _store_session(store, "a", system)
    with AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path)) as store:
        assert store.lookup_prefix(FP, torch.cat([system, torch.tensor([5])])) == ("a", 300)
        snap = store.lookup("a", FP)
        assert snap.tier == "disk" and snap.token_ids.equal(system)


def test_a_turn_that_ends_with_an_empty_session_is_not_recorded():
    """A session cut back to nothing when its turn ends has no prefix to offer (and recording it must not fail:
    an empty buffer's snapshot has no ids)."""
    store = AttnStore(host_bytes="16MiB")
    with store.open_turn("a", FP, None, torch.empty(0)) as turn:
        assert turn.append(torch.arange(100), _kv(100), _kv(100))
        turn.truncate(0)
    assert store.lookup_prefix(FP, torch.arange(100)) is None
    assert store.token_ids("a", FP) is None
