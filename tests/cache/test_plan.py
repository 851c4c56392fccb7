"""Planning once: the pure planner (plan.py) on plain tensors, and the number of calls a turn makes into the store
before its first forward (one `find`, one `open_turn`)."""

from __future__ import annotations

import pytest
import torch

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.cache.config import TruncationConfig
from hf_attnstore.cache.plan import ModelFacts, miss_plan, plan_turn, rectangular_prefix, shares
from hf_attnstore.cache.upstream import cache_kwargs
from hf_attnstore.store import Found, Match
from hf_attnstore.store.states import SessionState

from ..conftest import make_tiny, random_ids

DENSE = ModelFacts(has_rope=True)
HYBRID = ModelFacts(has_rope=True, has_state=True)
SPARSE = ModelFacts(has_rope=True, sparse=True)
NONE = TruncationConfig()
FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=16)


def match(ids, session="own", **kw) -> Match:
    return Match(session, torch.as_tensor(ids), None, kw.pop("tier", "host"), **kw)


def prompt(n) -> torch.Tensor:
    return torch.arange(n)


class TestPlanTurn:
    def test_the_own_session_is_reused_up_to_the_common_prefix(self):
        plan = plan_turn(prompt(10), NONE, Found(match([0, 1, 2, 9])), DENSE)
        assert plan.reused == 3 and plan.kv_source == "host" and plan.shared_from is None and plan.head == 0
        assert plan.reuse.input_ids.tolist() == [list(range(10))]
        # All of it matching: one token is left to compute.
        assert plan_turn(prompt(4), NONE, Found(match(range(4))), DENSE).reused == 3
        assert plan_turn(prompt(4), NONE, Found(None), DENSE).kv_source == "miss"

    def test_truncation_keeps_the_sinks_and_the_recent_tokens(self):
        cfg = TruncationConfig(context_window=8, keep_first=2)
        plan = plan_turn(prompt(10), cfg, Found(match(range(9))), DENSE)
        assert plan.reuse.dropped == 3 and plan.reuse.keep.tolist() == [0, 1, 5, 6, 7, 8]
        # Without RoPE the keys cannot move: only the sinks are reused.
        assert plan_turn(prompt(10), cfg, Found(match(range(9))), ModelFacts(has_rope=False)).reused == 2

    def test_a_longer_shared_prefix_replaces_the_own_one_unless_the_prompt_is_truncated(self):
        found = Found(match(range(3)), match(range(6), session="other", tier="disk"))
        plan = plan_turn(prompt(8), NONE, found, DENSE)
        assert plan.reused == 6 and plan.shared_from == "other" and plan.kv_source == "disk"
        assert plan_turn(prompt(8), NONE, Found(match(range(7)), found.shared), DENSE).shared_from is None
        cut = TruncationConfig(context_window=6, keep_first=2)
        assert not shares(prompt(8), cut, DENSE) and not shares(prompt(8), NONE, HYBRID)
        assert shares(prompt(8), NONE, DENSE)
        assert plan_turn(prompt(8), cut, found, DENSE).shared_from is None

    def test_a_hybrid_reuses_its_states_after_exactly_their_tokens_or_nothing(self):
        state = SessionState.capture(5, {"L0000.r0": torch.zeros(1, 2)})
        own = match(range(6), state=state)
        plan = plan_turn(prompt(8), NONE, Found(own), HYBRID)
        assert plan.reused == 5 and plan.state is state
        assert plan_turn(torch.tensor([0, 1, 2, 9, 9, 9, 9]), NONE, Found(own), HYBRID).reused == 0  # diverges early
        assert plan_turn(prompt(8), NONE, Found(match(range(6))), HYBRID).reused == 0  # no (verified) states
        cut = TruncationConfig(context_window=6, keep_first=2)
        assert plan_turn(prompt(8), cut, Found(own), HYBRID).reused == 0  # states cannot be cut

    def test_an_evicted_head_is_recomputed_up_to_the_last_reused_token_in_it(self):
        own = match(range(20), head=8)
        plan = plan_turn(prompt(24), NONE, Found(own), DENSE)
        assert (plan.reused, plan.head, plan.head_reused) == (20, 8, 8)
        # Every reused token in the head: recomputing them is all the reuse would save.
        assert plan_turn(torch.tensor(list(range(6)) + [99] * 4), NONE, Found(own), DENSE).reused == 0
        # Truncation keeps only the sinks of the head: those are recomputed.
        plan = plan_turn(prompt(40), TruncationConfig(context_window=30, keep_first=4), Found(match(range(39), head=8)),
                         DENSE)
        assert plan.reuse.dropped and (plan.head, plan.head_reused) == (4, 4)

    def test_a_sparse_turn_reuses_tokens_without_kv_only_as_one_tensor_per_layer(self):
        absent = torch.zeros(1, 2, 8, dtype=torch.bool)
        absent[0, 0, 5] = True  # head 0 lacks token 5, head 1 has it: uneven from there
        own = match(range(8), absent=absent)
        assert plan_turn(prompt(10), NONE, Found(own), SPARSE).reused == 5
        absent[0, 1, 6] = True  # even again after token 6
        assert plan_turn(prompt(10), NONE, Found(own), SPARSE).reused == 8
        assert plan_turn(prompt(10), NONE, Found(own), DENSE).reused == 8  # a dense match has no absent tokens
        assert rectangular_prefix(None, 3) == 3

    def test_a_recompute_keeps_the_ids_and_reuses_nothing(self):
        plan = plan_turn(prompt(10), TruncationConfig(context_window=8, keep_first=2), Found(match(range(9))), DENSE)
        again = plan.without_reuse()
        assert again.reused == 0 and again.kv_source == "miss" and torch.equal(again.reuse.input_ids,
                                                                                plan.reuse.input_ids)
        assert miss_plan(prompt(10), NONE, DENSE).reused == 0


class Counting:
    """Counts the calls to an AttnStore's public methods (the cache's crossings into the store)."""

    def __init__(self, store: AttnStore):
        self.calls: list[str] = []
        for name in dir(AttnStore):
            attr = getattr(AttnStore, name)
            if not name.startswith("_") and callable(attr) and not isinstance(attr, property):
                setattr(store, name, self._counted(name, getattr(store, name)))

    def _counted(self, name, method):
        def call(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)
        return call


@pytest.mark.parametrize("case", ["disk", "shared"])
def test_a_turn_calls_the_store_at_most_twice_before_its_first_forward(tmp_path, case):
    """A resumed disk hit, or a prompt that starts with a longer prefix of another session: `find`, `open_turn`."""
    model = make_tiny("llama")
    store = AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), **FAST)
    ids = random_ids(100, 1)
    with AttnStoreCache(model, store, "a", ids[:, :80]) as cache:
        model(cache.input_ids, **cache_kwargs(cache))
    store.flush()
    store.evict("a")
    session = "a" if case == "disk" else "b"
    counting = Counting(store)
    cache = AttnStoreCache(model, store, session, ids)
    assert cache.reused_tokens == 80 and cache.kv_source == "disk"
    assert cache.shared_from == (None if case == "disk" else "a")
    before_forward = list(counting.calls)
    assert before_forward == ["find", "open_turn"], before_forward
    model(cache.input_ids[:, cache.reused_tokens :], **cache_kwargs(cache))
    cache.close()
    store.close()
