"""Sliding-window layers (layers.AttnStoreSlidingLayer): on the device they keep and load only what their next
query can attend to, as transformers' `DynamicSlidingWindowLayer`; the store keeps every token.

What must hold, fp32: after resumed turns each layer holds exactly the KV a `DynamicCache(config=...)` run holds
(same length, same values), the tokens are those of recomputation, a later prompt that diverges long before the
end of the session still reuses its common prefix exactly (the store was not trimmed), and assisted decoding's
crop protocol (past recording, then a negative crop) behaves as transformers' own layer.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.cache.layers import AttnStoreSlidingLayer
from hf_attnstore.cache.layout import LayerLayout

from ..conftest import make_tiny, random_ids
from hf_attnstore.cache.upstream import cache_kwargs

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
WINDOW = 24  # conftest's sliding models


def _both(model, ids, store, session):
    """One turn of `ids` + 6 generated tokens through an AttnStoreCache and through DynamicCache(config)."""
    mask = torch.ones_like(ids)
    cache = AttnStoreCache(model, store, session, ids)
    out = model.generate(cache.input_ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=6, **GREEDY)
    ref_cache = DynamicCache(config=model.config)
    ref = model.generate(ids, attention_mask=mask, **cache_kwargs(ref_cache), max_new_tokens=6, **GREEDY)
    return cache, out, ref_cache, ref


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3_text", "gpt_oss", "olmo3"])
def test_sliding_layers_hold_what_dynamic_cache_holds(arch):
    model = make_tiny(arch)
    layout = LayerLayout.of(model)
    assert layout.slot_windows and set(layout.slot_windows.values()) == {WINDOW}
    store = AttnStore(host_bytes="64MiB")
    hist = random_ids(30, 1)
    for t in range(3):
        cache, out, ref_cache, ref = _both(model, hist, store, "s")
        assert torch.equal(out, ref), f"turn {t}"
        assert cache.reused_tokens == (0 if t == 0 else hist.shape[1] - 8 - 1)
        for slot, (mine, theirs) in enumerate(zip(cache.layers, ref_cache.layers)):
            assert isinstance(mine, AttnStoreSlidingLayer) == (slot in layout.slot_windows)
            assert mine.keys.shape == theirs.keys.shape, f"turn {t} layer {slot}"
            torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=0)
            assert mine.get_seq_length() == theirs.get_seq_length() == out.shape[1] - 1
        cache.close()
        # The store keeps every token of every layer, sliding ones included.
        snap = store.lookup("s", cache.fingerprint)
        assert snap.length == out.shape[1] - 1
        assert all(k.shape[2] == snap.length for k in (torch.cat([p[0] for p in snap.layer_parts(i)], 2)
                                                        for i in range(len(cache.layers))))
        hist = torch.cat([out, random_ids(8, 10 + t)], dim=1)


def test_a_prompt_that_diverges_before_the_window_reuses_the_stored_prefix():
    """The device kept 23 tokens of each sliding layer; the store kept all 60, so a branch at token 20 reuses 20."""
    model = make_tiny("gemma2")
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(60, 2)
    cache, out, _, _ = _both(model, ids, store, "b")
    cache.close()
    branch = torch.cat([ids[:, :20], random_ids(12, 3)], dim=1)
    cache, out, _, ref = _both(model, branch, store, "b")
    assert cache.reused_tokens == 20 and torch.equal(out, ref)


def test_assisted_decoding_crop_protocol_matches_transformers():
    """Past recording keeps drafted tokens until `crop` rejects some; then the window is restored, as in
    `DynamicSlidingWindowLayer`, and the store holds the kept tokens only."""
    model = make_tiny("gemma2")
    store = AttnStore(host_bytes="64MiB")
    ids, draft, tail = random_ids(40, 4), random_ids(6, 5), random_ids(3, 6)
    mine, theirs = AttnStoreCache(model, store, "c", ids), DynamicCache(config=model.config)
    with torch.no_grad():
        for cache in (mine, theirs):
            model(ids, **cache_kwargs(cache), use_cache=True)
            cache.activate_past_recording()
            model(draft, **cache_kwargs(cache), use_cache=True)
            cache.crop(-4)
            logits = model(tail, **cache_kwargs(cache), use_cache=True).logits
            cache.logits = logits
    torch.testing.assert_close(mine.logits, theirs.logits, atol=1e-5, rtol=0)
    for a, b in zip(mine.layers, theirs.layers):
        assert a.keys.shape == b.keys.shape
    kept = torch.cat([ids, draft[:, :2], tail], dim=1)[0]
    assert torch.equal(store.token_ids("c", mine.fingerprint), kept)
    # Without past recording, cropping a full window is refused, as transformers refuses it.
    other = AttnStoreCache(model, store, "d", ids)
    with torch.no_grad():
        model(ids, **cache_kwargs(other), use_cache=True)
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        other.crop(-2)
