"""Prefix sharing through AttnStoreCache: a turn starts from another session's stored prefix, exactly, and only
within one `cache_salt` (issue 31)."""

from __future__ import annotations

import pytest
import torch

from hf_attnstore import AttnStore, AttnStoreCache, cache_kwargs

from ..conftest import make_tiny, random_ids


def _greedy(model, store, sid, ids, **kw):
    cache = AttnStoreCache(model, store, sid, ids, **kw)
    out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=6, do_sample=False)
    return cache, out[:, ids.shape[1]:]


def test_seven_sessions_over_one_system_prompt_share_it_exactly():
    model = make_tiny("llama")
    store = AttnStore(host_bytes="256MiB")
    system = random_ids(1200, 1)
    used = []
    for i in range(7):
        ids = torch.cat([system, random_ids(30, 100 + i)], 1)
        cache, tokens = _greedy(model, store, f"s{i}", ids)
        reference = model.generate(ids, max_new_tokens=6, do_sample=False)[:, ids.shape[1]:]
        assert torch.equal(tokens, reference), i  # the same greedy tokens as recomputation (fp32)
        if i:
            assert cache.reused_tokens >= 1200 and cache.shared_from == f"s{i - 1}"
        del cache
        used.append(store.stats().host_bytes_used)
    assert used[-1] <= 1.3 * used[0]  # the shared prefix is held, and counted, once
    assert store.stats().prefix_hits == 6


def test_an_edited_turn_starts_from_the_session_with_the_longer_common_prefix():
    model = make_tiny("llama")
    store = AttnStore(host_bytes="256MiB")
    history = random_ids(300, 2)
    _greedy(model, store, "a", history)
    edited = torch.cat([history[:, :250], random_ids(20, 3)], 1)  # the last message edited, in a new session
    cache, tokens = _greedy(model, store, "b", edited)
    assert cache.shared_from == "a" and cache.reused_tokens == 250
    assert torch.equal(tokens, model.generate(edited, max_new_tokens=6, do_sample=False)[:, edited.shape[1]:])
    del cache
    stored = store.token_ids("a", AttnStoreCache.fingerprint_of(model, store))
    assert stored.numel() == 305 and stored[:300].equal(history[0])  # a keeps its own history and reply


def test_cache_salt_separates_tenants():
    model = make_tiny("llama")
    store = AttnStore(host_bytes="256MiB")
    system = random_ids(300, 4)
    _greedy(model, store, "a", torch.cat([system, random_ids(10, 5)], 1), cache_salt="tenant-a")
    ids = torch.cat([system, random_ids(10, 6)], 1)
    for sid, salt in (("b", "tenant-b"), ("c", None)):
        cache = AttnStoreCache(model, store, sid, ids, cache_salt=salt)
        assert cache.reused_tokens == 0 and cache.shared_from is None, salt
    # The same session id under another salt is another session: nothing of it is reused either.
    assert AttnStoreCache(model, store, "a", ids, cache_salt="tenant-b").reused_tokens == 0
    cache = AttnStoreCache(model, store, "d", ids, cache_salt="tenant-a")
    assert cache.reused_tokens == 300 and cache.shared_from == "a"


@pytest.mark.parametrize("salt, error", [("", ValueError), ("x" * 1025, ValueError), ("\ud800", ValueError),
                                         (b"salt", TypeError)])
def test_bad_cache_salt_is_refused(salt, error):
    model = make_tiny("llama")
    with pytest.raises(error, match="cache_salt"):
        AttnStoreCache(model, AttnStore(host_bytes="1MiB"), "s", random_ids(5, 1), cache_salt=salt)


def test_salted_sessions_are_found_under_their_salted_fingerprint():
    model = make_tiny("llama")
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(40, 7)
    cache = AttnStoreCache(model, store, "a", ids, cache_salt="tenant-a")
    model(cache.input_ids, **cache_kwargs(cache), use_cache=True)
    del cache
    salted = AttnStoreCache.fingerprint_of(model, store, cache_salt="tenant-a")
    assert store.token_ids("a", salted).equal(ids[0])
    assert store.token_ids("a", AttnStoreCache.fingerprint_of(model, store)) is None
    assert AttnStoreCache.fingerprints_of(model, store, "tenant-a") == [salted]
