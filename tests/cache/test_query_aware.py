"""Query-aware selection over the full stored KV (cache/query_aware.py): Quest's pages and the oracle.

What must hold, fp32: a page's bound is at least every q·k in the page; each query keeps the sinks, the pages of
the highest bound and a recent window, the same count per head and query, within the budget; a decoding step
(gathered keys) and a turn of several queries (a mask) both equal softmax over exactly the kept keys, the forward's
own tokens causal; the oracle keeps each query head's top keys, so it never drops more attention mass than Quest at
the same budget; through a cache, a one-layer model equals a dense forward with the selection masked, a whole budget
is dense, the layer holds every token and the KV computed under selection is labelled inexact.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_attnstore import AttnStore, AttnStoreCache, SparseConfig
from hf_attnstore.cache import query_aware
from hf_attnstore.cache.query_aware import (PageSummaries, Selection, history_indices, page_bounds, selecting,
                                            sketch_indices)
from hf_attnstore.cache.layers import build_layers
from hf_attnstore.cache.layout import LayerLayout
from hf_attnstore.cache.upstream import cache_kwargs
from hf_attnstore.serving.batching import batchable

from ..conftest import make_tiny, random_ids
from .test_sparse import GREEDY

MODULE = type("Attention", (), {"layer_idx": 0, "is_causal": True, "num_key_value_groups": 2, "training": False})()


def _qkv(q: int, n: int, seed: int, q_heads: int = 4, kv_heads: int = 2, dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, q_heads, q, dim, generator=g), torch.randn(1, kv_heads, n, dim, generator=g),
            torch.randn(1, kv_heads, n, dim, generator=g))


def _reference(query, key, value, kept, scaling):
    """Softmax over the keys `kept` lets each query head see (``[q_heads, q, K]`` bool): ``[1, q, q_heads, d]``."""
    group = query.shape[1] // key.shape[1]
    keys, values = key[0].repeat_interleave(group, 0), value[0].repeat_interleave(group, 0)
    logits = (query[0] @ keys.transpose(1, 2)) * scaling
    weights = logits.masked_fill(~kept, float("-inf")).softmax(-1)
    return (weights @ values).transpose(0, 1)[None]


def _kept_by_quest(indices, q_heads, q, n):
    """The mask of what history_indices kept, plus each query's own tokens causally: ``[q_heads, q, n]``."""
    kv_heads, history = indices.shape[0], n - q
    kept = torch.zeros(kv_heads, q, n, dtype=torch.bool)
    kept.scatter_(2, indices, True)
    kept[:, :, history:] = torch.ones(q, q, dtype=torch.bool).tril()
    return kept.repeat_interleave(q_heads // kv_heads, 0)


def _choose(query, key, config, scaling=None):
    """What the policy keeps of the history, per KV head and query (as the attention computes it)."""
    if config.policy == "sparq":
        return sketch_indices(query, key, config, scaling)
    return history_indices(query, key, config, PageSummaries(min(config.sink_tokens, config.budget(key.shape[2] -
                                                                 query.shape[2])), config.page_tokens), scaling)


def test_a_page_bound_is_at_least_every_key_score_in_the_page():
    query, key, _ = _qkv(3, 70, seed=1)
    summaries = PageSummaries(sinks=4, page=8)
    low, high = summaries.of(key, pages=7)  # pages [4, 12) ... [52, 60)
    q = query[0].reshape(2, 6, 8)  # the two query heads of each KV head, 3 queries each
    bound = page_bounds(q, low, high)  # [2, 6, 7]
    scores = (q @ key[0, :, 4:60].transpose(1, 2)).unflatten(2, (7, 8))  # [2, 6, 7 pages, 8]
    assert (bound >= scores.amax(-1) - 1e-5).all()
    # The bound is tight for a page of one repeated key.
    same = key.clone()
    same[0, :, 4:12] = key[0, :, 4:5]
    low, high = PageSummaries(4, 8).of(same, pages=1)
    tight = page_bounds(q, low, high)
    torch.testing.assert_close(tight[:, :, 0], (q @ same[0, :, 4:5].transpose(1, 2))[:, :, 0])


def test_summaries_are_computed_once_per_page_and_grow_with_the_keys():
    _, key, _ = _qkv(1, 60, seed=2)
    summaries = PageSummaries(sinks=2, page=4)
    summaries.of(key[:, :, :30], pages=5)  # pages [2, 6) ... [18, 22)
    later = key.clone()
    later[0, :, 2:22] = 100.0  # the summarized pages are not read again (a held layer only appends)
    low, high = summaries.of(later, pages=10)
    fresh_low, fresh_high = PageSummaries(2, 4).of(key, pages=10)
    torch.testing.assert_close(low, fresh_low)
    torch.testing.assert_close(high, fresh_high)
    assert low.shape == (2, 10, 8)


def test_quest_keeps_sinks_recent_and_each_kv_heads_highest_page():
    config = SparseConfig(14, sink_tokens=2, recent_ratio=0.3, policy="quest", page_tokens=4)
    key = torch.zeros(1, 2, 41, 2)  # 40 history keys and the query's own
    key[0, 0, 10] = torch.tensor([3.0, 0.0])  # head 0: page [10, 14), met by the query's positive component
    key[0, 1, 27] = torch.tensor([0.0, -3.0])  # head 1: page [26, 30), met by its negative component
    key[0, 1, 14:18, 1] = -0.5  # head 1: page [14, 18), a lower bound (wherever the 2nd component meets the max)
    query = torch.tensor([1.0, -1.0]).expand(1, 2, 1, 2)  # one query head per KV head
    indices = history_indices(query, key, config, PageSummaries(2, 4))
    # Budget 14: 2 sinks; recent ceil(0.3 * 12) = 4, reaching back to the 8 candidate pages' end (34): 6 recent;
    # (14 - 2 - 6) // 4 = 1 page per head, the one of the highest bound.
    recent = list(range(34, 40))
    assert indices[0, 0].tolist() == [0, 1, 10, 11, 12, 13] + recent
    assert indices[1, 0].tolist() == [0, 1, 26, 27, 28, 29] + recent


def test_sparq_keeps_sinks_recent_and_each_kv_heads_best_tokens_by_the_components_it_reads():
    config = SparseConfig(6, sink_tokens=1, recent_ratio=0.2, policy="sparq", sketch_dims=1)
    key = torch.zeros(1, 2, 21, 2)  # 20 history keys
    key[0, 0, [3, 8, 11, 12], 0] = torch.tensor([4.0, 3.0, 2.0, 1.0])  # head 0's query is large in component 0
    key[0, 0, 5, 1] = 50.0  # ... and small in component 1, which its sketch skips
    key[0, 1, [2, 6, 9, 14], 1] = torch.tensor([-0.5, -3.0, -2.0, -1.0])  # head 1's query is large (negative) in component 1
    query = torch.tensor([[[[1.0, 0.1]], [[0.1, -1.0]]]])  # [1, 2 heads, 1 query, 2]
    indices = sketch_indices(query, key, config)
    # Budget 6: 1 sink, ceil(0.2 * 5) = 1 recent, the 4 others by the sketch's scores.
    assert indices[0, 0].tolist() == [0, 3, 8, 11, 12, 19]  # key 5's large true score is not seen by the sketch
    assert indices[1, 0].tolist() == [0, 2, 6, 9, 14, 19]


@pytest.mark.parametrize("policy", ["quest", "sparq"])
@pytest.mark.parametrize("history", [5, 17, 40, 63, 200])
@pytest.mark.parametrize("budget", [0.1, 0.2, 0.5, 12])
def test_every_head_and_query_keeps_the_same_count_within_the_budget(policy, history, budget):
    config = SparseConfig(budget, policy=policy, page_tokens=4)
    query, key, _ = _qkv(3, history + 3, seed=history)
    indices = _choose(query, key, config)
    keep = config.budget(history)
    assert indices.shape[:2] == (2, 3) and keep - 4 < indices.shape[2] <= keep
    if policy == "sparq":
        assert indices.shape[2] == keep
    assert (indices.diff(dim=2) > 0).all() and int(indices.max()) < history  # distinct history positions
    sinks = min(config.sink_tokens, keep)
    assert (indices[..., :sinks] == torch.arange(sinks)).all()
    assert (indices[..., -1] == history - 1).all()  # the most recent token


@pytest.mark.parametrize("policy", ["quest", "sparq"])
def test_a_decoding_step_attends_to_exactly_the_kept_keys(policy):
    query, key, value = _qkv(1, 90, seed=3)
    config = SparseConfig(0.3, sink_tokens=3, policy=policy, page_tokens=4, sketch_dims=4)
    indices = _choose(query, key, config, 0.25)
    with selecting(Selection(config)) as selection:
        out, _ = query_aware.attention(MODULE, query, key, value, None, scaling=0.25)
    expected = _reference(query, key, value, _kept_by_quest(indices, 4, 1, 90), 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    dense, _ = query_aware.attention(MODULE, query, key, value, None, scaling=0.25)  # no selection: SDPA
    assert not torch.allclose(out, dense, atol=1e-3)
    assert selection.held == 89 * 2 and selection.attended == selection.gathered == indices.numel()
    assert selection.steps == 1  # one layer's decoding step, what bench_sparse divides by


@pytest.mark.parametrize("policy", ["quest", "sparq"])
def test_a_turn_of_several_queries_selects_per_query_and_attends_causally_to_itself(policy):
    query, key, value = _qkv(6, 80, seed=4)
    config = SparseConfig(0.25, sink_tokens=2, policy=policy, page_tokens=4, sketch_dims=4)
    indices = _choose(query, key, config, 0.3)
    assert not all(torch.equal(indices[:, 0], indices[:, i]) for i in range(6)), "queries that choose alike"
    with selecting(Selection(config)):
        out, _ = query_aware.attention(MODULE, query, key, value, None, scaling=0.3)
    torch.testing.assert_close(out, _reference(query, key, value, _kept_by_quest(indices, 4, 6, 80), 0.3),
                               rtol=1e-5, atol=1e-5)


def test_a_given_mask_still_applies():
    """transformers' own mask (a padded or custom 4D one) narrows the selection further, never widens it."""
    query, key, value = _qkv(2, 50, seed=5)
    config = SparseConfig(0.5, sink_tokens=2, policy="oracle")
    given = torch.ones(1, 1, 2, 50, dtype=torch.bool)
    given[..., :10] = False  # as if the first 10 keys were padding
    with selecting(Selection(config)):
        out, _ = query_aware.attention(MODULE, query, key, value, given, scaling=0.3)
    logits = (query[0] @ key[0, :, :48].repeat_interleave(2, 0).transpose(1, 2)) * 0.3
    kept = torch.zeros(4, 2, 50, dtype=torch.bool)
    kept.scatter_(2, logits.topk(24, dim=-1).indices, True)
    kept[:, :, 48:] = torch.ones(2, 2, dtype=torch.bool).tril()
    kept[:, :, :10] = False
    torch.testing.assert_close(out, _reference(query, key, value, kept, 0.3), rtol=1e-5, atol=1e-5)


def test_the_oracle_keeps_each_query_heads_top_keys_and_drops_no_more_mass_than_quest():
    query, key, value = _qkv(5, 120, seed=6)
    history, keep = 115, SparseConfig(0.2).budget(115)
    logits = (query[0] @ key[0, :, :history].repeat_interleave(2, 0).transpose(1, 2)) * 0.35  # [4, 5, 115]
    top = torch.zeros_like(logits, dtype=torch.bool).scatter_(2, logits.topk(keep, dim=-1).indices, True)
    kept = torch.cat([top, torch.ones(5, 5, dtype=torch.bool).tril().expand(4, -1, -1)], dim=2)
    with selecting(Selection(SparseConfig(0.2, policy="oracle"))):
        out, _ = query_aware.attention(MODULE, query, key, value, None, scaling=0.35)
    torch.testing.assert_close(out, _reference(query, key, value, kept, 0.35), rtol=1e-5, atol=1e-5)
    # The bound: of each query head's softmax over the history, the oracle's keys hold at least the mass Quest's do.
    quest = history_indices(query, key, SparseConfig(0.2, policy="quest", page_tokens=4), PageSummaries(4, 4), 0.35)
    weights = logits.softmax(-1)
    oracle_mass = (weights * top).sum(-1)
    quest_mass = weights.gather(2, quest.repeat_interleave(2, 0)).sum(-1)
    assert (oracle_mass >= quest_mass - 1e-6).all() and (oracle_mass > quest_mass + 1e-3).any()


def _one_layer_gqa(seed=0):
    from tests.conftest import _gqa

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**dict(_gqa(), num_hidden_layers=1))).eval()


@pytest.mark.parametrize("policy", ["quest", "sparq"])
@pytest.mark.parametrize("new", [1, 5])
def test_a_one_layer_model_equals_dense_attention_with_the_selection_masked(new, policy, monkeypatch):
    """Through the cache: the stored history is loaded whole, the layer attends to what Quest chose per query (a
    gather when decoding, a mask for several tokens), at the original positions, its own tokens causally."""
    model = _one_layer_gqa()
    store = AttnStore(host_bytes="64MiB")
    config = SparseConfig(0.25, sink_tokens=2, policy=policy, page_tokens=4, sketch_dims=4)
    ids = random_ids(60, 1)
    with AttnStoreCache(model, store, "q", ids, kv_budget=config) as cache, torch.no_grad():
        model(cache.input_ids, **cache_kwargs(cache))
    chosen = []
    name = "sparq_pick" if policy == "sparq" else "quest_pick"
    original = getattr(query_aware, name)
    monkeypatch.setattr(query_aware, name, lambda *a, **k: chosen.append(original(*a, **k)) or chosen[-1])
    longer = torch.cat([ids, random_ids(new, 2)], dim=1)
    cache = AttnStoreCache(model, store, "q", longer, kv_budget=config, save=False)
    assert cache.reused_tokens == 60
    with torch.no_grad():
        logits = model(cache.input_ids[:, 60:], **cache_kwargs(cache)).logits
    assert cache.layers[0].keys.shape[2] == 60 + new  # the layer holds every token
    assert cache.turn.sparse_from == 60  # what it computed attended to a selection
    assert cache.turn.selection.steps == (new == 1)  # one token: the gathered path; several: the mask
    (pick,) = chosen
    indices = pick.indices()
    heads = model.config.num_attention_heads
    mask = _kept_by_quest(indices, heads, new, 60 + new)[None]
    twin, past = _one_layer_gqa(), DynamicCache()
    with torch.no_grad():
        twin(ids, **cache_kwargs(past))
        expected = twin(longer[:, 60:], **cache_kwargs(past), attention_mask=mask,
                        position_ids=torch.arange(60, 60 + new).view(1, -1)).logits
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", ["quest", "sparq", "oracle"])
def test_a_whole_budget_is_the_dense_session_over_turns(policy):
    model = make_tiny("llama")
    store, dense = AttnStore(host_bytes="64MiB"), AttnStore(host_bytes="64MiB")
    ids = random_ids(30, 4)
    for turn in range(3):
        whole = AttnStoreCache(model, store, "x", ids, kv_budget=SparseConfig(1.0, policy=policy))
        plain = AttnStoreCache(model, dense, "x", ids)
        a = model.generate(whole.input_ids, **cache_kwargs(whole), max_new_tokens=4, **GREEDY)
        b = model.generate(plain.input_ids, **cache_kwargs(plain), max_new_tokens=4, **GREEDY)
        assert torch.equal(a, b) and whole.reused_tokens == plain.reused_tokens and whole.turn.sparse_from is None
        whole.close(), plain.close()
        ids = torch.cat([a, random_ids(4, 10 + turn)], dim=1)


@pytest.mark.parametrize("policy", ["quest", "sparq", "oracle"])
def test_decoding_keeps_every_token_and_labels_its_kv_inexact(policy):
    model = make_tiny("llama")
    store = AttnStore(host_bytes="64MiB")
    config = SparseConfig(0.25, policy=policy, page_tokens=4)
    ids = random_ids(40, 5)
    cache = AttnStoreCache(model, store, "b", ids, kv_budget=config)
    out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=10, **GREEDY)
    dense = AttnStoreCache(model, AttnStore(host_bytes="64MiB"), "b", ids)
    assert not torch.equal(out, model.generate(dense.input_ids, **cache_kwargs(dense), max_new_tokens=10, **GREEDY))
    assert all(layer.keys.shape[2] == out.shape[1] - 1 for layer in cache.layers)  # nothing dropped
    assert cache.turn.sparse_from == 40 and cache.turn.selection.attended < cache.turn.selection.held
    cache.close()
    store.flush()
    later = torch.cat([out, random_ids(3, 6)], dim=1)
    assert AttnStoreCache(model, store, "b", later, kv_budget=config, save=False).reused_tokens == out.shape[1] - 1
    # A dense turn reuses the prompt (computed densely) and recomputes the replies computed under selection.
    assert AttnStoreCache(model, store, "b", later).reused_tokens == 40


def test_query_aware_policies_need_sdpa_and_run_solo_in_a_batch():
    model = make_tiny("llama")
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="sdpa"):
        AttnStoreCache(model, AttnStore(host_bytes="64MiB"), "e", random_ids(10, 1),
                       kv_budget=SparseConfig(0.5, policy="quest"))
    ok, why = batchable(make_tiny("llama"), SparseConfig(0.5, policy="quest"))
    assert not ok and "per query" in why
    with pytest.raises(ValueError, match="page_tokens"):
        SparseConfig(0.5, policy="quest", page_tokens=0)
    with pytest.raises(ValueError, match="sketch_dims"):
        SparseConfig(0.5, policy="sparq", sketch_dims=0)
    # The recent window's default share: the query-aware policies choose the rest themselves.
    assert SparseConfig(0.2, policy="sparq").split(200, 1000) == (4, 20)
    assert SparseConfig(0.2).split(200, 1000) == (4, 98)


@pytest.mark.parametrize("count", [2, 3, 30])
@pytest.mark.parametrize("slope", [0.5, -0.3, 0.7])
def test_a_layer_slope_spreads_the_uniform_total_over_the_layers(slope, count):
    """PyramidKV's schedule: weights ``1 + a·(1 - 2i/(n - 1))``, the shares rounded so that they add up to the
    uniform total exactly (while no share is clamped to the sinks + 1 or the history)."""
    config = SparseConfig(0.2, policy="sparq", layer_slope=slope)
    for history in (100, 257, 1000, 2047):
        uniform = config.budget(history)
        shares = [config.at_layer(i, count).budget(history) for i in range(count)]
        assert sum(shares) == count * uniform
        weights = [1 + slope * (1 - 2 * i / (count - 1)) for i in range(count)]
        assert all(abs(share - uniform * w) <= 1 for share, w in zip(shares, weights))
        # Decreasing with depth for a > 0, increasing for a < 0 (the rounding may move a share by 1 either way).
        assert (shares[0] > shares[-1]) == (slope > 0) and (shares[0] < shares[-1]) == (slope < 0)
    assert [config.at_layer(0, 1).budget(1000)] == [SparseConfig(0.2).budget(1000)]  # one layer: uniform
    assert SparseConfig(0.2, policy="oracle").at_layer(2, 3).budget(1000) == 200  # no slope: uniform
    # Short histories: every layer keeps more than the sinks and at most the history (the total may then differ).
    shares = [SparseConfig(0.2, policy="sparq", layer_slope=0.9).at_layer(i, 30).budget(10) for i in range(30)]
    assert min(shares) == 5 and max(shares) <= 10


@pytest.mark.parametrize("policy", ["sparq", "oracle", "quest"])
def test_each_layer_attends_to_its_own_budget(policy, monkeypatch):
    """Counted per layer and decoding step by what the attention adds to `Selection.attended`: the layer's own
    share of a pyramid, which differs between the layers and adds up to the uniform total (Quest: at most it, less
    the part of a page that does not fit)."""
    model = make_tiny("llama")
    layers = model.config.num_hidden_layers
    config = SparseConfig(0.3, sink_tokens=2, policy=policy, page_tokens=2, sketch_dims=4, layer_slope=0.6)
    seen = {}  # (layer, history) -> history keys attended per KV head and query
    original = query_aware.attention

    def counting(module, query, key, value, attention_mask, **kwargs):
        selection = query_aware._active.get()
        before = selection.attended
        out = original(module, query, key, value, attention_mask, **kwargs)
        if query.shape[2] == 1:
            seen[(module.layer_idx, key.shape[2] - 1)] = (selection.attended - before) // key.shape[1]
        return out

    monkeypatch.setattr(query_aware, "attention", counting)
    cache = AttnStoreCache(model, AttnStore(host_bytes="64MiB"), "p", random_ids(80, 8), kv_budget=config)
    model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=6, **GREEDY)
    histories = sorted({history for _, history in seen})
    assert len(histories) == 5 and len(seen) == 5 * layers
    for history in histories:
        counts = [seen[(layer, history)] for layer in range(layers)]
        shares = [config.at_layer(layer, layers).budget(history) for layer in range(layers)]
        assert counts[0] > counts[-1]
        if policy == "quest":
            assert all(share - config.page_tokens < count <= share for count, share in zip(counts, shares))
        else:
            assert counts == shares and sum(counts) == layers * config.budget(history)


def test_a_layer_slope_is_validated_and_schedules_the_sparse_layers_alone():
    for slope in (1.0, -1.0, "0.5", True, float("nan")):
        with pytest.raises(ValueError, match="`layer_slope` must be a number in"):
            SparseConfig(0.2, policy="sparq", layer_slope=slope)
    with pytest.raises(ValueError, match="needs a query-aware policy"):
        SparseConfig(0.2, policy="alisa", layer_slope=0.5)
    for layer in ((3, 3), (-1, 3), [0, 3], (0,), (True, 2)):
        with pytest.raises(ValueError, match="the cache sets it"):
            SparseConfig(0.2, policy="sparq", layer=layer)
    # Layers 0 and 2 slide, 1 keeps nothing: the two full-attention layers 3 and 4 are the whole schedule.
    layout = LayerLayout(kinds=("kv", "none", "kv", "kv", "kv"), states=(0,) * 5, windows=(8, None, 8, None, None),
                         full=(False, False, False, True, True))
    layers = build_layers(type("Turn", (), {})(), layout, reused=0, state=None, device=torch.device("cpu"),
                          sparse=SparseConfig(0.2, policy="sparq", layer_slope=0.5))
    assert [getattr(layer, "config", None) and layer.config.layer for layer in layers] == [None] * 3 + [(0, 2), (1, 2)]
    assert [layers[i].config.budget(1000) for i in (3, 4)] == [300, 100]
