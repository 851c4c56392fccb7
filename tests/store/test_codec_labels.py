"""A chunk's codec label is true of every token it covers: dequantized KV is never labelled lossless.

Regression for the adversarial finding "a lossless store serves lossy KV": a lossy store loaded a session
whose trailing partial chunk was lossy, and rewrote that chunk with new tokens the codec could not encode
(beyond fp16's range), labelled lossless although it held dequantized tokens. A lossless store reopened on
the folder then reused it.
"""

from __future__ import annotations

import pytest
import torch

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.store.codec import KVCodec, least_accurate
from hf_attnstore.cache.upstream import cache_kwargs

from ..conftest import make_tiny, random_ids
from .kvdata import chunk_metadata

HUGE = 5  # the token whose layer-0 values the codecs cannot encode (|v| > 65504)
FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=8)


def _model_with_huge_values():
    """A tiny Llama in which token HUGE drives layer 0's values to ~72,000 and no other token does."""
    model = make_tiny("llama")
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 0.0  # dim 0 of the residual stream belongs to token HUGE alone
        emb[HUGE] = 0.0
        emb[HUGE, 0] = 1.0  # after RMSNorm: sqrt(hidden) on dim 0
        v = model.model.layers[0].self_attn.v_proj.weight
        v[:, 0] = 72_000 / model.config.hidden_size ** 0.5
    return model


def _ids(n: int, seed: int, huge_at: list[int]) -> torch.Tensor:
    ids = random_ids(n, seed)
    ids[ids == HUGE] = HUGE + 1
    ids[0, huge_at] = HUGE
    return ids


@pytest.mark.parametrize("codec", ["int4", "int8"])
def test_a_rewritten_chunk_over_dequantized_tokens_is_never_served_as_lossless(tmp_path, codec):
    model = _model_with_huge_values()
    first = _ids(12, 0, [3])  # chunk 0 (tokens 0-7) holds HUGE: lossless; chunk 1 (8-11): lossy
    ids = torch.cat([first, _ids(4, 1, [1])], dim=1)  # HUGE again at 13: the rewritten chunk 1 is unencodable
    with torch.no_grad():
        with AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), kv_codec=codec, **FAST) as lossy:
            with AttnStoreCache(model, lossy, "s", first) as cache:
                model(cache.input_ids, **cache_kwargs(cache))
            lossy.flush()
            lossy.evict("s")  # the next turn loads tokens 8-11 dequantized
            with AttnStoreCache(model, lossy, "s", ids) as cache:
                assert cache.kv_source == "disk" and cache.reused_tokens == 12
                model(cache.input_ids[:, 12:], **cache_kwargs(cache))
            lossy.flush()
        labels = [(int(m["n_tokens"]), m.get("codec"), m.get("derived")) for m in chunk_metadata(tmp_path)]
        # The rewritten chunk holds 4 dequantized tokens and 4 exact ones it could not encode: stored lossless
        # but labelled with the codec it was partly dequantized from.
        assert any(n == 8 and c is None and d is not None and KVCodec.parse(d).name == codec for n, c, d in labels), labels
        with AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), **FAST) as lossless:
            cache = AttnStoreCache(model, lossless, "s", ids, save=False)
            got = model(cache.input_ids[:, cache.reused_tokens:], **cache_kwargs(cache)).logits[0, -1]
            want = model(ids).logits[0, -1]
    assert cache.reused_tokens == 0  # a lossless store never serves lossy KV: a clean miss
    assert (got - want).abs().max() < 1e-4


def test_a_lossy_store_still_serves_its_own_derived_chunks(tmp_path):
    """The derived label is a lossy label: the store that wrote it (or any at most as accurate) reuses it."""
    model = _model_with_huge_values()
    first = _ids(12, 0, [3])
    ids = torch.cat([first, _ids(4, 1, [1])], dim=1)
    with torch.no_grad(), AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), kv_codec="int4", **FAST) as store:
        with AttnStoreCache(model, store, "s", first) as cache:
            model(cache.input_ids, **cache_kwargs(cache))
        store.flush()
        store.evict("s")
        with AttnStoreCache(model, store, "s", ids) as cache:
            model(cache.input_ids[:, 12:], **cache_kwargs(cache))
        store.flush()
        store.evict("s")
        with AttnStoreCache(model, store, "s", torch.cat([ids, _ids(2, 2, [])], dim=1), save=False) as cache:
            assert cache.kv_source == "disk" and cache.reused_tokens == 16


def test_least_accurate():
    int8, int4 = KVCodec("int8"), KVCodec("int4")
    assert least_accurate(None, None) is None
    assert least_accurate(int8, None) is int8 and least_accurate(None, int4) is int4
    assert least_accurate(int8, int4) is int4 and least_accurate(int4, int8) is int4
