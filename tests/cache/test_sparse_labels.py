"""KV a sparse turn computes (``kv_budget``: a forward that attended to a selection of the history) is stored labelled
inexact, and a dense turn never reuses it: it reuses the tokens before it and recomputes the rest, so its greedy
tokens are those of a turn without any store (fp32). A sparse turn reuses the whole session, as ALISA continues it.
"""

from __future__ import annotations

import pytest
import torch

from hf_attnstore import AttnStore, AttnStoreCache, SparseConfig
from hf_attnstore.cache.upstream import cache_kwargs

from ..conftest import make_tiny, random_ids

GREEDY = dict(do_sample=False, pad_token_id=0)


def sparse_turn(model, store, session, ids, budget, new=12):
    cache = AttnStoreCache(model, store, session, ids, kv_budget=budget)
    out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=new, **GREEDY)
    cache.close()
    return out, cache


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_dense_turn_after_sparse_turns_gives_the_tokens_of_recomputation(arch):
    model = make_tiny(arch)
    store = AttnStore("64MiB")
    out, first = sparse_turn(model, store, "s", random_ids(40, 1), 8)
    assert first.turn.sparse_from == 40  # the prompt attended to all of itself; the first reply token did not
    snap = store.lookup("s", AttnStoreCache.fingerprint_of(model, store))
    assert snap.length == out.shape[1] - 1 and snap.exact_prefix() == 40
    nxt = torch.cat([out, random_ids(5, 2)], dim=1)
    dense = AttnStoreCache(model, store, "s", nxt)
    assert dense.reused_tokens == 40
    reused = model.generate(dense.input_ids, **cache_kwargs(dense), max_new_tokens=10, **GREEDY)
    recomputed = model.generate(nxt, max_new_tokens=10, **GREEDY)
    assert torch.equal(reused, recomputed)
    dense.close()
    # The dense turn rewrote the session from token 40 on: exact again, every token reusable.
    assert store.lookup("s", AttnStoreCache.fingerprint_of(model, store)).exact_prefix() == reused.shape[1] - 1


def test_a_sparse_turn_reuses_the_whole_session_and_extends_its_label():
    model = make_tiny("llama")
    store = AttnStore("64MiB")
    out, _ = sparse_turn(model, store, "s", random_ids(40, 1), 8)
    nxt = torch.cat([out, random_ids(5, 2)], dim=1)
    out2, cache = sparse_turn(model, store, "s", nxt, 8)
    assert cache.reused_tokens == out.shape[1] - 1
    snap = store.lookup("s", AttnStoreCache.fingerprint_of(model, store))
    assert snap.length == out2.shape[1] - 1 and snap.exact_prefix() == 40


def test_a_budget_that_keeps_everything_labels_nothing():
    model = make_tiny("llama")
    store = AttnStore("64MiB")
    out, cache = sparse_turn(model, store, "s", random_ids(30, 3), 10_000)
    assert cache.turn.sparse_from is None
    assert AttnStoreCache(model, store, "s", torch.cat([out, random_ids(3, 4)], dim=1)).reused_tokens \
        == out.shape[1] - 1


@pytest.mark.parametrize("policy", ["alisa", "h2o", "streaming"])
def test_the_label_persists_on_disk_and_binds_a_restarted_store(tmp_path, policy):
    model = make_tiny("llama")
    config = SparseConfig(8, policy=policy)
    with AttnStore("64MiB", tmp_path, fsync=False, chunk_tokens=16) as store:
        out, _ = sparse_turn(model, store, "s", random_ids(40, 1), config)
        store.flush()
    nxt = torch.cat([out, random_ids(5, 2)], dim=1)
    with AttnStore("64MiB", tmp_path, fsync=False, chunk_tokens=16) as store:
        assert AttnStoreCache(model, store, "s", nxt, kv_budget=config, save=False).reused_tokens == out.shape[1] - 1
        dense = AttnStoreCache(model, store, "s", nxt)
        assert dense.reused_tokens == 40
        reused = model.generate(dense.input_ids, **cache_kwargs(dense), max_new_tokens=6, **GREEDY)
        assert torch.equal(reused, model.generate(nxt, max_new_tokens=6, **GREEDY))


def test_a_dense_turn_never_starts_from_another_sessions_inexact_prefix():
    """Prefix sharing: a new session over the same history as a sparse one reuses its exact tokens only."""
    model = make_tiny("llama")
    store = AttnStore("64MiB")
    out, _ = sparse_turn(model, store, "a", random_ids(80, 1), 8, new=80)
    prompt = torch.cat([out, random_ids(3, 2)], dim=1)
    dense = AttnStoreCache(model, store, "b", prompt)
    assert dense.shared_from in (None, "a") and dense.reused_tokens <= 80
    sparse = AttnStoreCache(model, store, "c", prompt, kv_budget=8, save=False)
    assert sparse.shared_from == "a" and sparse.reused_tokens > 80


def test_a_dense_turn_shares_the_prefix_with_the_most_exact_tokens():
    """Of two sessions over the same history, a sparse one (longer match, few exact tokens) and a dense one (shorter
    match, all exact), a dense turn starts from the dense one."""
    model = make_tiny("llama")
    store = AttnStore("64MiB")
    out, _ = sparse_turn(model, store, "a", random_ids(70, 1), 8, new=90)  # exact: its 70-token prompt
    # c shares one whole 64-token block with the prompt below, a two: c is found among the shallower matches.
    dense = AttnStoreCache(model, store, "c", out[:, :110])
    assert dense.shared_from == "a" and dense.reused_tokens == 70  # a's exact tokens
    model(dense.input_ids[:, dense.reused_tokens :], **cache_kwargs(dense))
    dense.close()
    later = AttnStoreCache(model, store, "b", torch.cat([out, random_ids(3, 2)], dim=1), save=False)
    assert later.shared_from == "c" and later.reused_tokens == 110
