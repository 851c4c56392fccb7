"""Context-overflow truncation: the planner (exact, pure) and its effect on cached keys."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_attnstore import AttnStore, AttnStoreCache, TruncationConfig
from hf_attnstore.cache import importance
from hf_attnstore.cache.truncation import common_prefix_length, plan_reuse, tokens_to_drop

from ..conftest import make_tiny, random_ids
from .test_cache import loaded_kv
from hf_attnstore.cache.upstream import cache_kwargs

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def cfg(window=20, ratio=0.5, keep=2, mode="decoupled"):
    return TruncationConfig(context_window=window, truncation_ratio=ratio, keep_first=keep, mode=mode)


def test_common_prefix_length():
    a = torch.tensor([1, 2, 3, 4])
    assert common_prefix_length(a, None) == 0
    assert common_prefix_length(a, torch.tensor([1, 2, 9])) == 2
    assert common_prefix_length(a, torch.tensor([1, 2])) == 2
    assert common_prefix_length(a, torch.tensor([7])) == 0
    assert common_prefix_length(a, a) == 4


def test_tokens_to_drop():
    c = cfg(window=20, ratio=0.5, keep=2)
    assert tokens_to_drop(20, c) == 0
    assert tokens_to_drop(21, c) == 9  # half of the 18 tokens after the sinks
    assert tokens_to_drop(35, c) == 15  # more than half is needed to fit
    assert tokens_to_drop(21, TruncationConfig(context_window=None)) == 0
    # Never drops the last token.
    assert tokens_to_drop(100, cfg(window=3, keep=2)) == 97


def test_plan_without_overflow_reuses_the_prefix():
    ids = torch.arange(10, 25)
    plan = plan_reuse(ids, torch.arange(10, 22), cfg(window=None), has_rope=True)
    assert plan.reused == 12 and plan.dropped == 0
    assert torch.equal(plan.input_ids[0], ids)
    assert torch.equal(plan.key_positions, torch.arange(12))


@pytest.mark.parametrize("mode", ["decoupled", "naive", "recompute"])
def test_plan_with_overflow(mode):
    ids = torch.arange(100, 124)  # 24 tokens > window 20: drop max(4, ceil(0.5 * 18)) = 9 after 2 sinks
    stored = torch.arange(100, 118)  # the first 18 are cached
    plan = plan_reuse(ids, stored, cfg(mode=mode), has_rope=True)
    assert plan.dropped == 9
    assert plan.input_ids[0].tolist() == [100, 101] + list(range(111, 124))
    if mode == "recompute":
        assert plan.keep.tolist() == [0, 1]
        assert plan.key_positions.tolist() == [0, 1]
    else:
        assert plan.keep.tolist() == [0, 1] + list(range(11, 18))
        expected_positions = plan.keep.tolist() if mode == "naive" else list(range(9))
        assert plan.key_positions.tolist() == expected_positions


def test_plan_overflow_when_the_cached_part_is_all_dropped():
    ids = torch.arange(24)
    plan = plan_reuse(ids, torch.arange(8), cfg(), has_rope=True)  # cached 8 < sinks + dropped = 11
    assert plan.keep.tolist() == [0, 1]


def test_plan_without_rope_falls_back_to_recompute():
    plan = plan_reuse(torch.arange(24), torch.arange(18), cfg(mode="decoupled"), has_rope=False)
    assert plan.keep.tolist() == [0, 1]


def one_layer_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("mode", ["decoupled", "naive"])
def test_truncated_keys_sit_at_their_new_positions(mode):
    """Layer 0 keys depend only on the token and its position, so after a decoupled truncation they must
    equal the keys the model computes for the truncated sequence from scratch; naive ones must not."""
    model = one_layer_llama()
    store = AttnStore(host_bytes="16MiB")
    ids = random_ids(40, 1)
    with torch.no_grad():
        first = AttnStoreCache(model, store, "t", ids[:, :36])
        model(first.input_ids, **cache_kwargs(first))
    cache = AttnStoreCache(model, store, "t", ids, context_window=32, keep_first=4, truncation=mode)
    assert cache.dropped_tokens == 14  # ceil(0.5 * (32 - 4))
    assert cache.input_ids.shape[1] == 26
    assert torch.equal(cache.input_ids[0], torch.cat([ids[0, :4], ids[0, 18:]]))
    assert cache.reused_tokens == 36 - 14
    geometry = model.model.layers[0].self_attn
    empty = torch.empty(1, model.config.num_key_value_heads, 0, geometry.head_dim)
    keys = cache.turn.loader.load_layer(0, cache.reused_tokens, empty, empty)[0]
    ref = DynamicCache()
    with torch.no_grad():
        model(cache.input_ids, **cache_kwargs(ref))
    ref_keys = ref.layers[0].keys[:, :, : cache.reused_tokens]
    if mode == "decoupled":
        torch.testing.assert_close(keys, ref_keys, atol=1e-5, rtol=0)
    else:
        torch.testing.assert_close(keys[:, :, :4], ref_keys[:, :, :4], atol=1e-5, rtol=0)
        assert (keys[:, :, 4:] - ref_keys[:, :, 4:]).abs().max() > 1e-2


def test_truncated_session_continues_consistently():
    model = make_tiny("llama")
    store = AttnStore(host_bytes="64MiB")
    hist = random_ids(30, 2)
    kwargs = dict(context_window=48, keep_first=4, truncation="decoupled")
    cache = AttnStoreCache(model, store, "c", hist, **kwargs)
    out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=8, **GREEDY)
    hist = torch.cat([out, random_ids(20, 3)], dim=1)  # 58 tokens > 48: truncate
    cache = AttnStoreCache(model, store, "c", hist, **kwargs)
    assert cache.dropped_tokens == 22 and cache.input_ids.shape[1] == 36
    assert cache.reused_tokens == 37 - 22
    out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=5, **GREEDY)
    assert out.shape[1] == 41
    # The session's stored ids are now the truncated sequence: the next turn reuses all of it.
    nxt = torch.cat([out, random_ids(3, 4)], dim=1)
    previous = cache
    cache = AttnStoreCache(model, store, "c", nxt, **kwargs)
    assert cache.dropped_tokens == 0 and cache.reused_tokens == 40
    # Without a further overflow, the stored state is resumed exactly: the same tokens as continuing the
    # previous turn's live cache (the decoupled-truncated KV, as the model held it) with the new ids.
    live = DynamicCache()
    for i, layer in enumerate(previous.layers):
        live.update(layer.keys.clone(), layer.values.clone(), i)
    out2 = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=4, **GREEDY)
    assert torch.equal(out2, model.generate(nxt, **cache_kwargs(live), max_new_tokens=4, **GREEDY))


def test_recompute_truncation_equals_generating_from_the_truncated_ids():
    model = make_tiny("qwen2")
    store = AttnStore(host_bytes="64MiB")
    hist = random_ids(40, 5)
    with torch.no_grad():
        first = AttnStoreCache(model, store, "r", hist)
        model(first.input_ids, **cache_kwargs(first))
    hist = torch.cat([hist, random_ids(16, 6)], dim=1)
    cache = AttnStoreCache(model, store, "r", hist, context_window=48, keep_first=4, truncation="recompute")
    assert cache.reused_tokens == 4
    out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=5, **GREEDY)
    assert torch.equal(out, model.generate(cache.input_ids, max_new_tokens=5, **GREEDY))


def test_importance_truncation_drops_the_least_important_tokens():
    cfg = TruncationConfig(context_window=64, truncation_ratio=0.5, keep_first=4, mode="importance", keep_recent=8)
    ids = torch.arange(100)
    weights = torch.ones(95)
    low = torch.tensor([3, 10, 50, 90] + list(range(20, 52)))  # 3: a sink, 90: recent: both stay
    weights[low] = 0.0
    plan = plan_reuse(ids, ids[:95], cfg, has_rope=True, importance=weights)
    dropped = sorted(set(range(100)) - set(plan.input_ids[0].tolist()))
    assert plan.dropped == 36 == len(dropped)
    # The 33 zeros that may go (10, 20..51; not the sink 3 nor the recent 90), then the oldest of the ties.
    assert dropped == [4, 5, 6, 10] + list(range(20, 52))
    assert plan.keep.tolist() == [i for i in range(95) if i not in dropped]
    assert torch.equal(plan.key_positions, torch.arange(plan.reused))
    # Without scores it is decoupled truncation.
    plain = plan_reuse(ids, ids[:95], cfg, has_rope=True)
    decoupled = plan_reuse(ids, ids[:95], TruncationConfig(64, 0.5, 4, "decoupled"), has_rope=True)
    assert torch.equal(plain.input_ids, decoupled.input_ids) and torch.equal(plain.keep, decoupled.keep)


def test_importance_truncation_keeps_keys_at_their_new_positions_and_goes_on():
    """A session scored by its turns is truncated by importance: the loaded keys equal what the model computes
    for the kept ids from scratch (re-rotated, as decoupled truncation), and the session continues from them."""
    model = make_tiny("llama")
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(40, 1)
    with torch.no_grad():
        cfg_ = TruncationConfig(context_window=32, truncation_ratio=0.5, keep_first=4, mode="importance",
                                keep_recent=4)
        # The first turn fits (no window), and scores its tokens as an importance-truncated session does.
        first = AttnStoreCache(model, store, "t", ids[:, :36],
                               truncation=TruncationConfig(None, 0.5, 4, "importance", 4))
        model(first.input_ids, **cache_kwargs(first))
        scores = {slot: s.clone() for slot, s in first.turn.scorer.scores.items()}
    first.close()
    store.flush()
    cache = AttnStoreCache(model, store, "t", ids, truncation=cfg_)
    assert cache.dropped_tokens == 14
    weights = importance.token_importance({k: v.half().float() for k, v in scores.items()}, 36)
    expected = plan_reuse(ids[0], ids[0, :36], cache.truncation, has_rope=True, importance=weights)
    assert torch.equal(cache.input_ids, expected.input_ids)
    assert not torch.equal(cache.input_ids, plan_reuse(ids[0], ids[0, :36], TruncationConfig(32, 0.5, 4),
                                                       has_rope=True).input_ids)
    ref = DynamicCache()
    with torch.no_grad():
        model(cache.input_ids, **cache_kwargs(ref))
    loaded = loaded_kv(cache, 0, cache.reused_tokens)
    for mine, theirs in zip(loaded, (ref.layers[0].keys, ref.layers[0].values)):
        torch.testing.assert_close(mine, theirs[:, :, : cache.reused_tokens], atol=1e-5, rtol=0)
    out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=4, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    nxt = torch.cat([out, random_ids(3, 2)], dim=1)
    assert AttnStoreCache(model, store, "t", nxt, context_window=64).reused_tokens == out.shape[1] - 1
