"""The placement decisions the store and the simulator share, on exact small cases."""

from __future__ import annotations

from hf_attnstore.store.policy import make_policy
from hf_attnstore.store.policy import choose_victims, lookahead_windows

SIZES = {"a": 10, "b": 20, "c": 30, "d": 40}


def test_victims_are_taken_in_order_until_the_overflow_is_freed():
    assert choose_victims("abcd", SIZES.get, lambda k: True, overflow=25) == ["a", "b"]
    assert choose_victims("abcd", SIZES.get, lambda k: True, overflow=0) == []
    assert choose_victims("abcd", SIZES.get, lambda k: k != "a", overflow=25) == ["b", "c"]
    assert choose_victims("abcd", SIZES.get, lambda k: False, overflow=25) == []


def test_a_prefetch_never_evicts_a_session_needed_sooner():
    policy = make_policy("lookahead")
    for k in "abcd":
        policy.insert(("fp", k))
    policy.set_queue(["d", "x", "b", "c"])  # a has no job; c's is furthest; d's is next
    order = list(policy.victims())
    assert order == [("fp", "a"), ("fp", "c"), ("fp", "b"), ("fp", "d")]
    size = lambda key: SIZES[key[1]]  # noqa: E731
    # Room for the job at position 2 (b): a and c (position 3) may go, b and d may not.
    chosen = choose_victims(order, size, lambda key: True, overflow=100, position=policy.position, keep_sooner_than=2)
    assert chosen == [("fp", "a"), ("fp", "c")]
    # Without the constraint (a turn that must run), everything may go.
    assert len(choose_victims(order, size, lambda key: True, overflow=100)) == 4


def test_lookahead_windows_follow_the_mean_session_size():
    # 4 sessions of 25 bytes in a 100-byte host tier and 1000 bytes of disk.
    assert lookahead_windows(100, 1000, 100, 4, 0, 0) == (8, 44)
    assert lookahead_windows(100, 1000, 0, 0, 500, 5) == (2, 11)  # only disk sessions so far
    assert lookahead_windows(100, 1000, 0, 0, 0, 0) == (2, 11)  # nothing stored yet
    assert lookahead_windows(100, 1000, 100, 4, 0, 0, prefetch_window=3, eviction_window=7) == (3, 7)
