"""Length-dependent RoPE (`longrope`, `dynamic`): KV is reused only in the frequency regime it was computed in.

Each model's frequencies change past `REGIME_LIMIT` tokens (conftest). What must hold, fp32: turns within one
regime reuse and give the tokens of a recomputation; a turn in another regime misses (the KV of every layer
past the first depends on the frequencies); `longrope`'s long regime is stored apart and reused in turn,
reused keys re-rotated with the frequencies of the forward that loads them; `dynamic` past its limit neither
reuses nor stores; a turn that decodes past the limit leaves no lagging KV behind.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.serving.batching import batchable
from hf_attnstore.cache.rope import RopeAdapter

from ..conftest import LENGTH_DEPENDENT_MODELS, REGIME_LIMIT, make_tiny, random_ids
from hf_attnstore.cache.upstream import cache_kwargs

ARCHS = sorted(LENGTH_DEPENDENT_MODELS)
LONGROPE = [a for a in ARCHS if "longrope" in a]
GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=16)


def turn(model, store, sid, ids, new=4, **kw):
    """One turn through the store and the same ids recomputed; asserts equal tokens, returns (cache, out)."""
    cache = AttnStoreCache(model, store, sid, ids, **kw)
    out = model.generate(cache.input_ids, attention_mask=torch.ones_like(cache.input_ids), **cache_kwargs(cache),
                         max_new_tokens=new, **GREEDY)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(DynamicCache(config=model.config)),
                         max_new_tokens=new, **GREEDY)
    assert torch.equal(out, ref)
    cache.close()
    return cache, out


def stored_length(model, store, sid) -> list[int | None]:
    """The stored token count of `sid` under each of the model's keys (None where nothing is stored)."""
    found = [store.token_ids(sid, fp) for fp in AttnStoreCache.fingerprints_of(model, store)]
    return [None if ids is None else ids.numel() for ids in found]


@pytest.mark.parametrize("arch", ARCHS)
def test_regimes_match_the_modules_frequencies(arch):
    """Lengths of one regime get one set of frequencies from the model's module, lengths of two get two."""
    model = make_tiny(arch)
    rope, rotary = RopeAdapter(model), model.model.rotary_emb
    lengths = [8, REGIME_LIMIT - 1, REGIME_LIMIT, REGIME_LIMIT + 1, REGIME_LIMIT + 9]
    freqs = {}
    for length in lengths:
        rotary(torch.empty(0), torch.arange(length).view(1, -1))
        freqs[length] = rotary.inv_freq.clone()
    for a in lengths:
        for b in lengths:
            ra, rb = rope.regime(a), rope.regime(b)
            if ra is not None and ra == rb:
                assert torch.equal(freqs[a], freqs[b]), (a, b)
            elif ra is not None and rb is not None:
                assert not torch.equal(freqs[a], freqs[b]), (a, b)
    # No regime (dynamic past its limit): the frequencies move with the length.
    assert all(not torch.equal(freqs[n], freqs[8]) for n in lengths if rope.regime(n) is None and n > REGIME_LIMIT)


@pytest.mark.parametrize("arch", ARCHS)
def test_reuse_within_the_first_regime_equals_recompute(arch):
    model = make_tiny(arch)
    store = AttnStore(host_bytes="16MiB")
    ids, reused = random_ids(20, 0), []
    for step in range(3):  # 20, 30 and 40 prompt tokens, 4 decoded: all under the limit
        cache, out = turn(model, store, "s", ids)
        assert cache.regime == "" and cache.fingerprint == AttnStoreCache.fingerprint_of(model, store)
        reused.append(cache.reused_tokens)
        ids = torch.cat([out, random_ids(6, 10 + step)], dim=1)
    assert reused[0] == 0 and all(r == n - 7 for r, n in zip(reused[1:], (30, 40)))


@pytest.mark.parametrize("arch", LONGROPE)
def test_longrope_long_regime_is_stored_apart_and_reused(arch):
    model = make_tiny(arch)
    store = AttnStore(host_bytes="16MiB")
    long_key, short_key = AttnStoreCache.fingerprints_of(model, store)
    assert short_key == AttnStoreCache.fingerprint_of(model, store) and long_key != short_key
    _, out = turn(model, store, "s", random_ids(40, 0))  # 44 tokens: the short regime
    assert stored_length(model, store, "s") == [None, 43]
    ids = torch.cat([out, random_ids(8, 1)], dim=1)  # 52: the long regime, whose KV nothing holds yet
    cache, out = turn(model, store, "s", ids)
    assert (cache.regime, cache.fingerprint, cache.reused_tokens) == ("long", long_key, 0)
    assert stored_length(model, store, "s") == [55, None]  # the short KV, now behind the history, is gone
    ids = torch.cat([out, random_ids(6, 2)], dim=1)
    cache, out = turn(model, store, "s", ids)
    assert cache.regime == "long" and cache.reused_tokens == 55
    # A branch that keeps only 30 tokens, fewer than the limit, in a long forward: the reused keys are rotated
    # with the long frequencies (the module would pick the short ones from their positions alone).
    branch = torch.cat([ids[:, :30], random_ids(25, 3)], dim=1)
    cache = AttnStoreCache(model, store, "s", branch, save=False)
    assert cache.regime == "long" and cache.reused_tokens == 30
    with torch.no_grad():
        logits = model(cache.input_ids[:, 30:], **cache_kwargs(cache)).logits[:, -1]
        expected = model(branch).logits[:, -1]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_decoding_past_the_limit_leaves_no_lagging_kv(arch):
    """The tokens decoded past the limit are of another regime: nothing of the session stays stored (a stored
    history behind the conversation would be served to a restarted pipeline), and the next turn recomputes."""
    model = make_tiny(arch)
    store = AttnStore(host_bytes="16MiB")
    cache, out = turn(model, store, "s", random_ids(40, 0), new=16)
    assert cache.regime == "" and 0 < cache.saved_tokens < out.shape[1] - 1
    assert all(n is None for n in stored_length(model, store, "s"))
    cache, _ = turn(model, store, "s", torch.cat([out, random_ids(4, 1)], dim=1))
    assert cache.reused_tokens == 0


def test_dynamic_past_its_limit_neither_reuses_nor_stores():
    model = make_tiny("llama-dynamic")
    store = AttnStore(host_bytes="16MiB")
    _, out = turn(model, store, "s", random_ids(30, 0))
    ids = torch.cat([out, random_ids(20, 1)], dim=1)  # 54 tokens, past the limit
    peek = AttnStoreCache(model, store, "s", ids, save=False)  # read-only: changes nothing
    with torch.no_grad():
        model(peek.input_ids, **cache_kwargs(peek))
    assert peek.regime is None and peek.reused_tokens == 0 and stored_length(model, store, "s") == [33]
    cache, _ = turn(model, store, "s", ids)
    assert cache.regime is None and cache.reused_tokens == 0 and cache.saved_tokens == 0
    assert stored_length(model, store, "s") == [None]  # the short KV would lag behind the history


@pytest.mark.parametrize("arch", LONGROPE)
def test_long_regime_round_trips_through_disk(tmp_path, arch):
    model = make_tiny(arch)
    with AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), **FAST) as store:
        _, out = turn(model, store, "s", random_ids(56, 0))
    ids = torch.cat([out, random_ids(6, 1)], dim=1)
    with AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), **FAST) as store:
        # The pipeline prefetches under both of the model's keys.
        assert store.prefetch(["s"], AttnStoreCache.fingerprints_of(model, store)) == 1
        store.flush(timeout=10)
        cache, _ = turn(model, store, "s", ids)
        assert cache.regime == "long" and cache.reused_tokens == 59


@pytest.mark.parametrize("arch", ARCHS)
def test_length_dependent_rope_is_not_batched(arch):
    ok, why = batchable(make_tiny(arch))
    assert not ok and "longest row" in why


def test_static_rope_keeps_one_key_and_regime():
    model = make_tiny("llama")
    store = AttnStore(host_bytes="16MiB")
    assert AttnStoreCache.fingerprints_of(model, store) == [AttnStoreCache.fingerprint_of(model, store)]
    rope = RopeAdapter(model)
    assert not rope.length_dependent and {rope.regime(n) for n in (1, REGIME_LIMIT, 10_000)} == {""}


def test_a_partially_evicted_long_session_is_recomputed(tmp_path):
    """A dropped head would be recomputed by a forward shorter than the limit, in the short regime: a session of
    the long regime that lost its head is a miss instead (and the turn gives the tokens of recomputation)."""
    model = make_tiny("llama-longrope")
    hist = {}
    with AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), **FAST) as store:
        for i, s in enumerate("abc"):
            _, out = turn(model, store, s, random_ids(56, i))
            hist[s] = torch.cat([out, random_ids(6, 10 + i)], dim=1)
    for manifest in tmp_path.rglob("manifest.json"):  # equal idle times: no session loses every chunk (see
        os.utime(manifest, (1_700_000_000, 1_700_000_000))  # test_cache_tiers._partially_evicted)
    used = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    with AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), disk_bytes=used + 16 * 4096, partial_eviction=True,
                   **FAST) as store:
        turn(model, store, "d", random_ids(56, 9), new=2)
        store.flush()
        long_key = AttnStoreCache.fingerprints_of(model, store)[0]
        headless = [s for s in "abc" if store.lookup(s, long_key).head]
        assert store.stats().head_drops >= 1 and headless
        for s in headless:
            cache, _ = turn(model, store, s, hist[s])
            assert cache.regime == "long" and cache.reused_tokens == 0 and cache.recomputed_head == 0


def test_chat_pipeline_serves_a_conversation_across_the_limit(tmp_path):
    """ChatPipeline over a longrope model: every reply is recomputation's; the turn that enters the long regime
    misses, the next ones reuse; a restarted pipeline finds the session's history and KV under the long key."""
    from hf_attnstore.serving.pipeline import ChatPipeline

    from ..serving.test_pipeline import tiny_tokenizer, words

    model, tok = make_tiny("llama-longrope"), tiny_tokenizer()
    sources, ids = [], None
    with AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), fsync=False) as store:
        with ChatPipeline(model, tok, store, max_new_tokens=4, eos_token_id=None) as pipe:
            for t in range(6):
                reply = pipe.chat("a", words(t), timeout=60)
                ids = (pipe.chat_tokens.first_turn(words(t)) if ids is None
                       else pipe.chat_tokens.next_turn(ids, words(t)))
                ref = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=4, **GREEDY)
                assert reply.text == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True), t
                sources.append((reply.kv_source, ids.shape[1]))
                ids = ref
    assert ids.shape[1] > REGIME_LIMIT + 20
    assert [s for s, n in sources if n > REGIME_LIMIT][:2] == ["miss", "host"]
    with AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), fsync=False) as store:
        long_key, short_key = AttnStoreCache.fingerprints_of(model, store)
        stored = store.token_ids("a", long_key)
        assert store.token_ids("a", short_key) is None and stored.numel() > REGIME_LIMIT + 20
        with ChatPipeline(model, tok, store, max_new_tokens=4, eos_token_id=None, prefetch_window=0) as pipe:
            reply = pipe.chat("a", words(9), timeout=60)
    assert reply.kv_source == "disk" and reply.reused_tokens == stored.numel()


@pytest.mark.parametrize("arch", LONGROPE)
def test_decoupled_truncation_within_the_long_regime(arch):
    """An overflowing long-regime turn keeps 32 stored tokens, fewer than the limit, in a 58-token forward:
    layer 0's re-rotated keys equal what the model computes for the truncated ids (the long factors)."""
    from hf_attnstore.store.format import shapes

    from .test_cache import prefill

    model = make_tiny(arch)
    store = AttnStore(host_bytes="16MiB")
    ids = random_ids(106, 1)
    prefill(model, store, "t", ids[:, :80])
    cache = AttnStoreCache(model, store, "t", ids, context_window=100, keep_first=4, save=False)
    assert (cache.regime, cache.dropped_tokens, cache.reused_tokens) == ("long", 48, 32)
    ref = DynamicCache()
    with torch.no_grad():
        model(cache.input_ids, **cache_kwargs(ref))
    _, (kh, kd), (vh, vd) = shapes(cache.turn._geometry)
    new = cache.input_ids.shape[1] - 32
    keys, _ = cache.turn.load_layer(0, 32, torch.zeros(1, kh, new, kd), torch.zeros(1, vh, new, vd))
    torch.testing.assert_close(keys[:, :, :32], ref.layers[0].keys[:, :, :32], atol=1e-5, rtol=0)
