"""Sparse window attention over a session (cache/sparse.py) and importance scores (cache/importance.py).

What must hold, fp32: a sparse forward equals a dense forward whose mask hides exactly the dropped tokens (per
KV head, at their original positions); the scores are the attention weights eager attention reports; a budget
of the whole session is the dense session, token for token; scores survive a disk round trip and drive the
selection of a resumed turn; models whose sessions cannot be kept sparse are refused with the reason.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache, SparseConfig
from hf_attnstore.cache import importance
from hf_attnstore.cache.sparse import select
from hf_attnstore.cache.upstream import cache_kwargs

from ..conftest import make_tiny, random_ids

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def _eager_twin(arch: str):
    model = make_tiny(arch)
    model.set_attn_implementation("eager")
    return model


@pytest.mark.parametrize("budget", [0, -3, 1.5, 0.0, True, "0.2", None])
def test_bad_budgets_are_refused(budget):
    with pytest.raises(ValueError, match="kv_budget"):
        SparseConfig(budget)


def test_bad_options_are_refused():
    for kwargs, name in [({"policy": "lru"}, "policy"), ({"sink_tokens": -1}, "sink_tokens"),
                         ({"recent_ratio": 2.0}, "recent_ratio"),
                         ({"recent_ratio": "0.5"}, "recent_ratio"), ({"score_window": 0}, "score_window")]:
        with pytest.raises(ValueError, match=name):
            SparseConfig(0.5, **kwargs)


def test_budget_counts():
    assert SparseConfig(0.2).budget(1000) == 200
    assert SparseConfig(0.2).budget(3) == 3  # never more than the session
    assert SparseConfig(0.01, sink_tokens=4).budget(100) == 5  # at least the sinks and one more
    assert SparseConfig(64).budget(1000) == 64


def test_select_keeps_sinks_recent_and_each_heads_most_important():
    config = SparseConfig(8, sink_tokens=2, recent_ratio=0.5)
    held = torch.arange(20).expand(2, -1)
    scores = torch.zeros(2, 20)
    scores[0, [5, 9, 11]] = torch.tensor([3.0, 2.0, 1.0])
    scores[1, [4, 6, 7]] = torch.tensor([1.0, 3.0, 2.0])
    picked = select(held, scores, 8, config)
    # 2 sinks, then half of the other 6 recent (3) and half important (3), per head.
    assert picked.tolist() == [[0, 1, 5, 9, 11, 17, 18, 19], [0, 1, 4, 6, 7, 17, 18, 19]]
    # Without scores the budget goes to recency (StreamingLLM).
    assert select(held, None, 8, config).tolist() == [[0, 1] + list(range(14, 20))] * 2
    assert select(held, scores, 25, config).tolist() == [list(range(20))] * 2


def _history(model, store, session, n, budget, seed=1, **kwargs):
    """Prefills a session of `n` tokens through a sparse cache (dense, as its first forward has no history) and
    returns its ids."""
    ids = random_ids(n, seed)
    with AttnStoreCache(model, store, session, ids, kv_budget=budget, **kwargs) as cache:
        with torch.no_grad():
            model(cache.input_ids, **cache_kwargs(cache))
    store.flush()
    return ids


def _dense_with_mask(arch, ids, n_history, keep_per_kv_head):
    """Logits of the last tokens of `ids` (after `n_history`) by a dense forward of the whole sequence whose mask
    lets each query head see, of the history, only its KV head's kept positions."""
    model = make_tiny(arch)
    q = ids.shape[1] - n_history
    heads = model.config.num_attention_heads
    group = heads // model.config.num_key_value_heads
    mask = torch.zeros(1, heads, q, ids.shape[1], dtype=torch.bool)
    for h in range(heads):
        mask[0, h, :, keep_per_kv_head[h // group]] = True
    mask[0, :, :, n_history:] = torch.ones(q, q, dtype=torch.bool).tril()
    past = DynamicCache()
    with torch.no_grad():
        model(ids[:, :n_history], **cache_kwargs(past))
        # A 4D mask is taken as it is (masking_utils); positions continue the history.
        out = model(ids[:, n_history:], **cache_kwargs(past), attention_mask=mask,
                    position_ids=torch.arange(n_history, ids.shape[1]).view(1, -1))
    return out.logits


@pytest.mark.parametrize("policy", ["streaming", "alisa", "h2o"])
def test_a_sparse_forward_equals_dense_attention_with_the_dropped_tokens_masked(policy):
    model = make_tiny("llama")
    store = AttnStore(host_bytes="64MiB")
    config = SparseConfig(16, sink_tokens=3, policy=policy)
    history = _history(model, store, "s", 50, config)
    ids = torch.cat([history, random_ids(6, 7)], dim=1)
    cache = AttnStoreCache(model, store, "s", ids, kv_budget=config, save=False)
    assert cache.reused_tokens == 50 and cache.turn.can_select(50)
    with torch.no_grad():
        logits = model(cache.input_ids[:, 50:], **cache_kwargs(cache)).logits
    layer = cache.layers[0]
    assert layer.keys.shape[2] == 16 + 6 and cache.get_seq_length() == 56
    kept = layer.columns[:, :16]
    assert (kept[:, :3] == torch.arange(3)).all()  # the sinks
    if policy == "streaming":
        assert kept.tolist() == [[0, 1, 2] + list(range(37, 50))] * 2
    # Every layer kept its own tokens; the reference masks layer 0's: compare where the selection is one model-wide.
    if policy == "streaming" or all(torch.equal(l.columns, layer.columns) for l in cache.layers):
        expected = _dense_with_mask("llama", ids, 50, kept)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_per_head_selection_equals_per_head_masks_in_a_one_layer_model():
    """With one layer, each KV head's own selection is the whole story: the sparse forward is the dense one
    with per-head masks (importance differs between heads, so their kept tokens do)."""
    from tests.conftest import _gqa  # the tiny configs
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**dict(_gqa(), num_hidden_layers=1))).eval()
    store = AttnStore(host_bytes="64MiB")
    config = SparseConfig(12, sink_tokens=2, policy="alisa", score_window=8)
    history = _history(model, store, "h", 40, config)
    ids = torch.cat([history, random_ids(5, 9)], dim=1)
    cache = AttnStoreCache(model, store, "h", ids, kv_budget=config, save=False)
    with torch.no_grad():
        logits = model(cache.input_ids[:, 40:], **cache_kwargs(cache)).logits
    kept = cache.layers[0].columns[:, :12]
    assert not torch.equal(kept[0], kept[1]), "the test needs heads that keep different tokens"
    torch.manual_seed(0)
    twin = LlamaForCausalLM(LlamaConfig(**dict(_gqa(), num_hidden_layers=1))).eval()
    heads, group = twin.config.num_attention_heads, 2
    mask = torch.zeros(1, heads, 5, 45, dtype=torch.bool)
    for h in range(heads):
        mask[0, h, :, kept[h // group]] = True
    mask[0, :, :, 40:] = torch.ones(5, 5, dtype=torch.bool).tril()
    past = DynamicCache()
    with torch.no_grad():
        twin(ids[:, :40], **cache_kwargs(past))
        expected = twin(ids[:, 40:], **cache_kwargs(past), attention_mask=mask,
                        position_ids=torch.arange(40, 45).view(1, -1)).logits
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", ["alisa", "h2o"])
def test_scores_are_the_attention_weights_eager_attention_reports(policy):
    model, twin = make_tiny("llama"), _eager_twin("llama")
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(30, 2)
    window = 8
    cache = AttnStoreCache(model, store, "w", ids, kv_budget=SparseConfig(1.0, policy=policy, score_window=window))
    with torch.no_grad():
        model(cache.input_ids, **cache_kwargs(cache))
        attentions = twin(ids, output_attentions=True).attentions  # per layer [1, q_heads, q, k]
    first = 0 if policy == "h2o" else 30 - window
    for layer, weights in enumerate(attentions):
        per_kv_head = weights[0, :, first:].sum(1).view(2, 2, 30).sum(1)  # query heads 0,1 -> KV head 0, ...
        torch.testing.assert_close(cache.turn.scorer.scores[layer], per_kv_head, rtol=1e-4, atol=1e-5)


def test_alisa_scores_keep_a_window_of_queries_while_decoding():
    model, twin = make_tiny("llama"), _eager_twin("llama")
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(20, 3)
    config = SparseConfig(1.0, policy="alisa", score_window=4)
    cache = AttnStoreCache(model, store, "d", ids, kv_budget=config)
    out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=6, **GREEDY)
    seen = out[:, :-1]  # the last token was never fed
    with torch.no_grad():
        weights = twin(seen, output_attentions=True).attentions[1][0]
    expected = weights[:, -4:].sum(1).view(2, 2, -1).sum(1)
    torch.testing.assert_close(cache.turn.scorer.scores[1], expected, rtol=1e-4, atol=1e-5)


def test_a_resumed_window_ages_pro_rata_over_short_turns():
    # A resumed session's scores summed the last `window` queries; their rows are gone, so each new query
    # retires 1/window of them: turns shorter than the window must not keep them for good (H2O's sum).
    from hf_attnstore.cache.importance import Scorer

    window, kv_heads = 8, 2
    initial = torch.rand(kv_heads, 6) * window
    scorer = Scorer({0: 0}, "alisa", window, initial={0: initial.clone()})
    layer = torch.nn.Module()
    layer.layer_idx = 0
    torch.manual_seed(0)
    key = torch.randn(1, kv_heads, 9, 16)
    query = torch.randn(1, 2 * kv_heads, 3, 16)  # 3 new queries: the last 3 keys are theirs
    scorer.observe(layer, query, key, None)
    new_rows = Scorer._weights(query, key, None, 0, 3).sum(1)
    expected = torch.cat([initial * (window - 3) / window, torch.zeros(kv_heads, 3)], dim=1) + new_rows
    torch.testing.assert_close(scorer.scores[0], expected)
    for _ in range(3):  # 9 more queries: everything resumed has left the window
        scorer.observe(layer, query, key, None)
    torch.testing.assert_close(scorer.scores[0][:, :6], _window_sum(Scorer._weights(query, key, None, 0, 3), window)[:, :6])


def _window_sum(rows: torch.Tensor, window: int) -> torch.Tensor:
    """The last `window` of the repeated rows (``[kv_heads, m, K]``, fed four times) summed."""
    repeated = torch.cat([rows] * 4, dim=1)
    return repeated[:, -window:].sum(1)


def whole_budget_turns(model, ids: torch.Tensor, turns: int, new_tokens: int, seed: int) -> torch.Tensor:
    """Runs `turns` turns with ``kv_budget=1.0`` beside dense ones, asserting the same greedy tokens and reuse;
    returns the ids after the last turn."""
    store, dense = AttnStore(host_bytes="64MiB"), AttnStore(host_bytes="64MiB")
    for turn in range(turns):
        sparse_cache = AttnStoreCache(model, store, "x", ids, kv_budget=1.0)
        dense_cache = AttnStoreCache(model, dense, "x", ids)
        a = model.generate(sparse_cache.input_ids, **cache_kwargs(sparse_cache), max_new_tokens=4, **GREEDY)
        b = model.generate(dense_cache.input_ids, **cache_kwargs(dense_cache), max_new_tokens=4, **GREEDY)
        assert torch.equal(a, b), f"turn {turn}"
        if turn:
            assert sparse_cache.reused_tokens == dense_cache.reused_tokens > 0
        ids = torch.cat([a, random_ids(new_tokens, seed + turn)], dim=1)
    return ids


def test_a_whole_budget_is_the_dense_session_over_turns():
    whole_budget_turns(make_tiny("llama"), random_ids(30, 4), turns=3, new_tokens=4, seed=10)


def test_decoding_keeps_the_budget_and_the_store_keeps_every_token():
    model = make_tiny("llama")
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(40, 5)
    cache = AttnStoreCache(model, store, "b", ids, kv_budget=0.25)
    out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=10, **GREEDY)
    n = out.shape[1] - 1
    assert cache.get_seq_length() == n
    # Before the last step the history was trimmed to its budget, then the step's token appended.
    assert cache.layers[0].keys.shape[2] == SparseConfig(0.25).budget(n - 1) + 1
    cache.close()
    store.flush()
    later = torch.cat([out, random_ids(3, 6)], dim=1)
    sparse = AttnStoreCache(model, store, "b", later, kv_budget=0.25, save=False)
    assert sparse.reused_tokens == n  # the store kept every token
    # The replies' KV was computed attending to a selection: a dense turn reuses the prompt (computed over its whole
    # history) and recomputes the rest, rather than take sparse KV for its own.
    dense = AttnStoreCache(model, store, "b", later)
    assert dense.reused_tokens == 40


def test_scores_persist_on_disk_and_drive_the_resumed_selection(tmp_path):
    model = make_tiny("llama")
    config = SparseConfig(12, policy="alisa")
    store = AttnStore(host_bytes="64MiB", disk_dir=tmp_path)
    history = _history(model, store, "p", 40, config)
    with AttnStoreCache(model, store, "p", torch.cat([history, random_ids(2, 8)], 1), kv_budget=config,
                        save=False) as first:
        saved = {slot: s.clone() for slot, s in first.turn.scorer.scores.items()}
    store.close()
    reopened = AttnStore(host_bytes="64MiB", disk_dir=tmp_path)
    ids = torch.cat([history, random_ids(3, 8)], dim=1)
    cache = AttnStoreCache(model, reopened, "p", ids, kv_budget=config, save=False)
    assert cache.kv_source == "disk" and cache.turn.scorer.has_scores
    for slot, s in saved.items():
        assert torch.equal(cache.turn.scorer.scores[slot], s[:, :40])
    with torch.no_grad():
        model(cache.input_ids[:, 40:], **cache_kwargs(cache))
    scores = saved[0][:, :40]
    expected = select(torch.arange(40).expand(2, -1), scores, 12, config)
    assert torch.equal(cache.layers[0].columns[:, :12], expected)
    reopened.close()


def test_stored_scores_keep_sums_beyond_fp16(tmp_path):
    """H2O's sums over every query outgrow fp16's 65,504 within ~15k tokens: scores are stored in fp32."""
    model = make_tiny("llama")
    config = SparseConfig(12, policy="h2o")
    store = AttnStore(host_bytes="64MiB", disk_dir=tmp_path)
    ids = random_ids(40, 1)
    with AttnStoreCache(model, store, "p", ids, kv_budget=config) as cache:
        with torch.no_grad():
            model(cache.input_ids, **cache_kwargs(cache))
        for scores in cache.turn.scorer.scores.values():
            scores[:, 0] += 1e6  # as a sink's sum after a long conversation
        saved = {slot: scores.clone() for slot, scores in cache.turn.scorer.scores.items()}
    store.close()
    reopened = AttnStore(host_bytes="64MiB", disk_dir=tmp_path)
    with AttnStoreCache(model, reopened, "p", torch.cat([ids, random_ids(3, 8)], 1), kv_budget=config,
                        save=False) as cache:
        assert cache.kv_source == "disk"
        for slot, scores in saved.items():
            assert torch.equal(cache.turn.scorer.scores[slot], scores)
    reopened.close()


@pytest.mark.parametrize("other", [SparseConfig(12, policy="h2o"), SparseConfig(12, policy="alisa", score_window=8)],
                         ids=["h2o", "alisa-window-8"])
def test_stored_scores_serve_only_their_own_policy_and_window(tmp_path, other):
    """ALISA's scores sum the last 32 queries' weights, H2O's every query's: a turn of another policy or window
    scores anew (its first forward dense) rather than rank tokens by a sum it did not make."""
    model = make_tiny("llama")
    config = SparseConfig(12, policy="alisa")
    store = AttnStore(host_bytes="64MiB", disk_dir=tmp_path)
    history = _history(model, store, "p", 40, config)
    ids = torch.cat([history, random_ids(3, 8)], dim=1)
    with AttnStoreCache(model, store, "p", ids, kv_budget=other, save=False) as cache:
        assert cache.reused_tokens == 40 and not cache.turn.scorer.has_scores
    with AttnStoreCache(model, store, "p", ids, kv_budget=config, save=False) as cache:
        assert cache.turn.scorer.has_scores  # its own are there
    store.close()


def test_a_session_resumed_without_scores_is_dense_for_its_first_forward():
    model = make_tiny("llama")
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(30, 11)
    with AttnStoreCache(model, store, "n", ids) as dense:  # a dense turn keeps no scores
        with torch.no_grad():
            model(dense.input_ids, **cache_kwargs(dense))
    store.flush()
    cache = AttnStoreCache(model, store, "n", torch.cat([ids, random_ids(4, 12)], 1), kv_budget=0.2)
    assert not cache.turn.scorer.has_scores and cache.layers[0].get_mask_sizes(4) == (34, 0)
    out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=3, **GREEDY)
    assert cache.layers[0].keys.shape[2] == SparseConfig(0.2).budget(out.shape[1] - 2) + 1


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_next", "mistral", "llama4_text"])
def test_models_that_cannot_be_sparse_are_refused_with_the_reason(arch):
    """Latent attention caches no keys; a hybrid's states summarize every token; a model whose every layer
    slides (the tiny mistral) has no full-attention layer to keep sparse; llama4's chunked layers share the
    full-attention mask, which would not fit the sparse layers."""
    model = make_tiny(arch)
    with pytest.raises(ValueError, match="latent attention|hybrid models|full-attention layers|chunked"):
        AttnStoreCache(model, AttnStore(host_bytes="64MiB"), "r", random_ids(10, 1), kv_budget=0.5)


def test_other_attention_implementations_are_refused():
    model = make_tiny("llama")
    model.config._attn_implementation = "flex_attention"  # what the check reads (no flex kernels needed)
    with pytest.raises(ValueError, match="sdpa"):
        AttnStoreCache(model, AttnStore(host_bytes="64MiB"), "e", random_ids(10, 1), kv_budget=0.5)
    # Recency alone needs no scores, so it works with any attention.
    AttnStoreCache(model, AttnStore(host_bytes="64MiB"), "e", random_ids(10, 1),
                   kv_budget=SparseConfig(0.5, policy="streaming"))


def test_assisted_decoding_crop_is_refused():
    model = make_tiny("llama")
    cache = AttnStoreCache(model, AttnStore(host_bytes="64MiB"), "c", random_ids(10, 1), kv_budget=0.5)
    with pytest.raises(ValueError, match="cropped"):
        cache.crop(2)


def test_scored_attention_is_sdpa_outside_a_scoring_turn():
    model = make_tiny("llama")
    ids = random_ids(12, 1)
    with torch.no_grad():
        before = model(ids).logits
        importance.enable(model)
        after = model(ids).logits
    assert model.config._attn_implementation == importance.ATTENTION_NAME
    torch.testing.assert_close(before, after, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gpt_neox", "gemma2", "gemma3_text", "olmo3",
                                  "smollm3", "exaone4", "mixtral"])
def test_families_keep_their_budget_and_a_whole_budget_is_dense(arch):
    """Families with full-attention layers, SDPA or eager (gemma2), sliding layers beside (gemma3, olmo3) or
    NoPE layers (smollm3); then a resumed turn of several tokens selects from stored scores (masks that fit)."""
    model = make_tiny(arch)
    ids = whole_budget_turns(model, random_ids(40, 13), turns=2, new_tokens=3, seed=20)
    kept = AttnStore(host_bytes="64MiB")
    sparse = AttnStoreCache(model, kept, "g", ids, kv_budget=0.3)
    out = model.generate(sparse.input_ids, **cache_kwargs(sparse), max_new_tokens=4, **GREEDY)
    full = [layer for layer in sparse.layers if hasattr(layer, "columns")]
    assert full and all(layer.keys.shape[2] < sparse.get_seq_length() for layer in full)
    resumed = AttnStoreCache(model, kept, "g", torch.cat([out, random_ids(6, 30)], dim=1), kv_budget=0.3)
    assert resumed.turn.scorer.has_scores and resumed.reused_tokens > 0
    model.generate(resumed.input_ids, **cache_kwargs(resumed), max_new_tokens=3, **GREEDY)
    full = [layer for layer in resumed.layers if hasattr(layer, "columns")]
    assert all(layer.keys.shape[2] < resumed.get_seq_length() for layer in full)
