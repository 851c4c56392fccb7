"""AttnStoreCache against full recomputation, on tiny random models (exact, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.cache.rope import RopeAdapter
from hf_attnstore.store.format import shapes

from ..conftest import ABSOLUTE_MODELS, SCALED_ROPE_MODELS, TINY_MODELS, make_tiny, random_ids
from hf_attnstore.cache.upstream import cache_kwargs

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def prefill(model, store, session, ids):
    """Runs `ids` through an AttnStoreCache so that the session holds their KV; returns the cache."""
    with torch.no_grad():
        cache = AttnStoreCache(model, store, session, ids)
        model(cache.input_ids, **cache_kwargs(cache))
    return cache


def run_turns(model, store, session, turns, new_tokens=6, **cache_options):
    """Runs a multi-turn chat twice, with AttnStoreCache and with DynamicCache recomputation."""
    hist = ref_hist = None
    records = []
    for user in turns:
        hist = user if hist is None else torch.cat([hist, user], dim=1)
        ref_hist = user if ref_hist is None else torch.cat([ref_hist, user], dim=1)
        cache = AttnStoreCache(model, store, session, hist, **cache_options)
        # Explicit masks: without one, `generate` masks every id equal to the pad id (a generated 0 here).
        out = model.generate(cache.input_ids, attention_mask=torch.ones_like(cache.input_ids), **cache_kwargs(cache),
                             max_new_tokens=new_tokens, **GREEDY)
        ref = model.generate(ref_hist, attention_mask=torch.ones_like(ref_hist),
                             **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=new_tokens, **GREEDY)
        records.append((cache, out, ref))
        hist, ref_hist = out, ref
    return records


@pytest.mark.parametrize("arch", sorted(TINY_MODELS) + sorted(ABSOLUTE_MODELS) + sorted(SCALED_ROPE_MODELS))
def test_multi_turn_greedy_equals_recompute(arch):
    model = make_tiny(arch)
    store = AttnStore(host_bytes="64MiB")
    turns = [random_ids(20, 1), random_ids(9, 2), random_ids(13, 3), random_ids(5, 4)]
    records = run_turns(model, store, "s", turns)
    expected_reuse = 0
    for i, (cache, out, ref) in enumerate(records):
        assert torch.equal(out, ref), f"turn {i} differs"
        assert cache.reused_tokens == expected_reuse
        # Everything but the last generated token went through the model and was saved.
        expected_reuse = out.shape[1] - 1
        assert torch.equal(cache.token_ids, out[0, :-1])
    assert expected_reuse > 40  # the history really grew across turns


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_plain_forward_logits_equal_recompute(arch):
    model = make_tiny(arch)
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(30, 5)
    with torch.no_grad():
        prefill(model, store, "f", ids[:, :18])
        second = AttnStoreCache(model, store, "f", ids)
        assert second.reused_tokens == 18
        rest = second.input_ids[:, second.get_seq_length():]
        logits = model(rest, **cache_kwargs(second)).logits
        full = model(ids).logits[:, 18:]
    torch.testing.assert_close(logits, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", sorted(TINY_MODELS) + sorted(SCALED_ROPE_MODELS))
def test_rerotated_keys_equal_model_post_rope_keys(arch):
    """Stored pre-RoPE keys, re-rotated on load, equal the keys the model itself caches."""
    model = make_tiny(arch)
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(40, 6)
    with torch.no_grad():
        prefill(model, store, "k", ids)
        ref = DynamicCache()
        model(ids, **cache_kwargs(ref))
    resumed = AttnStoreCache(model, store, "k", torch.cat([ids, random_ids(1, 7)], dim=1))
    assert resumed.reused_tokens == 40
    for layer in range(len(resumed.layers)):
        keys, values = loaded_kv(resumed, layer, 40)
        # What RoPE rotated round-trips within rounding, the rest bit for bit (multi-head latent attention
        # rotates the tensor it caches as values: the key's rotary part; its keys, a latent, carry no position).
        rotated_keys = not resumed.turn._layout.latent
        # A sliding-window layer loads only the tokens its window still sees.
        start = resumed.turn.loader.load_start(layer, 40)
        assert start == max(40 - resumed.turn._windows.get(layer, 41) + 1, 0) and keys.shape[2] == 40 - start
        torch.testing.assert_close(keys, ref.layers[layer].keys[:, :, start:], atol=1e-5 if rotated_keys else 0,
                                   rtol=0)
        torch.testing.assert_close(values, ref.layers[layer].values[:, :, start:], atol=0 if rotated_keys else 1e-5,
                                   rtol=0)


def loaded_kv(cache, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KV slot `slot`'s first `n` reused tokens as the cache loads them (re-rotated; a sliding-window slot: the
    last `window - 1` of them), in the model's roles (the store swaps those of multi-head latent attention, see
    layers.LayerLayout.latent)."""
    _, (kh, kd), (vh, vd) = shapes(cache.turn._geometry)
    keys, values = cache.turn.load_layer(slot, n, torch.empty(1, kh, 0, kd), torch.empty(1, vh, 0, vd))
    return (values, keys) if cache.turn._layout.latent else (keys, values)


def test_prefix_mismatch_reuses_exactly_the_common_prefix(tiny_llama):
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(30, 8)
    cache = prefill(tiny_llama, store, "p", ids)
    edited = ids.clone()
    edited[0, 17] = (edited[0, 17] + 1) % 128
    edited = torch.cat([edited, random_ids(4, 9)], dim=1)
    cache = AttnStoreCache(tiny_llama, store, "p", edited)
    assert cache.reused_tokens == 17
    out = tiny_llama.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=5, **GREEDY)
    ref = tiny_llama.generate(edited, max_new_tokens=5, **GREEDY)
    assert torch.equal(out, ref)
    # The session now holds the edited history: the next turn reuses all of it.
    assert AttnStoreCache(tiny_llama, store, "p", out).reused_tokens == out.shape[1] - 1


def test_identical_prompt_leaves_one_token_to_compute(tiny_llama):
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(12, 10)
    prefill(tiny_llama, store, "i", ids)
    again = AttnStoreCache(tiny_llama, store, "i", ids)
    assert again.reused_tokens == 11
    out = tiny_llama.generate(again.input_ids, **cache_kwargs(again), max_new_tokens=4, **GREEDY)
    assert torch.equal(out, tiny_llama.generate(ids, max_new_tokens=4, **GREEDY))


def test_other_model_or_dtype_is_a_miss(tiny_llama):
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(16, 11)
    prefill(tiny_llama, store, "m", ids)
    assert AttnStoreCache(tiny_llama, store, "m", ids).reused_tokens == 15
    other_weights = make_tiny("llama", seed=1)
    assert AttnStoreCache(other_weights, store, "m", ids).reused_tokens == 0
    bf16 = make_tiny("llama", seed=0, dtype=torch.bfloat16)
    assert AttnStoreCache(bf16, store, "m", ids).reused_tokens == 0


def test_sessions_are_isolated(tiny_llama):
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(16, 12)
    prefill(tiny_llama, store, "alice", ids)
    assert AttnStoreCache(tiny_llama, store, "bob", ids).reused_tokens == 0


def test_inputs_embeds_forward_is_not_saved(tiny_llama):
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(10, 13)
    cache = AttnStoreCache(tiny_llama, store, "e", ids)
    with torch.no_grad():
        tiny_llama(inputs_embeds=tiny_llama.get_input_embeddings()(ids), **cache_kwargs(cache))
    assert cache.saved_tokens == 0
    assert store.lookup("e", cache.fingerprint) is None


def test_read_only_cache_reuses_and_leaves_the_store_unchanged(tiny_llama):
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(40, 15)
    first = prefill(tiny_llama, store, "r", ids[:, :24])
    before = store.token_ids("r", first.fingerprint).clone()
    with torch.no_grad():
        for tail in (ids[:, 24:], random_ids(9, 16), random_ids(3, 17)):
            prompt = torch.cat([ids[:, :24], tail], dim=1)
            cache = AttnStoreCache(tiny_llama, store, "r", prompt, save=False)
            assert cache.reused_tokens == 24
            out = tiny_llama.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=4, **GREEDY)
            ref = tiny_llama.generate(prompt, **cache_kwargs(DynamicCache()), max_new_tokens=4, **GREEDY)
            assert torch.equal(out, ref)
            assert cache.saved_tokens == 0
            assert torch.equal(store.token_ids("r", first.fingerprint), before)
    # Truncating read-only turns leave the stored history whole too.
    cache = AttnStoreCache(tiny_llama, store, "r", ids, save=False, context_window=30, keep_first=2)
    assert cache.dropped_tokens > 0 and cache.reused_tokens > 2
    with torch.no_grad():
        tiny_llama(cache.input_ids[:, cache.reused_tokens :], **cache_kwargs(cache))
    assert torch.equal(store.token_ids("r", first.fingerprint), before)


def test_bf16_reuse_stays_close():
    model = make_tiny("llama", dtype=torch.bfloat16)
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(40, 14)
    with torch.no_grad():
        prefill(model, store, "b", ids[:, :30])
        second = AttnStoreCache(model, store, "b", ids)
        logits = model(second.input_ids[:, 30:], **cache_kwargs(second)).logits
        full = model(ids).logits[:, 30:]
    assert (logits.float() - full.float()).abs().max() < 0.1


class TestBadInput:
    def test_batch_of_two_is_refused(self, tiny_llama):
        with pytest.raises(ValueError, match="batch size 1"):
            AttnStoreCache(tiny_llama, AttnStore(), "x", random_ids(8, 0).repeat(2, 1))

    def test_padding_is_refused(self, tiny_llama):
        ids = random_ids(8, 0)
        mask = torch.ones_like(ids)
        mask[0, 0] = 0
        with pytest.raises(ValueError, match="padded"):
            AttnStoreCache(tiny_llama, AttnStore(), "x", {"input_ids": ids, "attention_mask": mask})

    @pytest.mark.parametrize(
        "kwargs, match",
        [
            (dict(truncation="fancy"), "unknown"),
            (dict(context_window=8, keep_first=8), "keep_first"),
            (dict(context_window=1), "context_window"),
            (dict(truncation_ratio=0.0), "truncation_ratio"),
            (dict(keep_first=-1), "keep_first"),
        ],
    )
    def test_bad_options(self, tiny_llama, kwargs, match):
        with pytest.raises(ValueError, match=match):
            AttnStoreCache(tiny_llama, AttnStore(), "x", random_ids(8, 0), **kwargs)

    @pytest.mark.parametrize("session_id, exc", [("", ValueError), (None, TypeError), (3, TypeError)])
    def test_bad_session_ids(self, tiny_llama, session_id, exc):
        with pytest.raises(exc, match="session_id"):
            AttnStoreCache(tiny_llama, AttnStore(), session_id, random_ids(8, 0))

    def test_empty_prompt(self, tiny_llama):
        with pytest.raises(ValueError, match="non-empty"):
            AttnStoreCache(tiny_llama, AttnStore(), "x", [])

    def test_wrong_ids_fed_to_generate(self, tiny_llama):
        store = AttnStore()
        ids = random_ids(12, 0)
        with torch.no_grad():
            cache = AttnStoreCache(tiny_llama, store, "x", ids)
            tiny_llama(cache.input_ids, **cache_kwargs(cache))
        cache = AttnStoreCache(tiny_llama, store, "x", torch.cat([ids, random_ids(3, 1)], dim=1))
        with pytest.raises(ValueError, match="cache.input_ids"):
            tiny_llama.generate(random_ids(15, 2), **cache_kwargs(cache), max_new_tokens=2, **GREEDY)
        # Nothing was saved by the refused call.
        assert store.lookup("x", cache.fingerprint).length == 12

    def test_beam_search_is_refused(self, tiny_llama):
        ids = random_ids(8, 0)
        cache = AttnStoreCache(tiny_llama, AttnStore(), "x", ids)
        with pytest.raises(ValueError, match="num_beams|batch size 1"):
            tiny_llama.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=2, num_beams=2, **GREEDY)

    def test_unsupported_architecture(self):
        from transformers import BloomConfig, BloomForCausalLM

        model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=2))
        with pytest.raises(ValueError, match="bloom.*not supported.*not verified"):
            AttnStoreCache(model, AttnStore(), "x", random_ids(8, 0))

    def test_length_dependent_rope_per_layer_type_is_refused(self):
        """Length-dependent RoPE is reused per frequency regime (tests/cache/test_rope_regimes.py); mixed with a static
        type per layer type (gemma3-style) it is refused."""
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        from ..conftest import _gqa

        cfg = Gemma3TextConfig(**_gqa(head_dim=16, sliding_window=16,
                                      layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                      rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                       "full_attention": {"rope_type": "dynamic", "factor": 2.0,
                                                                          "rope_theta": 1e5}}))
        with pytest.raises(ValueError, match="per layer type.*dynamic|dynamic.*per layer type"):
            RopeAdapter(Gemma3ForCausalLM(cfg))

    def test_failed_forward_poisons_only_the_cache(self, tiny_llama):
        store = AttnStore()
        ids = random_ids(10, 0)
        cache = AttnStoreCache(tiny_llama, store, "x", ids)
        layer = tiny_llama.model.layers[1]
        original = layer.forward

        def boom(*args, **kwargs):
            raise RuntimeError("injected")

        layer.forward = boom
        try:
            with pytest.raises(RuntimeError, match="injected"), torch.no_grad():
                tiny_llama(cache.input_ids, **cache_kwargs(cache))
        finally:
            layer.forward = original
        with pytest.raises(RuntimeError, match="did not complete"), torch.no_grad():
            tiny_llama(cache.input_ids, **cache_kwargs(cache))
        assert store.lookup("x", cache.fingerprint) is None  # nothing half-written
        fresh = AttnStoreCache(tiny_llama, store, "x", ids)
        out = tiny_llama.generate(fresh.input_ids, **cache_kwargs(fresh), max_new_tokens=3, **GREEDY)
        assert torch.equal(out, tiny_llama.generate(ids, max_new_tokens=3, **GREEDY))


@pytest.mark.parametrize("arch", ["phi3", "gpt_neox", "llama"])
def test_a_forward_with_gradients_on_stores_plain_tensors_and_accounts_what_it_holds(arch):
    """phi3 and gpt_neox hand the cache views into the fused QKV output; with gradients on, tensors carry
    a graph. The store keeps neither: it holds exactly the bytes it accounts for."""
    model = make_tiny(arch)
    store = AttnStore(host_bytes="64MiB")
    with torch.enable_grad():
        cache = AttnStoreCache(model, store, "g", random_ids(70, 1))
        model(cache.input_ids, **cache_kwargs(cache), use_cache=True)
    snap = store.lookup("g", cache.fingerprint)
    storages = {}
    for seg, _, _ in snap.parts:
        for t in seg.keys + seg.values + [seg.token_ids]:
            assert t.grad_fn is None and not t.requires_grad
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert sum(storages.values()) == store.stats().host_bytes_used


def test_crop_cuts_the_cache_and_the_stored_session_alike(tiny_llama):
    """`crop` (assisted decoding rejecting draft tokens) shortens the live cache and the session: the next
    turn reuses exactly the kept tokens and matches recomputation."""
    model, store = tiny_llama, AttnStore(host_bytes="64MiB")
    ids, draft, tail = random_ids(30, 11), random_ids(6, 12), random_ids(5, 13)
    with torch.no_grad():
        cache = AttnStoreCache(model, store, "c", ids)
        model(cache.input_ids, **cache_kwargs(cache), use_cache=True)
        model(draft, **cache_kwargs(cache), use_cache=True)  # six draft tokens verified at once
        cache.crop(-4)  # four rejected (transformers 5: a negative count removes tokens)
        kept = torch.cat([ids, draft[:, :2]], dim=1)
        assert cache.get_seq_length() == 32 and torch.equal(cache.token_ids, kept[0])
        assert torch.equal(store.token_ids("c", cache.fingerprint), kept[0])
        model(tail, **cache_kwargs(cache), use_cache=True)  # decoding goes on after the cut
    history = torch.cat([kept, tail], dim=1)
    assert torch.equal(store.token_ids("c", cache.fingerprint), history[0])
    prompt = torch.cat([history, random_ids(3, 14)], dim=1)
    resumed = AttnStoreCache(model, store, "c", prompt)
    assert resumed.reused_tokens == history.shape[1]
    out = model.generate(resumed.input_ids, **cache_kwargs(resumed), max_new_tokens=4, **GREEDY)
    assert torch.equal(out, model.generate(prompt, **cache_kwargs(DynamicCache()), max_new_tokens=4, **GREEDY))


def test_a_dropped_cache_ends_its_turn_without_waiting_for_the_garbage_collector(tiny_llama):
    """The session is pinned while its turn runs; dropping the cache (no reference cycle) unpins it at once."""
    import gc

    store = AttnStore(host_bytes="64MiB")
    gc.disable()
    try:
        cache = AttnStoreCache(tiny_llama, store, "d", random_ids(20, 1))
        tiny_llama.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=3, **GREEDY)
        fp = cache.fingerprint
        assert store._index.entries[(fp, "d")].writers  # the turn is open
        del cache
        store.evict("d")  # no disk tier: an unpinned session is dropped
        assert store.lookup("d", fp) is None
    finally:
        gc.enable()
