"""Model families beyond the first ones: reuse, truncation, disk round trips and batching, per family.

Each family is a tiny random model (conftest.FAMILY_MODELS) whose attention is llama's around other parts
(mixture-of-experts MLPs, qk-norms, clipped qkv, multipliers, LayerNorm, sliding-window layers mixed with
global ones). What must hold for each, fp32: multi-turn reuse gives the tokens of a `DynamicCache` run;
re-rotated keys are the model's own; decoupled truncation puts keys at their new positions and recompute
truncation generates what the truncated ids generate; sessions demoted to disk resume exactly; batched turns
give their solo tokens (where the family is batched).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.serving.batching import batchable
from hf_attnstore.cache.fingerprint import kv_geometry
from hf_attnstore.cache.rope import SUPPORTED_ROPE_MODEL_TYPES
from hf_attnstore.store.format import bytes_per_token

from ..serving import test_batching
from . import test_cache, test_cache_tiers
from ..conftest import FAMILY_MODELS, make_tiny, random_ids
from hf_attnstore.cache.upstream import cache_kwargs

FAMILIES = sorted(FAMILY_MODELS)
GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def test_every_family_here_is_declared_supported():
    decoders = {make_tiny(arch).config.get_text_config(decoder=True).model_type for arch in FAMILIES}
    assert decoders <= SUPPORTED_ROPE_MODEL_TYPES
    assert len(decoders) >= 10


@pytest.mark.parametrize("arch", FAMILIES)
def test_multi_turn_reuse_equals_recompute(arch):
    test_cache.test_multi_turn_greedy_equals_recompute(arch)


@pytest.mark.parametrize("arch", FAMILIES)
def test_rerotated_keys_are_the_models_own(arch):
    test_cache.test_rerotated_keys_equal_model_post_rope_keys(arch)


@pytest.mark.parametrize("arch", FAMILIES)
def test_decoupled_truncation_puts_keys_at_their_new_positions(arch):
    """Layer 0's keys depend only on each token and its position, so after a decoupled truncation the
    loaded ones equal what the model computes for the truncated ids from scratch."""
    model = make_tiny(arch)
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(40, 1)
    test_cache.prefill(model, store, "t", ids[:, :36])
    cache = AttnStoreCache(model, store, "t", ids, context_window=32, keep_first=4)
    assert cache.dropped_tokens == 14 and cache.reused_tokens == 36 - 14
    ref = DynamicCache()
    with torch.no_grad():
        model(cache.input_ids, **cache_kwargs(ref))
    loaded = test_cache.loaded_kv(cache, 0, cache.reused_tokens)
    start = cache.turn.loader.load_start(0, cache.reused_tokens)  # a sliding layer: its window's tail
    for mine, theirs in zip(loaded, (ref.layers[0].keys, ref.layers[0].values)):
        torch.testing.assert_close(mine, theirs[:, :, start : cache.reused_tokens], atol=1e-5, rtol=0)
    # And the truncated turn runs: it generates from the kept KV, and the session goes on from it.
    out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=4, **GREEDY)
    nxt = torch.cat([out, random_ids(3, 2)], dim=1)
    assert AttnStoreCache(model, store, "t", nxt, context_window=64).reused_tokens == out.shape[1] - 1


@pytest.mark.parametrize("arch", FAMILIES)
def test_recompute_truncation_generates_what_the_truncated_ids_generate(arch):
    model = make_tiny(arch)
    store = AttnStore(host_bytes="64MiB")
    hist = random_ids(40, 5)
    test_cache.prefill(model, store, "r", hist)
    hist = torch.cat([hist, random_ids(16, 6)], dim=1)
    cache = AttnStoreCache(model, store, "r", hist, context_window=48, keep_first=4, truncation="recompute")
    assert cache.reused_tokens == 4
    out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=5, **GREEDY)
    assert torch.equal(out, model.generate(cache.input_ids, max_new_tokens=5, **GREEDY))


@pytest.mark.parametrize("arch", FAMILIES)
def test_sessions_round_trip_through_disk(tmp_path, arch):
    model = make_tiny(arch)
    per_token = bytes_per_token(kv_geometry(model), 4)
    # Room for about one session in host memory: the others resume from disk.
    store = AttnStore(host_bytes=40 * per_token, disk_dir=str(tmp_path), **test_cache_tiers.FAST)
    sources, _ = test_cache_tiers.chat(model, store, ["a", "b", "c"], turns=2)
    assert "disk" in sources
    store.close()


@pytest.mark.parametrize("arch", FAMILIES)
def test_batched_turns_give_solo_tokens(arch):
    model = make_tiny(arch)
    if not batchable(model)[0]:  # chunked attention (llama4): one turn at a time, see batchable
        assert model.config.get_text_config().attention_chunk_size
        return
    solo = test_batching.run(model, AttnStore("64MiB"), 1)
    batched = test_batching.run(model, AttnStore("64MiB"), 4)
    for key, alone in solo.items():
        assert batched[key].generated_ids == alone.generated_ids, key
        assert batched[key].reused_tokens == alone.reused_tokens, key


@pytest.mark.parametrize("model_type, why", [("deepseek_v32", "indexer"), ("gemma4_text", "KV sharing")])
def test_families_not_handled_yet_are_refused_with_their_reason(model_type, why):
    """A stand-in model that reports the family's model type (the real ones are large to build here)."""
    model = make_tiny("llama")
    model.config.model_type = model_type
    with pytest.raises(ValueError, match=f"{model_type}.*not supported.*{why}"):
        AttnStoreCache(model, AttnStore(), "x", random_ids(8, 0))
