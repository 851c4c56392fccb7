"""The prefix-block eviction policies (store/policy/blocks.py, density.py): leaves first, exact orders, the
look-ahead queue, ghosts, and the store's placement code driving them through the EvictionPolicy interface."""

from __future__ import annotations

import pytest

from hf_attnstore.store.policy import choose_victims
from hf_attnstore.lab.block_policy import BLOCK_POLICIES, BlockKey, RetentionPolicy, make_block_policy
from hf_attnstore.lab.block_policy import HitDensityPolicy

K = BlockKey


def order(policy):
    return [k.block for k in policy.victims()]


def chain(policy, *ids):
    parent = None
    for b in ids:
        policy.insert(K(b, parent))
        parent = b


@pytest.mark.parametrize("name", [n for n in BLOCK_POLICIES if n != "lru"])
def test_only_leaves_are_victims_and_a_parent_follows_its_last_child(name):
    p = make_block_policy(name)
    chain(p, 1, 2, 3)
    chain(p, 1, 2, 4)
    assert sorted(order(p)) == [3, 4]
    p.remove(K(3, 2))
    assert order(p) == [4]
    p.remove(K(4, 2))
    assert order(p) == [2]  # now a leaf
    p.remove(K(2, 1))
    p.remove(K(1, None))
    assert order(p) == [] and len(p) == 0


def test_leaf_lru_order_is_exact():
    p = make_block_policy("lru-leaf")
    chain(p, "a", "b")
    chain(p, "c")
    chain(p, "d")
    p.touch(K("b", "a"))
    assert order(p) == ["c", "d", "b"]
    p.touch(K("zz", None))  # absent: ignored
    assert order(p) == ["c", "d", "b"]


def test_a_parent_removed_before_its_child_keeps_the_tree_right():
    p = make_block_policy("lru-leaf")
    chain(p, 1, 2)
    p.remove(K(1, None))  # a store may drop an inner block (e.g. a failed write)
    assert order(p) == [2]
    p.insert(K(1, None))  # back, with its child still present: not a leaf
    assert order(p) == [2]
    p.remove(K(2, 1))
    assert order(p) == [1]


@pytest.mark.parametrize("name", [n for n in BLOCK_POLICIES if n != "lru"])
def test_queued_blocks_go_last_the_furthest_in_the_queue_first(name):
    p = make_block_policy(name)
    for b in range(6):
        p.insert(K(b, None))
    p.set_queue([[4], [9, 1], [4, 2]])
    assert p.position(K(1, None)) == 1 and p.position(K(4, None)) == 0 and p.position(K(5, None)) is None
    assert order(p)[-3:] == [2, 1, 4]
    p.set_queue([])
    assert set(order(p)) == set(range(6)) and p.position(K(4, None)) is None


def test_retention_credit_keeps_reused_blocks_and_ghosts_count_a_missed_read():
    p, lru, none = RetentionPolicy(credit=10), make_block_policy("lru-leaf"), RetentionPolicy(credit=0)
    for q in (p, lru, none):
        q.insert(K("a", None))
        q.touch(K("a", None))
        q.insert(K("b", None))
        q.insert(K("c", None))
    assert order(lru) == order(none) == ["a", "b", "c"]
    assert order(p) == ["b", "c", "a"]  # a: last use 2 + 10
    p.remove(K("b", None))
    p.insert(K("d", None))
    p.insert(K("b", None))  # back while its ghost is remembered: a missed read, so reused
    assert order(p) == ["c", "d", "a", "b"]


def test_retention_measures_its_credit_when_none_is_given():
    p = RetentionPolicy()
    for b in range(10):
        p.insert(K(b, None))
    for b in range(5):
        p.remove(K(b, None))  # ages at eviction: 10, 9, ..., 6 ticks
    assert 6 <= p.lifetime <= 10
    p.touch(K(5, None))
    assert p.priority(5) == pytest.approx(p.last[5] + p.lifetime)


def test_density_sampling_is_seeded_and_queued_blocks_go_last():
    a, b = HitDensityPolicy(samples=4, seed=1), HitDensityPolicy(samples=4, seed=1)
    for p in (a, b):
        for i in range(50):
            p.insert(K(i, None))
    assert order(a) == order(b) and sorted(order(a)) == list(range(50))
    assert order(a)[:4] != list(range(4))  # a random sample leads, not the insertion order
    small = HitDensityPolicy(samples=32)
    for i in range(10):
        small.insert(K(i, None))
    small.set_queue([[7], [3]])
    assert order(small)[-2:] == [3, 7]


@pytest.mark.parametrize("bad, message", [("mru", "`policy`='mru' is unknown"),
                                          ("lru-leaf:3", "only retention:CREDIT and slru:SHARE take a parameter"),
                                          ("retention:abc", "the parameter 'abc' is not a number"),
                                          ("retention:-1", "`credit`=-1.0 must be >= 0")])
def test_bad_policy_names(bad, message):
    with pytest.raises(ValueError, match=message):
        make_block_policy(bad)
    with pytest.raises(TypeError, match="not a BlockKey"):
        make_block_policy("lru-leaf").insert("plain-key")


@pytest.mark.parametrize("name", list(BLOCK_POLICIES))
def test_the_stores_placement_code_drives_a_block_policy(name):
    p = make_block_policy(name)
    chain(p, 1, 2)
    chain(p, 3)
    sizes = {1: 100, 2: 100, 3: 100}
    chosen = choose_victims(p.victims(), lambda k: sizes[k.block], lambda k: k.block != 3, overflow=150)
    if name == "lru":  # plain LRU: the oldest first, parent or not
        assert [k.block for k in chosen] == [1, 2]
    else:  # leaves only (2; 3 is pinned): one pass frees what it can, the next pass offers the parent
        assert [k.block for k in chosen] == [2]


def test_slru_evicts_probation_first_until_the_protected_share_is_exceeded():
    orders = {}
    for share in (0.5, 0.8):
        p = make_block_policy(f"slru:{share}")
        for b in "abc":
            p.insert(K(b, None))
        p.touch(K("a", None))
        p.touch(K("b", None))  # two of three blocks protected
        orders[share] = order(p)
    assert orders[0.8] == ["c", "a", "b"]  # 2 <= 0.8 * 3: probation goes first
    assert orders[0.5] == ["a", "b", "c"]  # 2 > 0.5 * 3: the protected segment gives up its oldest
    p = make_block_policy("slru")
    for b in "ab":
        p.insert(K(b, None))
    p.remove(K("a", None))
    p.insert(K("a", None))  # back while its ghost is remembered: protected
    assert order(p) == ["b", "a"]
    with pytest.raises(ValueError, match="`protected`=1.0"):
        make_block_policy("slru:1")
