"""AttnStoreCache over the hierarchical store: disk round trips, damaged data mid-forward, ablations."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.store.format import session_dirname

from ..conftest import make_tiny, random_ids
from hf_attnstore.cache.upstream import cache_kwargs

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=16)


def chat(model, store, sessions, turns=3, new_tokens=5):
    """Round-robin turns over several sessions, each compared with full recomputation."""
    hist = {s: random_ids(20, i) for i, s in enumerate(sessions)}
    ref = dict(hist)
    sources = []
    for turn in range(turns):
        for s in sessions:
            cache = AttnStoreCache(model, store, s, hist[s])
            # Explicit masks: without one, `generate` masks every id equal to the pad id (a generated 0 here).
            out = model.generate(cache.input_ids, attention_mask=torch.ones_like(cache.input_ids), **cache_kwargs(cache),
                                 max_new_tokens=new_tokens, **GREEDY)
            expected = model.generate(ref[s], attention_mask=torch.ones_like(ref[s]),
                                      **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=new_tokens,
                                      **GREEDY)
            assert torch.equal(out, expected), (turn, s)
            sources.append(cache.kv_source)
            extra = random_ids(6, 100 + turn)
            hist[s], ref[s] = torch.cat([out, extra], dim=1), torch.cat([expected, extra], dim=1)
    return sources, hist


@pytest.mark.parametrize("kw", [dict(), dict(preload=True), dict(preload=False), dict(preload=True, read_buffer_layers=0)],
                         ids=["auto", "layerwise", "no-preload", "buffer0"])
def test_sessions_demoted_to_disk_resume_exactly(tmp_path, kw):
    model = make_tiny("llama")
    # Room for about one session in host memory: every other turn resumes from disk.
    store = AttnStore(host_bytes=40_000, disk_dir=str(tmp_path), **FAST, **kw)
    sources, _ = chat(model, store, ["a", "b", "c"])
    assert sources.count("disk") >= 4
    assert store.stats().demotions >= 4
    store.close()


def test_reopened_store_resumes_sessions(tmp_path):
    model = make_tiny("qwen3")
    store = AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), **FAST)
    _, hist = chat(model, store, ["a"], turns=2)
    store.close()
    store = AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), **FAST)
    cache = AttnStoreCache(model, store, "a", hist["a"])
    # Everything but the 6 new tokens and the last generated one (never fed to the model) is reused.
    assert cache.kv_source == "disk" and cache.reused_tokens == hist["a"].shape[1] - 7
    out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=4, **GREEDY)
    assert torch.equal(out, model.generate(hist["a"], max_new_tokens=4, **GREEDY))
    store.close()


def test_damaged_kv_found_mid_forward_is_recomputed_transparently(tmp_path):
    model = make_tiny("llama")
    ids = random_ids(40, 3)
    with AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), **FAST) as store:
        first = AttnStoreCache(model, store, "s", ids)
        with torch.no_grad():
            model(first.input_ids, **cache_kwargs(first))
    chunk = tmp_path / "sessions" / session_dirname(first.fingerprint, "s") / "00000000.safetensors"
    data = bytearray(chunk.read_bytes())
    data[-5] ^= 0x40  # the last layer's values: layers 0 and 1 load fine and are used first
    chunk.write_bytes(bytes(data))
    prompt = torch.cat([ids, random_ids(5, 4)], dim=1)
    with AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), **FAST) as store:
        cache = AttnStoreCache(model, store, "s", prompt)
        assert cache.reused_tokens == 40 and cache.kv_source == "disk"
        out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=5, **GREEDY)
        assert torch.equal(out, model.generate(prompt, max_new_tokens=5, **GREEDY))
        assert cache.recomputed and cache.reused_tokens == 0 and cache.kv_source == "miss"
        assert store.stats().load_errors == 1
        # The session was rewritten from the recomputed KV: the next turn reuses it.
        nxt = AttnStoreCache(model, store, "s", torch.cat([out, random_ids(2, 5)], dim=1))
        assert nxt.reused_tokens == out.shape[1] - 1


def test_damaged_kv_in_a_plain_forward_returns_the_right_logits(tmp_path):
    model = make_tiny("phi3")
    ids = random_ids(30, 6)
    with AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), **FAST) as store:
        first = AttnStoreCache(model, store, "s", ids[:, :24])
        with torch.no_grad():
            model(first.input_ids, **cache_kwargs(first))
    chunk = tmp_path / "sessions" / session_dirname(first.fingerprint, "s") / "00000000.safetensors"
    data = bytearray(chunk.read_bytes())
    data[-5] ^= 0x40
    chunk.write_bytes(bytes(data))
    with AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), **FAST) as store, torch.no_grad():
        cache = AttnStoreCache(model, store, "s", ids)
        logits = model(cache.input_ids[:, 24:], **cache_kwargs(cache)).logits
        assert cache.recomputed and logits.shape[1] == 6
        torch.testing.assert_close(logits, model(ids).logits[:, 24:], atol=1e-5, rtol=1e-5)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("read_buffer_layers", [None, 0])
def test_cuda_layerwise_prefetch_and_async_saving(tmp_path, read_buffer_layers):
    model = make_tiny("llama").to("cuda")
    store = AttnStore(host_bytes=40_000, disk_dir=str(tmp_path), read_buffer_layers=read_buffer_layers, **FAST)
    assert store.config.pin_memory
    hist = {s: random_ids(30, i).cuda() for i, s in enumerate("ab")}
    for turn in range(3):
        for s in "ab":
            cache = AttnStoreCache(model, store, s, hist[s])
            out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=5, **GREEDY)
            assert torch.equal(out, model.generate(hist[s], **cache_kwargs(DynamicCache()), max_new_tokens=5, **GREEDY))
            hist[s] = torch.cat([out, random_ids(4, turn).cuda()], dim=1)
    store.flush()
    assert store.stats().hits_disk >= 1
    store.close()


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])  # keys and values; a latent and the key's rotary part
@pytest.mark.parametrize("codec, tol", [("int8", 0.01), ("int4", 0.1)])
def test_a_lossy_codec_resumes_from_disk_close_to_recomputation(tmp_path, codec, tol, arch):
    model = make_tiny(arch)
    ids = random_ids(48, 5)
    with AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), kv_codec=codec, **FAST) as store, torch.no_grad():
        first = AttnStoreCache(model, store, "s", ids[:, :40])
        model(first.input_ids, **cache_kwargs(first))
        first.close()  # the turn ends: the session may leave host memory
        store.flush()
        store.evict("s")
        cache = AttnStoreCache(model, store, "s", ids)
        assert cache.kv_source == "disk" and cache.reused_tokens == 40
        got = model(cache.input_ids[:, 40:], **cache_kwargs(cache)).logits[0, -1]
        want = model(ids).logits[0, -1]
    # The cold copy is lossy (never bit-identical), within the codec's error of recomputation.
    assert 0 < (got - want).abs().max() < tol * want.abs().max()


def _partially_evicted(tmp_path, model, turns=2):
    """Three sessions on disk, then a store whose disk holds them minus a few chunks: writing a fourth
    session makes the idle ones lose leading chunks. Returns the store and the sessions' next prompts."""
    store = AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), **FAST)
    _, hist = chat(model, store, ["a", "b", "c"], turns=turns)
    store.close()
    # A reopened store dates each session's last use by its manifest's mtime, and partial eviction weighs
    # chunks by idle time: equal mtimes keep the choice to recompute costs (heads first), whatever this
    # machine's load made of the gaps between the writes (else the most idle session may lose every chunk).
    for manifest in tmp_path.rglob("manifest.json"):
        os.utime(manifest, (1_700_000_000, 1_700_000_000))
    used = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    # (A block more than the tightest fit: a head drop writes its new manifest beside the old one before its chunk
    # goes.)
    store = AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), disk_bytes=used + 17 * 4096,
                      partial_eviction=True, **FAST)
    with AttnStoreCache(model, store, "d", random_ids(40, 9)) as cache:
        model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=2, **GREEDY)
    store.flush()
    assert store.stats().head_drops >= 1
    return store, hist


# Uniform RoPE; sliding layers; a NoPE layer; multi-head latent attention (the recomputed head's KV swapped).
@pytest.mark.parametrize("arch", ["llama", "gemma2", "smollm3", "deepseek_v3"])
def test_a_partially_evicted_session_resumes_exactly(tmp_path, arch):
    """The dropped head is recomputed, the rest loaded: the same greedy tokens as recomputing everything."""
    model = make_tiny(arch)
    store, hist = _partially_evicted(tmp_path, model)
    resumed = 0
    for s in ["a", "b", "c"]:
        cache = AttnStoreCache(model, store, s, hist[s])
        head = cache.recomputed_head
        assert cache.kv_source == "disk" and cache.reused_tokens == hist[s].shape[1] - 7
        out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=5, **GREEDY)
        assert torch.equal(out, model.generate(hist[s], **cache_kwargs(DynamicCache()), max_new_tokens=5, **GREEDY))
        cache.close()
        if head:
            resumed += 1
            # The host copy is whole now: the next turn reuses it without recomputing anything.
            again = AttnStoreCache(model, store, s, out)
            assert again.kv_source == "host" and again.recomputed_head == 0 and again.reused_tokens == out.shape[1] - 1
            assert torch.equal(model.generate(again.input_ids, **cache_kwargs(again), max_new_tokens=3, **GREEDY),
                               model.generate(out, **cache_kwargs(DynamicCache()), max_new_tokens=3, **GREEDY))
    assert resumed >= 1
    store.close()


def test_a_partially_evicted_session_truncates_like_a_whole_one(tmp_path):
    """Decoupled truncation keeps the sinks of a recomputed head and stored tokens after the gap: the output
    equals the same truncation over the whole stored session."""
    model = make_tiny("llama")
    store, hist = _partially_evicted(tmp_path, model)
    victim = next(s for s in "abc" if store.lookup(s, AttnStoreCache.fingerprint_of(model, store)).head)
    window = hist[victim].shape[1] - 4  # overflows: half of the window is dropped after the 4 sinks
    cache = AttnStoreCache(model, store, victim, hist[victim], context_window=window, save=False)
    assert cache.dropped_tokens > 0 and cache.recomputed_head == 4  # only the sinks of the head are needed
    out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=5, **GREEDY)
    store.close()
    # The same history, never partially evicted.
    whole = AttnStore(host_bytes="16MiB", **FAST)
    first = AttnStoreCache(model, whole, victim, hist[victim][:, :-7])
    model.generate(first.input_ids, **cache_kwargs(first), max_new_tokens=1, **GREEDY)
    first.close()
    ref = AttnStoreCache(model, whole, victim, hist[victim], context_window=window, save=False)
    assert ref.dropped_tokens == cache.dropped_tokens and ref.reused_tokens == cache.reused_tokens
    assert torch.equal(out, model.generate(ref.input_ids, **cache_kwargs(ref), max_new_tokens=5, **GREEDY))


def _resumed_logits(model, store, ids, reused, **kw):
    with AttnStoreCache(model, store, "s", ids, save=False, **kw) as cache:
        assert cache.reused_tokens > 0 and (cache.dropped_tokens > 0) == ("context_window" in kw)
        return cache.kv_source, model(cache.input_ids[:, cache.reused_tokens:], **cache_kwargs(cache)).logits[0, -1]


# Uniform RoPE; sliding layers (a part narrowed to the window); multi-head latent attention (roles swapped).
@pytest.mark.parametrize("arch, window", [("llama", None), ("gemma2", None), ("deepseek_v3", None), ("llama", 40)],
                         ids=["llama", "gemma2", "deepseek_v3", "llama-truncated"])
@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_host_copies_kept_encoded_resume_exactly_as_their_disk_copy(tmp_path, codec, arch, window):
    """The host copy of a session's written chunks is the codec's blobs (store/buffer.py), dequantized where
    the layer loads: a turn resumed from host memory computes what the same turn resumed from disk does."""
    model = make_tiny(arch)
    ids = random_ids(50, 5)
    with AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), kv_codec=codec, **FAST) as store, torch.no_grad():
        with AttnStoreCache(model, store, "s", ids[:, :32]) as first:  # two whole chunks: nothing stays exact
            model(first.input_ids, **cache_kwargs(first))
        store.flush()
        assert store.stats().host_encoded_tokens == 32
        kw = dict(context_window=window, truncation="decoupled") if window else {}
        tier, from_host = _resumed_logits(model, store, ids, 32, **kw)
        assert tier == "host"
        store.evict("s")
        tier, from_disk = _resumed_logits(model, store, ids, 32, **kw)
        assert tier == "disk"
    assert torch.equal(from_host, from_disk)
    with AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path / "exact"), kv_codec=codec, kv_codec_host=False,
                   **FAST) as store, torch.no_grad():
        with AttnStoreCache(model, store, "s", ids[:, :32]) as first:
            model(first.input_ids, **cache_kwargs(first))
        store.flush()
        assert store.stats().host_encoded_tokens == 0
        tier, exact = _resumed_logits(model, store, ids, 32, **kw)
        assert tier == "host"
    want = model(ids).logits[0, -1] if not window else exact
    assert (exact - want).abs().max() < 1e-5  # kv_codec_host=False: host memory is exact
    assert 0 < (from_host - exact).abs().max() < (0.01 if codec == "int8" else 0.1) * exact.abs().max()


@needs_cuda
@pytest.mark.cuda
def test_cuda_resumes_encoded_host_copies_dequantized_on_the_device(tmp_path):
    model = make_tiny("llama").to("cuda")
    ids = random_ids(50, 5).cuda()
    with AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), kv_codec="int8", **FAST) as store, torch.no_grad():
        assert store.config.pin_memory
        with AttnStoreCache(model, store, "s", ids[:, :32]) as first:
            model(first.input_ids, **cache_kwargs(first))
        store.flush()
        assert store.stats().host_encoded_tokens == 32
        tier, from_host = _resumed_logits(model, store, ids, 32)  # blobs copied, dequantized on the GPU
        store.evict("s")
        disk_tier, from_disk = _resumed_logits(model, store, ids, 32)  # dequantized on the load thread
    assert (tier, disk_tier) == ("host", "disk")
    assert torch.allclose(from_host, from_disk, atol=1e-4)
