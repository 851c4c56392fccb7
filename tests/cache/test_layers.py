"""Hybrid models (layers.py): attention KV plus linear-attention / state-space states, per family.

Each hybrid is a tiny random model (conftest.HYBRID_MODELS). What must hold, fp32: multi-turn reuse gives the
tokens of a `DynamicCache` recomputation, with the states kept however the previous turn's cache ended
(closed, dropped, or still referenced); sessions demoted to disk, or reopened from it, resume exactly; a
prompt that diverges from the stored ids, or a truncation, recomputes (states are not position-decoupled).
"""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.serving.batching import batchable
from hf_attnstore.cache.fingerprint import kv_geometry
from hf_attnstore.cache.layout import BOTH, KV, NONE, STATE, LayerLayout
from hf_attnstore.cache.rope import HYBRID_MODEL_TYPES

from . import test_cache
from ..conftest import HYBRID_MODELS, make_tiny, random_ids
from .test_cache_tiers import FAST, chat
from hf_attnstore.cache.upstream import cache_kwargs

HYBRIDS = sorted(HYBRID_MODELS)
GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def turn(model, store, session, ids, new_tokens=5, **kw):
    """One turn through an AttnStoreCache; returns the cache (open) and the output ids."""
    cache = AttnStoreCache(model, store, session, ids, **kw)
    out = model.generate(cache.input_ids, attention_mask=torch.ones_like(cache.input_ids), **cache_kwargs(cache),
                         max_new_tokens=new_tokens, **GREEDY)
    return cache, out


def recompute(model, ids, new_tokens=5):
    return model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(DynamicCache(config=model.config)),
                          max_new_tokens=new_tokens, **GREEDY)


def test_every_hybrid_here_is_declared_supported():
    types = {make_tiny(arch).config.get_text_config(decoder=True).model_type for arch in HYBRIDS}
    assert types == HYBRID_MODEL_TYPES


@pytest.mark.parametrize("arch", HYBRIDS)
def test_layout_counts_kv_slots_and_state_layers(arch):
    model = make_tiny(arch)
    layout = LayerLayout.of(model)
    cache = DynamicCache(config=model.config)  # transformers' own dispatch of the same layer types
    assert len(layout.kinds) == len(cache.layers) and layout.has_state
    kinds = {"DynamicLayer": KV, "LinearAttentionLayer": STATE, "LinearAttentionAndFullAttentionLayer": BOTH,
             "DummyLayer": NONE}
    assert list(layout.kinds) == [kinds[type(layer).__name__] for layer in cache.layers]
    assert kv_geometry(model)[0] == len(layout.kv_layers) == sum(k in (KV, BOTH) for k in layout.kinds)
    assert batchable(model)[0] is False  # one turn at a time: the batch cache holds KV only


@pytest.mark.parametrize("arch", HYBRIDS)
def test_multi_turn_reuse_equals_recompute(arch):
    """Each turn's cache is still referenced when the next turn looks the session up: the store asks it for
    its states (the publish path)."""
    test_cache.test_multi_turn_greedy_equals_recompute(arch)


@pytest.mark.parametrize("ending", ["closed", "dropped", "open"])
def test_the_states_are_kept_however_the_turn_ends(ending):
    model = make_tiny("qwen3_next")
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(24, 1)
    cache, out = turn(model, store, "s", ids)
    if ending == "closed":
        cache.close()
    elif ending == "dropped":
        del cache
        gc.collect()
    nxt = torch.cat([out, random_ids(5, 2)], dim=1)
    second, out2 = turn(model, store, "s", nxt)
    assert second.reused_tokens == out.shape[1] - 1
    assert torch.equal(out2, recompute(model, nxt))
    assert store.stats().states_kept >= 1


def test_a_turn_still_running_offers_its_states_between_forwards_only():
    model = make_tiny("lfm2")
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(24, 3)
    cache = AttnStoreCache(model, store, "s", ids)
    with torch.no_grad():
        model(cache.input_ids, **cache_kwargs(cache))
    cache.turn.turn_end.complete = False  # as while a forward runs: the layers' states are half updated
    nxt = torch.cat([ids, random_ids(4, 4)], dim=1)
    assert AttnStoreCache(model, store, "s", nxt, save=False).reused_tokens == 0
    cache.turn.turn_end.complete = True
    reader = AttnStoreCache(model, store, "s", nxt, save=False)
    assert reader.reused_tokens == 24
    out = model.generate(reader.input_ids, **cache_kwargs(reader), max_new_tokens=4, **GREEDY)
    assert torch.equal(out, recompute(model, nxt, 4))


@pytest.mark.parametrize("arch", HYBRIDS)
def test_sessions_demoted_to_disk_and_reopened_resume_exactly(tmp_path, arch):
    model = make_tiny(arch)
    # Room for about one session in host memory: turns of the others resume from disk.
    per_session = AttnStore(host_bytes="64MiB")
    chat(model, per_session, ["x"], turns=3)
    size = per_session.stats().host_bytes_used
    store = AttnStore(host_bytes=int(size * 1.5), disk_dir=str(tmp_path), **FAST)
    sources, hist = chat(model, store, ["a", "b", "c"])
    assert sources.count("disk") >= 4, sources
    store.close()
    store = AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), **FAST)
    cache, out = turn(model, store, "a", hist["a"])
    # Everything but the 6 new tokens and the last generated one (never fed to the model) is reused.
    assert cache.kv_source == "disk" and cache.reused_tokens == hist["a"].shape[1] - 7
    assert torch.equal(out, recompute(model, hist["a"]))
    store.close()


@pytest.mark.parametrize("arch", ["qwen3_next", "falcon_h1", "jamba"])
def test_a_prompt_that_diverges_from_the_stored_ids_is_recomputed(arch):
    """Attention KV could be reused up to the divergence, but the states summarize every stored token."""
    model = make_tiny(arch)
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(30, 5)
    turn(model, store, "s", ids)[0].close()
    edited = ids.clone()
    edited[0, 20] = (edited[0, 20] + 1) % 128
    cache, out = turn(model, store, "s", edited)
    assert cache.reused_tokens == 0 and cache.kv_source == "miss"
    assert torch.equal(out, recompute(model, edited))
    # The same prompt again: nothing new to compute after the stored ids, so it is recomputed too.
    cache.close()
    again, _ = turn(model, store, "s", cache.token_ids.view(1, -1))
    assert again.reused_tokens == 0


@pytest.mark.parametrize("arch", ["qwen3_next", "bamba", "nemotron_h"])
@pytest.mark.parametrize("mode", ["decoupled", "recompute"])
def test_truncation_recomputes_the_truncated_ids(arch, mode):
    model = make_tiny(arch)
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(40, 6)
    turn(model, store, "r", ids)[0].close()
    hist = torch.cat([ids, random_ids(16, 7)], dim=1)
    cache, out = turn(model, store, "r", hist, context_window=48, keep_first=4, truncation=mode)
    assert cache.dropped_tokens > 0 and cache.reused_tokens == 0
    assert torch.equal(out, recompute(model, cache.input_ids))


def test_a_read_only_turn_reuses_the_states_and_changes_nothing():
    model = make_tiny("falcon_h1")
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(20, 8)
    first, out = turn(model, store, "s", ids)
    first.close()
    nxt = torch.cat([out, random_ids(6, 9)], dim=1)
    for _ in range(2):  # twice: the first read-only turn must not have changed the stored states
        reader, got = turn(model, store, "s", nxt, save=False)
        assert reader.reused_tokens == out.shape[1] - 1
        assert torch.equal(got, recompute(model, nxt))
        reader.close()
    assert torch.equal(store.token_ids("s", first.fingerprint), out[0, :-1])


@pytest.mark.parametrize("arch", ["qwen3_next", "zamba2"])
def test_the_chat_pipeline_serves_hybrids_one_turn_at_a_time_with_reuse(arch):
    from ..serving import test_batching

    model = make_tiny(arch)
    stored = test_batching.run(model, AttnStore("64MiB"), 4)  # asks for batches: hybrids run one at a time
    plain = test_batching.run(model, None, 4)  # recomputation, no store
    for key, reply in stored.items():
        assert reply.generated_ids == plain[key].generated_ids, key
        session, turn_index = key
        assert (reply.reused_tokens > 0) == (turn_index > 0), key  # every later turn resumes its session
