"""Sparse cold copies end to end (`StoreConfig.sparse_copies`, ALISA): a session kept sparse is written to disk or
Redis with only the tokens its next turn keeps. A sparse turn resumed from that copy gives the tokens it gives from
the whole copy, and never attends to a token without KV; a dense turn reuses the tokens before the first missing
one and gives recomputation's tokens; a store that did not ask for such copies never serves them."""

from __future__ import annotations

import struct
import json

import pytest
import torch

from hf_attnstore import AttnStore, AttnStoreCache, SparseConfig
from hf_attnstore.cache.upstream import cache_kwargs
from hf_attnstore.lab.redis_server import RedisServer

from ..conftest import make_tiny, random_ids

GREEDY = dict(do_sample=False, pad_token_id=0)
FAST = dict(fsync=False, chunk_tokens=16, idle_flush_s=0.05, io_timeout_s=10)


def turns(model, make_store, config, prompts, new=12, evict=True):
    """Runs one sparse turn per prompt piece, each on a store reopened (so resumed from its cold copy)."""
    ids, outs, reused = None, [], []
    for piece in prompts:
        ids = piece if ids is None else torch.cat([ids, piece], dim=1)
        with make_store() as store:
            cache = AttnStoreCache(model, store, "s", ids, kv_budget=config)
            out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=new, **GREEDY)
            reused.append(cache.reused_tokens)
            cache.close()
            store.flush()
        outs.append(out)
        ids = out
    return outs, reused


def disk_bytes(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.safetensors"))


@pytest.mark.parametrize("policy", ["alisa", "h2o"])
def test_a_sparse_turn_resumed_from_a_sparse_copy_keeps_what_it_keeps_from_the_whole_copy(tmp_path, policy):
    """The next turn: what its first forward drops is what the copy lacks. (Turns after it may differ: a fraction
    budget grows with the session, and a whole copy can give back a token an earlier thin one no longer has.)"""
    model = make_tiny("llama")
    config = SparseConfig(0.25, policy=policy)
    prompts = [random_ids(120, 1), random_ids(20, 2)]
    thin, thin_reused = turns(model, lambda: AttnStore("64MiB", tmp_path / "thin", sparse_copies=True, **FAST), config,
                              prompts)
    whole, whole_reused = turns(model, lambda: AttnStore("64MiB", tmp_path / "whole", **FAST), config, prompts)
    for a, b in zip(thin, whole):
        assert torch.equal(a, b)
    assert thin_reused == whole_reused and thin_reused[1] > 120
    assert disk_bytes(tmp_path / "thin") < 0.7 * disk_bytes(tmp_path / "whole")


def test_a_resumed_sparse_turn_never_attends_to_a_token_without_kv(tmp_path):
    """With another budget than the one that stored it, the turn selects among the tokens the copy kept."""
    model = make_tiny("llama")
    prompts = [random_ids(120, 1)]
    make = lambda: AttnStore("64MiB", tmp_path, sparse_copies=True, **FAST)  # noqa: E731
    outs, _ = turns(model, make, SparseConfig(0.2), prompts)
    nxt = torch.cat([outs[0], random_ids(6, 2)], dim=1)
    for budget in (0.5, 0.9, 16):
        with make() as store:
            cache = AttnStoreCache(model, store, "s", nxt, kv_budget=budget, save=False)
            absent = cache.turn.source.absent[:, :, : cache.reused_tokens]
            assert absent is not None and bool(absent.any()) and cache.reused_tokens == outs[0].shape[1] - 1
            model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=4, **GREEDY)
            assert attended_absent(cache, absent) == 0


def attended_absent(cache, absent) -> int:
    """How many (layer, head, token) the cache's layers hold that had no KV in the reused history."""
    bad = 0
    for layer in cache.layers:
        for h, columns in enumerate(layer.columns):
            bad += int(absent[layer.held_slot, h][columns[columns < cache.reused_tokens]].sum())
    return bad


def test_a_prompt_that_leaves_the_history_inside_a_thin_chunk_reuses_up_to_a_chunk_boundary(tmp_path):
    """A regenerated or edited turn: the common prefix ends where heads kept different counts; the turn reuses the
    longest prefix in which they agree and recomputes the rest (before: a crash)."""
    model = make_tiny("llama")
    make = lambda: AttnStore("64MiB", tmp_path, sparse_copies=True, **FAST)  # noqa: E731
    outs, _ = turns(model, make, SparseConfig(0.2), [random_ids(120, 1)])
    for cut in range(17, 120, 9):
        prompt = torch.cat([outs[0][:, :cut], random_ids(10, 99)], dim=1)
        with make() as store:
            cache = AttnStoreCache(model, store, "s", prompt, kv_budget=0.2, save=False)
            assert cache.reused_tokens <= cut
            model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=3, **GREEDY)
            absent = store.lookup("s", AttnStoreCache.fingerprint_of(model, store)).absent(cache.reused_tokens)
            assert absent is None or attended_absent(cache, absent) == 0


@pytest.mark.parametrize("window", [33, 40, 64])
def test_a_truncated_history_over_a_thin_copy_runs(tmp_path, window):
    model = make_tiny("llama")
    make = lambda: AttnStore("64MiB", tmp_path, sparse_copies=True, **FAST)  # noqa: E731
    outs, _ = turns(model, make, SparseConfig(0.2), [random_ids(120, 1)])
    with make() as store:
        cache = AttnStoreCache(model, store, "s", torch.cat([outs[0], random_ids(6, 2)], dim=1), kv_budget=0.2,
                               context_window=window, save=False)
        out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=3, **GREEDY)
        assert out.shape[1] == cache.input_ids.shape[1] + 3


def test_a_thin_copy_read_back_with_another_chunk_size_is_saved_again(tmp_path):
    """Tokens without KV, re-cut into smaller chunks: a chunk grows until every head keeps one (before: the save
    failed on every retry)."""
    model = make_tiny("llama")
    outs, _ = turns(model, lambda: AttnStore("64MiB", tmp_path, sparse_copies=True, **FAST), SparseConfig(0.2),
                    [random_ids(120, 1)])
    small = dict(FAST, chunk_tokens=4)
    with AttnStore("64MiB", tmp_path, sparse_copies=True, **small) as store:
        # Another session over the same history: its chunks are written anew, in chunks of 4.
        prompt = torch.cat([outs[0], random_ids(6, 2)], dim=1)
        cache = AttnStoreCache(model, store, "t", prompt, kv_budget=0.2)
        assert cache.shared_from == "s"
        model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=3, **GREEDY)
        cache.close()
        store.flush()
    with AttnStore("64MiB", tmp_path, sparse_copies=True, **small) as store:
        cache = AttnStoreCache(model, store, "t", torch.cat([prompt, random_ids(2, 3)], dim=1), kv_budget=0.2,
                               save=False)
        assert cache.reused_tokens > 100 and cache.kv_source == "disk"
        model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=3, **GREEDY)


def test_a_dense_turn_recomputes_what_the_sparse_copy_lacks(tmp_path):
    model = make_tiny("llama")
    make = lambda: AttnStore("64MiB", tmp_path, sparse_copies=True, **FAST)  # noqa: E731
    outs, _ = turns(model, make, SparseConfig(0.2), [random_ids(120, 1)])
    nxt = torch.cat([outs[0], random_ids(6, 2)], dim=1)
    with make() as store:
        dense = AttnStoreCache(model, store, "s", nxt)
        assert 0 < dense.reused_tokens < 120  # the first chunk's sinks (and what it kept before its first gap)
        out = model.generate(dense.input_ids, **cache_kwargs(dense), max_new_tokens=8, **GREEDY)
    assert torch.equal(out, model.generate(nxt, max_new_tokens=8, **GREEDY))


def test_a_store_that_did_not_ask_for_sparse_copies_never_serves_them(tmp_path, caplog):
    model = make_tiny("llama")
    outs, _ = turns(model, lambda: AttnStore("64MiB", tmp_path, sparse_copies=True, **FAST), SparseConfig(0.2),
                    [random_ids(120, 1)])
    nxt = torch.cat([outs[0], random_ids(6, 2)], dim=1)
    with AttnStore("64MiB", tmp_path, **FAST) as store:  # reopened without the option: those sessions go
        assert AttnStoreCache(model, store, "s", nxt, kv_budget=0.2, save=False).reused_tokens == 0
    assert "sparse cold copies are removed" in caplog.text
    assert not list(tmp_path.rglob("*.safetensors"))


def test_redis_serves_sparse_copies_only_to_stores_that_asked(tmp_path):
    model = make_tiny("llama")
    with RedisServer(tmp_path / "redis") as server:
        remote = dict(remote=server.url, remote_timeout_s=2, **FAST)
        outs, _ = turns(model, lambda: AttnStore("64MiB", sparse_copies=True, **remote), SparseConfig(0.2),
                        [random_ids(120, 1)])
        nxt = torch.cat([outs[0], random_ids(6, 2)], dim=1)
        with AttnStore("64MiB", **remote) as store:
            assert AttnStoreCache(model, store, "s", nxt, kv_budget=0.2, save=False).reused_tokens == 0
        with AttnStore("64MiB", sparse_copies=True, **remote) as store:
            cache = AttnStoreCache(model, store, "s", nxt, kv_budget=0.2, save=False)
            assert cache.reused_tokens == outs[0].shape[1] - 1 and cache.kv_source == "remote"
            dense = AttnStoreCache(model, store, "s", nxt, save=False)
            assert 0 < dense.reused_tokens < 120


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_sparse_copies_combine_with_a_codec(tmp_path, codec):
    model = make_tiny("llama")
    config = SparseConfig(0.2)
    prompts = [random_ids(120, 1)]
    both = tmp_path / "both"
    outs, _ = turns(model, lambda: AttnStore("64MiB", both, sparse_copies=True, kv_codec=codec, **FAST), config, prompts)
    turns(model, lambda: AttnStore("64MiB", tmp_path / "codec", kv_codec=codec, **FAST), config, prompts)
    assert disk_bytes(both) < 0.8 * disk_bytes(tmp_path / "codec")
    labels = []
    for path in both.rglob("*.safetensors"):
        raw = path.read_bytes()
        meta = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]]).get("__metadata__", {})
        if "kept" in meta:
            labels.append(meta.get("codec"))
    assert labels and all(label is not None for label in labels)  # thinned and encoded, each chunk says both
    nxt = torch.cat([outs[0], random_ids(6, 2)], dim=1)
    with AttnStore("64MiB", both, sparse_copies=True, kv_codec=codec, **FAST) as store:
        cache = AttnStoreCache(model, store, "s", nxt, kv_budget=config, save=False)
        assert cache.reused_tokens == outs[0].shape[1] - 1
        model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=4, **GREEDY)


def test_a_damaged_sparse_chunk_is_a_clean_miss(tmp_path):
    model = make_tiny("llama")
    make = lambda: AttnStore("64MiB", tmp_path, sparse_copies=True, **FAST)  # noqa: E731
    outs, _ = turns(model, make, SparseConfig(0.2), [random_ids(120, 1)])
    damaged = 0
    for path in tmp_path.rglob("*.safetensors"):
        raw = bytearray(path.read_bytes())
        header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
        if "kept" in header:
            begin = 8 + struct.unpack("<Q", raw[:8])[0] + header["kept"]["data_offsets"][0]
            raw[begin] ^= 0x01  # a kept position changes: its checksum no longer holds
            path.write_bytes(bytes(raw))
            damaged += 1
    assert damaged
    nxt = torch.cat([outs[0], random_ids(6, 2)], dim=1)
    with make() as store:
        cache = AttnStoreCache(model, store, "s", nxt, kv_budget=0.2)
        out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=4, **GREEDY)
        assert cache.reused_tokens == 0 or cache.turn.recomputed
        assert out.shape[1] == nxt.shape[1] + 4
