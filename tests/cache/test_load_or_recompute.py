"""Load or recompute by cost (`recompute_by_cost`): a resumed session's leading chunks recomputed by the turn
while the rest loads, when the measured rates say that is faster; the same greedy tokens either way.

The rates are set by observations that outweigh anything the run itself measures (a 1-byte load taking 1000 s,
a million-token prefill in a millisecond), so which path a turn takes does not depend on this machine's speed.
"""

from __future__ import annotations

import shutil
import time

import pytest
import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.lab.redis_server import RedisServer

from ..conftest import make_tiny, random_ids
from hf_attnstore.cache.upstream import cache_kwargs

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=16)


def slow_tier(store, tier="disk"):
    store.costs.observe_load(tier, 1, 1000.0)


def fast_tier(store, tier="disk"):
    store.costs.observe_load(tier, 10**15, 1e-3)


def fast_prefill(store, model):
    store.costs.observe_prefill(AttnStoreCache.fingerprint_of(model, store), 0, 10**6, 1e-3)


def slow_prefill(store, model):
    store.costs.observe_prefill(AttnStoreCache.fingerprint_of(model, store), 0, 64, 1000.0)


def on_disk(model, store, session="s", n=70, seed=0):
    """A session of `n` prompt tokens plus 3 generated ones, then only on disk; returns its ids."""
    ids = random_ids(n, seed)
    with AttnStoreCache(model, store, session, ids) as cache:
        out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=4, **GREEDY)
    store.evict(session)
    store.flush()
    assert "disk" in {store.tier_of(session, fp) for fp in AttnStoreCache.fingerprints_of(model, store)}
    return out


def resume(model, store, ids, session="s", new=5):
    """A resumed turn, checked against recomputation; returns the cache."""
    prompt = torch.cat([ids, random_ids(6, 99)], dim=1)
    cache = AttnStoreCache(model, store, session, prompt)
    out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=new, **GREEDY)
    assert torch.equal(out, model.generate(prompt, **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=new, **GREEDY))
    cache.close()
    return cache, out


def resumed_by_cost(tmp_path, arch, tier, prefill):
    """A session of 73 tokens (chunks of 16, 16, 16, 16, 9) on disk, the rates set by `tier` and `prefill`, then
    resumed by a store with `recompute_by_cost`; returns the model, the store, the turn's cache and its output."""
    model = make_tiny(arch)
    store = AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), recompute_by_cost=True, **FAST)
    ids = on_disk(model, store)
    tier(store)
    prefill(store, model)
    return (model, store) + resume(model, store, ids)


# Uniform RoPE; sliding layers; a NoPE layer; multi-head latent attention (the recomputed head's KV swapped).
@pytest.mark.parametrize("arch", ["llama", "gemma2", "smollm3", "deepseek_v3"])
def test_a_slow_tier_leaves_leading_chunks_to_recompute_with_the_same_output(tmp_path, arch):
    model, store, cache, out = resumed_by_cost(tmp_path, arch, slow_tier, fast_prefill)
    # Every chunk but the last is recomputed (the last is always loaded).
    assert cache.kv_source == "disk" and cache.recomputed_head == 64 and cache.reused_tokens == 73
    s = store.stats()
    assert (s.resume_decisions, s.resume_recomputes, s.resume_recomputed_tokens) == (1, 1, 64)
    assert s.resume_chosen_estimate_s < s.resume_load_estimate_s and s.resume_load_gbps > 0
    # The recomputed head went into the host copy: the next turn reuses everything, recomputing nothing.
    again = AttnStoreCache(model, store, "s", out)
    assert again.kv_source == "host" and again.recomputed_head == 0 and again.reused_tokens == out.shape[1] - 1
    assert torch.equal(model.generate(again.input_ids, **cache_kwargs(again), max_new_tokens=3, **GREEDY),
                       model.generate(out, **cache_kwargs(DynamicCache()), max_new_tokens=3, **GREEDY))
    store.close()


def test_a_fast_tier_is_loaded_whole(tmp_path):
    _, store, cache, _ = resumed_by_cost(tmp_path, "llama", fast_tier, slow_prefill)
    assert cache.kv_source == "disk" and cache.recomputed_head == 0
    s = store.stats()
    assert (s.resume_decisions, s.resume_recomputes) == (1, 0)
    assert s.resume_chosen_estimate_s == s.resume_load_estimate_s
    store.close()


def test_off_by_default_and_nothing_assumed_before_measuring(tmp_path):
    model = make_tiny("llama")
    off = AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path / "off"), **FAST)
    ids = on_disk(model, off)
    slow_tier(off)
    fast_prefill(off, model)
    cache, _ = resume(model, off, ids)
    assert cache.recomputed_head == 0 and off.stats().resume_decisions == 0
    off.close()
    # On, but the tier's rate is not measured yet: the first resume loads everything (and measures it).
    on = AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path / "on"), recompute_by_cost=True, **FAST)
    key = AttnStoreCache.fingerprint_of(model, on)
    ids = on_disk(model, on)
    assert on.costs.prefill_units_per_s(key) > 0  # the first turn's 70-token prefill was measured
    assert on.costs.load_bytes_per_s("disk") is None
    cache, _ = resume(model, on, ids)
    assert cache.recomputed_head == 0 and on.stats().resume_decisions == 0
    assert on.costs.load_bytes_per_s("disk") > 0  # measured by that load
    on.close()


def test_a_partially_evicted_head_grows_by_the_chunks_cheaper_to_recompute(tmp_path):
    model = make_tiny("llama")
    store = AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), **FAST)
    ids = on_disk(model, store)
    store.close()
    # A disk limit just above the session's files: writing another session makes it lose leading chunks.
    used = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    store = AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), disk_bytes=used + 8 * 4096, partial_eviction=True,
                      **FAST)
    with AttnStoreCache(model, store, "d", random_ids(40, 9)) as cache:
        model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=2, **GREEDY)
    store.flush()
    dropped = store.stats().head_dropped_tokens
    store.close()
    assert 0 < dropped < 64
    store = AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), recompute_by_cost=True, **FAST)
    slow_tier(store)
    fast_prefill(store, model)
    cache, _ = resume(model, store, ids)
    assert cache.recomputed_head == 64 and store.stats().resume_recomputed_tokens == 64 - dropped
    store.close()


def test_rebased_chunks_are_loaded(tmp_path):
    """After a decoupled truncation the kept tokens' KV was computed after another history: recomputing it would
    change what the session holds, so only the span before the first rebased one (the sinks) may be recomputed,
    and the turn's tokens are those of loading everything."""
    model = make_tiny("llama")
    store = AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path / "a"), recompute_by_cost=True, **FAST)
    ids = random_ids(70, 0)
    with AttnStoreCache(model, store, "s", ids) as cache:
        out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=4, **GREEDY)
    store.flush()  # on disk before the truncation, which then marks the spans it keeps after the gap rebased
    prompt = torch.cat([out, random_ids(20, 5)], dim=1)
    with AttnStoreCache(model, store, "s", prompt, context_window=80) as cache:
        assert cache.dropped_tokens > 0
        out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=2, **GREEDY)
    store.evict("s")
    store.close()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    outputs = []
    for folder, by_cost in (("a", True), ("b", False)):
        store = AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path / folder), recompute_by_cost=by_cost, **FAST)
        slow_tier(store)
        fast_prefill(store, model)
        cache = AttnStoreCache(model, store, "s", out, save=False)
        assert cache.kv_source == "disk" and cache.reused_tokens == out.shape[1] - 1
        assert cache.recomputed_head == (4 if by_cost else 0)  # the 4 sinks: the only span not rebased
        outputs.append(model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=5, **GREEDY))
        cache.close()
        store.close()
    assert torch.equal(*outputs)


# A hybrid model's states summarize every token; longrope's head computed alone could be of another regime.
@pytest.mark.parametrize("arch", ["qwen3_next", "llama-longrope"])
def test_models_whose_head_cannot_be_recomputed_alone_are_loaded(tmp_path, arch):
    _, store, cache, _ = resumed_by_cost(tmp_path, arch, slow_tier, fast_prefill)
    assert cache.kv_source == "disk" and cache.recomputed_head == 0 and store.stats().resume_decisions == 0
    store.close()


def test_the_remote_tier_is_decided_by_its_own_rate(tmp_path):
    model = make_tiny("llama")
    with RedisServer(tmp_path / "redis") as server:
        store = AttnStore(host_bytes="16MiB", remote=server.url, recompute_by_cost=True, **FAST)
        ids = random_ids(70, 0)
        with AttnStoreCache(model, store, "s", ids) as cache:
            ids = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=4, **GREEDY)
        store.flush()
        store.close()
        # Another server finds the session in the remote tier only.
        other = AttnStore(host_bytes="16MiB", remote=server.url, recompute_by_cost=True, **FAST)
        fast_tier(other, "disk")  # another tier's rate says nothing of this one
        slow_tier(other, "remote")
        fast_prefill(other, model)
        cache, _ = resume(model, other, ids)
        assert cache.kv_source == "remote" and cache.recomputed_head == 64
        assert other.stats().resume_recomputes == 1
        other.close()


def _remote_and_disk(tmp_path, server, model, name, **kw):
    store = AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path / name), remote=server.url, **FAST, **kw)
    if kw.get("recompute_by_cost"):
        slow_tier(store, "remote")
        fast_prefill(store, model)
    return store


def _equal_to_recomputation(model, store, ids):
    with AttnStoreCache(model, store, "s", ids, save=False) as cache:
        assert cache.reused_tokens > 0, cache.kv_source
        out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=6, **GREEDY)
    return torch.equal(out, model.generate(ids, **cache_kwargs(DynamicCache()), max_new_tokens=6, **GREEDY))


@pytest.mark.parametrize("probe", [False, True], ids=["resumed", "probe-diverging-in-the-head"])
def test_a_remote_copy_loaded_without_its_head_is_written_locally_only_once_whole(tmp_path, monkeypatch, probe):
    """A store with a disk and a remote tier writes a session it loaded from the remote tier to its disk (and
    mirrors it back): never before the turn has recomputed the head left out of the load, whatever the timing
    (the recompute is made slow here), and never when no turn recomputes it (a read-only probe whose prompt
    diverges inside the head): then the host copy is dropped, and the remote copy serves the next turn."""
    model = make_tiny("llama")
    with RedisServer(tmp_path / "redis") as server:
        first = _remote_and_disk(tmp_path, server, model, "a")
        with AttnStoreCache(model, first, "s", random_ids(70, 0)) as cache:
            ids = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=4, **GREEDY)
        first.flush()
        first.close()
        store = _remote_and_disk(tmp_path, server, model, "b", recompute_by_cost=True)
        fill = store.fill_head

        def slow_fill(*args, **kwargs):
            time.sleep(0.3)  # a long recompute: the load has finished and the writer is idle meanwhile
            return fill(*args, **kwargs)

        monkeypatch.setattr(store, "fill_head", slow_fill)
        prompt = torch.cat([ids[:, :30], random_ids(10, 5)], 1) if probe else torch.cat([ids, random_ids(6, 7)], 1)
        with AttnStoreCache(model, store, "s", prompt, save=not probe) as cache:
            assert cache.kv_source == ("miss" if probe else "remote")
            assert cache.recomputed_head == (0 if probe else 64)
            model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=2, **GREEDY)
        store.flush(timeout=10)
        store.evict("s")
        store.flush(timeout=10)
        assert store.stats().resume_recomputes == 1
        if not probe:
            assert store.tier_of("s", AttnStoreCache.fingerprint_of(model, store)) == "disk"
        assert _equal_to_recomputation(model, store, ids)  # from its own disk copy, or the remote one
        store.close()
        other = AttnStore(host_bytes="16MiB", remote=server.url, **FAST)  # what the remote tier holds now
        assert _equal_to_recomputation(model, other, ids)
        other.close()


def test_a_load_that_does_not_start_is_not_counted_as_a_decision(tmp_path):
    model = make_tiny("llama")
    store = AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), **FAST)
    on_disk(model, store)
    store.close()
    small = AttnStore(host_bytes=20_000, disk_dir=str(tmp_path), recompute_by_cost=True, **FAST)
    slow_tier(small)
    fast_prefill(small, model)
    key = AttnStoreCache.fingerprint_of(model, small)
    assert small.lookup("s", key, prefill_key=key) is None  # larger than the host tier: a miss
    assert small.stats().resume_decisions == 0
    small.close()


def test_a_prefetch_for_a_turn_about_to_run_is_decided_but_counted_only_once_started(tmp_path):
    """`store.prefetch(prefill_key=)` decides the first session's load by cost, the others load whole; a prefetch
    refused for room (a running turn holds the host tier) decides nothing until room frees and it starts."""
    model = make_tiny("llama")
    options = dict(disk_dir=str(tmp_path), recompute_by_cost=True, **FAST)
    store = AttnStore(host_bytes="16MiB", **options)
    for sid in ("s", "t"):
        on_disk(model, store, sid)
    store.close()
    for host, sessions in ((90_000, ["s"]), ("16MiB", ["s", "t"])):  # room for one session; for all
        store = AttnStore(host_bytes=host, **options)
        slow_tier(store)
        fast_prefill(store, model)
        key, fingerprints = AttnStoreCache.prefill_key_of(model, store), AttnStoreCache.fingerprints_of(model, store)
        if len(sessions) == 1:
            with AttnStoreCache(model, store, "running", random_ids(60, 2)) as busy:
                model(busy.input_ids, **cache_kwargs(busy))  # a running turn pinned in host memory: no room now
                assert store.prefetch(sessions, fingerprints, prefill_key=key) == 0
                assert store.stats().resume_decisions == 0
            store.evict("running")  # written out: room frees, and the wanted prefetch starts, decided by cost
            store.flush()
        else:
            assert store.prefetch(sessions, fingerprints, prefill_key=key) == 2
        s = store.stats()
        assert (s.resume_decisions, s.resume_recomputes, s.resume_recomputed_tokens) == (1, 1, 64)  # "s" only
        assert store.tier_of("s", fingerprints[0]) == "host"
        store.close()


def test_a_turn_that_switches_to_a_shared_prefix_reports_nothing_recomputed(tmp_path):
    """The turn's own session is resumed with a head to recompute, then another session sharing a longer prefix is
    reused instead: none of the reused tokens were recomputed."""
    model = make_tiny("llama")
    store = AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), recompute_by_cost=True, **FAST)
    ids = random_ids(200, 3)
    for sid, n in (("a", 80), ("b", 160)):
        with AttnStoreCache(model, store, sid, ids[:, :n]) as cache:  # b starts from a's stored prefix
            model(cache.input_ids[:, cache.reused_tokens:], **cache_kwargs(cache))
        store.evict(sid)
    store.flush()
    slow_tier(store)
    fast_prefill(store, model)
    with AttnStoreCache(model, store, "a", ids[:, :170], save=False) as cache:
        assert cache.shared_from == "b" and cache.reused_tokens == 160
        assert cache.recomputed_head == cache.reused_recomputed == 0
    store.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_measures_its_prefills_and_resumes_with_a_recomputed_head(tmp_path):
    model = make_tiny("llama").cuda()
    store = AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), recompute_by_cost=True, **FAST)
    key = AttnStoreCache.fingerprint_of(model, store)
    ids = random_ids(70, 0).cuda()
    with AttnStoreCache(model, store, "s", ids) as cache:
        ids = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=4, **GREEDY)
    torch.cuda.synchronize()
    with AttnStoreCache(model, store, "other", random_ids(40, 1).cuda()) as cache:  # its clock collects the first
        model(cache.input_ids, **cache_kwargs(cache))
    assert store.costs.prefill_units_per_s(key) > 0  # timed by CUDA events
    store.evict("s")
    store.flush()
    slow_tier(store)
    fast_prefill(store, model)
    prompt = torch.cat([ids, random_ids(6, 99).cuda()], dim=1)
    cache = AttnStoreCache(model, store, "s", prompt)
    assert cache.kv_source == "disk" and cache.recomputed_head == 64
    out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=5, **GREEDY)
    assert torch.equal(out, model.generate(prompt, **cache_kwargs(DynamicCache()), max_new_tokens=5, **GREEDY))
    cache.close()
    store.close()
